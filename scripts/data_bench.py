"""Data-pipeline benchmark: prepare throughput and peak memory on a generated corpus, then the training
reader's throughput against a step's consumption.

    python scripts/data_bench.py --mb 1100 --workdir /tmp/db [--workers 0] [--seconds 20] [--consume 221800]
        [--doc-chars 4096]
    python scripts/data_bench.py --workdir /tmp/db --reader-only    # the reader again, on WORKDIR/shards
    python scripts/data_bench.py --mb 1100 --workdir /tmp/db --format parquet   # or jsonl: the same documents

Writes MB megabytes of text (the builtin generator's sentences, one document per line, or documents of about
--doc-chars characters) to WORKDIR/text, runs
`python -m detjax.data.prepare` on it in a child process (byte tokenizer: one token per byte, so 1100 MB is
about 1.15 B tokens with EOS), and reports its wall time, tokens/s and peak RSS (the prepare process and its
workers, from getrusage). Then it reads batches of configs/gpu_medium.yaml's shape (16 x 2049 tokens) through
make_dataset at the steps the trainer would (a shuffled window order over the whole corpus) for --seconds, and
reports tokens/s and that rate over --consume (gpu_medium's tokens/s in training: 32768 / 0.1477 s on one H200,
docs/benchmarks-history.md set 10), the reader's RSS after its first batch and at the end, and the corpus's size on
disk over both peak RSS figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mb() -> float:
    """This process's resident set now (MB), from /proc."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def write_text(path: Path, mb: int, doc_chars: int, fmt: str = "text") -> int:
    """MB megabytes of the generator's sentences: one sentence per document, or documents of about doc_chars
    characters (sentences joined by spaces) when doc_chars > 0; as lines of text, as jsonl records {"text": ...}
    or as a parquet file's `text` column (row groups of 1000 documents per write). -> the documents' bytes."""
    from detjax.data.corpus import sentences

    pool = list(sentences(50_000, seed=7))
    sep = " " if doc_chars else "\n"
    per_line = max(1, doc_chars // (sum(map(len, pool[:1000])) // 1000 + 1)) if doc_chars else 1
    n = i = 0
    writer = None
    with path.open("w") as f:
        while n < mb << 20:
            rows = pool[(i * 7919) % 49_000 : (i * 7919) % 49_000 + 1000]
            docs = [sep.join(rows[j : j + per_line]) for j in range(0, 1000, per_line)]
            if fmt == "parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                table = pa.table({"text": docs})
                writer = writer or pq.ParquetWriter(path, table.schema)
                writer.write_table(table)
            elif fmt == "jsonl":
                f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
            else:
                f.write("\n".join(docs) + "\n")
            n += sum(len(d.encode()) + 1 for d in docs)
            i += 1
    if writer is not None:
        writer.close()
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1100)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--consume", type=float, default=32768 / 0.1477)
    ap.add_argument("--reader-only", action="store_true", help="time the reader on WORKDIR/shards from an earlier run")
    ap.add_argument("--doc-chars", type=int, default=0, help="documents of about N characters (0: one sentence)")
    ap.add_argument("--format", choices=("text", "jsonl", "parquet"), default="text", help="the corpus's file format")
    a = ap.parse_args()
    wd = Path(a.workdir)
    if a.reader_only:
        meta = json.loads((wd / "shards" / "meta.json").read_text())
        return read(a, wd, meta, sum(s["tokens"] for s in meta["splits"].values()), None)
    shutil.rmtree(wd, ignore_errors=True)
    (wd / "text").mkdir(parents=True)
    t0 = time.perf_counter()
    name = {"text": "corpus.txt", "jsonl": "corpus.jsonl", "parquet": "corpus.parquet"}[a.format]
    size = write_text(wd / "text" / name, a.mb, a.doc_chars, a.format)
    on_disk = (wd / "text" / name).stat().st_size
    print(f"wrote {size / 2**20:.0f} MB of documents ({on_disk / 2**20:.0f} MB as {a.format}) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    cmd = [sys.executable, "-m", "detjax.data.prepare", "--input", str(wd / "text" / name), "--output",
           str(wd / "shards"), "--workers", str(a.workers)]  # fmt: skip
    cmd += ["--split-lines"] if a.format == "text" else []
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode:
        print(r.stderr[-2000:], file=sys.stderr)
        return 1
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    meta = json.loads((wd / "shards" / "meta.json").read_text())
    n_tok = sum(s["tokens"] for s in meta["splits"].values())
    workers = a.workers or min(os.cpu_count() or 1, 16)
    print(
        f"prepare: {n_tok:,} tokens in {dt:.1f} s = {n_tok / dt:,.0f} tokens/s with {workers}"
        f" workers on {os.cpu_count()} cores; peak RSS of one process (largest of prepare and its workers) "
        f"{peak:.0f} MB",
        flush=True,
    )
    shutil.rmtree(wd / "text")
    return read(a, wd, meta, n_tok, peak)


def read(a: argparse.Namespace, wd: Path, meta: dict, n_tok: int, peak: float | None) -> int:
    from detjax.config import load_config
    from detjax.data.pipeline import BatchIterator, make_dataset

    cfg = load_config(
        str(Path(__file__).resolve().parents[1] / "configs/gpu_medium.yaml"),
        ["data.source=arrayrecord", f"data.path={wd / 'shards'}"],
    )
    it = BatchIterator(make_dataset(cfg))
    next(it)
    before = rss_mb()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < a.seconds:
        n += next(it).size
    rate = n / (time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    disk = n_tok * np.dtype(meta["dtype"]).itemsize / 2**20
    after = rss_mb()
    print(
        f"reader: {rate:,.0f} tokens/s (one process, gpu_medium batches) = {rate / a.consume:.1f} x the gpu_medium "
        f"step's {a.consume:,.0f} tokens/s; reader process peak RSS {rss:.0f} MB (RSS {before:.0f} MB after the "
        f"first batch, {after:.0f} MB after {n:,} tokens read); corpus tokens on disk "
        f"{disk:,.0f} MB = "
        + (f"{disk / peak:.0f} x prepare's peak RSS, " if peak else "")
        + f"{disk / rss:.0f} x the reader's"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
