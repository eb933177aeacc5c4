"""Data: batch at step s is a pure function of (seed, s); iterator state; ArrayRecord preparation."""

import subprocess

import numpy as np
import pytest

from detjax.config import load_config
from detjax.data.pipeline import BatchIterator, DataError, make_dataset
from detjax.data.tokenizer import EOS, decode, encode


def test_tokenizer_roundtrip():
    ids = encode("héllo")
    assert ids[-1] == EOS and decode(ids) == "héllo"


def test_batch_is_pure_function_of_seed_and_step(tiny_path):
    cfg = load_config(tiny_path)
    a, b = make_dataset(cfg), make_dataset(cfg)
    for s in (0, 5, 1000):
        np.testing.assert_array_equal(a[s], b[s])
    assert not np.array_equal(a[0], a[1])
    other = make_dataset(load_config(tiny_path, ["train.seed=1"]))
    assert not np.array_equal(a[0], other[0])
    assert a[0].shape == (cfg.train.global_batch, cfg.train.seq_len + 1)


def test_iterator_state_resumes(tiny_path):
    ds = make_dataset(load_config(tiny_path))
    it = BatchIterator(ds)
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    assert state["next_step"] == 3
    rest = next(it)
    it2 = BatchIterator(ds)
    it2.set_state(state)
    np.testing.assert_array_equal(next(it2), rest)
    np.testing.assert_array_equal(first[1], ds[1])


def test_prepare_then_train_config(tmp_path, python, tiny_path):
    src = tmp_path / "txt"
    src.mkdir()
    for i in range(3):
        (src / f"doc{i}.txt").write_text(("the quick brown fox jumps over the lazy dog. " * 40) + str(i))
    out = tmp_path / "shards"
    cmd = [python, "-m", "detjax.data.prepare", "--input", str(src / "*.txt"), "--output", str(out), "--workers", "1"]
    r = subprocess.run([*cmd, "--eval-fraction", "0"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cfg = load_config(tiny_path, ["data.source=arrayrecord", f"data.path={out}"])
    ds = make_dataset(cfg)
    assert "quick brown fox" in decode(ds[0][0])
    r2 = subprocess.run(cmd, capture_output=True, text=True)
    assert r2.returncode == 2 and r2.stderr.startswith("error: ") and "refusing to mix" in r2.stderr


def test_missing_shards_error(tiny_path, tmp_path):
    cfg = load_config(tiny_path, ["data.source=arrayrecord", f"data.path={tmp_path}/none*.arrayrecord"])
    with pytest.raises(DataError, match=r"is not a directory \(a glob of shards is the old format"):
        make_dataset(cfg)
    cfg = load_config(tiny_path, ["data.source=arrayrecord", f"data.path={tmp_path}"])
    with pytest.raises(DataError, match="holds no meta.json"):
        make_dataset(cfg)
