"""The Mosaic GPU flash attention (pallas_kernels/flash_attention/mosaic.py): its math against the jnp
reference (on CPU under Pallas' Mosaic GPU interpreter, on a Hopper GPU compiled), its replays, and the
config's refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detjax.config import ConfigError, load_config, with_flash_backend
from detjax.pallas_kernels.flash_attention import mosaic
from detjax.pallas_kernels.flash_attention.ops import flash_attention
from detjax.pallas_kernels.flash_attention.reference import attention_reference
from detjax.pallas_kernels.harness import assert_replays_bit_exact, matmul_contention

# P and dS are rounded to bf16 before their products and the outputs are bf16: errors of a few bf16 ulps of
# the largest value (measured under the interpreter: 2.0e-3 forward, 3.0e-3 to 3.9e-3 for the gradients, the
# Triton kernel's figures too; the shifted-key control: 1.0)
TOL = 1e-2


def _inputs(seed=0, b=1, length=256, h=2, kv=1, d=64):
    k = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k[0], (b, length, h, d), jnp.bfloat16)
    kk = jax.random.normal(k[1], (b, length, kv, d), jnp.bfloat16)
    v = jax.random.normal(k[2], (b, length, kv, d), jnp.bfloat16)
    return q, kk, v, jax.random.normal(k[3], (b, length, h, d), jnp.bfloat16)


def _bits(a) -> bytes:
    return np.asarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32).tobytes()


def _rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _value_and_grads(fn, q, k, v, g):
    return jax.value_and_grad(lambda *x: jnp.sum(fn(*x).astype(jnp.float32) * g.astype(jnp.float32)), (0, 1, 2))(
        q, k, v
    )


def _reference(q, k, v):
    with jax.default_matmul_precision("highest"):
        return attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))


@pytest.mark.skipif(
    jax.default_backend() == "gpu" and not mosaic.available(), reason="the Mosaic GPU backend needs a Hopper GPU"
)
def test_mosaic_flash_attention_matches_reference():
    """Two query heads per kv head, two CTA tiles of 128 rows: fully visible kv blocks, diagonal (masked)
    ones, warpgroup 0's skipped last block in the forward and dQ, warpgroup 1's skipped first query block in
    dK/dV. Negative control: the same comparison with the keys shifted by one position fails."""
    q, k, v, g = _inputs()
    fn = jax.jit(lambda *x: flash_attention(*x, "mosaic"))
    o = fn(q, k, v)
    assert o.dtype == jnp.bfloat16 and o.shape == q.shape
    ref = _reference(q, k, v)
    assert _rel(o, ref) <= TOL
    assert _rel(o, _reference(q, jnp.roll(k, 1, axis=1), v)) > 10 * TOL
    _, got = _value_and_grads(lambda *x: flash_attention(*x, "mosaic"), q, k, v, g)
    _, want = _value_and_grads(_reference, q, k, v, g)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.dtype == jnp.bfloat16, name
        assert _rel(a, b) <= TOL, name


@pytest.mark.extended  # ring depths and persistent kernels other than the pinned ones (time only)
@pytest.mark.skipif(
    jax.default_backend() == "gpu" and not mosaic.available(), reason="the Mosaic GPU backend needs a Hopper GPU"
)
def test_mosaic_ring_depths_and_persistent_kernels_give_the_pinned_bytes():
    """The inputs of test_mosaic_flash_attention_matches_reference: a ring of two slots in every kernel (each
    ring wraps at this length) and the persistent dQ (three CTAs, four items) and dK/dV (one CTA, both items)
    give the bytes of the pinned kernels. The Triton backend's differ (other arithmetic), so the comparison can
    fail."""
    q, k, v, g = _inputs()
    o = jax.jit(lambda *x: flash_attention(*x, "mosaic"))(q, k, v)
    _, got = _value_and_grads(lambda *x: flash_attention(*x, "mosaic"), q, k, v, g)
    interp = jax.default_backend() != "gpu"
    o2, lse2 = mosaic._fwd_call(q, k, v, interpret=interp, stages=2)
    _, lse = mosaic.flash_fwd(q, k, v, interpret=interp)
    assert _bits(o2) == _bits(o) and _bits(lse2) == _bits(lse)
    delta = jnp.sum(g.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    dq2 = mosaic._dq_call(q, k, v, g, lse, delta, interpret=interp, stages=2)
    dk2, dv2 = mosaic._dkv_call(q, k, v, g, lse, delta, interpret=interp, stages=2)
    assert [_bits(x) for x in (dq2, dk2, dv2)] == [_bits(x) for x in got]
    dq3 = mosaic._dq_call(q, k, v, g, lse, delta, interpret=interp, stages=2, persistent=True, programs=3)
    dk3, dv3 = mosaic._dkv_call(q, k, v, g, lse, delta, interpret=interp, stages=2, persistent=True, programs=1)
    assert [_bits(x) for x in (dq3, dk3, dv3)] == [_bits(x) for x in got]
    assert _bits(flash_attention(q, k, v, "triton")) != _bits(o)


@pytest.mark.extended  # forward configurations other than the pinned one (FWD); the default run checks the pinned one
@pytest.mark.skipif(
    jax.default_backend() == "gpu" and not mosaic.available(), reason="the Mosaic GPU backend needs a Hopper GPU"
)
def test_mosaic_forward_variants():
    """The forward with 128-key blocks (one diagonal block per CTA, masked at each warpgroup's offset) matches
    the reference, with and without the warpgroups taking turns; the turns and a three-slot ring (the pinned
    depth is two) change time, not bytes, and the block size changes the online softmax's steps, so it is part
    of the bits (the control: 64-key blocks differ). Pingpong needs 128-key blocks and says so. The persistent
    forward (four CTAs walking the six (tile, head) items, the ring running on across items) gives the same
    bytes with either block size. The scale applied before the row maximum (fold_scale off; on by default it
    is folded into exp2's argument) matches the reference and the default's lse to float32 rounding."""
    q, k, v, _ = _inputs(2, length=384)
    interp = jax.default_backend() != "gpu"
    ref = _reference(q, k, v)
    o128, lse128 = mosaic._fwd_call(q, k, v, interpret=interp, block_kv=128, pingpong=False)
    assert _rel(o128, ref) <= TOL
    assert _rel(o128, _reference(q, jnp.roll(k, 1, axis=1), v)) > 10 * TOL
    o_pp, lse_pp = mosaic._fwd_call(q, k, v, interpret=interp, block_kv=128, pingpong=True, stages=3)
    assert _bits(o_pp) == _bits(o128) and _bits(lse_pp) == _bits(lse128)
    o_ps, lse_ps = mosaic._fwd_call(q, k, v, interpret=interp, block_kv=128, pingpong=True, persistent=True, programs=4)
    assert _bits(o_ps) == _bits(o128) and _bits(lse_ps) == _bits(lse128)
    o64, lse64 = mosaic._fwd_call(q, k, v, interpret=interp, block_kv=64, pingpong=False)
    assert _rel(o64, ref) <= TOL
    o_ps, lse_ps = mosaic._fwd_call(q, k, v, interpret=interp, block_kv=64, pingpong=False, persistent=True, programs=4)
    assert _bits(o_ps) == _bits(o64) and _bits(lse_ps) == _bits(lse64)
    # the scale applied before the row maximum instead of in exp2's argument: the same math (lse to float32
    # rounding), both block sizes
    assert mosaic.FWD["fold_scale"]
    for bk, pp, lse_pinned in ((128, True, lse128), (64, False, lse64)):
        o_f, lse_f = mosaic._fwd_call(q, k, v, interpret=interp, block_kv=bk, pingpong=pp, fold_scale=False)
        assert _rel(o_f, ref) <= TOL
        assert float(jnp.max(jnp.abs(lse_f - lse_pinned))) <= 1e-4 * float(jnp.max(jnp.abs(lse_pinned)))
    assert _bits(lse64) != _bits(lse128)


def test_mosaic_pingpong_needs_128_key_blocks():
    """The forward's warpgroups take turns only over 128-key blocks, and a call that asks for turns over
    64-key blocks is refused before anything runs."""
    q, k, v, _ = _inputs(2, length=384)
    with pytest.raises(ValueError, match="block_kv 128"):
        mosaic._fwd_call(q, k, v, interpret=jax.default_backend() != "gpu", block_kv=64, pingpong=True)


def test_persistent_kernels_deal_every_item_once_and_evenly():
    """The persistent kernels' rounds (mosaic.dealt) give every item position to exactly one CTA, with item
    counts and CTA counts that do and do not divide; for the causal forward at 2 x 4096 x 16 heads on 132 CTAs
    (work t + 1 kv blocks for tile t, the longest first) the busiest CTA does the mean work, where dealing
    round-robin gives it 12.5 % more (the control)."""
    for total, programs in ((1024, 132), (6, 4), (4, 3), (2, 1), (5, 7), (264, 132)):
        rounds = -(-total // programs)
        got = sorted(p for k in range(rounds) for i in range(programs) if (p := mosaic.dealt(k, i, programs)) < total)
        assert got == list(range(total)), (total, programs)
    work = [32 - pos // 32 for pos in range(1024)]  # tile index pos // 32 has t = 31 - index: t + 1 blocks
    mean = sum(work) / 132

    def busiest(position):
        load = [0] * 132
        for k in range(8):
            for i in range(132):
                if (p := position(k, i)) < 1024:
                    load[i] += work[p]
        return max(load) / mean

    assert busiest(lambda k, i: mosaic.dealt(k, i, 132)) == 1.0
    assert busiest(lambda k, i: k * 132 + i) == 1.125


def test_mosaic_flash_attention_has_no_races():
    """The three kernels with two-slot rings (every ring wraps) under the interpreter's happens-before race
    detector: the memory warpgroup refills a slot only after both compute warpgroups released it, and shared
    memory written by one warpgroup is read by wgmma only after its fence. Control: the detector flags a
    kernel whose second warpgroup reads what the first writes with no barrier between them."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    # the detector's verdict has no public accessor (jax 0.11.2 - 0.12): skip if a newer jax moves it
    ipc = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
    if not hasattr(ipc, "get_races"):
        pytest.skip("this jax has no interpreter race-detection state to read")

    def detector(on_race):  # jax 0.11.2's detector has no `on_race`: it records, and the test reads the record
        try:
            return plgpu.InterpretGPUParams(detect_races=True, on_race=on_race)
        except TypeError:
            return plgpu.InterpretGPUParams(detect_races=True)

    q, k, v, g = _inputs(3)
    o, lse = mosaic._fwd_call(q, k, v, interpret=detector("raise"), stages=2)
    jax.block_until_ready(mosaic._fwd_call(q, k, v, interpret=detector("raise"), stages=2, block_kv=128, pingpong=True))
    persistent = {"persistent": True, "programs": 3}  # three CTAs (dK/dV: two) for four items (dK/dV: two)
    jax.block_until_ready(mosaic._fwd_call(q, k, v, interpret=detector("raise"), stages=2, **persistent))
    delta = jnp.sum(g.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    for kw in ({}, persistent):
        jax.block_until_ready(mosaic._dq_call(q, k, v, g, lse, delta, interpret=detector("raise"), stages=2, **kw))
        jax.block_until_ready(mosaic._dkv_call(q, k, v, g, lse, delta, interpret=detector("raise"), stages=2, **kw))
    assert not ipc.get_races().races_found

    def racy(x_ref, o_ref, smem):
        wg = jax.lax.axis_index("wg")

        @pl.when(wg == 0)
        def _():
            smem[...] = x_ref[...]

        @pl.when(wg == 1)
        def _():
            o_ref[...] = smem[...]

    x = jnp.arange(128, dtype=jnp.float32)
    run = plgpu.kernel(
        racy,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_types=[plgpu.SMEM(x.shape, x.dtype)],
        num_threads=2,
        thread_name="wg",
        interpret=detector("warn"),
    )
    jax.block_until_ready(run(x))
    assert ipc.get_races().races_found


@pytest.mark.parametrize("d", [64, 128])
def test_mosaic_flash_attention_lowers_for_cuda(d):
    """The three kernels go through Pallas' Mosaic GPU lowering for the CUDA platform (jax.export, no GPU
    needed): layouts, wgmma operand shapes, shared-memory transforms and barrier types are accepted. (It
    caught a loop carry the interpreter took and the lowering does not.)"""
    q = jax.ShapeDtypeStruct((2, 1024, 8, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1024, 2, d), jnp.bfloat16)
    r = jax.ShapeDtypeStruct((2, 8, 1024), jnp.float32)
    calls = {
        "fwd": (lambda q, k, v: mosaic._fwd_call(q, k, v, interpret=False, block_kv=64, pingpong=False), (q, k, k)),
        "fwd128": (lambda q, k, v: mosaic._fwd_call(q, k, v, interpret=False, block_kv=128, pingpong=False), (q, k, k)),
        "fwd128pp": (
            lambda q, k, v: mosaic._fwd_call(q, k, v, interpret=False, block_kv=128, pingpong=True),
            (q, k, k),
        ),
        "fwd128unfolded": (
            lambda q, k, v: mosaic._fwd_call(q, k, v, interpret=False, block_kv=128, pingpong=True, fold_scale=False),
            (q, k, k),
        ),
        "fwd128persistent": (
            lambda q, k, v: mosaic._fwd_call(q, k, v, interpret=False, block_kv=128, pingpong=True, persistent=True),
            (q, k, k),
        ),
        "dq": (lambda *a: mosaic._dq_call(*a, interpret=False), (q, k, k, q, r, r)),
        "dkv": (lambda *a: mosaic._dkv_call(*a, interpret=False), (q, k, k, q, r, r)),
        "dq_persistent": (lambda *a: mosaic._dq_call(*a, interpret=False, persistent=True), (q, k, k, q, r, r)),
        "dkv_persistent": (lambda *a: mosaic._dkv_call(*a, interpret=False, persistent=True), (q, k, k, q, r, r)),
    }
    for name, (fn, args) in calls.items():
        text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
        assert "mosaic_gpu" in text, name


@pytest.mark.gpu
def test_mosaic_flash_attention_replays_bit_exact():
    """Forward and backward at head_dim 128 and 64, quiet and with a GEMM stream on the GPU beside it; the
    persistent kernels (with fewer CTAs than items, and with one per SM) give the pinned kernels' bytes and
    replay too; the forward with the scale applied before the row maximum (fold_scale off) replays."""
    if not mosaic.available():
        pytest.skip("the Mosaic GPU backend needs a Hopper GPU")
    for d in (128, 64):
        q, k, v, g = _inputs(1, b=2, length=1024, h=8, kv=2, d=d)
        fn = jax.jit(lambda q, k, v, g=g: _value_and_grads(lambda *x: flash_attention(*x, "mosaic"), q, k, v, g))
        assert_replays_bit_exact(fn, (q, k, v), replays=4)
        assert_replays_bit_exact(fn, (q, k, v), replays=3, contention=matmul_contention(256, 5))
        o, lse = mosaic._fwd_call(q, k, v, interpret=False)
        delta = jnp.sum(g.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)

        def kernels(q, k, v, g=g, lse=lse, delta=delta, **kw):
            return (
                *mosaic._fwd_call(q, k, v, interpret=False, **kw),
                mosaic._dq_call(q, k, v, g, lse, delta, interpret=False, **kw),
                *mosaic._dkv_call(q, k, v, g, lse, delta, interpret=False, **kw),
            )

        want = [_bits(a) for a in kernels(q, k, v, persistent=False)]
        for programs in (7, None):
            persistent = jax.jit(functools.partial(kernels, persistent=True, programs=programs))
            assert [_bits(a) for a in persistent(q, k, v)] == want
            assert_replays_bit_exact(persistent, (q, k, v), replays=3, contention=matmul_contention(256, 5))
        unfolded = jax.jit(functools.partial(mosaic._fwd_call, interpret=False, fold_scale=False))
        assert_replays_bit_exact(unfolded, (q, k, v), replays=3, contention=matmul_contention(256, 5))


def test_mosaic_flash_backend_refusals(tiny_path):
    """head_dim outside 64 / 128 and float32 compute are refused with one line naming the fix."""
    with pytest.raises(ConfigError, match=r"'model.head_dim' = 16: the Mosaic GPU flash attention takes head_dim 64"):
        load_config(tiny_path, ["model.kernels=pallas", "model.flash_backend=mosaic"])
    over = ["model.kernels=pallas", "model.flash_backend=mosaic", "model.head_dim=64", "model.compute_dtype=float32"]
    with pytest.raises(ConfigError, match=r"multiplies bf16 operands.*Fix: use model.compute_dtype=bfloat16"):
        load_config(tiny_path, over)
    # the backend is part of the trajectory's hash; Triton (auto's choice here) keeps the hash configs had
    # before the key
    base = with_flash_backend(
        load_config(tiny_path, ["model.kernels=pallas", "model.head_dim=64", "run.tensorboard=false"])
    )
    again = load_config(
        tiny_path, [*over[:1], "model.flash_backend=triton", "model.head_dim=64", "run.tensorboard=false"]
    )
    assert base.hash() == again.hash()
    assert base.hash() != load_config(tiny_path, [*over[:3], "run.tensorboard=false"]).hash()
    assert mosaic.refusal(192, 64, jnp.bfloat16) == (
        "the Mosaic GPU flash attention needs seq_len a multiple of 128; got 192"
    )
    assert mosaic.refusal(256, 64, jnp.bfloat16) is None
