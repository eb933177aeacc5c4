"""`python -m detjax.data.prepare --input 'GLOB' --output DIR`: text files -> ArrayRecord token shards.

Each record holds one document's byte-tokenizer ids (uint16, EOS-terminated). Files are read in sorted
path order, so shards are a pure function of the inputs. Use with `data.source=arrayrecord
data.path='DIR/*.arrayrecord'`.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

from detjax.data.tokenizer import encode


def prepare(pattern: str, out_dir: str, docs_per_shard: int = 1000, split_lines: bool = False) -> list[Path]:
    from array_record.python.array_record_module import ArrayRecordWriter

    paths = sorted(glob.glob(pattern, recursive=True))
    if not paths:
        raise SystemExit(f"error: --input {pattern!r} matches no files. Fix: quote the glob and check the path")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.arrayrecord")):
        raise SystemExit(f"error: {out} already holds *.arrayrecord shards; refusing to mix. Fix: pick an empty dir")
    docs: list[str] = []
    for p in paths:
        text = Path(p).read_text(encoding="utf-8", errors="replace")
        docs.extend([ln for ln in text.splitlines() if ln.strip()] if split_lines else [text])
    shards: list[Path] = []
    for s in range(0, len(docs), docs_per_shard):
        shard = out / f"tokens-{len(shards):05d}.arrayrecord"
        w = ArrayRecordWriter(str(shard), "group_size:1")
        for d in docs[s : s + docs_per_shard]:
            w.write(encode(d).tobytes())
        w.close()
        shards.append(shard)
    return shards


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.data.prepare", description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="glob of UTF-8 text files (quote it)")
    ap.add_argument("--output", required=True, help="directory for the shards (must hold none yet)")
    ap.add_argument("--docs-per-shard", type=int, default=1000)
    ap.add_argument("--split-lines", action="store_true", help="one document per non-empty line")
    a = ap.parse_args(argv)
    shards = prepare(a.input, a.output, a.docs_per_shard, a.split_lines)
    print(f"wrote {len(shards)} shard(s) to {a.output}")
    print(f"use: data.source=arrayrecord data.path='{a.output}/*.arrayrecord'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
