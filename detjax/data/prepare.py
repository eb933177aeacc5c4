"""`python -m detjax.data.prepare --input 'GLOB' --output DIR [--train-bpe N | --tokenizer FILE]`: text -> token shards.

Streams the documents of the inputs (detjax.data.sources: UTF-8 text files, each one document or each
non-empty line with --split-lines; jsonl / jsonl.gz and parquet files and saved Hugging Face `datasets`
directories, the document in --text-field; inputs in sorted path order; bad records fail the run, or with
--bad-records skip are left out and counted), tokenizes them in parallel worker processes (results taken in
input order, so the output is a pure function of the inputs and the tokenizer, whatever the worker count), and
writes two token streams, `train` and `eval`: a document goes to `eval` when the hash of its text falls under
--eval-fraction (a deterministic split by document hash). Each stream is cut into records of --block-tokens
tokens (the last one shorter) in the narrowest unsigned dtype that holds the vocabulary, in ArrayRecord shards
of --blocks-per-shard records. Memory stays bounded: at most two batches of documents per worker in flight,
one block per stream and the open shard writers' buffers (ArrayRecord's writer holds up to about 16 MB,
whatever the shard size); a document is held whole while it is tokenized, so the largest document also sets
the bound.

DIR/meta.json records the format, the tokenizer (kind, sha256, vocabulary size, EOS id), the dtype, the block
size and every shard's record and token counts; DIR/tokenizer.json holds a BPE tokenizer. Train with
`data.source=arrayrecord data.path=DIR`; the batch at step s stays a pure function of (seed, s).

The tokenizer: the byte tokenizer (the default), `--train-bpe N` (a byte-level BPE of N ids trained on the
train documents, streamed, before tokenizing) or `--tokenizer FILE` (an existing HF tokenizer.json).
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import multiprocessing
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from detjax.data import sources
from detjax.data import tokenizer as tk
from detjax.data.sources import BadRecords, SourceError

FORMAT = 2
SPLITS = ("train", "eval")


class PrepareError(ValueError):
    pass


def documents(paths: list[Path], split_lines: bool, text_field: str = "text", bad: BadRecords | None = None):
    """Every document of the inputs, streamed (detjax.data.sources.documents)."""
    return sources.documents(paths, split_lines, text_field, bad or BadRecords("fail"))


def input_paths(pattern: str) -> list[Path]:
    """The glob's files and saved `datasets` directories, in sorted order (files inside such a directory are
    its own; other directories hold inputs, they are not one)."""
    found = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
    datasets_dirs = [p for p in found if p.is_dir() and sources.kind_of_dir(p)]
    return [p for p in found if (p.is_file() or p in datasets_dirs) and not any(d in p.parents for d in datasets_dirs)]


def is_eval(text: str, fraction: float) -> bool:
    """The held-out split: the first 8 bytes of the text's BLAKE2b hash, as a fraction of 2^64, < fraction."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return h < fraction * 2.0**64


_WORKER: dict[str, Any] = {}


def _init_worker(tok_json: str | None, fraction: float) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["tok"] = tk.ByteTokenizer() if tok_json is None else tk.BPETokenizer(tok_json)
    _WORKER["fraction"] = fraction


def _encode_batch(texts: list[str]) -> list[tuple[bool, np.ndarray]]:
    tok, fraction = _WORKER["tok"], _WORKER["fraction"]
    return [(is_eval(t, fraction), tok.encode(t)) for t in texts]


def _batches(docs: Iterator[str], max_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _in_order(pool: Any, batches: Iterator[list[str]], window: int) -> Iterator[list[tuple[bool, np.ndarray]]]:
    """The workers' results in input order, with at most `window` batches submitted and not yet taken (Pool.imap
    would queue finished results without limit whenever the writer falls behind the workers)."""
    pending: collections.deque[Any] = collections.deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_batch, (batch,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class _Stream:
    """One split's token stream, written in blocks of `block` tokens into shards of `per_shard` records."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, block: int, per_shard: int) -> None:
        self.out, self.split, self.dtype, self.block, self.per_shard = out, split, dtype, block, per_shard
        self.buf = np.empty(block, dtype)
        self.fill = 0
        self.shards: list[dict[str, Any]] = []
        self.writer = None
        self.documents = 0

    def add(self, ids: np.ndarray) -> None:
        self.documents += 1
        pos = 0
        while pos < len(ids):
            take = min(len(ids) - pos, self.block - self.fill)
            self.buf[self.fill : self.fill + take] = ids[pos : pos + take]
            self.fill += take
            pos += take
            if self.fill == self.block:
                self._write()

    def _write(self) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        if self.writer is None or self.shards[-1]["records"] == self.per_shard:
            if self.writer is not None:
                self.writer.close()
            name = f"{self.split}-{len(self.shards):05d}.arrayrecord"
            self.writer = ArrayRecordWriter(str(self.out / name), "group_size:1,uncompressed")
            self.shards.append({"file": name, "records": 0, "tokens": 0})
        self.writer.write(self.buf[: self.fill].tobytes())
        self.shards[-1]["records"] += 1
        self.shards[-1]["tokens"] += self.fill
        self.fill = 0

    def close(self) -> dict[str, Any]:
        if self.fill:
            self._write()
        if self.writer is not None:
            self.writer.close()
        return {"shards": self.shards, "tokens": sum(s["tokens"] for s in self.shards), "documents": self.documents}


def prepare(
    pattern: str,
    out_dir: str,
    *,
    split_lines: bool = False,
    tokenizer: str = "bytes",
    train_bpe: int = 0,
    eval_fraction: float = 0.01,
    block_tokens: int = 1 << 16,
    blocks_per_shard: int = 1024,
    workers: int = 0,
    text_field: str = "text",
    bad_records: str = "fail",
) -> dict[str, Any]:
    """Write the shards and meta.json (see the module docstring); -> the meta record."""
    paths = input_paths(pattern)
    if not paths:
        raise PrepareError(f"--input {pattern!r} matches no files. Fix: quote the glob and check the path")
    bad = BadRecords(bad_records)
    if not 0 <= eval_fraction < 1:
        raise PrepareError(f"--eval-fraction {eval_fraction} is not in [0, 1). Fix: e.g. 0.01")
    if block_tokens < 1 or blocks_per_shard < 1:
        raise PrepareError("--block-tokens and --blocks-per-shard must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.arrayrecord")) or (out / "meta.json").exists():
        raise PrepareError(f"{out} already holds shards; refusing to mix. Fix: pick an empty directory")
    if train_bpe:
        first_pass = BadRecords(bad_records)  # the bad records are counted once, in the tokenizing pass
        train_docs = (d for d in documents(paths, split_lines, text_field, first_pass) if not is_eval(d, eval_fraction))
        tok: tk.ByteTokenizer | tk.BPETokenizer = tk.train_bpe(train_docs, train_bpe)
    else:
        tok = tk.load(tokenizer)
    tok_json = tok.to_json()
    if tok_json is not None:
        (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    dtype = tk.id_dtype(tok.vocab_size)
    streams = {s: _Stream(out, s, dtype, block_tokens, blocks_per_shard) for s in SPLITS}
    batches = _batches(documents(paths, split_lines, text_field, bad), max_chars=1 << 20)
    workers = workers or min(os.cpu_count() or 1, 16)
    if workers == 1:
        _init_worker(tok_json, eval_fraction)
        results: Iterator[list[tuple[bool, np.ndarray]]] = map(_encode_batch, batches)
        pool = None
    else:  # spawn: no fork of a process whose tokenizer threads may be running
        pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tok_json, eval_fraction))
        results = _in_order(pool, batches, window=2 * workers)
    try:
        for batch in results:
            for ev, ids in batch:
                streams["eval" if ev else "train"].add(ids.astype(dtype, copy=False))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    meta = {
        "format": FORMAT,
        "tokenizer": {"kind": tok.kind, "sha256": tok.sha256, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
        "dtype": dtype.name,
        "block_tokens": block_tokens,
        "eval_fraction": eval_fraction,
        "inputs": len(paths),
        "text_field": text_field,
        "bad_records_skipped": dict(sorted(bad.counts.items())),
        "splits": {s: streams[s].close() for s in SPLITS},
    }
    if not meta["splits"]["train"]["tokens"]:
        raise PrepareError(f"--input {pattern!r}: no training text (empty files, or every document went to eval)")
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.data.prepare", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--input", required=True, help="glob (quote it) of text, jsonl[.gz] or parquet files, or saved `datasets` dirs"
    )
    ap.add_argument("--text-field", default="text", help="the document's field (jsonl) or column (parquet, datasets)")
    ap.add_argument("--bad-records", choices=("fail", "skip"), default="fail", help="fail on a bad record, or skip it")
    ap.add_argument("--output", required=True, help="directory for the shards (must hold none yet)")
    ap.add_argument("--split-lines", action="store_true", help="one document per non-empty line")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tokenizer", default="bytes", help="'bytes' (default) or an HF tokenizer.json")
    g.add_argument("--train-bpe", type=int, default=0, metavar="N", help="train a byte-level BPE of N ids first")
    ap.add_argument("--eval-fraction", type=float, default=0.01, help="held-out share of documents (by hash)")
    ap.add_argument("--block-tokens", type=int, default=1 << 16, help="tokens per record")
    ap.add_argument("--blocks-per-shard", type=int, default=1024, help="records per shard file")
    ap.add_argument("--workers", type=int, default=0, help="tokenizer processes (0: one per core, at most 16)")
    a = ap.parse_args(argv)
    try:
        meta = prepare(
            a.input,
            a.output,
            split_lines=a.split_lines,
            tokenizer=a.tokenizer,
            train_bpe=a.train_bpe,
            eval_fraction=a.eval_fraction,
            block_tokens=a.block_tokens,
            blocks_per_shard=a.blocks_per_shard,
            workers=a.workers,
            text_field=a.text_field,
            bad_records=a.bad_records,
        )
    except (PrepareError, SourceError, tk.TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sp = meta["splits"]
    print(
        f"wrote {sp['train']['tokens']:,} train tokens ({sp['train']['documents']:,} documents) and "
        f"{sp['eval']['tokens']:,} eval tokens ({sp['eval']['documents']:,} documents) as {meta['dtype']} to "
        f"{a.output} (tokenizer {meta['tokenizer']['kind']}, {meta['tokenizer']['vocab_size']} ids)"
    )
    if meta["bad_records_skipped"]:
        print(f"skipped bad records: {', '.join(f'{n} {k}' for k, n in meta['bad_records_skipped'].items())}")
    print(f"use: data.source=arrayrecord data.path={a.output} model.vocab_size>={meta['tokenizer']['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
