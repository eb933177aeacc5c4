"""Grain pipeline: the batch for step s is a pure function of (seed, s).

Windows of seq_len+1 tokens are cut from one token stream; Grain shuffles window indices with the
seed (a new permutation each epoch) and batches them. Indexing the dataset at s (`make_dataset(cfg)[s]`)
and the iterator (whose state is checkpointed) give the same batches.

The stream is the builtin corpus (generated in memory) or a corpus `python -m detjax.data.prepare` wrote
(data.path = its directory): there each window is read from the ArrayRecord blocks it spans (StreamSource),
so nothing is loaded whole and each process reads only its own rows' windows. The held-out split (`eval`)
is read in order, without shuffling: the same eval.steps batches at every evaluation.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grain
import numpy as np

from detjax.config import Config
from detjax.data.corpus import BUILTIN_EVAL_SEED, builtin_tokens
from detjax.data.prepare import FORMAT


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class WindowSource:
    """Random-access source of (seq_len + 1)-token windows over a token stream."""

    tokens: np.ndarray
    seq_len: int

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].astype(np.int32)


class StreamSource:
    """(seq_len + 1)-token windows of a prepared split, read through its block index: window i starts at
    token i * seq_len, so it lies in blocks start // block ... (start + seq_len) // block, and only those records
    are read (the corpus is never loaded whole). The same windows as WindowSource over the concatenated stream.

    A random-access source for Grain's MapDataset. The records are read with ArrayRecord's reader, at most
    MAX_OPEN shard files open at once (least recently used closed first; 256 shards of the default size are
    16 Gi tokens). Grain's own ArrayRecordDataSource, used before, kept about 0.2 MB per shard file for the
    life of the process (measured, docs/benchmarks-history.md set 11), which on a corpus of thousands of shards
    would grow every process's memory with the corpus; an open reader here costs a few KB."""

    MAX_OPEN = 256

    def __init__(self, paths: tuple[str, ...], records: tuple[int, ...], n_tokens: int, block: int, dtype: str,
                 seq_len: int) -> None:  # fmt: skip
        self.paths, self.records, self.n_tokens = tuple(paths), tuple(records), n_tokens
        self.block, self.dtype, self.seq_len = block, np.dtype(dtype), seq_len
        self.first = [0, *itertools.accumulate(self.records)]  # the first block of each shard
        self._readers: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # for Grain's worker processes: readers are reopened there
        return {k: v for k, v in self.__dict__.items() if k not in ("_readers", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._readers, self._lock = collections.OrderedDict(), threading.Lock()

    def __len__(self) -> int:
        return max(self.n_tokens - 1, 0) // self.seq_len

    def _reader(self, shard: int) -> Any:
        r = self._readers.pop(shard, None)
        if r is None:
            from array_record.python.array_record_module import ArrayRecordReader

            r = ArrayRecordReader(self.paths[shard], "readahead_buffer_size:0", file_reader_buffer_size=32768)
            if len(self._readers) >= self.MAX_OPEN:
                self._readers.popitem(last=False)[1].close()
        self._readers[shard] = r
        return r

    def block_bytes(self, b: int) -> bytes:
        shard = bisect.bisect_right(self.first, b) - 1
        with self._lock:
            return self._reader(shard).read([b - self.first[shard]])[0]

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        b0, b1 = start // self.block, (start + self.seq_len) // self.block
        parts = [np.frombuffer(self.block_bytes(b), dtype=self.dtype) for b in range(b0, b1 + 1)]
        run = parts[0] if len(parts) == 1 else np.concatenate(parts)
        off = start - b0 * self.block
        return run[off : off + self.seq_len + 1].astype(np.int32)

    def check(self) -> None:
        """Open each shard once (one at a time) and check its record count against meta.json."""
        from array_record.python.array_record_module import ArrayRecordReader

        for path, want in zip(self.paths, self.records, strict=True):
            r = ArrayRecordReader(path, "readahead_buffer_size:0")
            try:
                n = r.num_records()
            finally:
                r.close()
            if n != want:
                raise ValueError(f"{path} holds {n} records, meta.json says {want}")


def corpus_dir(path: str) -> Path:
    """The directory `prepare` wrote, from data.path (the directory or its meta.json)."""
    p = Path(path)
    if p.name == "meta.json":
        p = p.parent
    if not p.is_dir():
        hint = " (a glob of shards is the old format: give the directory)" if any(c in path for c in "*?[") else ""
        raise DataError(
            f"data.path={path!r} is not a directory{hint}. Fix: point data.path at the directory written by "
            "`python -m detjax.data.prepare`"
        )
    if not (p / "meta.json").is_file():
        raise DataError(
            f"data.path={path!r} holds no meta.json, so it was not written by this version's prepare. Fix: run "
            "`python -m detjax.data.prepare --input GLOB --output DIR` and set data.path=DIR"
        )
    return p


def read_meta(path: str) -> dict[str, Any]:
    """The prepared corpus's meta.json, checked: format, dtype, every shard present and non-empty."""
    d = corpus_dir(path)
    try:
        meta = json.loads((d / "meta.json").read_text())
        fmt, dtype, splits = meta["format"], np.dtype(meta["dtype"]), meta["splits"]
        int(meta["block_tokens"]), meta["tokenizer"]["sha256"], int(meta["tokenizer"]["vocab_size"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{d / 'meta.json'} is malformed ({type(e).__name__}: {e}). Fix: re-run prepare") from None
    if fmt != FORMAT:
        raise DataError(f"{d / 'meta.json'}: format {fmt}, this version reads {FORMAT}. Fix: re-run prepare")
    if dtype.kind != "u":
        raise DataError(f"{d / 'meta.json'}: token dtype {dtype} is not unsigned. Fix: re-run prepare")
    for split in splits.values():
        for sh in split["shards"]:
            f = d / sh["file"]
            if not f.is_file() or f.stat().st_size == 0:
                raise DataError(f"data file {f} is missing or empty. Fix: re-run prepare into an empty directory")
    meta["dir"] = str(d)
    return meta


def split_source(meta: dict[str, Any], split: str, seq_len: int) -> StreamSource:
    sp = meta["splits"][split]
    paths = tuple(str(Path(meta["dir"]) / sh["file"]) for sh in sp["shards"])
    if not paths:
        raise DataError(f"{meta['dir']}: the {split} split is empty. Fix: re-run prepare (--eval-fraction for eval)")
    try:
        src = StreamSource(paths, tuple(int(sh["records"]) for sh in sp["shards"]), int(sp["tokens"]),
                           int(meta["block_tokens"]), meta["dtype"], seq_len)  # fmt: skip
        src.check()
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DataError(
            f"data.path={meta['dir']!r}: cannot read the {split} shards as the ArrayRecord files meta.json describes "
            f"({first}). Fix: re-run `python -m detjax.data.prepare` into an empty directory"
        ) from None
    return src


def resolve_data(cfg: Config) -> Config:
    """The config with data.tokenizer_sha256 filled in from the prepared corpus (so it enters the config hash
    and a resume onto data written with another tokenizer is refused); checks the vocabulary fits the model.
    The builtin corpus (byte tokenizer) leaves it empty."""
    if cfg.data.source != "arrayrecord":
        return cfg
    meta = read_meta(cfg.data.path)
    tok = meta["tokenizer"]
    if tok["vocab_size"] > cfg.model.vocab_size:
        raise DataError(
            f"data.path={cfg.data.path!r}: the tokenizer has {tok['vocab_size']} ids, more than model.vocab_size="
            f"{cfg.model.vocab_size}. Fix: set model.vocab_size >= {tok['vocab_size']}"
        )
    want = cfg.data.tokenizer_sha256
    if want and want != tok["sha256"]:
        raise DataError(
            f"data.tokenizer_sha256={want!r}, but {meta['dir']} was written with tokenizer {tok['sha256']!r}: "
            "the token ids would mean other text. Fix: point data.path at data of that tokenizer, or leave "
            "data.tokenizer_sha256 empty in a new run"
        )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer_sha256=tok["sha256"]))


def _builtin(cfg: Config, split: str) -> np.ndarray:
    if split == "train":
        return builtin_tokens(cfg.data.builtin_sentences)
    return builtin_tokens(cfg.eval.builtin_sentences, seed=BUILTIN_EVAL_SEED)


def window_source(cfg: Config, split: str = "train") -> WindowSource | StreamSource:
    if cfg.data.source == "builtin":
        return WindowSource(_builtin(cfg, split), cfg.train.seq_len)
    return split_source(read_meta(cfg.data.path), split, cfg.train.seq_len)


def make_dataset(
    cfg: Config, tokens: np.ndarray | None = None, rows: tuple[int, int] | None = None
) -> grain.MapDataset:
    """MapDataset whose element s is the (global_batch, seq_len + 1) int32 batch of step s.

    `rows=(lo, hi)` keeps only rows lo..hi-1 of every batch (one process's share of a multi-process
    batch): only those windows are read, and the rows are the same whatever the process count.
    """
    t = cfg.train
    src = window_source(cfg) if tokens is None else WindowSource(tokens, t.seq_len)
    if len(src) < t.global_batch:
        raise DataError(
            f"the corpus has {len(src)} windows of {t.seq_len + 1} tokens, fewer than train.global_batch="
            f"{t.global_batch}. Fix: use more data or a smaller batch / seq_len"
        )
    windows = grain.MapDataset.source(src).shuffle(seed=t.seed).repeat(None)
    if rows is None or rows == (0, t.global_batch):
        return windows.batch(t.global_batch, drop_remainder=True)
    lo, hi = rows
    if not 0 <= lo < hi <= t.global_batch:
        raise DataError(f"rows {rows} are not a slice of a batch of {t.global_batch}")
    n = hi - lo
    g = t.global_batch
    local = grain.MapDataset.range(len(windows) // g * n).map(lambda k: windows[(k // n) * g + lo + k % n])
    return local.batch(n, drop_remainder=True)


def eval_batches(cfg: Config, rows: tuple[int, int] | None = None) -> list[np.ndarray]:
    """The eval.steps held-out batches (rows lo..hi-1 of each): windows k * global_batch ... of the eval split,
    in order. The builtin corpus's held-out text is a separately seeded stream of the same generator (its
    training text has no documents to split by hash); a prepared corpus has its eval split by document hash."""
    g, steps = cfg.train.global_batch, cfg.eval.steps
    src = window_source(cfg, "eval")
    if len(src) < steps * g:
        raise DataError(
            f"the eval split has {len(src)} windows of {cfg.train.seq_len + 1} tokens, fewer than eval.steps x "
            f"train.global_batch = {steps * g}. Fix: lower eval.steps, or hold out more text (prepare "
            "--eval-fraction, eval.builtin_sentences)"
        )
    lo, hi = rows or (0, g)
    return [np.stack([src[k * g + r] for r in range(lo, hi)]) for k in range(steps)]


class BatchIterator:
    """Iterator over step batches with a checkpointable state {'next_step': s}."""

    def __init__(self, ds: grain.MapDataset, start_step: int = 0) -> None:
        self._ds = ds
        self._it = iter(ds.to_iter_dataset())
        self.set_state({"next_step": start_step})

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> np.ndarray:
        self._next += 1
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        return {"next_step": self._next, "grain": self._it.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._next = int(state["next_step"])
        self._it.set_state(state.get("grain", {"next_index": self._next}))
