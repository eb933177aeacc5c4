"""Pallas kernels (interpret mode on CPU): equal to their references, replay bit-exact; the manifest gate."""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detjax import determinism
from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.flash_attention.ops import flash_attention
from detjax.pallas_kernels.flash_attention.reference import flash_attention_ref
from detjax.pallas_kernels.gmm.kernel import tgmm
from detjax.pallas_kernels.gmm.ops import grouped_matmul
from detjax.pallas_kernels.gmm.reference import gmm_ref, tgmm_ref
from detjax.pallas_kernels.harness import assert_replays_bit_exact, count_differing_replays, matmul_contention
from detjax.pallas_kernels.manifest import check_manifest
from detjax.pallas_kernels.rmsnorm.ops import rmsnorm
from detjax.pallas_kernels.rmsnorm.reference import rmsnorm_ref
from detjax.pallas_kernels.segment_sum.ops import segment_sum
from detjax.pallas_kernels.segment_sum.reference import segment_sum_ref
from detjax.pallas_kernels.ssd.ops import ssd
from detjax.pallas_kernels.ssd.reference import ssd_chunked, ssd_quadratic

# Tolerances (float32 math on both sides; they differ in summation order only): relative to max |ref|.
TOL_FWD, TOL_GRAD = 1e-6, 1e-5
# On the GPU the SSD and gmm kernels multiply float32 operands in TF32 (Triton's default, as the Mamba2
# Triton kernels do; the model feeds gmm bf16); measured on the H200: 5.4e-4 (ssd) and 7e-4 (gmm).
TOL_TF32 = 2e-3


def _tf32_tol(tol: float) -> float:
    return TOL_TF32 if jax.default_backend() == "gpu" else tol


def _bits(a) -> bytes:
    """The array's bytes (the float32 bit patterns, for byte-equality checks)."""
    return np.asarray(a).tobytes()


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


def _u32(tree):
    return [np.asarray(a).view(np.uint32 if a.dtype.itemsize == 4 else np.uint16) for a in jax.tree.leaves(tree)]


def _small_tiles(rk, monkeypatch):
    """Programs of 32 rows walked in 8-row sub-blocks at every width class (several programs on tiny inputs)."""
    small = {"rows": 32, "block_rows": 8, "num_warps": 4, "num_stages": 1}
    monkeypatch.setattr(rk, "TILES", {k: dict.fromkeys(v, small) for k, v in rk.TILES.items()})
    jax.clear_caches()


@pytest.mark.parametrize("d", [384, 1536])
def test_rmsnorm_takes_widths_that_are_not_powers_of_two(monkeypatch, d):
    """Widths such as 1536 run as power-of-two column chunks (3 x 512): equal to the reference, on 72 rows (not
    a whole number of 32-row programs); the weight gradient adds the programs' chunk sums by the pairwise tree.
    Negative control: a serial walk over the same chunk sums gives other bytes."""
    from detjax.pallas_kernels.rmsnorm import kernel as rk

    _small_tiles(rk, monkeypatch)
    x, w, g = _rms_inputs(3, n=72, d=d)
    assert _rel(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5)) <= TOL_FWD
    grads = _rms_grads(lambda x, w: rmsnorm(x, w, 1e-5), x, w, g)
    for a, b in zip(grads, _rms_grads(lambda x, w: rmsnorm_ref(x, w, 1e-5), x, w, g), strict=True):
        assert _rel(a, b) <= TOL_GRAD
    # one token per 32-row chunk carries a gradient, so each chunk's sum is that token's product exactly
    # and only the order across chunks is left: the tree ((c0 + c2) + c1), not the walk ((c0 + c1) + c2)
    one = jnp.zeros((72, 1)).at[jnp.array([5, 40, 70])].set(1.0)
    _, rstd = rk.rmsnorm_fwd(x, w, eps=1e-5, interpret=interpret_mode())
    c = np.asarray((g * one) * (x * rstd))[[5, 40, 70]]
    dw = _u32(_rms_grads(lambda x, w: rmsnorm(x, w, 1e-5), x, w, g * one)[1])[0]
    assert np.array_equal(dw, ((c[0] + c[2]) + c[1]).view(np.uint32))
    assert not np.array_equal(dw, ((c[0] + c[1]) + c[2]).view(np.uint32))
    jax.clear_caches()


def test_rmsnorm_multi_block_tiles_pad_rows_and_write_the_compute_dtype(monkeypatch):
    from detjax.pallas_kernels.rmsnorm import kernel as rk

    # programs of 32 rows walked in 8-row sub-blocks; 72 rows is not a whole number of programs (zero-padded)
    _small_tiles(rk, monkeypatch)
    x, w, g = _rms_inputs(2, n=72)
    assert _rel(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5)) <= TOL_FWD
    grads = _rms_grads(lambda x, w: rmsnorm(x, w, 1e-5), x, w, g)
    for a, b in zip(grads, _rms_grads(lambda x, w: rmsnorm_ref(x, w, 1e-5), x, w, g), strict=True):
        assert _rel(a, b) <= TOL_GRAD
    # a bf16 output straight from the kernel has the bits of the float32 output cast to bf16, and the same
    # gradients (the bf16 cotangent's values are read exactly)
    g16 = g.astype(jnp.bfloat16)
    y16 = rmsnorm(x, w, 1e-5, jnp.dtype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    assert np.array_equal(_u32(y16)[0], _u32(rmsnorm(x, w, 1e-5).astype(jnp.bfloat16))[0])
    grads16 = jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w, 1e-5, jnp.dtype(jnp.bfloat16)) * g16), argnums=(0, 1))(x, w)
    grads32 = jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w, 1e-5).astype(jnp.bfloat16) * g16), argnums=(0, 1))(x, w)
    for a, b in zip(_u32(grads16), _u32(grads32), strict=True):
        assert np.array_equal(a, b)
    # zero rows appended (masked tokens) add exact zeros to the weight gradient; other rows change it
    dw = _u32(_rms_grads(lambda x, w: rmsnorm(x, w, 1e-5), x, w, g)[1])[0]
    for extra in (jnp.zeros((40, 64)), jnp.ones((40, 64))):
        xx, gg = jnp.concatenate([x, extra]), jnp.concatenate([g, extra])
        dw2 = _u32(_rms_grads(lambda x, w: rmsnorm(x, w, 1e-5), xx, w, gg)[1])[0]
        assert np.array_equal(dw, dw2) == (not bool(extra.any()))
    jax.clear_caches()


def test_rmsnorm_stream_adds_the_residual_cotangent_in_the_kernel(monkeypatch):
    """rmsnorm_stream's backward adds the stream's own cotangent to the norm's dx inside the kernel, in a
    pre-norm block y = x + f(norm(x)). The weight's gradient and everything else keep the bytes of the norm's
    backward followed by XLA's add (the residual add's transpose); the stream's gradient may differ from it
    by the rounding of one product, since the compiler may contract the kernel's last product and the add
    into one fma (the CPU's does): within one float32 step of the norm's dx plus one of the sum. It replays
    bit-exact; the layers' RMSNorm takes it. Negative control: a cotangent one bit apart gives other bytes."""
    from detjax.model import layers
    from detjax.pallas_kernels.rmsnorm.kernel import rmsnorm_bwd, rmsnorm_fwd
    from detjax.pallas_kernels.rmsnorm.ops import rmsnorm_stream

    x, w, g = _rms_inputs(4, n=72)
    m = jax.random.normal(jax.random.key(9), (64, 64)) / 8

    def block(norm_stream):
        def f(x, w):
            h, y = norm_stream(x, w)
            return jnp.sum((h + jnp.tanh(y.astype(jnp.float32) @ m)) * g)

        return jax.jit(jax.grad(f, argnums=(0, 1)))

    fused_fn = block(lambda x, w: rmsnorm_stream(x, w, 1e-5, jnp.dtype(jnp.bfloat16)))
    fused = fused_fn(x, w)
    composed = block(lambda x, w: (x, rmsnorm(x, w, 1e-5, jnp.dtype(jnp.bfloat16))))(x, w)
    assert np.array_equal(_u32(fused[1])[0], _u32(composed[1])[0])  # the weight's gradient
    dx_norm = composed[0] - g  # the norm's own dx (the block's g reaches x through the residual add)
    a, b = np.asarray(fused[0]), np.asarray(composed[0])
    assert np.all(np.abs(a - b) <= np.spacing(np.abs(np.asarray(dx_norm))) + np.spacing(np.abs(b)))
    assert_replays_bit_exact(fused_fn, (x, w), replays=3)
    # the kernel on its own: with a cotangent one bit apart, other bytes
    y, rstd = rmsnorm_fwd(x, w, eps=1e-5, interpret=interpret_mode())
    flip = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(g, jnp.uint32).at[3, 5].add(1), jnp.float32)
    base = _u32(rmsnorm_bwd(x, w, rstd, g, g, interpret=interpret_mode())[0])[0]
    assert not np.array_equal(_u32(rmsnorm_bwd(x, w, rstd, g, flip, interpret=interpret_mode())[0])[0], base)
    with pytest.raises(ValueError, match="x's shape and dtype"):
        rmsnorm_bwd(x, w, rstd, g, g.astype(jnp.bfloat16), interpret=interpret_mode())
    # the layers' norm passes the stream through rmsnorm_stream on the Pallas path
    norm = layers.RMSNorm(1e-5, "pallas", jnp.bfloat16)
    params = norm.init(jax.random.key(0), x[None])
    seen = []
    monkeypatch.setattr(layers, "rmsnorm_stream", lambda *a: seen.append(1) or rmsnorm_stream(*a))
    h, yb = norm.apply(params, x[None], stream=True)
    assert seen and np.array_equal(_u32(h)[0], _u32(x[None])[0]) and yb.dtype == jnp.bfloat16


def _rope_case(seed=0, b=2, length=256, h=4, kv=2, q=64, theta=1e4):
    """XLA's backward of splitting y = [q | k | v] and rotating q and k (reference.rope), and the kernel's
    inputs: the cotangents flattened to rows, the tables."""
    from detjax.pallas_kernels.rope import reference as rr
    from detjax.pallas_kernels.rope.ops import split_rope_forward

    shape = (b, length, h, kv, q)
    kx, kc = jax.random.split(jax.random.key(seed))
    y = jax.random.normal(kx, (b * length, (h + 2 * kv) * q), jnp.float32).astype(jnp.bfloat16)
    outs, vjp = jax.vjp(lambda y: split_rope_forward(y, shape, theta), y)
    cts = tuple(
        jax.random.normal(jax.random.fold_in(kc, i), o.shape, jnp.float32).astype(jnp.bfloat16)
        for i, o in enumerate(outs)
    )
    flat = [c.reshape(b * length, -1) for c in cts]
    return shape, cts, flat, rr.tables(length, q, theta), vjp(cts)[0]


def _ulps(a, b):
    """Per element, how many bf16 steps apart a and b are (same-sign values; 0 for equal bytes)."""
    ia, ib = (np.asarray(v).view(np.int16).astype(np.int32) for v in (a, b))
    return np.abs(ia - ib)


def test_rope_grad_matches_reference():
    """RoPE's backward kernel against XLA's autodiff of the split and rope (interpreted on the CPU): within one
    bf16 step everywhere (XLA contracts some products and sums into an fma where the kernel rounds them
    apart: 4 of 262144 elements here), byte-equal elsewhere; the fp8 variant byte-equal to quantizing the
    bf16 variant's output (quantize_transposed), amax included. Negative control: another theta's tables
    change the bytes."""
    from detjax.pallas_kernels.matmul.quantize import quantize_transposed
    from detjax.pallas_kernels.rope import kernel as rk
    from detjax.pallas_kernels.rope import reference as rr

    (b, length, h, kv, q), _, flat, (cos, sin), want = _rope_case()
    kw = {"length": length, "head_dim": q, "interpret": interpret_mode()}
    got = rk.rope_grad_concat(*flat, cos, sin, **kw)
    assert got.shape == want.shape and got.dtype == jnp.bfloat16
    ulps = _ulps(got, want)
    assert ulps.max() <= 1 and (ulps > 0).mean() < 1e-3, (ulps.max(), (ulps > 0).sum())
    s, e5 = jnp.float32(3.0), jnp.float8_e5m2
    q8, q8t, amax = rk.rope_grad_quantize_transposed(*flat, cos, sin, s, dtype=e5, **kw)
    w8, w8t, wamax = quantize_transposed(got, s, dtype=e5, interpret=kw["interpret"])
    assert np.array_equal(np.asarray(q8).view(np.uint8), np.asarray(w8).view(np.uint8))
    assert np.array_equal(np.asarray(q8t).view(np.uint8), np.asarray(w8t).view(np.uint8))
    assert np.asarray(amax).view(np.uint32) == np.asarray(wamax).view(np.uint32)
    other = rk.rope_grad_concat(*flat, *rr.tables(length, q, 5e5), **kw)
    assert _ulps(other, got).max() > 1  # negative control
    with pytest.raises(ValueError, match="do not fit the kernel's tiles"):
        rk.rope_grad_concat(flat[0][:, :96], *flat[1:], cos, sin, **kw)


def test_rope_grad_replays_bit_exact():
    from detjax.pallas_kernels.rope import kernel as rk

    (b, length, h, kv, q), _, flat, (cos, sin), _ = _rope_case(1)
    kw = {"length": length, "head_dim": q, "interpret": interpret_mode()}

    def both(dq, dk, dv):
        e5 = jnp.float8_e5m2
        return rk.rope_grad_concat(dq, dk, dv, cos, sin, **kw), rk.rope_grad_quantize_transposed(
            dq, dk, dv, cos, sin, jnp.float32(2.0), dtype=e5, **kw
        )

    fn = jax.jit(both)
    assert_replays_bit_exact(fn, tuple(flat), replays=5)
    assert_replays_bit_exact(fn, tuple(flat), replays=3, contention=matmul_contention(256, 5))


def test_attention_takes_the_rope_kernel_where_its_tiles_fit(monkeypatch):
    """The attention block with model.kernels=pallas runs RoPE's backward in the kernel (its name is in the
    gradient's program) where the tiles fit, and its gradients stay within bf16 rounding of XLA's backward
    (the path taken where they do not fit, forced here); the forward is the same bytes."""
    from detjax.model.attention import Attention
    from detjax.pallas_kernels.rope import ops as rope_ops

    att = Attention(128, 4, 2, 64, 1e4, 0.02, jnp.bfloat16, impl="pallas")
    x = jax.random.normal(jax.random.key(3), (2, 128, 128), jnp.float32).astype(jnp.bfloat16)
    params = jax.jit(att.init)(jax.random.key(4), x)
    g = jax.random.normal(jax.random.key(5), (2, 128, 128), jnp.float32).astype(jnp.bfloat16)

    def grads(p, x):
        y, vjp = jax.vjp(lambda p, x: att.apply(p, x), p, x)
        return y, vjp(g)

    assert rope_ops.fits(256, 128, 4, 2, 64)
    assert "rope_grad_concat" in str(jax.make_jaxpr(grads)(params, x))
    fused = jax.jit(grads)(params, x)
    monkeypatch.setattr(rope_ops, "fits", lambda *a: False)
    jax.clear_caches()  # (the traces of `grads` above are cached under the same function)
    assert "rope_grad_concat" not in str(jax.make_jaxpr(grads)(params, x))
    xla = jax.jit(grads)(params, x)
    assert np.array_equal(_u32(fused[0])[0], _u32(xla[0])[0])
    for a, b in zip(jax.tree.leaves(fused[1]), jax.tree.leaves(xla[1]), strict=True):
        assert _rel(a.astype(jnp.float32), b.astype(jnp.float32)) <= 2e-2, a.shape


def _seg_inputs(seed=0, t=200, d=64, v=37):
    k = jax.random.split(jax.random.key(seed), 2)
    ids = jax.random.randint(k[0], (t,), 0, v // 3)  # many repeats: the case atomics get wrong
    return ids, jax.random.normal(k[1], (t, d)), v


def test_segment_sum_matches_reference():
    ids, g, v = _seg_inputs()
    assert _rel(segment_sum(ids, g, v), segment_sum_ref(ids, g, v)) <= TOL_FWD
    # skewed ids (one id holds ~60 % of the tokens: its run spans several token blocks), ids on id-block
    # edges, a feature width of 48 (16-wide feature tiles)
    k = jax.random.split(jax.random.key(7), 3)
    ids = jnp.where(jax.random.uniform(k[0], (300,)) < 0.6, 5, jax.random.randint(k[1], (300,), 0, 100))
    ids = ids.at[:4].set(jnp.array([15, 16, 31, 99]))
    g = jax.random.normal(k[2], (300, 48))
    assert _rel(segment_sum(ids, g, 100), segment_sum_ref(ids, g, 100)) <= TOL_FWD


def test_segment_sum_replays_bit_exact():
    ids, g, v = _seg_inputs(2)
    fn = jax.jit(lambda i, g: segment_sum(i, g, v))
    assert_replays_bit_exact(fn, (ids, g), replays=5)
    assert_replays_bit_exact(fn, (ids, g), replays=3, contention=matmul_contention(256, 5))


def _ce_inputs(rows=32, vocab=3072, dtype=jnp.bfloat16, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (4 * jax.random.normal(k1, (rows, vocab))).astype(dtype), jax.random.randint(k2, (rows,), 0, vocab)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_ce_fwd_matches_reference(dtype):
    """The one-pass cross-entropy kernel against XLA's logsumexp and label sum (model.ce.token_ce), over a
    vocabulary of three blocks (not a power of two)."""
    from detjax.pallas_kernels.ce.kernel import ce_fwd
    from detjax.pallas_kernels.ce.reference import token_ce_ref

    x, t = _ce_inputs(dtype=dtype)
    (ce, lse), (rce, rlse) = ce_fwd(x, t, interpret=interpret_mode()), token_ce_ref(x, t)
    assert _rel(lse, rlse) <= TOL_FWD and _rel(ce, rce) <= 4 * TOL_FWD


def test_ce_fwd_replays_bit_exact():
    from detjax.pallas_kernels.ce.kernel import ce_fwd

    x, t = _ce_inputs()
    fn = jax.jit(lambda x, t: ce_fwd(x, t, interpret=interpret_mode()))
    assert_replays_bit_exact(fn, (x, t), replays=5)
    assert_replays_bit_exact(fn, (x, t), replays=3, contention=matmul_contention(256, 5))


def test_token_ce_of_takes_the_kernel_only_when_switched_on_and_where_it_fits(monkeypatch):
    """model.ce.KERNEL_FWD puts the kernel into token_ce_of's forward (its loss and logits gradient then agree
    with XLA's formula's to rounding); off, or for rows that are not whole blocks, the step keeps XLA's
    formula, the same bytes as before."""
    from detjax.model import ce as ce_mod

    x, t = _ce_inputs(rows=32)
    x3, t3 = x.reshape(2, 16, -1), t.reshape(2, 16)

    def run(x, t):
        loss = lambda x: jnp.sum(ce_mod.token_ce_of(x, t) * jnp.arange(1, t.size + 1).reshape(t.shape))  # noqa: E731
        fn = jax.jit(jax.value_and_grad(loss))
        return "ce_fwd" in str(fn.trace(x).jaxpr), fn(x)

    monkeypatch.setattr(ce_mod, "KERNEL_FWD", False)
    used_off, (v_off, g_off) = run(x3, t3)
    monkeypatch.setattr(ce_mod, "KERNEL_FWD", True)
    used_on, (v_on, g_on) = run(x3, t3)
    assert (used_off, used_on) == (False, True)
    assert _rel(v_on, v_off) <= TOL_FWD and _rel(g_on.astype(jnp.float32), g_off.astype(jnp.float32)) <= 1e-2
    used_odd, (v_odd, _) = run(x3[:, :9], t3[:, :9])  # 18 rows: not whole blocks of 16
    monkeypatch.setattr(ce_mod, "KERNEL_FWD", False)
    _, (v_ref, _) = run(x3[:, :9], t3[:, :9])
    assert not used_odd and np.asarray(v_odd).view(np.uint32) == np.asarray(v_ref).view(np.uint32)


MIXER_KERNELS = ("rmsnorm_fwd", "gated_norm_fwd", "conv_silu_bwd")


def _mixer_run(monkeypatch, d_state=16, dtype=jnp.float32, **switches):
    """A small Mamba2 mixer (inner width 128, B/C width 2 d_state) under model.kernels=pallas with the given
    model.mamba2 switches (the rest at their defaults): which of MIXER_KERNELS its step holds, its output and
    the gradients of sum(out^2) / 2, and the number of slices in its jaxpr."""
    from detjax.config import MambaConfig
    from detjax.jaxprs import iter_eqns
    from detjax.model import mamba2

    for name in ("KERNEL_GATE", "KERNEL_GATED_NORM", "KERNEL_CONV", "KERNEL_IN_PLACE"):
        monkeypatch.setattr(mamba2, name, switches.get(name, getattr(mamba2, name)))
    cfg = MambaConfig(d_state=d_state, d_conv=4, expand=2, n_heads=2, chunk_size=16)
    mixer = mamba2.Mamba2(d_model=64, cfg=cfg, init_std=0.02, norm_eps=1e-5, dtype=dtype, kernels="pallas")
    x = jax.random.normal(jax.random.key(1), (1, 32, 64))
    params = mixer.init(jax.random.key(0), x)

    def with_grads(p, x):
        out, pull = jax.vjp(mixer.apply, p, x)
        return out, pull(out)

    fn = jax.jit(with_grads)
    jaxpr = fn.trace(params, x).jaxpr
    slices = sum(eq.primitive.name == "slice" for eq in iter_eqns(jaxpr.jaxpr))
    return {k for k in MIXER_KERNELS if k in str(jaxpr)}, *fn(params, x), slices


def _agree(a, b, tol_y, tol_g=1e-4):
    (_, y_a, g_a, _), (_, y_b, g_b, _) = a, b
    assert _rel(y_a, y_b) <= tol_y
    for x, y in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b), strict=True):
        assert _rel(x, y) <= tol_g


def test_mamba2_kernel_switches_put_their_kernels_in_only_when_on(monkeypatch):
    """The Mamba2 mixer's kernel switches (model.kernels=pallas), each on against off with the others as they
    are, four steps in all. model.mamba2.KERNEL_GATE (on by default) puts the gate and gated norm's kernel into
    the mixer; off, KERNEL_GATED_NORM puts the Pallas RMSNorm into the gated norm (at a width the kernel
    takes), and with both off the mixer keeps the jnp norm: the outputs and gradients agree to rounding.
    KERNEL_CONV puts the Pallas backward into the convolutions where it takes the width (here the inner width
    128, not the B/C width 32); the forward is the same formula, but XLA fuses it differently behind the
    custom_vjp (on the CPU some outputs move by one ulp), so it agrees with XLA's autodiff to rounding."""
    from detjax.model import mamba2

    both = _mixer_run(monkeypatch, KERNEL_GATE=True, KERNEL_CONV=True)
    assert both[0] == {"gated_norm_fwd", "conv_silu_bwd"}
    no_gate = _mixer_run(monkeypatch, KERNEL_GATE=False, KERNEL_GATED_NORM=True, KERNEL_CONV=True)
    assert no_gate[0] == {"rmsnorm_fwd", "conv_silu_bwd"}
    _agree(both, no_gate, 1e-5)
    no_norm = _mixer_run(monkeypatch, KERNEL_GATE=False, KERNEL_GATED_NORM=False, KERNEL_CONV=True)
    assert no_norm[0] == {"conv_silu_bwd"}
    _agree(no_gate, no_norm, 1e-5)
    no_conv = _mixer_run(monkeypatch, KERNEL_GATE=True, KERNEL_CONV=False)
    assert no_conv[0] == {"gated_norm_fwd"}
    _agree(both, no_conv, TOL_FWD)
    assert mamba2.gated_norm_kernel_fits(32, 128) and not mamba2.gated_norm_kernel_fits(32, 96)
    assert not mamba2.gated_norm_kernel_fits(30, 128)  # rows not in whole blocks


@pytest.mark.parametrize("d_state", [16, 64], ids=["bc_sliced", "bc_in_place"])
def test_mamba2_kernels_read_the_in_projection_in_place(monkeypatch, d_state):
    """model.mamba2.KERNEL_IN_PLACE: the gate's kernel reads z and the convolution's backward kernel reads x
    (and B|C, where its width 2 d_state is a whole channel block: 128) from the in-projection's one bf16 output
    instead of from slices of it. The output and every gradient have the bytes of the mixer without it; the
    traced step holds fewer slices (the control that the other path ran)."""
    on = _mixer_run(monkeypatch, d_state, jnp.bfloat16, KERNEL_IN_PLACE=True)
    off = _mixer_run(monkeypatch, d_state, jnp.bfloat16, KERNEL_IN_PLACE=False)
    assert on[0] == off[0] == {"gated_norm_fwd", "conv_silu_bwd"}
    assert _bits(on[1]) == _bits(off[1])
    for a, b in zip(jax.tree.leaves(on[2]), jax.tree.leaves(off[2]), strict=True):
        assert _bits(a) == _bits(b)
    assert on[3] < off[3]


def _conv_inputs(dtype=jnp.bfloat16, b=2, length=64, ch=256):
    k = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(k[0], (b, length, ch)).astype(dtype)
    w, bias = 0.5 * jax.random.normal(k[1], (4, ch)), 0.1 * jax.random.normal(k[2], (ch,))
    return x, w, bias, jax.random.normal(k[3], (b, length, ch))


def _conv_dx_in_kernel(monkeypatch, dx_in: bool):
    from detjax.pallas_kernels.conv import kernel as vk

    monkeypatch.setitem(vk.TILES, "dx_in_kernel", dx_in)
    jax.clear_caches()


@pytest.mark.parametrize(
    "dx_in",
    [pytest.param(True, marks=pytest.mark.extended), False],  # the one pass is not the pinned form
    ids=["one_pass", "two_pass"],
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_conv_silu_bwd_matches_reference(monkeypatch, dtype, dx_in):
    """The convolution's backward, dx in the kernel (one pass) or from the kernel's dconv (two passes), against
    autodiff of the mixer's formula, over two sequences of two row tiles and two channel tiles each (the tiles'
    halos and the sequence edges); the forward is that formula, the same bytes."""
    from detjax.pallas_kernels.conv.ops import conv_silu
    from detjax.pallas_kernels.conv.reference import conv_silu_ref

    _conv_dx_in_kernel(monkeypatch, dx_in)
    x, w, bias, g = _conv_inputs(dtype)
    y, pull = jax.vjp(conv_silu, x, w, bias)
    y_ref, pull_ref = jax.vjp(conv_silu_ref, x, w, bias)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint32), np.asarray(y_ref).view(np.uint32))
    (dx, dw, db), (rx, rw, rb) = pull(g), pull_ref(g)
    assert dx.dtype == x.dtype and _rel(dx, rx) <= (1e-2 if dtype == jnp.bfloat16 else TOL_GRAD)
    assert _rel(dw, rw) <= TOL_GRAD and _rel(db, rb) <= TOL_GRAD


@pytest.mark.parametrize(
    "dx_in",
    [pytest.param(True, marks=pytest.mark.extended), False],  # the one pass is not the pinned form
    ids=["one_pass", "two_pass"],
)
def test_conv_silu_bwd_replays_bit_exact(monkeypatch, dx_in):
    from detjax.pallas_kernels.conv.ops import conv_silu

    _conv_dx_in_kernel(monkeypatch, dx_in)
    x, w, bias, g = _conv_inputs()
    fn = jax.jit(lambda x, w, b: jax.vjp(conv_silu, x, w, b)[1](g))
    assert_replays_bit_exact(fn, (x, w, bias), replays=5)
    assert_replays_bit_exact(fn, (x, w, bias), replays=3, contention=matmul_contention(256, 5))


def _gate_inputs(seed=4, n=80, d=384):
    """The gated norm's operands: y, x float32, z bf16 (N, D); d, w (D,); an incoming bf16 gradient."""
    k = jax.random.split(jax.random.key(seed), 6)
    y, x = jax.random.normal(k[0], (n, d)), jax.random.normal(k[1], (n, d))
    z = jax.random.normal(k[2], (n, d)).astype(jnp.bfloat16)
    dd, w = jax.random.normal(k[3], (d,)), 1 + 0.1 * jax.random.normal(k[4], (d,))
    return (y, x, z, dd, w), jax.random.normal(k[5], (n, d)).astype(jnp.bfloat16)


@pytest.mark.parametrize("d", [256, 384])
def test_gated_norm_matches_reference(monkeypatch, d):
    """The gate and gated norm's kernels against autodiff of the mixer's formula (reference.gated_norm_ref):
    output and all five gradients, at a power-of-two width and one of three 128-column chunks, over several
    programs of 32 rows walked in 8-row sub-blocks and a last program of padded rows (80 rows)."""
    from detjax.pallas_kernels.gated_norm.ops import gated_norm
    from detjax.pallas_kernels.gated_norm.reference import gated_norm_ref
    from detjax.pallas_kernels.rmsnorm import kernel as rk

    _small_tiles(rk, monkeypatch)
    args, g = _gate_inputs(d=d)
    out, pull = jax.vjp(lambda *a: gated_norm(*a, 1e-5, jnp.bfloat16), *args)
    ref, pull_ref = jax.vjp(lambda *a: gated_norm_ref(*a, 1e-5, jnp.bfloat16), *args)
    assert out.dtype == jnp.bfloat16 and _rel(out.astype(jnp.float32), ref.astype(jnp.float32)) <= 1e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)
    for a, b in zip(pull(g), pull_ref(g), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        tol = 1e-2 if a.dtype == jnp.bfloat16 else TOL_GRAD
        assert _rel(a.astype(jnp.float32), b.astype(jnp.float32)) <= tol


def test_gated_norm_and_conv_read_a_block_of_a_wider_array_in_place():
    """The gated norm's z as columns z_col .. z_col + D of a wider array, and the convolution's x as channels
    col0 .. col0 + C of one (what the Mamba2 mixer's in-projection output holds side by side, mamba2.
    KERNEL_IN_PLACE): the output and every gradient have the bytes of the same call on the sliced block, and
    the wider array's cotangent is the block's, zero elsewhere. Negative control: another block (other
    values) gives other output bytes."""
    from detjax.pallas_kernels.conv.ops import conv_silu
    from detjax.pallas_kernels.gated_norm.ops import gated_norm

    def run(f, ct, *args):
        out, pull = jax.vjp(f, *args)
        return out, *pull(ct)

    def zero_outside(a, lo, hi):
        return not np.any(np.asarray(a[..., :lo], np.float32)) and not np.any(np.asarray(a[..., hi:], np.float32))

    (y, x, z, dd, w), g = _gate_inputs(n=64, d=256)
    d = z.shape[1]
    wide = jnp.concatenate([jnp.flip(z, 0), z, z[:, ::-1]], axis=1)  # z is block 1 of 3
    want = run(lambda *a: gated_norm(*a, 1e-5, jnp.bfloat16), g, y, x, z, dd, w)
    got = run(lambda *a: gated_norm(*a, 1e-5, jnp.bfloat16, d), g, y, x, wide, dd, w)
    for i, name in enumerate(("out", "dy", "dx", "dz", "dd", "dw")):
        assert _bits(got[i][:, d : 2 * d] if name == "dz" else got[i]) == _bits(want[i]), name
    assert got[3].shape == wide.shape and zero_outside(got[3], d, 2 * d)
    assert _bits(gated_norm(y, x, wide, dd, w, 1e-5, jnp.bfloat16, 0)) != _bits(want[0])

    xc, wc, bc, cg = _conv_inputs(ch=128)
    xwide = jnp.concatenate([-xc, xc, 2 * xc], axis=2)  # x is channels 128 .. 255
    want = run(conv_silu, cg, xc, wc, bc)
    got = run(lambda *a: conv_silu(*a, 128), cg, xwide, wc, bc)
    for i, name in enumerate(("out", "dx", "dw", "db")):
        assert _bits(got[i][..., 128:256] if name == "dx" else got[i]) == _bits(want[i]), name
    assert got[1].shape == xwide.shape and zero_outside(got[1], 128, 256)
    assert _bits(conv_silu(xwide, wc, bc, 0)) != _bits(want[0])


def test_gated_norm_replays_bit_exact():
    from detjax.pallas_kernels.gated_norm.ops import gated_norm

    args, g = _gate_inputs()
    fn = jax.jit(lambda *a: jax.vjp(lambda *b: gated_norm(*b, 1e-5, jnp.bfloat16), *a)[1](g))
    assert_replays_bit_exact(fn, args, replays=5)
    assert_replays_bit_exact(fn, args, replays=3, contention=matmul_contention(256, 5))


def _attn_inputs(seed=0, b=2, length=48, h=4, kv=2, d=16):
    k = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k[0], (b, length, h, d))
    return q, jax.random.normal(k[1], (b, length, kv, d)), jax.random.normal(k[2], (b, length, kv, d)), k[3]


@pytest.mark.parametrize("shape", [{}, {"b": 1, "length": 256, "h": 2, "kv": 1}], ids=["L48", "L256"])
def test_flash_attention_matches_reference(shape):
    """L48 runs 16-row tiles; L256 the pinned 64 x 64 tiles, with blocks fully visible, masked on the diagonal
    and skipped."""
    q, k, v, gk = _attn_inputs(**shape)
    g = jax.random.normal(gk, q.shape)
    with jax.default_matmul_precision("highest"):  # the GPU reference would otherwise multiply in TF32
        ref = flash_attention_ref(q, k, v)
        gb = jax.grad(lambda *x: jnp.sum(flash_attention_ref(*x) * g), argnums=(0, 1, 2))(q, k, v)
    assert _rel(flash_attention(q, k, v), ref) <= TOL_FWD * 4
    ga = jax.grad(lambda *x: jnp.sum(flash_attention(*x) * g), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ga, gb, strict=True):
        assert _rel(a, b) <= TOL_GRAD


@pytest.mark.extended  # tile_sweep's candidates, not the pinned tiles (test_flash_attention_matches_reference)
@pytest.mark.parametrize("tiles", [(32, 64), (64, 32)], ids=["q32k64", "q64k32"])
def test_flash_dkv_uneven_tiles_match_reference(tiles, monkeypatch):
    """dK/dV with query and key blocks of different sizes (tile_sweep's candidates): the causal mask of the
    transposed (keys x queries) scores and the first/last query blocks a key block sees stay right."""
    from detjax.pallas_kernels.flash_attention import kernel as fk

    monkeypatch.setitem(fk.TILES, "dkv", {"block_q": tiles[0], "block_k": tiles[1], "num_warps": 4, "num_stages": 2})
    jax.clear_caches()
    q, k, v, gk = _attn_inputs(2, b=1, length=128, h=2, kv=1)
    g = jax.random.normal(gk, q.shape)
    with jax.default_matmul_precision("highest"):
        gb = jax.grad(lambda *x: jnp.sum(flash_attention_ref(*x) * g), argnums=(1, 2))(q, k, v)
    ga = jax.grad(lambda *x: jnp.sum(flash_attention(*x) * g), argnums=(1, 2))(q, k, v)
    jax.clear_caches()
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


def _ssd_inputs(seed=0, b=2, length=64, h=3, p=16, n=16):
    k = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(k[0], (b, length, h, p))
    a = -0.3 * jnp.exp(jax.random.normal(k[1], (b, length, h)))
    bm, cm = jax.random.normal(k[2], (b, length, n)), jax.random.normal(k[3], (b, length, n))
    return (x, a, bm, cm), jax.random.normal(k[4], x.shape)


def _ssd_grads(fn, args, g):
    return jax.grad(lambda *a: jnp.sum(fn(*a) * g), argnums=(0, 1, 2, 3))(*args)


def test_ssd_matches_reference():
    """Forward and every input gradient (dx, da, dB, dC; ddt, dA, dD follow by the chain rule outside)."""
    args, g = _ssd_inputs()
    with jax.default_matmul_precision("highest"):
        chunked, quadratic = ssd_chunked(*args, 16), ssd_quadratic(*args)
        want = _ssd_grads(lambda *a: ssd_chunked(*a, 16), args, g)
    assert _rel(ssd(*args, 16), chunked) <= _tf32_tol(TOL_FWD)
    assert _rel(ssd(*args, 16), quadratic) <= _tf32_tol(TOL_FWD * 4)
    got = _ssd_grads(lambda *a: ssd(*a, 16), args, g)
    for name, a, b in zip("x a B C".split(), got, want, strict=True):
        assert _rel(a, b) <= _tf32_tol(TOL_GRAD), name


def test_ssd_splits_heads_that_are_not_powers_of_two():
    """Head dim 48 runs as three sub-heads of 16 (ops.py): against the chunked reference, and byte-equal to the
    kernel on the sub-heads given explicitly, da added over sub-heads in ascending order. Control: the sub-heads'
    da added in descending order differ in some bytes, so the comparison can see the order."""
    args, g = _ssd_inputs(2, b=2, length=32, h=2, p=48)
    x, a, bm, cm = args
    with jax.default_matmul_precision("highest"):
        want = _ssd_grads(lambda *t: ssd_chunked(*t, 16), args, g)
        assert _rel(ssd(*args, 16), ssd_chunked(*args, 16)) <= _tf32_tol(TOL_FWD)
    got = _ssd_grads(lambda *t: ssd(*t, 16), args, g)
    for name, u, w in zip("x a B C".split(), got, want, strict=True):
        assert _rel(u, w) <= _tf32_tol(TOL_GRAD), name

    def split(x, a, bm, cm):  # the same scan on six heads of 16
        y = ssd(x.reshape(2, 32, 6, 16), jnp.repeat(a, 3, axis=2), bm, cm, 16)
        return y.reshape(x.shape)

    assert _bits(ssd(*args, 16)) == _bits(split(*args))
    sub = jax.grad(lambda *t: jnp.sum(ssd(*t, 16) * g.reshape(2, 32, 6, 16)), argnums=(0, 1, 2, 3))(
        x.reshape(2, 32, 6, 16), jnp.repeat(a, 3, axis=2), bm, cm
    )
    da = sub[1].reshape(2, 32, 2, 3)
    assert _bits(got[1]) == _bits(da[..., 0] + da[..., 1] + da[..., 2])
    assert _bits(got[1]) != _bits(da[..., 2] + da[..., 1] + da[..., 0])
    for u, w in zip((got[0], got[2], got[3]), (sub[0].reshape(x.shape), sub[2], sub[3]), strict=True):
        assert _bits(u) == _bits(w)


def test_ssd_walks_split_over_state_rows_change_no_byte(monkeypatch):
    """The two walks run one program per block of TILES["pass_rows"] state rows; the recurrence is elementwise,
    so four blocks of 16 rows and one block of 64 give the same bytes, forward and every gradient. Control: one
    x element 0.1 % larger changes bytes."""
    from detjax.pallas_kernels.ssd import kernel as sk

    args, g = _ssd_inputs(3, b=1, length=32, h=2, p=64)

    def run(*a):
        return _bits(ssd(*a, 16)) + b"".join(_bits(d) for d in _ssd_grads(lambda *t: ssd(*t, 16), a, g))

    monkeypatch.setitem(sk.TILES, "pass_rows", 16)
    jax.clear_caches()
    split = run(*args)
    monkeypatch.setitem(sk.TILES, "pass_rows", 64)
    jax.clear_caches()
    assert run(*args) == split
    assert run(args[0].at[0, 5, 1, 7].multiply(1.001), *args[1:]) != split
    jax.clear_caches()


def test_ssd_head_sum_kernel_gives_the_ordered_chain_bits(monkeypatch):
    """ssd.kernel.sum_heads adds the backward's per-head dB / dC slots with the chain of ops._sum_heads_in_order,
    the same float32 adds in ascending head order: the same bytes, alone and through the SSD's backward
    (ops.KERNEL_SUM_HEADS); it replays byte-equal, quiet and under contention. Negative control: the heads added
    in descending order differ in some bytes."""
    from detjax.pallas_kernels.ssd import ops as so
    from detjax.pallas_kernels.ssd.kernel import sum_heads, sum_heads_usable

    b, h, length, n = 2, 8, 64, 16
    ks = jax.random.split(jax.random.key(11), 2)
    db = jax.random.normal(ks[0], (b * h, length, n))
    dc = 1e3 * jax.random.normal(ks[1], (b * h, length, n))
    got = sum_heads(db, dc, h=h, interpret=interpret_mode())
    want = [so._sum_heads_in_order(v, b, h) for v in (db, dc)]
    assert [_bits(v) for v in got] == [_bits(v) for v in want]
    flipped = so._sum_heads_in_order(dc.reshape(b, h, length, n)[:, ::-1].reshape(dc.shape), b, h)
    assert _bits(flipped) != _bits(want[1])
    fn = jax.jit(lambda x, y: sum_heads(x, y, h=h, interpret=interpret_mode()))
    assert_replays_bit_exact(fn, (db, dc), replays=3)
    assert_replays_bit_exact(fn, (db, dc), replays=2, contention=matmul_contention(256, 5))
    assert sum_heads_usable(32, 2048, 64) and not sum_heads_usable(24, 2048, 64)

    args, g = _ssd_inputs(5, b=2, length=64, h=4, p=16)
    grads = {}
    for on in (False, True):
        monkeypatch.setattr(so, "KERNEL_SUM_HEADS", on)
        jax.clear_caches()
        grads[on] = [_bits(v) for v in _ssd_grads(lambda *t: ssd(*t, 16), args, g)]
    assert grads[True] == grads[False]
    jax.clear_caches()


def _transposes_of_size(fn, args, size: int) -> int:
    text = jax.jit(fn).lower(*args).as_text()
    sizes = []
    for line in text.splitlines():
        if "stablehlo.transpose" in line:
            dims = line.rsplit("-> tensor<", 1)[1].split("x")[:-1]
            sizes.append(int(np.prod([int(d) for d in dims])))
    return sum(1 for s in sizes if s == size)


def test_ssd_reads_and_writes_heads_in_place():
    """The kernel reads x and dy and writes y and dx in the model's (B, L, H*P) layout: the scan's forward and
    backward move no x-sized array to heads-first. Control: a heads-first copy of x is seen."""
    args, g = _ssd_inputs(4, b=2, length=32, h=2, p=16)

    def fwd_bwd(*a):
        y, vjp = jax.vjp(lambda *t: ssd(*t, 16), *a)
        return y, vjp(g)

    assert _transposes_of_size(fwd_bwd, args, args[0].size) == 0
    assert _transposes_of_size(lambda x: jnp.moveaxis(x, 2, 1) * 2.0, args[:1], args[0].size) == 1


def test_ssd_replays_bit_exact():
    args, g = _ssd_inputs(1, length=32)
    fn = jax.jit(lambda *a: (ssd(*a, 16), _ssd_grads(lambda *b: ssd(*b, 16), a, g)))
    assert_replays_bit_exact(fn, args, replays=4)
    assert_replays_bit_exact(fn, args, replays=3, contention=matmul_contention(256, 5))


def _gmm_inputs(seed=0, r=200, k=64, n=96, sizes=(30, 0, 71, 5, 64, 30)):
    ks = jax.random.split(jax.random.key(seed), 3)
    gs = jnp.asarray(sizes, jnp.int32)
    w = jax.random.normal(ks[1], (len(sizes), k, n))
    return jax.random.normal(ks[0], (r, k)), w, gs, jax.random.normal(ks[2], (r, n))


def _gmm_grads(fn, x, w, gs, g):
    return jax.grad(lambda x, w: jnp.sum(fn(x, w, gs) * g), argnums=(0, 1))(x, w)


def test_gmm_matches_reference():
    """Groups of uneven sizes, one empty, groups straddling row tiles; forward, dx and dw."""
    x, w, gs, g = _gmm_inputs()
    with jax.default_matmul_precision("highest"):
        ref, ref_grads, ref_t = gmm_ref(x, w, gs), _gmm_grads(gmm_ref, x, w, gs, g), tgmm_ref(x, g, gs)
    assert _rel(grouped_matmul(x, w, gs), ref) <= _tf32_tol(TOL_FWD)
    for a, b in zip(_gmm_grads(grouped_matmul, x, w, gs, g), ref_grads, strict=True):
        assert _rel(a, b) <= _tf32_tol(TOL_GRAD)
    # interpret=True on a GPU still multiplies float32 in TF32 there, like the compiled kernel
    assert _rel(tgmm(x, g, gs, out_dtype=jnp.float32, interpret=True), ref_t) <= _tf32_tol(TOL_FWD)


def test_gmm_replays_bit_exact():
    x, w, gs, g = _gmm_inputs(1, r=96, sizes=(20, 40, 0, 36))
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)  # the model's operand dtype
    fn = jax.jit(lambda x, w: (grouped_matmul(x, w, gs), _gmm_grads(grouped_matmul, x, w, gs, g)))
    assert_replays_bit_exact(fn, (x, w), replays=4)
    assert_replays_bit_exact(fn, (x, w), replays=3, contention=matmul_contention(256, 5))


def test_tgmm_order_ignores_other_groups():
    """Expert 2's weight gradient is bit-identical when the groups before it change size: its rows are
    summed in tiles aligned to its own first row, not to global row positions."""
    x, _, gs, g = _gmm_inputs()
    start = 30  # groups 0 and 1 hold 30 rows; group 2 is rows 30..100
    mine_x, mine_g = x[start : start + 71], g[start : start + 71]
    for before in (7, 45, 64):  # group 2 now starts at row 7, 45, 64 (other tile phases)
        other = jax.random.normal(jax.random.key(before), (before, x.shape[1] + g.shape[1]))
        x2 = jnp.concatenate([other[:, : x.shape[1]], mine_x, x[start + 71 :]])
        g2 = jnp.concatenate([other[:, x.shape[1] :], mine_g, g[start + 71 :]])
        gs2 = jnp.asarray([before, 0, 71, 5, 64, 30], jnp.int32)
        want = tgmm(x, g, gs, out_dtype=jnp.float32, interpret=True)[2]
        got = tgmm(x2, g2, gs2, out_dtype=jnp.float32, interpret=True)[2]
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


def _gmm_impl(impl, x, w, gs, g):
    y, pull = jax.vjp(lambda x, w: grouped_matmul(x, w, gs, impl), x, w)
    return y, *pull(g)


@pytest.mark.parametrize("n", [128, 256])
def test_gmm_mosaic_path_gives_the_triton_bits_on_exact_values(n):
    """The bf16 experts' products through the Mosaic kernel on the padded group layout (bf16 wgmma on Hopper;
    its interpreter here): an empty group, a group over two 256-row tiles and one inside a tile. On small
    integers every sum is exact, so y, dx and dw are byte-equal to the Triton gmm / tgmm's. dw comes from the
    transposed copies at N 128 and from x and dy as stored at N 256 (gmm/mosaic.py grouped_dw). Negative
    control: swapped group sizes change y."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    assert gmosaic.dw_usable(256, n, jnp.bfloat16) == (n == 256)
    ks = jax.random.split(jax.random.key(3), 3)
    gs = jnp.asarray([0, 300, 90], jnp.int32)
    ints = lambda k, shape: jax.random.randint(k, shape, -3, 4).astype(jnp.bfloat16)  # noqa: E731
    x, w, g = ints(ks[0], (390, 256)), ints(ks[1], (3, 256, n)), ints(ks[2], (390, n)).astype(jnp.float32)
    want = _gmm_impl("triton", x, w, gs, g)
    got = _gmm_impl("mosaic", x, w, gs, g)
    for name, a, b in zip(("y", "dx", "dw"), want, got, strict=True):
        assert a.dtype == b.dtype and _bits(a) == _bits(b), name
    assert float(jnp.max(jnp.abs(got[2][1].astype(jnp.float32)))) > 0 and not np.any(np.asarray(got[2][0]))
    assert _bits(_gmm_impl("mosaic", x, w, gs[::-1], g)[0]) != _bits(got[0])


def test_gmm_compute_copy_gives_the_cast_at_use_bits():
    """grouped_matmul_copy reads the step's once-per-step copy (gmm.ops.grouped_compute_copy: the stack cast,
    and its transpose for dx) in place of casting the float32 stack at each use: y, dx and the float32 dw are
    byte-equal to grouped_matmul of the cast stack, on both paths (Mosaic under its interpreter), on general
    values; dw comes back in w's float32. Negative control: a copy of another stack changes y and dx. A copy
    of another shape is refused."""
    from detjax.pallas_kernels.gmm.ops import grouped_compute_copy, grouped_matmul_copy

    ks = jax.random.split(jax.random.key(5), 3)
    gs = jnp.asarray([0, 300, 90], jnp.int32)
    x = jax.random.normal(ks[0], (390, 256)).astype(jnp.bfloat16)
    w, g = 0.1 * jax.random.normal(ks[1], (3, 256, 128)), jax.random.normal(ks[2], (390, 128))

    def run(impl, copy_of):
        def f(x, w):
            if copy_of is None:
                return grouped_matmul(x, w.astype(jnp.bfloat16), gs, impl)
            return grouped_matmul_copy(x, w, gs, grouped_compute_copy(copy_of, jnp.bfloat16), impl)

        y, pull = jax.vjp(f, x, w)
        return y, *pull(g)

    for impl in ("mosaic", "triton"):
        want, got = run(impl, None), run(impl, w)
        for name, a, b in zip(("y", "dx", "dw"), want, got, strict=True):
            assert a.dtype == b.dtype and _bits(a) == _bits(b), (impl, name)
        assert got[2].dtype == jnp.float32
    other = run("triton", 2 * w)
    assert _bits(other[0]) != _bits(got[0]) and _bits(other[1]) != _bits(got[1])
    with pytest.raises(ValueError, match="expert weight copy does not fit"):
        grouped_matmul_copy(x, w, gs, grouped_compute_copy(w[:, :128], jnp.bfloat16))


def test_padded_group_layout_matches_a_row_by_row_construction():
    """gmm/mosaic.py padded_layout against a plain loop over the groups: every sorted row's padded row, every
    padded row's source and validity, each row tile's expert and each group's blocks, with empty groups, a
    group of exactly one tile, and fewer rows than the group sizes' bound. Negative control: other sizes give
    another layout."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    t = gmosaic.GROUP_ROWS
    for sizes, rows in (([0, 300, 90], 390), ([t, 0, 0, 1, 2 * t + 5], 3 * t + 6), ([7, 0, 0, 0], 20)):
        lay = jax.jit(gmosaic.padded_layout, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), rows, 64)
        p = gmosaic.padded_rows(rows, len(sizes))
        pos, src, valid, tile_groups, starts, counts = [], [None] * p, [False] * p, [], [], []
        tile, first = 0, 0
        for e, g in enumerate(sizes):
            tiles = max(1, -(-g // t))
            starts.append(tile * t // 64)
            counts.append(tiles * t // 64)
            for r in range(g):
                pos.append(tile * t + r)
                src[tile * t + r], valid[tile * t + r] = first + r, True
            tile_groups += [e] * tiles
            tile, first = tile + tiles, first + g
        tile_groups += [len(sizes) - 1] * (p // t - len(tile_groups))  # the zero tiles past the last group
        assert np.asarray(lay.pos_R[: len(pos)]).tolist() == pos, sizes
        assert np.asarray(lay.valid_P).tolist() == valid, sizes
        assert [s for s, v in zip(np.asarray(lay.src_P).tolist(), valid, strict=True) if v] == [
            s for s, v in zip(src, valid, strict=True) if v
        ], sizes
        assert np.asarray(lay.tile_groups).tolist() == tile_groups, sizes
        assert np.asarray(lay.group_blocks).tolist() == [starts, counts], sizes
    one, other = (gmosaic.padded_layout(jnp.asarray(s, jnp.int32), 390, 64) for s in ([0, 300, 90], [90, 300, 0]))
    assert np.asarray(one.pos_R).tolist() != np.asarray(other.pos_R).tolist()


def test_grouped_dw_adds_its_rounded_sums_into_a_running_sum():
    """gmm.mosaic.grouped_dw with `acc` (the experts in the gradient accumulation fusion; Mosaic under its
    interpreter): acc + dw rounded to bf16, added in the kernel's epilogue, byte-equal to adding them apart,
    an empty group included. Negative control: adding the unrounded float32 dw gives other bits, so the test
    sees the rounding."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    bf = jnp.bfloat16
    ks = jax.random.split(jax.random.key(9), 3)
    gs = jnp.asarray([70, 0, 30], jnp.int32)
    lay = gmosaic.padded_layout(gs, 100, 64)
    x = gmosaic.to_padded(jax.random.normal(ks[0], (100, 128)).astype(bf), lay)
    g = gmosaic.to_padded(jax.random.normal(ks[1], (100, 256)).astype(bf), lay)
    acc = jax.random.normal(ks[2], (3, 128, 256), jnp.float32) * 30
    dw = gmosaic.grouped_dw(x, g, lay, interpret=True)
    got = gmosaic.grouped_dw(x, g, lay, interpret=True, acc=acc)
    assert got.dtype == jnp.float32 and _bits(got) == _bits(acc + dw.astype(bf).astype(jnp.float32))
    assert _bits(got[1]) == _bits(acc[1] + 0.0)  # the empty expert: its sum plus zeros
    assert _bits(got) != _bits(acc + dw), "negative control: the float32 dw unrounded"


@pytest.mark.parametrize("gate_up_in_dtype", [False, True])
def test_experts_swiglu_on_the_padded_layout_gives_the_per_product_bits(monkeypatch, gate_up_in_dtype):
    """gmm.ops.grouped_swiglu_padded (the experts' three products with the rows kept in the padded group
    layout, Mosaic under its interpreter) gives the bytes of three grouped_matmul(..., "mosaic") calls around
    the same SwiGLU: y (written in bf16 by the down product's kernel: the float32 y rounded), dx and the three
    float32 weight gradients, on general values, reading the step's weight copies; with running sums of the
    stacks (the gradient accumulation fusion) each sum plus its dw, added in grouped_dw's epilogue, and y and
    dx unchanged, here with rows not yet sorted by expert (`rows`: the sort composed with the padded layout's
    copies; y and dx come back in the rows' own order). Without copies it casts the weights itself (the same
    grouped_compute_copy, then the same products and backward): dispatch.expert_ffn takes that path where
    swiglu_on_padded_layout says so, and its float32 y is checked here (its backward is the interpreter's most
    expensive run and adds no other code).
    With gmm.ops.GATE_UP_IN_DTYPE the gate and up sums are rounded to bf16 before the SwiGLU (their kernels write
    bf16) in both, y and the four gradients are checked, and so are the Triton path's y (dispatch rounds its
    float32 sums the same way) and the bits the rounding changes (the y of the float32 sums differs).
    Negative control: swapped group sizes change y."""
    from detjax.model import dispatch
    from detjax.pallas_kernels.gmm import ops as gmm_ops
    from detjax.pallas_kernels.gmm.ops import grouped_compute_copy, grouped_swiglu_padded

    monkeypatch.setattr(gmm_ops, "GATE_UP_IN_DTYPE", gate_up_in_dtype)

    bf = jnp.bfloat16
    ks = jax.random.split(jax.random.key(7), 5)
    gs = jnp.asarray([0, 200, 40], jnp.int32)
    x = jax.random.normal(ks[0], (240, 256)).astype(bf)
    ws = (
        0.1 * jax.random.normal(ks[1], (3, 256, 256)),
        0.1 * jax.random.normal(ks[2], (3, 256, 256)),
        0.1 * jax.random.normal(ks[3], (3, 256, 256)),
    )
    g = jax.random.normal(ks[4], (240, 256)).astype(bf)  # the cotangent of a bf16 y; float32 for want's y

    def per_product(x, *ws, gs=gs, impl="mosaic", rounded=gate_up_in_dtype):
        def mm(a, w):
            return grouped_matmul(a.astype(bf), w.astype(bf), gs, impl)

        def gate_up(v):  # the float32 sums, or rounded to bf16 as their kernels write them
            return v.astype(bf).astype(jnp.float32) if rounded else v

        return mm((jax.nn.silu(gate_up(mm(x, ws[0]))) * gate_up(mm(x, ws[1]))).astype(bf), ws[2])

    @functools.partial(jax.jit, static_argnums=0)
    def run(f, x, ws, ct):
        y, pull = jax.vjp(f, x, *ws)
        return y, *pull(ct.astype(y.dtype))

    def padded_copies(x, *ws):  # y in bf16, as the MoE block asks for it: the down product's kernel writes it
        return grouped_swiglu_padded(x, gs, ws, bf, tuple(grouped_compute_copy(w, bf) for w in ws), out_dtype=bf)

    # the gradient accumulation fusion (the dw go to running sums of the stacks), on rows not yet sorted:
    # sorted row i is row order[i] of x[inv] (rows=), so y and dx come back as got's rows in x[inv]'s order
    order = jax.random.permutation(jax.random.key(8), 240).astype(jnp.int32)
    inv = jnp.argsort(order).astype(jnp.int32)

    def padded_sums(x, *accs):
        cs = tuple(grouped_compute_copy(w, bf) for w in ws)
        return grouped_swiglu_padded(x, gs, ws, bf, cs, out_dtype=bf, accs=accs, rows=(order, inv))

    want, got = run(per_product, x, ws, g), run(padded_copies, x, ws, g)
    assert want[0].dtype == jnp.float32 and got[0].dtype == bf and _bits(got[0]) == _bits(want[0].astype(bf))
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), want[1:], got[1:], strict=True):
        assert a.dtype == b.dtype and _bits(a) == _bits(b), name
    if gate_up_in_dtype:  # the Triton path rounds alike; the rounding changes the bits
        monkeypatch.setattr(dispatch, "swiglu_on_padded_layout", lambda dtype, d, f: False)
        triton = jax.jit(lambda x: dispatch.expert_ffn(x, gs, *ws, bf, "pallas"))(x)
        assert _bits(triton) == _bits(jax.jit(functools.partial(per_product, impl="triton"))(x, *ws))
        assert _bits(jax.jit(functools.partial(per_product, rounded=False))(x, *ws)) != _bits(want[0])
        return
    accs = tuple(30 * jax.random.normal(jax.random.key(i), w.shape) for i, w in enumerate(ws))
    summed = run(padded_sums, x[inv], accs, g[inv])
    assert _bits(summed[0]) == _bits(got[0][inv]) and _bits(summed[1]) == _bits(got[1][inv])
    for name, acc, a, b in zip(("gate", "up", "down"), accs, want[2:], summed[2:], strict=True):
        assert _bits(b) == _bits(acc + a), name  # want's dw: the float32 sums rounded to bf16, then float32
    assert want[4].dtype == jnp.float32
    assert float(jnp.max(jnp.abs(want[4][1]))) > 0 and not np.any(np.asarray(want[4][0]))  # expert 0: no rows

    monkeypatch.setattr(dispatch, "swiglu_on_padded_layout", lambda dtype, d, f: True)
    routed = dispatch.expert_ffn(x, gs, *ws, bf, "pallas")
    assert _bits(routed) == _bits(want[0])
    assert _bits(grouped_swiglu_padded(x, gs[::-1], ws, bf)) != _bits(want[0])


@pytest.mark.gpu
def test_gmm_mosaic_path_gives_the_triton_bits_and_replays_on_gpu():
    """On Hopper, the bf16 experts' products on general values (sums that round): the Mosaic path at
    gpu_medium's expert shape gives the Triton gmm / tgmm's bytes, replays quiet and under a GEMM stream, and
    100 rows added in front of expert 0's group change no other row's y or dx and no other expert's dw.
    Negative control: expert 0's dw changes."""
    from detjax.pallas_kernels.gmm.ops import use_mosaic

    e, k, n = 8, 1024, 1024
    if not use_mosaic(jnp.bfloat16, jnp.bfloat16, k, n):
        pytest.skip("the bf16 grouped Mosaic path needs a Hopper GPU")
    w = (0.02 * jax.random.normal(jax.random.key(1), (e, k, n))).astype(jnp.bfloat16)
    gs = jnp.asarray([900, 1100, 0, 1500, 1024, 700, 1300, 1668], jnp.int32)
    rows = int(gs.sum())
    x = jax.random.normal(jax.random.key(2), (rows + 100, k)).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.key(3), (rows + 100, n))
    run = jax.jit(_gmm_impl, static_argnums=0)
    base = run("mosaic", x[100:], w, gs, g[100:])
    triton = run("triton", x[100:], w, gs, g[100:])
    for name, a, b in zip(("y", "dx", "dw"), triton, base, strict=True):
        assert _bits(a) == _bits(b), name
    assert_replays_bit_exact(functools.partial(run, "mosaic"), (x[100:], w, gs, g[100:]), replays=3)
    assert_replays_bit_exact(
        functools.partial(run, "mosaic"), (x[100:], w, gs, g[100:]), replays=2, contention=matmul_contention(2048, 5)
    )
    grown = run("mosaic", x, w, gs.at[0].add(100), g)
    assert _bits(grown[0][100:]) == _bits(base[0]) and _bits(grown[1][100:]) == _bits(base[1])
    assert _bits(grown[2][1:]) == _bits(base[2][1:])
    assert _bits(grown[2][0]) != _bits(base[2][0])


def test_harness_compares_bytes_not_values():
    """Signed zero: equal as values, different as bytes — the harness must count it."""
    flips = iter([0.0, -0.0, 0.0])
    assert count_differing_replays(lambda: jnp.float32(next(flips)), (), replays=3) == 1


@pytest.mark.gpu
def test_atomic_scatter_add_negative_control(python):
    """On the GPU, XLA's scatter-add (atomics) differs between replays when the deterministic flag is off —
    the harness can see a race. Runs in a fresh process: this process has the strict flags set."""
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


KERNEL_NAMES = {
    "flash_attention_fwd",
    "flash_attention_dkv",
    "flash_attention_dq",
    "gmm",
    "tgmm",
    "matmul_fwd",
    "matmul_dx",
    "matmul_dw",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "segment_sum",
    "ssd_fwd",
    "ssd_bwd",
}


def test_model_uses_pallas_kernels_through_one_switch(tiny_path):
    """model.kernels=pallas puts every kernel (forward and backward) into the train step of the hybrid
    M*E- model, every GEMM included, and the step's loss and gradient norm match the reference path's."""
    from detjax.config import load_config
    from detjax.jaxprs import iter_eqns
    from detjax.step import Trainer

    over = ["model.pattern=M*E-", "model.mtp.depth=0", "model.dropout=0.0"]
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (16, 65)), jnp.int32)
    out, dots = {}, {}
    for kernels in ("pallas", "reference"):
        tr = Trainer(load_config(tiny_path, [f"model.kernels={kernels}", *over]))
        state = jax.jit(tr.init_state)(jax.random.key(0))
        traced = jax.jit(tr.train_step).trace(state, batch)  # one trace and one lowering serve every check
        names = {str(e.params["name"]) for e in iter_eqns(traced.jaxpr) if "name" in e.params}  # kernels, jits
        lowered = traced.lower()
        out[kernels] = (names & KERNEL_NAMES, lowered.compile()(state, batch)[1], lowered.as_text())
        dots[kernels] = determinism.xla_dots(traced.jaxpr)
    assert out["pallas"][0] == KERNEL_NAMES
    assert out["reference"][0] == set()
    # every GEMM of the Pallas step is detjax's own: no dot is left to XLA (what strategy=kernels checks) ...
    assert dots["pallas"] == [] and determinism.check_xla_dots(dots["pallas"]) == []
    # ... while the reference step's projections are XLA dots, which the check refuses by name
    assert {d["scope"].rsplit("/", 1)[-1] for d in dots["reference"]} >= {"bld,df->blf", "bld,dv->blv", "td,de->te"}
    with pytest.raises(
        determinism.DeterminismError, match=r"(?s)GEMM\(s\) in the train step would run in XLA.*layer_3"
    ):
        determinism.check_xla_dots(dots["reference"])
    # nothing in the Pallas step needs XLA's deterministic flag (what determinism.strategy=kernels checks)
    assert determinism.nondeterministic_ops(out["pallas"][2]) == {}
    (_, mp, _), (_, mr, _) = out["pallas"], out["reference"]
    np.testing.assert_allclose(float(mp["lm_loss"]), float(mr["lm_loss"]), rtol=1e-4)
    np.testing.assert_allclose(float(mp["grad_norm"]), float(mr["grad_norm"]), rtol=2e-3)


def test_remat_keeps_the_pallas_step_bits_on_cpu(tiny_path):
    """model.remat=block recomputes each block in the backward with the same kernels: on the CPU the step's
    losses, gradient norm and digests (params, grads, optimizer state) are byte-equal to keeping the
    activations (an attention block, Pallas kernels). Negative control: another init seed differs. On the
    H200 the bits are not equal (aux_loss differed in its last bit, 2026-11-30): XLA fuses the recomputed
    elementwise ops differently there, so remat is a trajectory of its own on the GPU."""
    from detjax.config import load_config
    from detjax.step import Trainer

    if jax.default_backend() != "cpu":
        pytest.skip("a CPU-only property (see the docstring)")
    over = ["model.pattern=*", "model.mtp.depth=0", "model.dropout=0.0", "model.kernels=pallas"]
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (16, 65)), jnp.int32)

    def stepper(*extra):
        tr = Trainer(load_config(tiny_path, [*over, *extra]))
        init, step = jax.jit(tr.init_state), jax.jit(tr.train_step)

        def run(seed=0):
            return [np.asarray(x).tobytes() for x in jax.tree.leaves(step(init(jax.random.key(seed)), batch)[1])]

        return run

    plain = stepper()
    want = plain()
    assert stepper("model.remat=block")() == want
    assert plain(seed=1) != want
