"""Real-corpus tooling (#16): the BPE tokenizer, streaming shards, held-out evaluation, metric sinks, plots."""

import json
import subprocess

import numpy as np
import pytest

from detjax.config import load_config
from detjax.data import tokenizer as tk
from detjax.data.corpus import sentences
from detjax.data.pipeline import (
    BatchIterator,
    DataError,
    StreamSource,
    WindowSource,
    make_dataset,
    read_meta,
    resolve_data,
    split_source,
)
from detjax.data.prepare import PrepareError, documents, is_eval, prepare

ONE_BLOCK = ["model.pattern='-'", "model.mtp.depth=0"]  # quoted: a bare - is a YAML list


def _texts(d, files=3, lines=700):
    d.mkdir()
    pool = list(sentences(files * lines, seed=11))
    for i in range(files):
        extra = "naïve café — ünïcödé ✓" if i == 1 else ""
        (d / f"t{i}.txt").write_text("\n".join(pool[i * lines : (i + 1) * lines]) + "\n" + extra + "\n")
    return str(d / "*.txt")


def test_bpe_tokenizer_train_save_load_roundtrip(tmp_path):
    docs = list(sentences(3000, seed=5))
    a, b = tk.train_bpe(iter(docs), 400), tk.train_bpe(iter(docs), 400)
    assert a.sha256 == b.sha256 and a.to_json() == b.to_json()  # training is a pure function of the text
    assert tk.train_bpe(iter(docs), 380).sha256 != a.sha256  # control: the hash sees the tokenizer
    p = tmp_path / "tokenizer.json"
    p.write_text(a.to_json())
    c = tk.load(str(p))
    assert c.sha256 == a.sha256 and c.vocab_size == a.vocab_size <= 400 and c.eos_id == 0
    text = "the quick fox sees 42 plus 7 is 49. naïve café ✓"
    ids = c.encode(text, eos=False)
    assert c.decode(ids) == text and len(ids) < len(text.encode())  # subwords: fewer ids than bytes
    assert c.encode(text)[-1] == c.eos_id
    assert tk.id_dtype(256) == np.uint8 and tk.id_dtype(259) == np.uint16 and tk.id_dtype(65537) == np.uint32
    with pytest.raises(tk.TokenizerError, match="not a tokenizers JSON"):
        tk.BPETokenizer("{not json", "x.json")


def test_prepare_streams_the_in_memory_windows_whatever_the_workers(tmp_path, tiny_path):
    pattern = _texts(tmp_path / "txt")
    kw = dict(split_lines=True, eval_fraction=0.05, block_tokens=97, blocks_per_shard=5)
    m1 = prepare(pattern, str(tmp_path / "a"), workers=1, **kw)
    m2 = prepare(pattern, str(tmp_path / "b"), workers=2, **kw)  # two spawned tokenizer processes
    assert m1 == m2 and m1["dtype"] == "uint16"
    for sh in m1["splits"]["train"]["shards"] + m1["splits"]["eval"]["shards"]:
        assert (tmp_path / "a" / sh["file"]).read_bytes() == (tmp_path / "b" / sh["file"]).read_bytes()
    # the in-memory stream: every document encoded, split by its hash, concatenated in input order
    docs = list(documents(sorted((tmp_path / "txt").glob("*.txt")), split_lines=True))
    ref = {
        s: np.concatenate([tk.encode(d) for d in docs if is_eval(d, 0.05) == (s == "eval")]) for s in ("train", "eval")
    }
    assert 0 < len(ref["eval"]) < len(ref["train"])
    meta = read_meta(str(tmp_path / "a"))
    for split in ("train", "eval"):
        src, mem = split_source(meta, split, 64), WindowSource(ref[split], 64)
        assert isinstance(src, StreamSource) and len(src) == len(mem)
        for i in range(len(mem)):  # windows spanning 1..2 blocks of 97 tokens, across shard files
            np.testing.assert_array_equal(src[i], mem[i])
    src, mem = split_source(meta, "train", 64), WindowSource(ref["train"], 64)
    src.MAX_OPEN = 2  # more shard files than open readers: least recently used ones closed and reopened
    assert len(src.paths) > 4
    for i in np.random.default_rng(0).permutation(len(mem)):
        np.testing.assert_array_equal(src[int(i)], mem[int(i)])
    assert len(src._readers) == 2
    over = ["data.source=arrayrecord", f"data.path={tmp_path / 'a'}", "train.seq_len=64"]
    cfg = resolve_data(load_config(tiny_path, over))
    assert cfg.data.tokenizer_sha256 == tk.ByteTokenizer.sha256
    ds, ds_mem = make_dataset(cfg), make_dataset(cfg, tokens=ref["train"])
    for s in (0, 3, 40):
        np.testing.assert_array_equal(ds[s], ds_mem[s])
    it = BatchIterator(ds)
    [next(it) for _ in range(3)]
    it2 = BatchIterator(make_dataset(cfg))
    it2.set_state(it.get_state())  # a resume: the batch at step 3 is unchanged
    np.testing.assert_array_equal(next(it2), next(it))
    with pytest.raises(DataError, match=r"more than model.vocab_size=200\. Fix: set model.vocab_size >= 259"):
        resolve_data(load_config(tiny_path, over + ["model.vocab_size=200"]))
    with pytest.raises(DataError, match="the token ids would mean other text"):
        resolve_data(load_config(tiny_path, over + ["data.tokenizer_sha256=abc"]))
    with pytest.raises(PrepareError, match="already holds shards"):
        prepare(pattern, str(tmp_path / "a"), workers=1)


def test_prepare_with_bpe_then_train_and_sample(tmp_path, tiny_path, python):
    pattern = _texts(tmp_path / "txt", files=2, lines=400)
    r = subprocess.run(
        [python, "-m", "detjax.data.prepare", "--input", pattern, "--output", str(tmp_path / "bpe"),
         "--split-lines", "--train-bpe", "300", "--workers", "1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "bpe" / "meta.json").read_text())
    tok = tk.from_meta(meta, tmp_path / "bpe")
    assert (
        meta["tokenizer"]["kind"] == "bpe" and meta["dtype"] == "uint16" and tok.sha256 == meta["tokenizer"]["sha256"]
    )
    from detjax.sample import run_tokenizer

    over = ["data.source=arrayrecord", f"data.path={tmp_path / 'bpe'}", "train.seq_len=32", "model.vocab_size=304"]
    cfg = resolve_data(load_config(tiny_path, over))
    assert run_tokenizer(cfg).sha256 == tok.sha256
    alphabet = set("".join((tmp_path / "txt" / f"t{i}.txt").read_text() for i in range(2)))
    text = tok.decode(make_dataset(cfg)[0][0])
    assert len(text) > 32 and set(text) <= alphabet  # subword ids that decode to the corpus's text
    (tmp_path / "bpe" / "tokenizer.json").write_text(tk.train_bpe(iter(["other text"] * 50), 270).to_json())
    with pytest.raises(tk.TokenizerError, match="not the one meta.json records"):
        tk.from_meta(meta, tmp_path / "bpe")


def test_eval_is_deterministic_and_goes_to_tensorboard_and_plots(tmp_path, tiny_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from detjax.compare import load_fingerprints
    from detjax.plot import load_metrics, plot
    from detjax.train import train

    over = ONE_BLOCK + ["train.steps=4", "eval.every=2", "eval.steps=2", "run.progress=false", "ckpt.enabled=false"]
    runs = {}
    for name, extra in (("a", []), ("b", []), ("c", ["eval.steps=3"])):
        runs[name] = train(load_config(tiny_path, over + extra), tmp_path / name).run_dir
    fa = (runs["a"] / "fingerprints.jsonl").read_bytes()
    assert fa == (runs["b"] / "fingerprints.jsonl").read_bytes()  # L1, the eval fields included
    recs = load_fingerprints(runs["a"])
    assert [r["step"] for r in recs if "eval" in r] == [1, 3]
    rc = load_fingerprints(runs["c"])
    for r, q in zip(recs, rc, strict=True):  # control: more held-out batches, same training bits
        assert r["digest"] == q["digest"] and (r.get("eval") is None) == (q.get("eval") is None)
        if "eval" in r:
            assert r["eval"]["digest"] != q["eval"]["digest"]
    m = load_metrics(runs["a"])
    ev = [x for x in m if "eval_loss" in x]
    assert len(ev) == 2 and all(np.isclose(x["eval_ppl"], np.exp(x["eval_loss"])) for x in ev)
    assert all(x["data_wait_s"] >= 0 for x in m)
    acc = EventAccumulator(str(runs["a"] / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/loss")] == [1, 3]
    tb = [e.value for e in acc.Scalars("train/lm_loss")]
    assert np.allclose(tb, [x["lm_loss"] for x in m]) and len(tb) == 4
    assert {"train/step_time_s", "train/tokens_per_s", "train/data_wait_s"} <= set(acc.Tags()["scalars"])
    # no peak is known for the CPU: MFU is n/a (null in metrics.jsonl, no scalar), never a made-up 0 %
    assert "train/mfu" not in acc.Tags()["scalars"] and all(x["mfu"] is None for x in m)
    one = plot([str(runs["a"])], tmp_path / "one.png")
    same = plot([str(runs["a"]), str(runs["b"])], tmp_path / "two.png")
    diff = plot([str(runs["a"]), str(runs["c"])], tmp_path / "diff.png")
    assert "first_divergent_step" not in one and same["first_divergent_step"] is None
    assert diff["first_divergent_step"] == 1  # the first step with an eval record
    for f in ("one.png", "two.png", "diff.png"):
        assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_RSS = """
import gc, resource, sys
import numpy as np
from detjax.data.corpus import sentences
from detjax.data.pipeline import read_meta, split_source
from detjax.data.prepare import prepare

d = sys.argv[1]
text = " ".join(sentences(2000, seed=3))
text = text * (1 + 16384 // len(text))

def write(path, mb):  # documents (lines) of 8 KiB, each at another offset of the text
    with open(path, "w") as f:
        for i in range((mb << 20) // 8192):
            o = (i * 7919) % 8192
            f.write(text[o : o + 8191] + "\\n")

peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731
write(f"{d}/warm.txt", 24)
write(f"{d}/big.txt", 160)
kw = dict(split_lines=True, workers=1, eval_fraction=0.0, block_tokens=4096, blocks_per_shard=16384)
# Warm-up: the reader's libraries and threads, then the shard writer's buffer (freed when a shard closes).
prepare(f"{d}/warm.txt", f"{d}/w", **kw)
w = split_source(read_meta(f"{d}/w"), "train", 512)
for i in np.random.default_rng(1).integers(0, len(w), 500):
    w[int(i)]
del w
gc.collect()
prepare(f"{d}/warm.txt", f"{d}/w2", **kw)
warm = peak()
prepare(f"{d}/big.txt", f"{d}/b", **kw)
big = peak()
meta = read_meta(f"{d}/b")
src = split_source(meta, "train", 512)
for i in range(0, len(src), 16):  # one pass: every shard's reader opened
    src[i]
opened = peak()
for i in np.random.default_rng(0).integers(0, len(src), 5000):
    src[int(i)]
tokens = meta["splits"]["train"]["tokens"]
print(warm, big, opened, peak(), tokens * np.dtype(meta["dtype"]).itemsize / 2**20)
"""


def test_prepare_and_read_memory_is_bounded_on_a_corpus_100x_the_bound(tmp_path, python):
    """Peak RSS growth (MB) while preparing a 160 MiB text corpus (320 MiB of uint16 tokens) and then reading
    5000 windows at random positions of it is bounded by 3 MB: the corpus is > 100 x the bound. Measured after a
    warm-up (prepare 24 MiB, read from it, prepare it again) that brings in the libraries and the reader's
    threads and fills the ArrayRecord shard writer's buffer (about 16 MB, fixed whatever the shard or corpus
    size); loading the corpus, or holding any
    per-block state, would show as growth. Eval off, so one writer is open. The absolute figures (peak RSS of
    prepare and the reader on multi-GB corpora) are in docs/BENCHMARKS.md (scripts/data_bench.py)."""
    r = subprocess.run([python, "-c", _RSS, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    warm, big, opened, read, corpus_mb = (float(x) for x in r.stdout.split())
    bound = 3.0
    assert corpus_mb > 100 * bound, corpus_mb
    assert big - warm < bound, (warm, big)
    assert read - warm < bound, (warm, big, opened, read)


def test_wandb_asked_for_but_missing_is_a_clear_error(tiny_path):
    import importlib.util

    from detjax.config import ConfigError

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ConfigError, match=r"'run.wandb_project' = 'p': W&B is not installed\. Fix: pip install wandb"):
        load_config(tiny_path, ["run.wandb_project=p"])
    assert load_config(tiny_path).run.tensorboard  # TensorBoard is the default sink


def test_tensorboard_without_tensorboardx_is_a_clear_error(tiny_path, monkeypatch):
    """A machine without tensorboardX (the GPU image: the trainer crashed in its sink with a traceback) gets
    the one-line config error naming both fixes; with the sink off the same config loads."""
    import importlib.util

    from detjax.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboardX" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"'run.tensorboard' = True: tensorboardX is not installed\. Fix: pip"):
        load_config(tiny_path)
    assert not load_config(tiny_path, ["run.tensorboard=false"]).run.tensorboard
    monkeypatch.undo()
    assert load_config(tiny_path).run.tensorboard  # control: installed here, so the default loads
