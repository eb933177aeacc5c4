"""L2: save/restore at any step(s), any number of times, equals the uninterrupted run, bit for bit."""

import json
import os
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from detjax.ckpt import Checkpointer, CheckpointError
from detjax.ckpt.manager import KILL_DURING_SAVE_ENV, host_bytes
from detjax.config import load_config
from detjax.sharding.mesh import MESH_AXES, replicated, single_device_mesh
from detjax.step import Trainer
from detjax.train import train

STEPS = 12
BASE = [f"train.steps={STEPS}", "train.warmup_steps=4", "run.progress=false", "run.log_every=0"]


@pytest.fixture(scope="module")
def cfg_of(tiny_path):
    return lambda *extra: load_config(tiny_path, BASE + list(extra))


@pytest.fixture(scope="module")
def continuous(cfg_of, tmp_path_factory):
    """The reference: uninterrupted, with a checkpoint after every step to compare restored states with."""
    d = tmp_path_factory.mktemp("cont") / "run"
    return train(cfg_of("ckpt.every=1", f"ckpt.keep={STEPS + 1}"), d)


def _restore_at(run_dir, cfg, step):
    trainer = Trainer(cfg)
    abstract = trainer.abstract_state()
    ck = Checkpointer(run_dir / "checkpoints", cfg)
    try:
        state, data, _ = ck.restore(abstract, jax.tree.map(lambda _: replicated(single_device_mesh()), abstract), step)
    finally:
        ck.close()
    return state, data


def _assert_same_run(ref, got):
    a = (ref.run_dir / "fingerprints.jsonl").read_bytes()
    b = (got.run_dir / "fingerprints.jsonl").read_bytes()
    assert len(a.splitlines()) == STEPS and a == b
    assert host_bytes(ref.state) == host_bytes(got.state)  # params, optimizer state, RNG, collections
    assert ref.data_state == got.data_state


def _interrupted(cfg_of, run_dir, stops, hook=None):
    for i, s in enumerate(stops):
        r = train(cfg_of(f"run.stop_after={s}"), run_dir, resume=i > 0, after_restore=hook if i else None)
        assert r.stopped_by == "stop_after" and int(r.state.step) == s
    return train(cfg_of(), run_dir, resume=True, after_restore=hook)


@pytest.mark.parametrize(
    "stops", [[5], [5, 9], [1], [3, 7]], ids=["one-restore", "two-restores", "after-step-1", "across-warmup-end"]
)
def test_resume_is_bitwise(cfg_of, continuous, tmp_path, stops):
    seen = []

    def record(state, batches):
        seen.append((int(state.step), host_bytes(state), batches.get_state()))
        return state, batches

    got = _interrupted(cfg_of, tmp_path / "run", stops, record)
    _assert_same_run(continuous, got)
    # right after every restore: params, optimizer state, RNG and data position equal the reference's
    assert [s for s, _, _ in seen] == stops
    for step, state_bytes, data_state in seen:
        ref_state, ref_data = _restore_at(continuous.run_dir, cfg_of(), step)
        assert state_bytes == host_bytes(ref_state)
        assert data_state == ref_data and data_state["next_step"] == step


@pytest.mark.parametrize("what", ["rng", "data"])
def test_negative_control_diverges(cfg_of, continuous, tmp_path, what):
    """Restoring without the RNG state or with a wrong data position must be caught: the test can fail."""

    def spoil(state, batches):
        if what == "rng":
            return state.replace(rng=jax.random.key(987654)), batches
        batches.set_state({"next_step": int(state.step) + 1})
        return state, batches

    run = tmp_path / "run"
    if what == "rng":
        _interrupted(cfg_of, run, [5], spoil)
    else:  # the final save refuses the inconsistent state; the fingerprints already show the damage
        with pytest.raises(CheckpointError, match="data iterator is at step 13 but the state is at step 12"):
            _interrupted(cfg_of, run, [5], spoil)
    from detjax.compare import first_divergence, load_fingerprints

    d = first_divergence(load_fingerprints(continuous.run_dir), load_fingerprints(run))
    assert d is not None and d["step"] == 5
    names = {f[0] for f in d["fields"]}
    assert ("digest.rng" in names) if what == "rng" else ("digest.batch" in names)


def test_resume_step_continues_from_an_earlier_checkpoint(cfg_of, continuous, tmp_path):
    """--resume-step 5 in a directory holding checkpoints 0..12: the later ones are moved aside (kept), the run
    continues from step 5 and equals the uninterrupted one; a step that is not there is refused."""
    run = tmp_path / "run"
    shutil.copytree(continuous.run_dir / "checkpoints", run / "checkpoints")
    with pytest.raises(CheckpointError, match=r"--resume-step 99: .* holds no complete checkpoint at that step"):
        train(cfg_of(), run, resume_step=99)
    got = train(cfg_of(), run, resume_step=5)
    _assert_same_run(continuous, got)
    moved = sorted(int(p.name) for p in (run / "superseded" / "after_5").iterdir())
    assert moved == list(range(6, STEPS + 1))  # kept, not deleted
    ck = Checkpointer(run / "checkpoints", cfg_of())
    assert ck.all_steps()[-1] == STEPS  # the continued run saved its own step 12
    ck.close()


def test_extended_run_equals_a_run_planned_longer(cfg_of, tmp_path):
    """A finished 8-step run resumed with train.steps=12 keeps its recorded schedule horizon (8): its 12 steps
    equal a fresh 12-step run with train.decay_steps=8, byte for byte; a fresh 12-step run with the default
    horizon (12) differs from step 4 on (negative control). A one-block model: the schedule is what is tested."""
    small = ["model.pattern='-'", "model.mtp.depth=0"]
    run = tmp_path / "run"
    first = train(cfg_of(*small, "train.steps=8"), run)
    assert first.stopped_by == "steps" and "decay_steps: 8" in (run / "config.yaml").read_text()
    extended = train(cfg_of(*small), run, resume=True)
    planned = train(cfg_of(*small, "train.decay_steps=8"), tmp_path / "planned")
    a = (extended.run_dir / "fingerprints.jsonl").read_bytes()
    assert len(a.splitlines()) == STEPS and a == (planned.run_dir / "fingerprints.jsonl").read_bytes()
    assert host_bytes(extended.state) == host_bytes(planned.state)
    from detjax.compare import first_divergence, load_fingerprints

    default = train(cfg_of(*small), tmp_path / "default")
    d = first_divergence(load_fingerprints(default.run_dir), load_fingerprints(run))
    assert d is not None and d["step"] >= 4  # warmup (4 steps) is shared; the cosine phase depends on the horizon


def test_flipped_byte_is_refused(cfg_of, continuous, tmp_path):
    ck_dir = tmp_path / "checkpoints"
    shutil.copytree(continuous.run_dir / "checkpoints" / str(STEPS), ck_dir / str(STEPS))
    files = [p for p in (ck_dir / str(STEPS) / "state").rglob("*") if p.is_file()]
    target = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    target.write_bytes(bytes(raw))
    cfg = cfg_of()
    trainer = Trainer(cfg)
    abstract = trainer.abstract_state()
    ck = Checkpointer(ck_dir, cfg)
    with pytest.raises(CheckpointError, match=r"(?s)checkpoint step 12.*(item 'state'|reading the items).*corrupt"):
        ck.restore(abstract, jax.tree.map(lambda _: replicated(single_device_mesh()), abstract))
    ck.close()


def test_config_and_shape_mismatch_are_refused(cfg_of, continuous):
    other = cfg_of("model.ffn_dim=96")
    trainer = Trainer(other)
    abstract = trainer.abstract_state()
    ck = Checkpointer(continuous.run_dir / "checkpoints", other)
    with pytest.raises(CheckpointError, match=r"(?s)model\.ffn_dim: saved 128, now 96.*Only these sections"):
        ck.restore(abstract, jax.tree.map(lambda _: replicated(single_device_mesh()), abstract))
    # the leaf check, reached when the hash matches but a leaf does not (e.g. a hand-edited target)
    meta = ck._read_meta(STEPS)
    ck.close()
    ck = Checkpointer(continuous.run_dir / "checkpoints", cfg_of())
    wrong = jax.eval_shape(lambda: {"step": np.zeros((), np.float32)})
    with pytest.raises(CheckpointError, match=r"leaf state\['step'\]: checkpoint has dtype int32.*float32"):
        ck.check_compatible(dict(meta, leaves={"['step']": {"dtype": "int32", "shape": []}}), wrong)
    ck.close()


def _restore_on_fsdp8(cfg_of, continuous):
    """Checkpoint 6, saved on one device, restored with fsdp-style shardings over 8 devices."""
    cfg = cfg_of()
    trainer = Trainer(cfg)
    abstract = trainer.abstract_state()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8, 1, 1, 1), MESH_AXES)

    def pick(x):
        shardable = x.ndim >= 1 and x.shape[0] % 8 == 0 and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        return NamedSharding(mesh, PartitionSpec("fsdp") if shardable else PartitionSpec())

    shardings = jax.tree.map(pick, abstract)
    ck = Checkpointer(continuous.run_dir / "checkpoints", cfg)
    state, _, _ = ck.restore(abstract, shardings, step=6)
    ck.close()
    return cfg, trainer, mesh, state


def test_restore_onto_another_mesh(cfg_of, continuous):
    """The restored arrays are sharded over the 8 devices and hold the bytes of the one-device restore."""
    cfg, _, mesh, state = _restore_on_fsdp8(cfg_of, continuous)
    ref, _ = _restore_at(continuous.run_dir, cfg, 6)
    assert host_bytes(state) == host_bytes(ref)
    w = state.params["layer_3"]["mixer"]["w_gate"]
    assert w.sharding == NamedSharding(mesh, PartitionSpec("fsdp")) and len(w.sharding.device_set) == 8


@pytest.mark.extended  # compiles the step over 8 devices (~2 min); training on fsdp meshes: test_mesh_cells.py
def test_restore_onto_another_mesh_and_continue(cfg_of, continuous):
    """Restored onto fsdp 8 as above, then trains on."""
    cfg, trainer, mesh, state = _restore_on_fsdp8(cfg_of, continuous)
    step = jax.jit(trainer.train_step)
    from detjax.data.pipeline import make_dataset

    ds = make_dataset(cfg)
    losses = []
    for s in range(6, 8):
        state, m = step(state, jax.device_put(np.asarray(ds[s]), NamedSharding(mesh, PartitionSpec())))
        losses.append(float(m["lm_loss"]))
    assert int(state.step) == 8 and all(np.isfinite(losses))


def _spawn(python, tiny_path, run_dir, extra, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    cmd = [python, "-m", "detjax.train", "--config", str(tiny_path), "--run-dir", str(run_dir), *BASE, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.slow
def test_sigkill_during_async_save_then_resume(python, tiny_path, cfg_of, continuous, tmp_path):
    run = tmp_path / "run"
    p = _spawn(python, tiny_path, run, ["ckpt.every=3"], {KILL_DURING_SAVE_ENV: "6"})
    out, _ = p.communicate(timeout=600)
    assert p.returncode == -signal.SIGKILL, out
    ck = Checkpointer(run / "checkpoints", cfg_of())
    assert ck.latest_step() == 3, sorted(os.listdir(run / "checkpoints"))
    ck.close()
    before = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert before[:6] == list(range(6))  # flushed per line: the killed process's lines are all there
    got = train(cfg_of("ckpt.every=3"), run, resume=True)
    _assert_same_run(continuous, got)
    # the lines of steps after the restored checkpoint were redone: one line per step, in order
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == list(range(STEPS))


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(python, tiny_path, cfg_of, continuous, tmp_path):
    run = tmp_path / "run"
    p = _spawn(python, tiny_path, run, [])
    fp = run / "fingerprints.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and p.poll() is None:
        if fp.exists() and len(fp.read_text().splitlines()) >= 2:
            p.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    out, _ = p.communicate(timeout=600)
    # 128 + SIGTERM when the signal stopped the run (after saving); 0 when it arrived after the last step
    assert (p.returncode, "stopped by signal" in out) in ((128 + signal.SIGTERM, True), (0, False)), out
    got = train(cfg_of(), run, resume=True)
    _assert_same_run(continuous, got)


@pytest.mark.slow
@pytest.mark.extended  # the script end to end; L2 itself is test_resume_is_bitwise and the kill/signal tests
def test_resume_check_script(python, tiny_path, tmp_path):
    """The L2 tool end to end, each stop a new process: exit 0 and the 'identical' verdict."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "resume_check.py"
    cmd = [
        python,
        str(script),
        "--config",
        str(tiny_path),
        "--stops",
        "2",
        "--steps",
        "4",
        "--workdir",
        str(tmp_path / "w"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical: continuous vs stops [2] over 4 steps" in r.stdout
    bad = subprocess.run(
        [python, str(script), "--config", str(tiny_path), "--stops", "9", "--steps", "4"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "every stop must lie in 1..3" in bad.stderr


def _json_item(ck_dir, item: str):
    f = ck_dir / str(STEPS) / item / "metadata"  # Orbax's JSON item file
    assert f.is_file(), sorted((ck_dir / str(STEPS) / item).iterdir())
    return f


@pytest.mark.parametrize("edit", ["data-position", "fingerprint-digit", "config-no-hash", "rng-impl"])
def test_edited_json_items_are_refused(cfg_of, continuous, tmp_path, edit):
    """The items beside the arrays are checksummed at save: an edited data position (the resumed run would
    read other batches), fingerprint history, config (hash left alone) or PRNG implementation is refused
    with a one-line reason. Negative control: the unedited copy restores."""
    ck_dir = tmp_path / "checkpoints"
    shutil.copytree(continuous.run_dir / "checkpoints" / str(STEPS), ck_dir / str(STEPS))
    cfg = cfg_of()
    abstract = Trainer(cfg).abstract_state()
    shardings = jax.tree.map(lambda _: replicated(single_device_mesh()), abstract)
    ck = Checkpointer(ck_dir, cfg)
    ck.restore(abstract, shardings)  # negative control: as saved, it restores
    item, change = {
        "data-position": ("data", _bump_first_int),
        "fingerprint-digit": ("meta", lambda m: {**m, "fingerprints": _bump_fingerprint(m["fingerprints"])}),
        "config-no-hash": ("meta", lambda m: {**m, "config": _with_d_model(m["config"], 80)}),
        "rng-impl": ("meta", lambda m: {**m, "rng_impl": "rbg"}),
    }[edit]
    f = _json_item(ck_dir, item)
    f.write_text(json.dumps(change(json.loads(f.read_text()))))
    with pytest.raises(CheckpointError, match=rf"checkpoint step {STEPS}: .*(checksum|hashes to).*Fix: ") as e:
        ck.restore(abstract, shardings)
    assert "\n" not in str(e.value)
    ck.close()


def _bump_first_int(d: dict) -> dict:
    """The data state with its first integer field other than next_step changed by one (e.g. Grain's index)."""
    out = json.loads(json.dumps(d))

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if isinstance(v, int) and not isinstance(v, bool) and k != "next_step":
                    x[k] = v + 1
                    return True
                if walk(v):
                    return True
        if isinstance(x, list):
            return any(walk(v) for v in x)
        return False

    if not walk(out):  # Grain keeps its state as a JSON string: edit the first digit in it
        for k, v in out.items():
            if isinstance(v, str) and any(c.isdigit() for c in v):
                i = next(i for i, c in enumerate(v) if c.isdigit())
                out[k] = v[:i] + str((int(v[i]) + 1) % 10) + v[i + 1 :]
                break
    assert out != d
    return out


def _bump_fingerprint(history: list) -> list:
    out = json.loads(json.dumps(history))
    d = out[-1]["digest"]["params"]
    out[-1]["digest"]["params"] = ("1" if d[0] != "1" else "2") + d[1:]
    return out


def _with_d_model(config: dict, value: int) -> dict:
    out = json.loads(json.dumps(config))
    out["model"]["d_model"] = value
    return out


def test_checkpoints_of_the_older_digest_version_restore_and_unknown_versions_are_refused(cfg_of, continuous, tmp_path):
    """A checkpoint written before digest version 2 (no `digest_version`, version-1 leaf digests) restores and
    is still checked leaf by leaf (a version-1 digest edited by one digit is refused); an unknown version is a
    one-line error."""
    from detjax.ckpt.manager import json_sha256, leaf_digests

    src = continuous.run_dir / "checkpoints" / str(STEPS)
    cfg = cfg_of()
    abstract = Trainer(cfg).abstract_state()
    shardings = jax.tree.map(lambda _: replicated(single_device_mesh()), abstract)
    ref, _ = _restore_at(continuous.run_dir, cfg, STEPS)
    v1 = leaf_digests(
        {
            "step": ref.step,
            "params": ref.params,
            "opt_state": ref.opt_state,
            "rng": jax.random.key_data(ref.rng),
            "collections": ref.collections,
        },
        version=1,
    )

    def rewrite(d, meta_edit):
        ck_dir = tmp_path / d / "checkpoints"
        shutil.copytree(src, ck_dir / str(STEPS))
        f = _json_item(ck_dir, "meta")
        m = meta_edit(json.loads(f.read_text()))
        m["meta_sha256"] = json_sha256({k: v for k, v in m.items() if k != "meta_sha256"})
        f.write_text(json.dumps(m))
        return Checkpointer(ck_dir, cfg)

    def as_v1(m):
        assert m.pop("digest_version") == 2 and set(m["digests"]) == set(v1) and m["digests"] != v1
        return {**m, "digests": v1}

    ck = rewrite("old", as_v1)
    state, _, _ = ck.restore(abstract, shardings)
    assert host_bytes(state) == host_bytes(ref)
    ck.close()
    k0 = sorted(v1)[0]
    edited = dict(v1, **{k0: ("0" if v1[k0][0] != "0" else "1") + v1[k0][1:]})
    ck = rewrite("old-edited", lambda m: {**as_v1(m), "digests": edited})
    with pytest.raises(CheckpointError, match=rf"leaf {__import__('re').escape(k0)} has digest .* corrupt"):
        ck.restore(abstract, shardings)
    ck.close()
    ck = rewrite("future", lambda m: {**m, "digest_version": 99})
    with pytest.raises(CheckpointError, match=r"digests are version 99, which this detjax does not know") as e:
        ck.restore(abstract, shardings)
    assert "\n" not in str(e.value)
    ck.close()
