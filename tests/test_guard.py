"""The non-finite guard: checked on device inside the step, read on host with each step's metrics."""

import numpy as np
import pytest

from detjax.config import load_config
from detjax.runlog import NonFiniteError, nonfinite_problem
from detjax.train import train

PATHS = ["['embed']['table']", "['layer_0']['norm']['scale']", "['w_head']"]


def _host(**over):
    host = {"lm_loss": 2.0, "mtp_loss": 2.1, "aux_loss": 1.0, "grad_norm": 0.5}
    host["finite"] = {"grads": np.ones(3, bool), "params": np.ones(3, bool)}
    host["digest"] = {k: np.array([1, 2], np.uint32) for k in ("params", "grads", "opt_state", "batch", "rng")}
    for k, v in over.items():
        if k in ("grads", "params"):
            host["finite"][k] = np.array(v, bool)
        else:
            host[k] = v
    return host


def test_the_guard_names_quantity_leaf_and_step():
    assert nonfinite_problem(4, _host(), PATHS) is None
    msg = nonfinite_problem(7, _host(lm_loss=float("nan"), grad_norm=float("inf"), grads=[1, 0, 0]), PATHS)
    assert "at step 7: lm_loss is lm_loss=nan" in msg and "first non-finite gradient leaf: ['layer_0']" in msg
    assert "digests params=0000000100000002" in msg and "Fix: " in msg and "\n" not in msg
    msg = nonfinite_problem(3, _host(grad_norm=float("inf"), grads=[1, 1, 0]), PATHS)
    assert "grad_norm is" in msg and "leaf: ['w_head']" in msg
    msg = nonfinite_problem(0, _host(params=[1, 0, 1]), PATHS)
    assert "the update (parameters after the optimizer step)" in msg and "update: ['layer_0']" in msg


def test_a_run_that_goes_non_finite_stops_and_saves_nothing(tiny_path, tmp_path):
    """lr = 1e39 overflows float32 in the first update: the run stops at step 0 naming the update and the
    first parameter leaf; no fingerprint, checkpoint or final params of a non-finite state is written. The
    metrics line of the step is kept (flushed), with its losses."""
    over = ["train.lr=1e39", "train.warmup_steps=0", "train.steps=3", "ckpt.every=1", "run.progress=false"]
    over += ["model.pattern='-'", "model.mtp.depth=0"]  # a one-block model: the guard is what is tested
    with pytest.raises(NonFiniteError, match=r"step 0: the update .*leaf after the update: \['embed'\]\['table'\]"):
        train(load_config(tiny_path, over), tmp_path / "run")
    run = tmp_path / "run"
    assert (run / "fingerprints.jsonl").read_text() == ""
    assert not (run / "final_params.npz").exists()
    assert not any((run / "checkpoints").glob("*/")), "a checkpoint of the non-finite state was written"
    assert '"step": 0' in (run / "metrics.jsonl").read_text()


def test_skip_step_keeps_the_state_and_records_it(tiny_path, tmp_path):
    """train.on_nonfinite=skip_step. With lr = 1e39 every update overflows: all three steps are skipped, their
    fingerprints say so and keep one parameter and optimizer digest, the run finishes with finite state, and a
    second run gives the same bytes. With a healthy lr nothing is skipped and the fingerprints equal the default
    mode's. Negative control: the default (stop) stops at step 0 on the overflowing config."""
    import json

    import jax

    over = ["train.steps=3", "train.warmup_steps=0", "ckpt.every=1", "run.progress=false", "run.log_every=0"]
    over += ["model.pattern='-'", "model.mtp.depth=0"]
    skip = [*over, "train.on_nonfinite=skip_step"]

    def recs(r):
        return [json.loads(x) for x in (r.run_dir / "fingerprints.jsonl").read_text().splitlines()]

    bad = [train(load_config(tiny_path, [*skip, "train.lr=1e39"]), tmp_path / f"bad{i}") for i in (0, 1)]
    assert (bad[0].run_dir / "fingerprints.jsonl").read_bytes() == (bad[1].run_dir / "fingerprints.jsonl").read_bytes()
    got = recs(bad[0])
    assert [r["skipped"] for r in got] == [True, True, True]
    for field in ("params", "opt_state"):
        assert len({r["digest"][field] for r in got}) == 1
    assert bad[0].stopped_by == "steps" and int(bad[0].state.step) == 3
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(bad[0].state.params))
    metrics = [json.loads(x) for x in (bad[0].run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in metrics] == [True, True, True]
    healthy = recs(train(load_config(tiny_path, skip), tmp_path / "healthy"))
    assert [r.pop("skipped") for r in healthy] == [False, False, False]
    assert healthy == recs(train(load_config(tiny_path, over), tmp_path / "default"))
    with pytest.raises(NonFiniteError, match=r"step 0: "):
        train(load_config(tiny_path, [*over, "train.lr=1e39"]), tmp_path / "stop")


def test_one_process_per_run_directory(tmp_path):
    """The run directory's lock: a second holder is refused with the first one's pid; released after."""
    import os

    from detjax import rundir
    from detjax.config import ConfigError

    with rundir.locked(tmp_path, primary=True):
        with pytest.raises(ConfigError, match=rf"in use by another training process \(pid {os.getpid()}\)\. Fix: "):
            with rundir.locked(tmp_path, primary=True):
                pass
    with rundir.locked(tmp_path, primary=True):  # released: taken again
        pass


def test_resume_of_a_missing_run_directory_is_refused(tiny_path, tmp_path):
    from detjax import rundir
    from detjax.config import ConfigError

    cfg = load_config(tiny_path)
    with pytest.raises(ConfigError, match=r"--resume: run directory .*does not exist.*Fix: check the --run-dir"):
        rundir.choose(cfg, tmp_path / "typo", resume=True, process_count=1)
    assert rundir.choose(cfg, tmp_path / "new", resume=False, process_count=1).is_dir()


def test_resume_without_a_checkpoint_is_refused(tiny_path, tmp_path, capsys):
    """--resume (or --resume-step) on a directory with no checkpoint: exit 2, one line; nothing trains."""
    from detjax.train import main

    (tmp_path / "run").mkdir()
    base = ["--config", str(tiny_path), "--run-dir", str(tmp_path / "run")]
    assert main([*base, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no complete checkpoint, so there is nothing to resume. Fix: " in err[0]
    assert main([*base, "--resume-step", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume-step 3: " in err[0] and "(it holds none). Fix: pick" in err[0]
    assert not (tmp_path / "run" / "fingerprints.jsonl").exists()


def test_bad_data_files_get_one_line_errors(tiny_path, tmp_path, capsys):
    import json

    from detjax.data.pipeline import DataError, make_dataset
    from detjax.data.prepare import prepare
    from detjax.train import main

    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    good = tmp_path / "good"
    prepare(str(tmp_path / "t.txt"), str(good), eval_fraction=0, block_tokens=512, workers=1)
    cfg = load_config(tiny_path, ["data.source=arrayrecord", f"data.path={good}"])
    assert make_dataset(cfg)[0].shape == (cfg.train.global_batch, cfg.train.seq_len + 1)  # control: it reads
    shard = good / "train-00000.arrayrecord"
    data = shard.read_bytes()
    shard.write_bytes(b"")
    with pytest.raises(DataError, match=r"is missing or empty\. Fix: "):
        make_dataset(cfg)
    shard.write_bytes(b"not an array record file\n" * 10)
    with pytest.raises(DataError, match=r"cannot read the train shards as the ArrayRecord files meta.json .*\. Fix: "):
        make_dataset(cfg)
    shard.write_bytes(data)
    meta = json.loads((good / "meta.json").read_text())
    bad = json.loads(json.dumps(meta))
    bad["splits"]["train"]["shards"][0]["records"] += 1
    (good / "meta.json").write_text(json.dumps(bad))
    with pytest.raises(DataError, match=r"holds \d+ records, meta.json says \d+\)\. Fix: re-run"):
        make_dataset(cfg)
    (good / "meta.json").write_text(json.dumps(meta | {"format": 1}))
    with pytest.raises(DataError, match=r"format 1, this version reads 2\. Fix: re-run prepare"):
        make_dataset(cfg)
    (good / "meta.json").write_text("{")
    with pytest.raises(DataError, match=r"meta.json is malformed"):
        make_dataset(cfg)
    over = ["data.source=arrayrecord", f"data.path={tmp_path / 'nothing'}", f"run.out_dir={tmp_path}"]
    assert main(["--config", str(tiny_path), *over]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.path=") and "is not a directory. Fix: " in err[0]


def test_resume_with_another_resolved_mesh_is_refused(python, tiny_path, tmp_path):
    """mesh.devices=0 (all devices) with data=-1: written with 2 devices, resumed where only 1 is present,
    the mesh resolves to data=1; the trajectory would change, so the resume is refused (exit 2, one line)."""
    import os
    import subprocess

    run = tmp_path / "run"
    over = ["mesh.devices=0", "mesh.data=-1", "train.steps=2", "run.stop_after=1", "run.progress=false"]
    over += ["model.pattern='-'", "model.mtp.depth=0"]  # one block (quoted: a bare - is a YAML list)

    def start(n: int, *extra: str):
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env = dict(os.environ, XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={n}"]))
        cmd = [python, "-m", "detjax.train", "--config", str(tiny_path), "--run-dir", str(run), *over, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)

    first = start(2)
    assert first.returncode == 0, first.stderr[-2000:]
    second = start(1, "--resume")
    assert second.returncode == 2, second.stderr[-2000:]
    err = [x for x in second.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "was written on the mesh" in err[0] and "'data': 2" in err[0] and "Fix: " in err[0]


# ~50 s on 2 cores (a training process of its own). The refusal path is the one the resolved-mesh test above
# runs end to end, and test_layout_changes_list_what_changes_bits checks the host-device-count rule itself.
@pytest.mark.extended
def test_resume_on_another_host_device_count_is_refused(python, tiny_path, tmp_path):
    """A single-device run written with 1 host CPU device, resumed in a process with 2: the mesh is the same,
    but XLA's CPU numerics follow the host device count, so the resume is refused (exit 2, one line)."""
    import os
    import subprocess

    run = tmp_path / "run"
    over = ["mesh.devices=1", "train.steps=2", "run.stop_after=1", "run.progress=false"]
    over += ["model.pattern='-'", "model.mtp.depth=0"]

    def start(n: int, *extra: str):
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env = dict(os.environ, XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={n}"]))
        cmd = [python, "-m", "detjax.train", "--config", str(tiny_path), "--run-dir", str(run), *over, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)

    assert start(1).returncode == 0
    second = start(2, "--resume")
    assert second.returncode == 2, second.stderr[-2000:]
    err = [x for x in second.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "host CPU devices: saved 1, now 2" in err[0] and "Fix: " in err[0], second.stderr


def test_layout_changes_list_what_changes_bits():
    from detjax.train import _layout_changes, _policy_drift

    saved = {"platform": "gpu", "device_kind": "H200", "device_count": 8, "xla_flags": "--a=1 --xla_dump_to=/x"}
    same = dict(saved, xla_flags="--a=1 --xla_dump_to=/y", device_count=4)  # dumps and GPU count: no change
    assert _layout_changes(saved, same) == [] and _policy_drift(saved, same) == ["device_count: saved 8, now 4"]
    other = dict(saved, device_kind="H100", xla_flags="--a=2")
    got = _layout_changes(saved, other)
    assert got[0] == "device_kind: saved 'H200', now 'H100'" and "only at save ['--a=1'], only now ['--a=2']" in got[1]
    cpu = {"platform": "cpu", "device_kind": "cpu", "device_count": 1, "xla_flags": ""}
    assert _layout_changes(cpu, dict(cpu, device_count=8)) == ["host CPU devices: saved 1, now 8"]
    code = dict(cpu, code={"git_commit": "a" * 40})
    newer = dict(code, code={"git_commit": "b" * 40})
    assert _layout_changes(code, newer) == [] and [d[:6] for d in _policy_drift(code, newer)] == ["code: "]
