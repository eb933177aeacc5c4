"""The documents of `prepare`'s inputs, streamed in a fixed order, whatever their format.

An input is a file or a directory matched by the --input glob, taken in sorted path order:
- `*.jsonl`, `*.jsonl.gz`: one JSON object a line, the document in its `text_field`;
- `*.parquet`: the `text_field` column, read one row group at a time (pyarrow; memory bounded by a row group);
- a directory written by Hugging Face `datasets` (`save_to_disk`: `state.json`, or `dataset_dict.json` with one
  folder per split, splits in sorted order): its Arrow files in the order `state.json` lists them, one record
  batch at a time (pyarrow; the files `datasets.load_from_disk` reads);
- any other file: UTF-8 text, one document (or one a non-empty line with split_lines).

A record that is not a document -- a missing field, a value that is not a string, bytes that are not UTF-8,
a line that is not JSON -- is counted by kind. With on_bad="fail" (the default) the first one stops the run
with a one-line error naming the file, the record and the fix; with on_bad="skip" it is left out and counted
(`BadRecords`), and the counts go into meta.json. Nothing is repaired or replaced.
"""

from __future__ import annotations

import collections
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class SourceError(ValueError):
    pass


class BadRecords:
    """Counts of the records left out, by kind; raises on the first one unless skipping."""

    def __init__(self, on_bad: str) -> None:
        if on_bad not in ("fail", "skip"):
            raise SourceError(f"--bad-records {on_bad!r}: use 'fail' or 'skip'")
        self.on_bad = on_bad
        self.counts: collections.Counter[str] = collections.Counter()

    def report(self, kind: str, where: str) -> None:
        if self.on_bad == "fail":
            raise SourceError(
                f"{where}: {kind}. Fix: clean the input, or pass --bad-records skip to leave such records out"
            )
        self.counts[kind] += 1

    def summary(self) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items())) or "none"


def kind_of_dir(path: Path) -> bool:
    """Whether a directory is a saved `datasets` dataset (or dataset dict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def kind_of(path: Path) -> str:
    if path.is_dir():
        if kind_of_dir(path):
            return "datasets"
        raise SourceError(f"--input matched the directory {path}, which is not a saved `datasets` dataset")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _text(value: Any, field: str, where: str, bad: BadRecords) -> str | None:
    if value is None:
        bad.report(f"missing field {field!r}", where)
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            bad.report("invalid UTF-8", where)
            return None
    if not isinstance(value, str):
        bad.report(f"field {field!r} is a {type(value).__name__}, not a string", where)
        return None
    return value


def _text_file(path: Path, split_lines: bool, bad: BadRecords) -> Iterator[str]:
    if not split_lines:
        try:
            yield path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            bad.report(f"invalid UTF-8 at byte {e.start}", str(path))
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\n")
            except UnicodeDecodeError:
                bad.report("invalid UTF-8", f"{path} line {n}")
                continue
            if line.strip():
                yield line


def _jsonl(path: Path, field: str, bad: BadRecords) -> Iterator[str]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path} line {n}"
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                bad.report("invalid UTF-8", where)
                continue
            except json.JSONDecodeError:
                bad.report("not a JSON object", where)
                continue
            if not isinstance(record, dict):
                bad.report("not a JSON object", where)
                continue
            text = _text(record.get(field), field, where, bad)
            if text is not None:
                yield text


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
    except ImportError as e:
        raise SourceError("parquet and `datasets` inputs need pyarrow. Fix: pip install 'detjax[data]'") from e
    import pyarrow.ipc
    import pyarrow.parquet

    return pyarrow


def _column(batch: Any, field: str, where: str) -> list:
    if field not in batch.schema.names:
        raise SourceError(f"{where} has no column {field!r} (columns: {batch.schema.names}). Fix: --text-field NAME")
    return batch.column(field).to_pylist()


def _parquet(path: Path, field: str, bad: BadRecords) -> Iterator[str]:
    pa = _pyarrow()
    f = pa.parquet.ParquetFile(path)
    if field not in f.schema_arrow.names:
        raise SourceError(f"{path} has no column {field!r} (columns: {f.schema_arrow.names}). Fix: --text-field NAME")
    row = 0
    for g in range(f.num_row_groups):  # one row group at a time, only the text column
        for value in f.read_row_group(g, columns=[field]).column(field).to_pylist():
            text = _text(value, field, f"{path} row {row}", bad)
            row += 1
            if text is not None:
                yield text


def _datasets_dir(path: Path, field: str, bad: BadRecords) -> Iterator[str]:
    pa = _pyarrow()
    if (path / "dataset_dict.json").is_file():  # one saved dataset per split
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        for split in sorted(splits):
            yield from _datasets_dir(path / split, field, bad)
        return
    files = [d["filename"] for d in json.loads((path / "state.json").read_text())["_data_files"]]
    row = 0
    for name in files:
        with pa.ipc.open_stream(pa.memory_map(str(path / name))) as reader:
            for batch in reader:  # one record batch at a time
                for value in _column(batch, field, str(path / name)):
                    text = _text(value, field, f"{path / name} row {row}", bad)
                    row += 1
                    if text is not None:
                        yield text


def documents(paths: list[Path], split_lines: bool, field: str, bad: BadRecords) -> Iterator[str]:
    """Every document of the inputs, in path order and in each input's own order."""
    for p in paths:
        kind = kind_of(p)
        if kind == "text":
            yield from _text_file(p, split_lines, bad)
        elif kind == "jsonl":
            yield from _jsonl(p, field, bad)
        elif kind == "parquet":
            yield from _parquet(p, field, bad)
        else:
            yield from _datasets_dir(p, field, bad)
