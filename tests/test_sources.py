"""prepare's inputs (detjax.data.sources): jsonl, parquet and saved `datasets` directories beside text files, in
one fixed order; bad records fail or are skipped and counted, never repaired."""

import gzip
import json

import pytest

from detjax.data.corpus import sentences
from detjax.data.prepare import main, prepare
from detjax.data.sources import BadRecords, SourceError, documents

DOCS = list(sentences(120, seed=5)) + ["naïve café — ünïcödé ✓"]
KW = dict(eval_fraction=0.1, block_tokens=61, blocks_per_shard=4, workers=1)


def _shards(meta, d):
    return [(d / sh["file"]).read_bytes() for s in ("train", "eval") for sh in meta["splits"][s]["shards"]]


def _write_jsonl(path, docs, field="text"):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")


def test_jsonl_shards_are_the_text_lines_shards(tmp_path):
    """Documents from jsonl (plain and gzipped, split over two files in path order) give the bytes that the same
    documents as lines of a text file give."""
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "all.txt").write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    (tmp_path / "js").mkdir()
    _write_jsonl(tmp_path / "js" / "a.jsonl", DOCS[:50], field="content")
    _write_jsonl(tmp_path / "js" / "b.jsonl.gz", DOCS[50:], field="content")
    ref = prepare(str(tmp_path / "txt" / "*.txt"), str(tmp_path / "t"), split_lines=True, **KW)
    got = prepare(str(tmp_path / "js" / "*"), str(tmp_path / "j"), text_field="content", **KW)
    assert _shards(got, tmp_path / "j") == _shards(ref, tmp_path / "t")
    assert got["splits"] == ref["splits"] and got["bad_records_skipped"] == {}
    with pytest.raises(SourceError, match=r"a\.jsonl line 1: missing field 'text'\. Fix: "):
        prepare(str(tmp_path / "js" / "*"), str(tmp_path / "x"), **KW)  # the default field is not there


def test_parquet_and_datasets_directories_read_in_order(tmp_path):
    """Parquet by row group (three groups) and a saved `datasets` directory (its Arrow stream files, as
    load_from_disk reads them) give the documents in order; parquet's shards equal the text lines' and do not
    depend on the worker count."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    pq.write_table(
        pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "pq" / "c.parquet", row_group_size=50
    )
    assert pq.ParquetFile(tmp_path / "pq" / "c.parquet").num_row_groups == 3
    assert list(documents([tmp_path / "pq" / "c.parquet"], False, "text", BadRecords("fail"))) == DOCS
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "all.txt").write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    ref = prepare(str(tmp_path / "txt" / "*.txt"), str(tmp_path / "t"), split_lines=True, **KW)
    one = prepare(str(tmp_path / "pq" / "*.parquet"), str(tmp_path / "p1"), **KW)
    two = prepare(str(tmp_path / "pq" / "*.parquet"), str(tmp_path / "p2"), **{**KW, "workers": 2})
    assert _shards(one, tmp_path / "p1") == _shards(ref, tmp_path / "t") == _shards(two, tmp_path / "p2")

    ds = tmp_path / "ds"
    try:
        import datasets

        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(ds), max_shard_size="2KB")
    except ImportError:  # the same files, written as `datasets` writes them: Arrow IPC streams listed in state.json
        ds.mkdir()
        files = []
        for k, part in enumerate((DOCS[:70], DOCS[70:])):
            files.append(f"data-{k:05d}-of-00002.arrow")
            table = pa.table({"text": part})
            with pa.ipc.new_stream(str(ds / files[-1]), table.schema) as w:
                w.write_table(table, max_chunksize=16)
        (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": f} for f in files]}))
    assert list(documents([ds], False, "text", BadRecords("fail"))) == DOCS
    got = prepare(str(ds), str(tmp_path / "d"), **KW)
    assert _shards(got, tmp_path / "d") == _shards(ref, tmp_path / "t")


def test_bad_records_fail_or_are_skipped_and_counted(tmp_path, capsys):
    """A missing field, a number, invalid UTF-8 and a line that is not JSON: the default stops at the first with
    one line naming where; --bad-records skip leaves the four out and counts them; a clean file counts none."""
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"text": DOCS[0]}), json.dumps({"other": "x"}), json.dumps({"text": 7})]
    src.write_bytes(
        ("\n".join(lines) + "\n").encode()
        + b'{"text": "caf\xe9"}\nnot json\n'
        + json.dumps({"text": DOCS[1]}).encode()
        + b"\n"
    )
    out = tmp_path / "o"
    assert main(["--input", str(src), "--output", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "in.jsonl line 2: missing field 'text'" in err and "--bad-records skip" in err
    meta = prepare(str(src), str(tmp_path / "s"), bad_records="skip", **KW)
    assert meta["bad_records_skipped"] == {
        "field 'text' is a int, not a string": 1,
        "invalid UTF-8": 1,
        "missing field 'text'": 1,
        "not a JSON object": 1,
    }
    assert sum(meta["splits"][s]["documents"] for s in ("train", "eval")) == 2
    clean = tmp_path / "clean.jsonl"
    _write_jsonl(clean, DOCS[:3])
    assert prepare(str(clean), str(tmp_path / "c"), bad_records="skip", **KW)["bad_records_skipped"] == {}
    (tmp_path / "bad.txt").write_bytes(b"fine\n\xff\xfe broken\n")  # text files are checked too, never replaced
    with pytest.raises(SourceError, match=r"bad\.txt line 2: invalid UTF-8"):
        prepare(str(tmp_path / "bad.txt"), str(tmp_path / "b"), split_lines=True, **KW)
