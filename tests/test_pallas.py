"""Pallas kernels (interpret mode on CPU): equal to their references, replay bit-exact; the manifest gate."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detjax.pallas_kernels.flash_attention.ops import flash_attention
from detjax.pallas_kernels.flash_attention.reference import flash_attention_ref
from detjax.pallas_kernels.harness import assert_replays_bit_exact, count_differing_replays, matmul_contention
from detjax.pallas_kernels.manifest import check_manifest
from detjax.pallas_kernels.rmsnorm.ops import rmsnorm
from detjax.pallas_kernels.rmsnorm.reference import rmsnorm_ref
from detjax.pallas_kernels.segment_sum.ops import segment_sum
from detjax.pallas_kernels.segment_sum.reference import segment_sum_ref

# Tolerances (float32 math on both sides; they differ in summation order only): relative to max |ref|.
TOL_FWD, TOL_GRAD = 1e-6, 1e-5


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _rms_inputs(seed=0, n=64, d=64):
    k = jax.random.split(jax.random.key(seed), 3)
    return jax.random.normal(k[0], (n, d)), 1 + 0.1 * jax.random.normal(k[1], (d,)), jax.random.normal(k[2], (n, d))


def _rms_grads(fn, x, w, g):
    return jax.grad(lambda x, w: jnp.sum(fn(x, w) * g), argnums=(0, 1))(x, w)


def test_rmsnorm_matches_reference():
    x, w, g = _rms_inputs()
    assert _rel(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5)) <= TOL_FWD
    for a, b in zip(
        _rms_grads(lambda x, w: rmsnorm(x, w, 1e-5), x, w, g),
        _rms_grads(lambda x, w: rmsnorm_ref(x, w, 1e-5), x, w, g),
        strict=True,
    ):
        assert _rel(a, b) <= TOL_GRAD


def test_rmsnorm_replays_bit_exact():
    x, w, g = _rms_inputs(1)
    fwd_bwd = jax.jit(lambda x, w: (rmsnorm(x, w, 1e-5), _rms_grads(lambda a, b: rmsnorm(a, b, 1e-5), x, w, g)))
    assert_replays_bit_exact(fwd_bwd, (x, w), replays=5)
    assert_replays_bit_exact(fwd_bwd, (x, w), replays=3, contention=matmul_contention(256, 5))


def _seg_inputs(seed=0, t=200, d=64, v=37):
    k = jax.random.split(jax.random.key(seed), 2)
    ids = jax.random.randint(k[0], (t,), 0, v // 3)  # many repeats: the case atomics get wrong
    return ids, jax.random.normal(k[1], (t, d)), v


def test_segment_sum_matches_reference():
    ids, g, v = _seg_inputs()
    assert _rel(segment_sum(ids, g, v), segment_sum_ref(ids, g, v)) <= TOL_FWD


def test_segment_sum_replays_bit_exact():
    ids, g, v = _seg_inputs(2)
    fn = jax.jit(lambda i, g: segment_sum(i, g, v))
    assert_replays_bit_exact(fn, (ids, g), replays=5)
    assert_replays_bit_exact(fn, (ids, g), replays=3, contention=matmul_contention(256, 5))


def _attn_inputs(seed=0, b=2, length=48, h=4, kv=2, d=16):
    k = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k[0], (b, length, h, d))
    return q, jax.random.normal(k[1], (b, length, kv, d)), jax.random.normal(k[2], (b, length, kv, d)), k[3]


def test_flash_attention_matches_reference():
    q, k, v, gk = _attn_inputs()
    g = jax.random.normal(gk, q.shape)
    assert _rel(flash_attention(q, k, v), flash_attention_ref(q, k, v)) <= TOL_FWD * 4
    ga = jax.grad(lambda *x: jnp.sum(flash_attention(*x) * g), argnums=(0, 1, 2))(q, k, v)
    gb = jax.grad(lambda *x: jnp.sum(flash_attention_ref(*x) * g), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ga, gb, strict=True):
        assert _rel(a, b) <= TOL_GRAD


def test_flash_attention_replays_bit_exact():
    q, k, v, gk = _attn_inputs(1)
    g = jax.random.normal(gk, q.shape)
    fn = jax.jit(
        lambda q, k, v: jax.value_and_grad(lambda *x: jnp.sum(flash_attention(*x) * g), argnums=(0, 1, 2))(q, k, v)
    )
    assert_replays_bit_exact(fn, (q, k, v), replays=4)
    assert_replays_bit_exact(fn, (q, k, v), replays=3, contention=matmul_contention(256, 5))


def test_harness_compares_bytes_not_values():
    """Signed zero: equal as values, different as bytes — the harness must count it."""
    flips = iter([0.0, -0.0, 0.0])
    assert count_differing_replays(lambda: jnp.float32(next(flips)), (), replays=3) == 1


@pytest.mark.gpu
def test_atomic_scatter_add_negative_control(python):
    """On the GPU, XLA's scatter-add (atomics) differs between replays when the deterministic flag is off —
    the harness can see a race. Runs in a fresh process: this session has the strict flags set."""
    import os
    import subprocess

    code = (
        "import jax, jax.numpy as jnp\n"
        "from detjax.pallas_kernels.harness import count_differing_replays\n"
        "ids = jax.random.randint(jax.random.key(0), (1 << 20,), 0, 64)\n"
        "vals = jax.random.normal(jax.random.key(1), (1 << 20, 8))\n"
        "fn = jax.jit(lambda i, v: jnp.zeros((64, 8)).at[i].add(v))\n"
        "print('DIFFER', count_differing_replays(fn, (ids, vals), replays=20))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split("DIFFER")[1]) > 0


def test_manifest_gate(tmp_path):
    from pathlib import Path

    import detjax.pallas_kernels as pk

    root = Path(pk.__file__).parent
    assert check_manifest(root) == []
    # an unregistered kernel file fails the gate
    copy = tmp_path / "detjax" / "pallas_kernels"
    shutil.copytree(root, copy)
    shutil.copytree(root.parents[1] / "tests", tmp_path / "tests")
    (copy / "newk").mkdir()
    (copy / "newk" / "kernel.py").write_text("from jax.experimental import pallas as pl\nf = pl.pallas_call\n")
    assert any("newk/kernel.py is not registered" in p for p in check_manifest(copy, tmp_path))
    # a registered kernel whose test was removed fails the gate
    (copy / "newk" / "kernel.py").unlink()
    t = tmp_path / "tests" / "test_pallas.py"
    t.write_text(t.read_text().replace("def test_rmsnorm_replays_bit_exact", "def renamed"))
    assert any("test_rmsnorm_replays_bit_exact does not exist" in p for p in check_manifest(copy, tmp_path))


def test_model_uses_pallas_kernels_through_one_switch(tiny_path):
    from detjax.config import load_config
    from detjax.step import Trainer

    cfg_p = load_config(tiny_path, ["model.kernels=pallas", "model.pattern=*-", "model.mtp.depth=0"])
    cfg_r = load_config(tiny_path, ["model.kernels=reference", "model.pattern=*-", "model.mtp.depth=0"])
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (16, 65)), jnp.int32)
    out = []
    for cfg in (cfg_p, cfg_r):
        tr = Trainer(cfg)
        state = jax.jit(tr.init_state)(jax.random.key(0))
        lowered = jax.jit(tr.train_step).lower(state, batch)
        out.append((lowered.as_text(), jax.jit(tr.train_step)(state, batch)[1]))
    assert "pallas" in out[0][0].lower() or "while" in out[0][0].lower()
    np.testing.assert_allclose(float(out[0][1]["lm_loss"]), float(out[1][1]["lm_loss"]), rtol=1e-4)
    np.testing.assert_allclose(float(out[0][1]["grad_norm"]), float(out[1][1]["grad_norm"]), rtol=1e-3)
