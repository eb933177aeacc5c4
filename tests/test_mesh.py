"""Meshes on 8 CPU devices: every cell repeats bit for bit and tracks the single-device loss; golden
sharding files; impossible layouts fail before compiling; pipeline schedules; expert parallel = local."""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cells import BASE, CELLS, MESH_CFG, STEPS, cell_overrides, cfg_for, params_equal
from flax import linen as nn

from detjax.config import ConfigError
from detjax.sharding.mesh import build_layout
from detjax.sharding.pipeline import stack_params, unstack_params
from detjax.sharding.rules import activation_specs, spec_json
from detjax.sharding.schedule import BWD, FWD, IDLE, build_schedule

GOLDEN = Path(__file__).resolve().parent / "golden" / "shardings"

# ---------------------------------------------------------------------------------------------- golden


def sharding_record(cell: str) -> dict:
    """Parameter shardings (from the rules table) and the activation shardings the step pins, per cell."""
    from detjax.step import Trainer

    cfg = cfg_for(*cell_overrides(cell))
    layout = build_layout(cfg, jax.devices()[:8])
    tr = Trainer(cfg, layout=layout)
    ss = tr.state_shardings()
    params = {
        "/".join(str(k.key) for k in p): spec_json(s.spec)
        for p, s in jax.tree_util.tree_flatten_with_path(ss.params)[0]
    }
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32)
    jaxpr = jax.make_jaxpr(tr.train_step)(tr.abstract_state(), batch)
    return {
        "mesh": dict(layout.mesh.shape),
        "params": params,
        "activations": dict(sorted(activation_specs(jaxpr).items())),
    }


@pytest.mark.parametrize("cell", list(CELLS))
def test_golden_shardings(cell):
    rec = sharding_record(cell)
    path = GOLDEN / f"{cell}.json"
    if os.environ.get("DETJAX_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    assert path.exists(), f"no golden file {path}; create it with DETJAX_UPDATE_GOLDEN=1"
    assert rec == json.loads(path.read_text()), f"shardings of {cell} drifted from {path}"


def test_golden_shardings_split_what_the_cell_says():
    """The golden files are not vacuous: the axes each cell names really split parameters."""
    tp = json.loads((GOLDEN / "tp4.json").read_text())
    assert tp["params"]["layer_1/mixer/w_q"] == [None, "tensor"]
    assert tp["params"]["w_head"] == [None, "tensor"]
    assert tp["params"]["embed/table"] == ["tensor"]  # vocab-parallel embedding
    assert tp["activations"]["logits"] == ["data", None, "tensor"]  # vocab-parallel logits: no gather
    ep = json.loads((GOLDEN / "fsdp8-ep4.json").read_text())
    assert ep["params"]["layer_2/mixer/experts/w_gate"] == ["expert", "fsdp"]
    assert ep["params"]["embed/table"] == [None, "fsdp"]
    assert ep["activations"]["embed_out"] == [["fsdp", "expert"]]
    sp = json.loads((GOLDEN / "tp4-sp.json").read_text())
    assert sp["activations"]["residual"] == ["data", "tensor"]  # sequence parallel between blocks
    assert tp["activations"]["residual"] == ["data"]
    pp = json.loads((GOLDEN / "pp2-vpp2.json").read_text())
    assert pp["params"]["stages/block_0/mixer/w_q"] == [None, "pipeline"]  # stacked stages split over pipeline


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["mesh.tensor=3"], "model.n_heads"),
        (["mesh.tensor=16"], "is not divisible by mesh.tensor = 16"),
        (["mesh.expert=3"], "model.moe.n_experts"),
        (["mesh.pipeline=3"], "cannot be split into pipeline"),
        (["mesh.pipeline=2"], "must hold the same block sequence"),
        (["mesh.pipeline=2", "model.pattern=M*E-M*E-", "mesh.expert=2"], "expert parallel inside pipeline"),
        (["mesh.data=2", "mesh.tensor=-1", "mesh.fsdp=-1"], "only one axis may be -1"),
        (["mesh.pipeline_virtual=2"], "need mesh.pipeline > 1"),
        (["mesh.fsdp=3"], "model.d_model"),
    ],
)
def test_impossible_layouts_fail_in_config(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("*", r"\*")):
        cfg_for(*overrides)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["mesh.tensor=2", "mesh.data=2"], "multiply to 4 but 8 devices"),
        (["mesh.fsdp=3", "model.d_model=96"], "mesh.data=-1 cannot be filled"),
        (["mesh.data=8", "train.micro_batch=4", "train.global_batch=16"], "train.micro_batch"),
        (["mesh.devices=16"], "only 8 devices are present"),
    ],
)
def test_impossible_meshes_fail_before_compiling(overrides, needle):
    cfg = cfg_for(*overrides)  # consistent on its own; only the device count makes it impossible
    with pytest.raises(ConfigError, match=needle):
        build_layout(cfg) if "mesh.devices=16" in overrides else build_layout(cfg, jax.devices()[:8])


# ---------------------------------------------------------------------------------------------- schedules


@pytest.mark.slow
@pytest.mark.extended  # three multi-process launches (~3 min on 2 cores); run with -m extended
def test_two_processes_stop_together_on_sigterm_and_resume(tmp_path, python):
    """SIGTERM to one process of a 2-process run: JAX's preemption service stops both at the same step, both
    save it (one checkpoint) and exit 143; a 2-process --resume finishes the run, byte-identical to an
    uninterrupted one-process run of 8 devices."""
    import signal
    import subprocess
    import time

    steps = 8
    mesh = [*cell_overrides("dp2-tp2-pp2"), "mesh.data=2", "mesh.devices=0", f"train.steps={steps}"]
    base = [python, "-m", "detjax.train", "--config", str(MESH_CFG), "run.progress=false", *mesh, "model.pattern=*E*E"]

    def env(n_dev: int) -> dict:
        e = dict(os.environ, JAX_PLATFORMS="cpu")
        keep = [f for f in e.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")]
        e["XLA_FLAGS"] = " ".join([*keep, f"--xla_force_host_platform_device_count={n_dev}"])
        return e

    def two(*extra: str) -> list:
        port = _free_port()
        dist = [f"dist.coordinator=127.0.0.1:{port}", "dist.num_processes=2"]
        return [
            subprocess.Popen(
                [*base, "--run-dir", str(tmp_path / "two"), *dist, f"dist.process_id={i}", *extra],
                env=env(4),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]

    procs = two()
    fp = tmp_path / "two" / "fingerprints.jsonl"
    deadline = time.time() + 900
    while time.time() < deadline and procs[1].poll() is None:
        if fp.exists() and len(fp.read_text().splitlines()) >= 2:
            procs[1].send_signal(signal.SIGTERM)  # process 1 only
            break
        time.sleep(0.05)
    logs = [p.communicate(timeout=900)[0] for p in procs]
    saved = []
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 128 + signal.SIGTERM, f"process {i}:\n{log}"
        saved += [line.split("saved step ")[1].split(",")[0] for line in log.splitlines() if "saved step " in line]
    assert len(saved) == 2 and saved[0] == saved[1] and int(saved[0]) < steps, logs
    resumed = two("--resume")
    logs = [p.communicate(timeout=900)[0] for p in resumed]
    for i, (p, log) in enumerate(zip(resumed, logs, strict=True)):
        assert p.returncode == 0 and "resumed from" in log, f"process {i}:\n{log}"
    one = subprocess.run([*base, "--run-dir", str(tmp_path / "one")], env=env(8), capture_output=True, text=True)
    assert one.returncode == 0, one.stdout + one.stderr
    a, b = (tmp_path / "one" / "fingerprints.jsonl").read_bytes(), fp.read_bytes()
    assert len(a.splitlines()) == steps and a == b


@pytest.mark.parametrize(
    "kind,stages,virtual,micro",
    [
        ("gpipe", 2, 1, 4),
        ("1f1b", 2, 1, 4),
        ("1f1b", 4, 1, 8),
        ("1f1b", 4, 1, 2),
        ("1f1b", 2, 2, 4),
        ("gpipe", 2, 2, 4),
        ("1f1b", 4, 2, 8),
    ],
)
def test_schedule_runs_every_action_once_after_its_inputs(kind, stages, virtual, micro):
    sch = build_schedule(kind, stages, virtual, micro)
    chunks = stages * virtual
    seen_f, seen_b = {}, {}
    for t in range(sch.ticks):
        for s in range(stages):
            k, v, m = (int(x) for x in sch.action[t, s])
            c = v * stages + s
            if k == FWD:
                assert (c, m) not in seen_f
                assert c == 0 or seen_f[(c - 1, m)] < t
                seen_f[(c, m)] = t
            elif k == BWD:
                assert (c, m) not in seen_b
                assert seen_b[(c + 1, m)] < t if c < chunks - 1 else seen_f[(c, m)] < t
                seen_b[(c, m)] = t
            else:
                assert k == IDLE
    assert len(seen_f) == len(seen_b) == chunks * micro
    # every chunk's backward runs in ascending microbatch order (the gradient accumulation order)
    for c in range(chunks):
        assert sorted(range(micro), key=lambda m: seen_b[(c, m)]) == list(range(micro))
    if kind == "1f1b" and virtual == 1:
        # 1F1B: rank s never holds more than S - s microbatches in flight (GPipe holds all of them)
        for s in range(stages):
            live = peak = 0
            for t in range(sch.ticks):
                live += int(sch.action[t, s, 0] == FWD) - int(sch.action[t, s, 0] == BWD)
                peak = max(peak, live)
            assert peak <= min(stages - s, micro)


def test_stack_params_roundtrip():
    cfg = cfg_for("mesh.pipeline=2", "mesh.pipeline_virtual=2", "model.pattern=" + BASE * 4)
    from detjax.model.lm import HybridLM

    # the parameters' shapes without compiling the 16-layer init; distinct values in every leaf
    shapes = nn.unbox(jax.eval_shape(HybridLM(cfg.model).init, jax.random.key(0), jnp.zeros((2, 16), jnp.int32)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes["params"])
    stacked = stack_params(params, cfg)
    assert stacked["stages"]["block_2"]["mixer"]["experts"]["w_up"].shape[:2] == (2, 2)
    # chunk c = v * S + s holds layers c*n .. c*n+n-1
    np.testing.assert_array_equal(stacked["stages"]["block_1"]["mixer"]["w_q"][1, 0], params["layer_9"]["mixer"]["w_q"])
    back = unstack_params(stacked, cfg)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------- expert parallel


def test_expert_parallel_equals_local_experts_forward_and_grads():
    """The all-to-all path computes what the local path computes (fp32: only summation order may differ)."""
    from detjax.model.moe import Experts, route

    cfg = cfg_for("mesh.expert=4", "mesh.tensor=2")
    layout = build_layout(cfg, jax.devices()[:8])
    e, d, f = 8, 16, 8
    ks = jax.random.split(jax.random.key(0), 3)
    x_TD = jax.random.normal(ks[0], (32, d))
    idx, gate, _ = route(jax.random.normal(ks[1], (32, e)) * 3, 2, "softmax")
    local = Experts(e, d, f, 0.3, jnp.float32)
    params = nn.unbox(local.init(ks[2], x_TD, idx, gate)["params"])
    ep = Experts(e, d, f, 0.3, jnp.float32, layout=layout)
    w = jax.random.normal(ks[0], (32, d))

    def loss(mod, p, x):
        return jnp.sum(mod.apply({"params": p}, x, idx, gate) * w)

    y_l = local.apply({"params": params}, x_TD, idx, gate)
    y_e = jax.jit(lambda p, x: ep.apply({"params": p}, x, idx, gate))(params, x_TD)
    np.testing.assert_allclose(np.asarray(y_e), np.asarray(y_l), rtol=1e-5, atol=1e-6)
    g_l = jax.grad(lambda p, x: loss(local, p, x), argnums=(0, 1))(params, x_TD)
    g_e = jax.jit(jax.grad(lambda p, x: loss(ep, p, x), argnums=(0, 1)))(params, x_TD)
    for a, b in zip(jax.tree.leaves(g_e), jax.tree.leaves(g_l), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    hlo = jax.jit(lambda p, x: ep.apply({"params": p}, x, idx, gate)).lower(params, x_TD).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo


def test_expert_parallel_fp8_equals_local_experts_and_its_amaxes_are_the_global_maxima():
    """model.fp8 on the all-to-all path (expert 4 x tensor 2): output and gradients as the local path's
    (float32 sums of the same fp8 products: only their order may differ), and each scale set's amaxes (its
    "gradient") byte-equal to the local path's -- the maximum over every device's rows and weight shards,
    not their sum. Negative control: other scales give another output."""
    from detjax.model.moe import Experts, route

    layout = build_layout(cfg_for("mesh.expert=4", "mesh.tensor=2"), jax.devices()[:8])
    e, d, f = 8, 16, 8
    ks = jax.random.split(jax.random.key(1), 4)
    x_TD = jax.random.normal(ks[0], (32, d))
    idx, gate, _ = route(jax.random.normal(ks[1], (32, e)) * 3, 2, "softmax")
    local = Experts(e, d, f, 0.3, jnp.float32, fp8=True)
    variables = nn.unbox(local.init(ks[2], x_TD, idx, gate))
    params = variables["params"]
    scales = jax.tree.map(lambda s: jnp.asarray([4.0, 16.0, 2.0], jnp.float32), variables["fp8"])
    ep = Experts(e, d, f, 0.3, jnp.float32, layout=layout, fp8=True)
    w = jax.random.normal(ks[3], (32, d))

    def loss(mod, p, s, x):
        return jnp.sum(mod.apply({"params": p, "fp8": s}, x, idx, gate) * w)

    y_l = local.apply({"params": params, "fp8": scales}, x_TD, idx, gate)
    y_e = jax.jit(lambda p, s, x: ep.apply({"params": p, "fp8": s}, x, idx, gate))(params, scales, x_TD)
    np.testing.assert_allclose(np.asarray(y_e), np.asarray(y_l), rtol=1e-5, atol=1e-6)
    g_l = jax.grad(lambda p, s, x: loss(local, p, s, x), argnums=(0, 1, 2))(params, scales, x_TD)
    g_e = jax.jit(jax.grad(lambda p, s, x: loss(ep, p, s, x), argnums=(0, 1, 2)))(params, scales, x_TD)
    for a, b in zip(jax.tree.leaves((g_e[0], g_e[2])), jax.tree.leaves((g_l[0], g_l[2])), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    for name in ("gate", "up", "down"):
        amax_e, amax_l = np.asarray(g_e[1][name]), np.asarray(g_l[1][name])
        assert (amax_l > 0).all() and np.array_equal(amax_e.view(np.uint32), amax_l.view(np.uint32)), name
    other = jax.tree.map(lambda s: s * 2.0, scales)
    y_o = jax.jit(lambda p, s, x: ep.apply({"params": p, "fp8": s}, x, idx, gate))(params, other, x_TD)
    assert not np.array_equal(np.asarray(y_o), np.asarray(y_e)), "negative control: the scales must be used"


# ---------------------------------------------------------------------------------------------- multi-process


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_of_four_devices_equal_one_process_of_eight(tmp_path, python):
    """Multi-controller JAX (jax.distributed over gloo on CPU): 2 processes x 4 devices give byte-identical
    fingerprints and final params to 1 process x 8 devices on the same mesh; only process 0 writes."""
    import subprocess

    # dp2-tp2-pp2: every cross-device sum has two operands (a + b == b + a bitwise), so the gloo transport of
    # the two-process run and the in-process collectives of the one-process run cannot order them apart.
    # Larger reductions need detjax's own ordered reductions (canonical numerics, a later issue): gloo's
    # ring and XLA's in-process all-reduce add 4 partial sums in different orders.
    # Stages of attention + MoE (routing, aux loss, expert grads) keep the three concurrent compiles small.
    mesh = [*cell_overrides("dp2-tp2-pp2"), "mesh.data=2", "mesh.devices=0", f"train.steps={STEPS}"]
    mesh.append("model.pattern=*E*E")
    base = [python, "-m", "detjax.train", "--config", str(MESH_CFG), "run.progress=false", *mesh]

    def env(n_dev: int) -> dict:  # this process's flags (codegen settings included), another device count
        e = dict(os.environ, JAX_PLATFORMS="cpu")
        keep = [f for f in e.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")]
        e["XLA_FLAGS"] = " ".join([*keep, f"--xla_force_host_platform_device_count={n_dev}"])
        return e

    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                *base,
                "--run-dir",
                str(tmp_path / "two"),
                f"dist.coordinator=127.0.0.1:{port}",
                "dist.num_processes=2",
                f"dist.process_id={i}",
            ],
            env=env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    one = subprocess.run([*base, "--run-dir", str(tmp_path / "one")], env=env(8), capture_output=True, text=True)
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert one.returncode == 0, one.stdout + one.stderr
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"process {i}:\n{log}"
    a = (tmp_path / "one" / "fingerprints.jsonl").read_bytes()
    b = (tmp_path / "two" / "fingerprints.jsonl").read_bytes()
    assert len(a.splitlines()) == STEPS and a == b
    params_equal(
        dict(np.load(tmp_path / "one" / "final_params.npz")), dict(np.load(tmp_path / "two" / "final_params.npz"))
    )
    assert sum("run directory" in log for log in logs) == 2  # both finished; files below came from process 0 only
    assert sorted(p.name for p in (tmp_path / "two").iterdir() if p.is_file()) == sorted(
        p.name for p in (tmp_path / "one").iterdir() if p.is_file()
    )


@pytest.mark.parametrize(
    "kind,stages,virtual,micro", [("gpipe", 2, 1, 4), ("1f1b", 4, 1, 8), ("1f1b", 2, 2, 4), ("1f1b", 4, 2, 8)]
)
def test_schedule_bubble_is_the_textbook_fraction(kind, stages, virtual, micro):
    """The simulated schedules idle exactly (S-1)/(v*M+S-1) of rank-ticks: GPipe and 1F1B alike, and
    interleaving v virtual stages shrinks the bubble by v (Megatron's analysis)."""
    from fractions import Fraction

    sched = build_schedule(kind, stages, virtual, micro)
    want = Fraction(stages - 1, virtual * micro + stages - 1)
    assert Fraction(sched.bubble()).limit_denominator(1000) == want
