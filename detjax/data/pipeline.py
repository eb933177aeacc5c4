"""Grain pipeline: the batch for step s is a pure function of (seed, s).

Windows of seq_len+1 tokens are cut from one token stream; Grain shuffles window indices with the
seed (a new permutation each epoch) and batches them. Indexing the dataset at s (`make_dataset(cfg)[s]`)
and the iterator (whose state is checkpointed) give the same batches.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from detjax.config import Config
from detjax.data.corpus import builtin_tokens


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


def read_arrayrecord_tokens(pattern: str) -> np.ndarray:
    """Concatenate the uint16 token records of every shard matching `pattern`, shards in sorted order."""
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise DataError(
            f"data.path={pattern!r} matches no files. Fix: run `python -m detjax.data.prepare` and point "
            "data.path at its *.arrayrecord shards"
        )
    for p in paths:
        if not os.path.isfile(p) or os.path.getsize(p) == 0:
            raise DataError(f"data file {p} is empty or not a file. Fix: point data.path at the shards `prepare` wrote")
    try:
        src = grain.sources.ArrayRecordDataSource(paths)
        records = [np.frombuffer(src[i], dtype=np.uint16) for i in range(len(src))]
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DataError(
            f"data.path={pattern!r}: cannot read the shards as ArrayRecord ({first}). Fix: point data.path at the "
            "*.arrayrecord shards written by `python -m detjax.data.prepare`"
        ) from None
    if not records:
        raise DataError(
            f"data.path={pattern!r}: the shards hold no records. Fix: re-run `python -m detjax.data.prepare`"
        )
    return np.concatenate(records)


def load_tokens(cfg: Config) -> np.ndarray:
    if cfg.data.source == "builtin":
        return builtin_tokens(cfg.data.builtin_sentences)
    return read_arrayrecord_tokens(cfg.data.path)


def make_dataset(
    cfg: Config, tokens: np.ndarray | None = None, rows: tuple[int, int] | None = None
) -> grain.MapDataset:
    """MapDataset whose element s is the (global_batch, seq_len + 1) int32 batch of step s.

    `rows=(lo, hi)` keeps only rows lo..hi-1 of every batch (one process's share of a multi-process
    batch): only those windows are read, and the rows are the same whatever the process count.
    """
    t = cfg.train
    tokens = load_tokens(cfg) if tokens is None else tokens
    src = WindowSource(tokens, t.seq_len)
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
