"""The pinned-tile Pallas matmul (interpret mode on CPU, Triton on GPU): equal to XLA's dot within rounding,
bit-exact on replay, and batch-invariant -- row and column subsets and masked appended rows give the same
bits as the full product. Byte equality throughout (arrays viewed as unsigned integers)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.harness import assert_replays_bit_exact, matmul_contention
from detjax.pallas_kernels.matmul.kernel import matmul_kernel
from detjax.pallas_kernels.matmul.ops import dense, matmul
from detjax.pallas_kernels.matmul.reference import matmul_ref


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _inputs(seed=0, m=200, k=96, n=300, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (m, k)).astype(dtype)
    return x, jax.random.normal(ks[1], (k, n)), jax.random.normal(ks[2], (m, n))


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matmul_matches_reference(dtype):
    """Forward, dx and dw against XLA's dot on the same operand dtypes (float32 accumulation on both sides)."""
    x, w, g = _inputs(dtype=dtype)
    assert _rel(matmul(x, w, jnp.float32), matmul_ref(x, w)) <= 1e-6
    dx, dw = jax.grad(lambda x, w: jnp.sum(matmul(x, w, jnp.float32) * g), argnums=(0, 1))(x, w)
    g_c = g.astype(dtype)  # the backward's operands are in the compute dtype, as in the forward
    assert dx.dtype == dtype and dw.dtype == jnp.float32
    assert _rel(dx, matmul_ref(g_c, w.T.astype(dtype), dtype)) <= (1e-6 if dtype == jnp.float32 else 4e-3)
    assert _rel(dw, matmul_ref(x.T, g_c)) <= 1e-6


def test_dense_folds_einsum_specs():
    ks = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(ks[0], (2, 24, 4, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (4, 16, 48))
    want = jnp.einsum("blhq,hqd->bld", x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    assert _rel(dense("blhq,hqd->bld", x, w, jnp.bfloat16, jnp.float32), want) <= 1e-6
    with pytest.raises(ValueError, match="specs"):
        dense("bld,hd->blh", x[:, :, 0], w[:, 0], jnp.bfloat16)


def test_fused_projections_equal_separate_ones():
    """dense_many (one product over concatenated weights) gives each projection's bits exactly."""
    from detjax.pallas_kernels.matmul.ops import dense_many

    ks = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(ks[0], (2, 40, 64)).astype(jnp.bfloat16)
    w1, w2 = jax.random.normal(ks[1], (64, 4, 50)), jax.random.normal(ks[2], (64, 150))
    specs = ["bld,dhq->blhq", "bld,df->blf"]
    fused = dense_many(specs, x, [w1, w2], jnp.bfloat16)
    for spec, w, got in zip(specs, [w1, w2], fused, strict=True):
        assert _same(got, dense(spec, x, w, jnp.bfloat16)), spec
    assert not _same(fused[1], dense(specs[1], x, w2 * (1 + 2**-7), jnp.bfloat16))  # the check can fail


def check_batch_invariance(m: int, k: int, n: int, dtype=jnp.bfloat16) -> None:
    """Rows of x[:r] @ w (r in 1, 7, 64, 100, m), row windows and column subsets equal the full product's
    bits; dx rows likewise; dw unchanged when unrelated rows with zero (masked) gradient are appended."""
    x, w, g = _inputs(1, m, k, n, dtype)
    interp = interpret_mode()
    full = matmul(x, w, jnp.float32)
    for r in (1, 7, 64, 100, m):
        assert _same(matmul(x[:r], w, jnp.float32), full[:r]), f"rows :{r}"
    assert _same(matmul(x[33 : m - 20], w, jnp.float32), full[33 : m - 20]), "row window"
    for c0, c1 in ((0, max(1, n // 3)), (1, n - 1), (n // 2, n)):
        assert _same(matmul(x, w[:, c0:c1], jnp.float32), full[:, c0:c1]), f"columns {c0}:{c1}"
    wc, gc = w.astype(dtype), g.astype(dtype)
    dx = matmul_kernel(gc, wc, kind="dx", out_dtype=jnp.float32, interpret=interp)
    for r in (1, 7, 100):
        assert _same(matmul_kernel(gc[:r], wc, kind="dx", out_dtype=jnp.float32, interpret=interp), dx[:r])
    dw = matmul_kernel(x, gc, kind="dw", out_dtype=jnp.float32, interpret=interp)
    extra = jax.random.normal(jax.random.key(9), (77, k)).astype(dtype)
    x2, g2 = jnp.concatenate([x, extra]), jnp.concatenate([gc, jnp.zeros((77, n), dtype)])
    assert _same(matmul_kernel(x2, g2, kind="dw", out_dtype=jnp.float32, interpret=interp), dw), "dw + masked rows"
    # negative control: the same product summed in another K order is a different float sum, and the
    # comparison above sees it (so the checks can fail)
    perm = jnp.roll(jnp.arange(k), k // 2 + 3)
    assert not _same(matmul(x[:, perm], w[perm], jnp.float32), full)


def test_matmul_is_batch_invariant():
    check_batch_invariance(200, 96, 300)


def test_matmul_float32_is_batch_invariant():
    """The float32 tile class (MoE router: N = n_experts, a few columns)."""
    check_batch_invariance(130, 64, 8, jnp.float32)


def test_dw_token_chunks_split_or_not_give_the_same_bits():
    """dw sums tokens in fixed chunks: one program per tile looping over the chunks and one program per
    (chunk, tile) with the sums added afterwards give the same bits; masked rows appended across a chunk
    boundary change nothing; without chunks the bits differ (so the comparison can fail)."""
    tiles = {"bm": 16, "bn": 16, "block_r": 16, "num_warps": 4, "num_stages": 2, "r_chunk": 64}

    def dw(a, b, **kw):
        t = tuple(sorted(dict(tiles, **kw).items()))
        return matmul_kernel(a, b, kind="dw", out_dtype=jnp.float32, interpret=True, sweep_tiles=t)

    for dtype in (jnp.bfloat16, jnp.float32):
        x, _, g = _inputs(6, 300, 96, 40, dtype)
        g = g.astype(dtype)

        loop = dw(x, g, split=0)
        assert _same(dw(x, g, split=1), loop), dtype
        x2 = jnp.concatenate([x, jnp.ones((100, 96), dtype)])
        g2 = jnp.concatenate([g, jnp.zeros((100, 40), dtype)])
        assert _same(dw(x2, g2, split=1), loop) and _same(dw(x2, g2, split=0), loop), dtype
        assert not _same(dw(x, g, r_chunk=1024), loop), dtype
        assert _rel(loop, matmul_ref(x.T, g)) <= 1e-6


@pytest.mark.gpu
def test_matmul_is_batch_invariant_on_gpu():
    """The same properties compiled on the GPU, at model-like sizes (several tiles each way): Triton, and on
    Hopper the Mosaic GPU kernel (a weight of >= MOSAIC_MIN_SIZE elements)."""
    from detjax.pallas_kernels.matmul.kernel import MOSAIC_MIN_SIZE

    check_batch_invariance(1000, 1024, 1000)
    check_batch_invariance(700, 1024, 8, jnp.float32)
    check_batch_invariance(600, 1024, MOSAIC_MIN_SIZE // 1024 + 104)


@pytest.mark.gpu
def test_matmul_replays_bit_exact_on_gpu():
    """Replays and replays under contention of both GPU kernels (the Mosaic one on Hopper) in one step."""
    x, w, g = _inputs(2, 1030, 1024, 4200)
    fn = jax.jit(lambda x, w: jax.value_and_grad(lambda x, w: jnp.sum(matmul(x, w, jnp.float32) * g), (0, 1))(x, w))
    assert_replays_bit_exact(fn, (x, w), replays=4)
    assert_replays_bit_exact(fn, (x, w), replays=3, contention=matmul_contention(2048, 5))


def test_mosaic_matmul_matches_reference_interpreted():
    """The Mosaic GPU kernel (mosaic.py) under its interpreter on CPU: fwd, dx and chunked / unchunked dw
    against XLA's dot, and rows of a row subset equal to the full product's (its pipeline and tile
    indexing; the GPU's bits are checked by the GPU tests above -- the interpreter's dot is not wgmma)."""
    x, w, g = _inputs(7, 192, 64, 250)
    w, g = w.astype(jnp.bfloat16), g.astype(jnp.bfloat16)

    def run(kind, a, b, **kw):
        t = tuple(sorted(dict(backend="mosaic", **kw).items()))
        return matmul_kernel(a, b, kind=kind, out_dtype=jnp.float32, interpret=True, sweep_tiles=t)

    fwd = run("fwd", x, w)
    assert _rel(fwd, matmul_ref(x, w)) <= 1e-6
    assert _same(run("fwd", x[:7], w), fwd[:7])
    assert _rel(run("dx", g, w), matmul_ref(g, w.T)) <= 1e-6
    want = matmul_ref(x.T, g)
    chunked = run("dw", x, g, r_chunk=64)
    assert _rel(chunked, want) <= 1e-6 and _rel(run("dw", x, g, r_chunk=0), want) <= 1e-6
    # the chunk partials are added in ascending order: the same sum in another order differs
    parts = [run("dw", x[i : i + 64], g[i : i + 64], r_chunk=0) for i in (0, 64, 128)]
    assert _same(chunked, (parts[0] + parts[1]) + parts[2])
    assert not _same(chunked, parts[0] + (parts[1] + parts[2]))


def _stream_cases(gpu: bool):
    """(name, args, kwargs) of mosaic.mosaic_matmul for every mode it has, on operands padded to its tiles:
    bf16 fwd / dx / dw (chunked and not), fp8 nt with a scale and with chunks, and both grouped nt modes in
    fp8 and in bf16 (the MoE experts' products, gmm/mosaic.py)."""
    e4, e5, bf = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
    m, k, n = (8192, 1024, 1536) if gpu else (512, 256, 256)  # CPU: 4-8 work items, 2 per interpreted "SM"
    ks = iter(jax.random.split(jax.random.key(11), 20))

    def rnd(shape, dtype):
        return (4 * jax.random.normal(next(ks), shape)).astype(dtype)

    one = jnp.full((1,), 0.37, jnp.float32)
    chunk = 2048 if gpu else 128
    blocks = jnp.asarray([[0, 2 if gpu else 1], [2 if gpu else 1, 6 if gpu else 3]], jnp.int32)  # first, count
    return [
        ("bf16 fwd", (rnd((m, k), bf), rnd((k, n), bf)), dict(kind="fwd", out_dtype=bf, r_chunk=0)),
        ("bf16 dx", (rnd((m, n), bf), rnd((k, n), bf)), dict(kind="dx", out_dtype=bf, r_chunk=0)),
        ("bf16 dw", (rnd((m, k), bf), rnd((m, n), bf)), dict(kind="dw", out_dtype=jnp.float32, r_chunk=chunk)),
        ("bf16 dw one loop", (rnd((m, k), bf), rnd((m, n), bf)), dict(kind="dw", out_dtype=jnp.float32, r_chunk=0)),
        ("fp8 nt", (rnd((m, k), e4), rnd((n, k), e4), one), dict(kind="nt", out_dtype=bf, r_chunk=0)),
        ("fp8 nt chunks", (rnd((k, m), e4), rnd((n, m), e4)), dict(kind="nt", out_dtype=jnp.float32, r_chunk=chunk)),
        (
            "fp8 nt tile_groups",
            (rnd((m, k), e4), rnd((3, n, k), e4), one),
            dict(kind="nt", out_dtype=bf, r_chunk=0, tile_groups=jnp.arange(m // 256, dtype=jnp.int32) % 3),
        ),
        (
            "fp8 nt group_blocks",
            (rnd((k, m), e4), rnd((n, m), e5 if gpu else e4)),
            dict(kind="nt", out_dtype=jnp.float32, r_chunk=0, group_blocks=blocks),
        ),
        (
            "bf16 nt tile_groups",
            (rnd((m, k), bf), rnd((3, n, k), bf)),
            dict(kind="nt", out_dtype=jnp.float32, r_chunk=0, tile_groups=jnp.arange(m // 256, dtype=jnp.int32) % 3),
        ),
        (
            "bf16 nt group_blocks",
            (rnd((k, m), bf), rnd((n, m), bf)),
            dict(kind="nt", out_dtype=jnp.float32, r_chunk=0, group_blocks=blocks),
        ),
    ]


def test_mosaic_matmul_lowers_for_cuda(monkeypatch):
    """Every mode of mosaic.mosaic_matmul goes through Pallas' Mosaic GPU lowering for the CUDA platform
    (jax.export; no GPU needed), in both pipelines: what the interpreter does not check (layouts, wgmma operand
    forms, transforms) is checked on any machine and any jax version CI installs."""
    from detjax.pallas_kernels.matmul import mosaic

    monkeypatch.setattr(mosaic, "_num_sms", lambda: 132)  # an H100 / H200's SM count (no device to ask here)
    for name, args, kw in _stream_cases(gpu=False):
        for stream in (True, False):
            fn = functools.partial(mosaic.mosaic_matmul, stream=stream, **kw)
            text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
            assert "mosaic_gpu" in text, (name, stream)


# cpu: `-m extended` (~30 s on 2 cores); the default run's interpreted Mosaic tests run the streamed pipeline
@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.extended), pytest.param("gpu", marks=pytest.mark.gpu)]
)
def test_streamed_mosaic_pipeline_gives_the_tiled_bits(device):
    """mosaic.mosaic_matmul's streamed pipeline (one pipeline over all of an SM's tiles) against one pipeline
    per tile: byte-equal outputs in every mode, with one wgmma in flight or none (on the GPU: wgmma on
    general values at gpu_dense's widths; on CPU: Pallas' Mosaic GPU interpreter, which checks the slots,
    the barriers' phases and the indexing). Negative control: the same products with two reduction blocks
    swapped (the same sum in another order) give other bits, so a streamed pipeline that fed a tile's blocks
    out of order would fail here."""
    from detjax.pallas_kernels.matmul import mosaic

    gpu = device == "gpu"
    if gpu and not mosaic.available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    for name, args, kw in _stream_cases(gpu):
        call = functools.partial(mosaic.mosaic_matmul, *args, interpret=not gpu, **kw)
        base = call(stream=False, delay=0)  # the per-tile pipeline takes delay 1 only for >= 2 blocks a tile
        for delay in (0, 1) if gpu or "fp8" in name else (0,):  # CPU time: the bf16 products once
            assert _same(call(stream=True, delay=delay), base), (name, delay)
        if name == "bf16 fwd":  # negative control: reduction blocks 1 and 2 swapped in both operands (not 0 and
            a, b = args  # 1: (0 + x) + y == (0 + y) + x exactly)
            br = mosaic.block_r(a.dtype)
            perm = jnp.concatenate([jnp.arange(br), jnp.arange(2 * br, 3 * br), jnp.arange(br, 2 * br)])
            perm = jnp.concatenate([perm, jnp.arange(3 * br, a.shape[1])])
            f32 = dict(kw, out_dtype=jnp.float32)  # float32 sums: a bf16 rounding could hide the order
            kept = mosaic.mosaic_matmul(a, b, interpret=not gpu, stream=True, **f32)
            swapped = mosaic.mosaic_matmul(a[:, perm], b[perm], interpret=not gpu, stream=True, **f32)
            assert not _same(swapped, kept), "negative control: the block order must show in the bits"


@pytest.mark.gpu
def test_tile_sets_give_the_same_bits_on_gpu():
    """The shape classes may pick any tile set: on the GPU every set of one dtype gives the same bits (dw with
    four token chunks, so split and chunk-looping sets are compared too), and on Hopper the Mosaic GPU kernel
    (mosaic.py, which bfloat16 products use there) gives the Triton sets' bits."""
    from detjax.pallas_kernels.matmul import mosaic
    from detjax.pallas_kernels.matmul.kernel import TILE_SETS

    sets = dict(TILE_SETS)
    if mosaic.available():
        sets["mosaic"] = {"backend": "mosaic"}
    for dtype, prefix in ((jnp.bfloat16, ""), (jnp.float32, "f32_")):
        x, w, g = _inputs(4, 1000, 1024, 520, dtype)
        args = {"fwd": (x, w.astype(dtype)), "dx": (g.astype(dtype), w.astype(dtype)), "dw": (x, g.astype(dtype))}
        for kind, (a, b) in args.items():
            outs = [
                matmul_kernel(
                    a,
                    b,
                    kind=kind,
                    out_dtype=jnp.float32,
                    interpret=False,
                    sweep_tiles=tuple(sorted(dict(t, **({"r_chunk": 256} if kind == "dw" else {})).items())),
                )
                for name, t in sets.items()
                if name.startswith("f32_") == (prefix == "f32_")
            ]
            assert all(_same(o, outs[0]) for o in outs[1:]), (kind, dtype)


def test_matmul_replays_bit_exact():
    x, w, g = _inputs(2, 130, 64, 96)
    fn = jax.jit(lambda x, w: jax.value_and_grad(lambda x, w: jnp.sum(matmul(x, w, jnp.float32) * g), (0, 1))(x, w))
    assert_replays_bit_exact(fn, (x, w), replays=4)
    assert_replays_bit_exact(fn, (x, w), replays=3, contention=matmul_contention(256, 5))


def _fp8_operands(seed: int, m: int, k: int, n: int, integers: bool):
    """x (m, k) e4m3, w (k, n) e4m3, g (m, n) e5m2; `integers`: values in -3..3, so every float32 sum of
    their products is exact in any order and any two kernels must agree bit for bit."""
    ks = jax.random.split(jax.random.key(seed), 3)
    shapes = ((m, k, jnp.float8_e4m3fn), (k, n, jnp.float8_e4m3fn), (m, n, jnp.float8_e5m2))
    if integers:
        return [jax.random.randint(kk, s[:2], -3, 4).astype(s[2]) for kk, s in zip(ks, shapes, strict=True)]
    return [(4 * jax.random.normal(kk, s[:2])).astype(s[2]) for kk, s in zip(ks, shapes, strict=True)]


def test_fp8_mosaic_product_is_exact_and_scaled():
    """model.fp8's products through the Mosaic kernel (fp8 wgmma on Hopper; its interpreter on CPU) on
    small-integer fp8 values, whose sums are exact in any order: fwd, dx (e5m2 x e4m3) and dw (e4m3 x e5m2,
    over 2 token chunks and a part) equal the Triton kernel's and XLA's products byte for byte, with the
    dequantizing scale applied once before the rounding (on the GPU also at gpu_dense's MLP width). Negative
    control: another scale gives other bits."""
    from detjax.pallas_kernels.matmul.kernel import fp8_product

    interp = interpret_mode()
    shapes = [(2304, 64, 136)] + ([(8192, 1024, 4096)] if not interp else [])
    for m, k, n in shapes:
        x, w, g = _fp8_operands(3, m, k, n, integers=True)
        inv = jnp.float32(0.37)
        for kind, a, b, od, dims in (
            ("fwd", x, w, jnp.bfloat16, ((1,), (0,))),
            ("dx", g, w, jnp.bfloat16, ((1,), (1,))),
            ("dw", x, g, jnp.float32, ((0,), (0,))),
        ):
            got = fp8_product(a, b, inv, kind=kind, out_dtype=od, interpret=interp, backend="mosaic")
            tri = fp8_product(a, b, inv, kind=kind, out_dtype=od, interpret=interp, backend="triton")
            f32 = (a.astype(jnp.float32), b.astype(jnp.float32))
            xla = (jax.lax.dot_general(*f32, (dims, ((), ())), precision="highest") * inv).astype(od)
            assert _same(got, tri) and _same(got, xla), (kind, m, k, n)
            other = fp8_product(a, b, jnp.float32(0.38), kind=kind, out_dtype=od, interpret=interp, backend="mosaic")
            assert not _same(other, got), "negative control: the scale must change the bits"


@pytest.mark.gpu
def test_fp8_mosaic_product_replays_bit_exact_on_gpu():
    """The Mosaic fp8 products on general fp8 values (sums that round) and the quantization with its
    transposed copy: replays and replays under contention give the same bits, for each product and both the
    scaled and the chunked (dw) epilogue."""
    from detjax.pallas_kernels.matmul import mosaic
    from detjax.pallas_kernels.matmul.kernel import fp8_product
    from detjax.pallas_kernels.matmul.quantize import quantize_transposed

    if not mosaic.available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    x, w, g = _fp8_operands(5, 8192, 1024, 4096, integers=False)
    v = jax.random.normal(jax.random.key(6), (8192, 4096)).astype(jnp.bfloat16)

    def run(x, w, g, v):
        one = functools.partial(fp8_product, inv_scale=jnp.float32(0.37), interpret=False, backend="mosaic")
        return (
            one(x, w, kind="fwd", out_dtype=jnp.bfloat16),
            one(g, w, kind="dx", out_dtype=jnp.bfloat16),
            one(x, g, kind="dw", out_dtype=jnp.float32),
            *(a.view(jnp.uint8) for a in quantize_transposed(v, 9.0, dtype=jnp.float8_e5m2, interpret=False)[:2]),
            *(  # partial tiles and tiles past v (zero-padded, masked)
                a.view(jnp.uint8)
                for a in quantize_transposed(
                    v[:8188, :4000], 9.0, dtype=jnp.float8_e5m2, interpret=False, rows_to=4096, cols_to=256
                )[:2]
            ),
        )

    fn = jax.jit(run)
    assert_replays_bit_exact(fn, (x, w, g, v), replays=4)
    assert_replays_bit_exact(fn, (x, w, g, v), replays=3, contention=matmul_contention(2048, 5))


@pytest.mark.parametrize(
    "tile",
    [None, pytest.param({"block_m": 64, "block_n": 32, "num_warps": 4, "t32": True}, marks=pytest.mark.extended)],
    ids=["pinned", "64x32_t32"],  # other tiles: a sweep's candidates, run with -m extended
)
def test_fp8_quantize_transposed_matches_the_xla_quantization(tile, monkeypatch):
    """quantize.quantize_transposed (Triton on the GPU, the interpreter on CPU): q byte-equal to
    detjax.model.fp8's XLA quantization (clipping included), q^T its transpose, amax the exact max |v|, for a
    bf16 activation and a float32 weight; with the pinned tile and another, whose transposed copy is quantized
    from the float32 transpose ("t32"): no tile may change a bit.
    Negative control: another scale gives another q."""
    from detjax.model import fp8
    from detjax.pallas_kernels.matmul import quantize as qz

    quantize_transposed = qz.quantize_transposed
    if tile is not None:  # the traced function reads TILES: run it unjitted under the other tile
        monkeypatch.setitem(qz.TILES, "transposed", tile)
        monkeypatch.setitem(qz.TILES, "transposed_f32", tile)  # the float32 case's tile
        quantize_transposed = qz.quantize_transposed.__wrapped__
    interp = interpret_mode()
    ks = jax.random.split(jax.random.key(8), 2)
    cases = (
        (30 * jax.random.normal(ks[0], (256, 384))).astype(jnp.bfloat16),  # some |v| * scale beyond fmax: clipped
        jax.random.normal(ks[1], (384, 128)),
    )
    for v in cases:
        for dtype, s in ((fp8.E4M3, 40.0), (fp8.E5M2, 3000.0)):
            q, qt, amax = quantize_transposed(v, jnp.float32(s), dtype=dtype, interpret=interp)
            want = fp8._quantize(v, jnp.float32(s), dtype)
            assert q.dtype == dtype and _same(q.view(jnp.uint8), want.view(jnp.uint8)), (v.dtype, dtype)
            assert _same(qt.view(jnp.uint8), want.T.view(jnp.uint8))
            assert _same(amax, fp8._amax(v))
            other, _, _ = quantize_transposed(v, jnp.float32(s * 1.01), dtype=dtype, interpret=interp)
            assert not _same(other.view(jnp.uint8), q.view(jnp.uint8)), "negative control: the scale is used"
    # a shape of partial tiles, zero-padded to 256 x 384 (rows 2 tiles beyond v): q is the quantization of
    # v padded with zeros, and the amax v's alone (the values beyond v's edge are masked, never read as data)
    v = 30 * jax.random.normal(ks[0], (100, 260))
    q, qt, amax = quantize_transposed(v, jnp.float32(40.0), dtype=fp8.E4M3, interpret=interp, rows_to=256, cols_to=384)
    want = jnp.pad(fp8._quantize(v, jnp.float32(40.0), fp8.E4M3), ((0, 156), (0, 124)))
    assert q.shape == (256, 384) and _same(q.view(jnp.uint8), want.view(jnp.uint8))
    assert _same(qt.view(jnp.uint8), want.T.view(jnp.uint8)) and _same(amax, fp8._amax(v))
    # round_to: a float32 v rounded to bfloat16 in the kernel gives the bytes of quantizing v.astype(bfloat16)
    # (model.fp8's float32 cotangents), padding and amax included; without it the float32 values differ
    v = 3000 * jax.random.normal(ks[1], (100, 260))
    vb = v.astype(jnp.bfloat16)
    q, qt, amax = quantize_transposed(
        v, jnp.float32(1.0), dtype=fp8.E5M2, interpret=interp, rows_to=256, cols_to=384, round_to=jnp.bfloat16
    )
    want, want_t, want_amax = quantize_transposed(
        vb, jnp.float32(1.0), dtype=fp8.E5M2, interpret=interp, rows_to=256, cols_to=384
    )
    assert _same(q.view(jnp.uint8), want.view(jnp.uint8)) and _same(qt.view(jnp.uint8), want_t.view(jnp.uint8))
    assert _same(amax, want_amax) and _same(amax, fp8._amax(vb))
    unrounded = quantize_transposed(v, jnp.float32(1.0), dtype=fp8.E5M2, interpret=interp, rows_to=256, cols_to=384)
    assert not _same(unrounded[2], amax), "negative control: the float32 amax differs from the rounded one"
    # scale_index: the kernel reads one element of a scale set (the model hands it a projection's (s_x, s_w,
    # s_g), so that no slice of the set runs as a copy): the bytes of passing that element itself
    s3, v = jnp.array([7.0, 40.0, 3000.0], jnp.float32), cases[0]
    by_index = [quantize_transposed(v, s3, dtype=fp8.E5M2, interpret=interp, scale_index=i) for i in range(3)]
    for i, got in enumerate(by_index):
        want = quantize_transposed(v, s3[i], dtype=fp8.E5M2, interpret=interp)
        assert all(_same(a.view(jnp.uint8), b.view(jnp.uint8)) for a, b in zip(got[:2], want[:2], strict=True))
        assert _same(got[2], want[2])
    assert not _same(by_index[0][0].view(jnp.uint8), by_index[1][0].view(jnp.uint8)), "negative control: the index"
    with pytest.raises(ValueError, match="scale_index=3"):
        qz.quantize_transposed.__wrapped__(v, s3, dtype=fp8.E5M2, interpret=interp, scale_index=3)
    # amax_tiles: one amax per tile of the padded copy (the model reduces a product's amaxes together, amax_of),
    # whose maximum is the reduced amax's bytes
    q, _, tiles = quantize_transposed(
        cases[0][:100], jnp.float32(40.0), dtype=fp8.E4M3, interpret=interp, rows_to=256, amax_tiles=True
    )
    bm, bn = qz.TILES["transposed"]["block_m"], qz.TILES["transposed"]["block_n"]
    assert tiles.shape == (q.shape[0] // bm, q.shape[1] // bn) and tiles.dtype == jnp.float32
    assert _same(qz.amax_of(tiles), fp8._amax(cases[0][:100]).reshape(1))


@pytest.mark.parametrize(
    "tiles",
    [
        None,  # the pinned TILES; the others are a sweep's candidates, run with -m extended
        pytest.param(
            {
                "swiglu_fwd": {"block_m": 256, "block_n": 128, "num_warps": 8, "t32": True},
                "swiglu_bwd": {"block_m": 128, "block_n": 128, "num_warps": 8, "pair": False, "t32": True},
            },
            marks=pytest.mark.extended,
        ),
        pytest.param(
            {"swiglu_bwd": {"block_m": 64, "block_n": 128, "num_warps": 4, "pair": True, "t32": True}},
            marks=pytest.mark.extended,
        ),
    ],
    ids=["pinned", "other_tiles_t32", "pair_t32"],
)
def test_fp8_swiglu_quantization_kernels_match_xla(tiles, monkeypatch):
    """quantize.swiglu_quantize_transposed / swiglu_bwd_quantize_transposed (Triton on the GPU, the interpreter
    on CPU) on general bf16 values: q byte-equal to XLA's quantization of quantize.swiglu(gate, up) and of
    [dgate | dup] = quantize.swiglu_grads (float32, clipping included), q^T its transpose, amax the exact max;
    with the pinned tiles and with others (256-row forward tiles, the backward's one-program-per-half grid, and
    transposed copies quantized from the float32 transpose, "t32"), since no tile may change a bit. Negative
    control: a changed up tile changes h's bytes."""
    from detjax.model import fp8
    from detjax.pallas_kernels.matmul import quantize as qz

    swiglu, swiglu_grads = qz.swiglu, qz.swiglu_grads
    swiglu_quantize_transposed = qz.swiglu_quantize_transposed
    swiglu_bwd_quantize_transposed = qz.swiglu_bwd_quantize_transposed
    if tiles is not None:  # the traced functions read TILES: run them unjitted under the other tiles
        for key, value in tiles.items():
            monkeypatch.setitem(qz.TILES, key, value)
        swiglu_quantize_transposed = qz.swiglu_quantize_transposed.__wrapped__
        swiglu_bwd_quantize_transposed = qz.swiglu_bwd_quantize_transposed.__wrapped__

    interp = interpret_mode()
    ks = jax.random.split(jax.random.key(9), 2)
    m, f = 256, 512  # f a multiple of every tile's block_n, so the pinned tiles run (not the 128 fallback)
    y = (4 * jax.random.normal(ks[0], (m, 2 * f))).astype(jnp.bfloat16)
    dh = (3 * jax.random.normal(ks[1], (m, f))).astype(jnp.bfloat16)
    g, u = y[:, :f].astype(jnp.float32), y[:, f:].astype(jnp.float32)
    h = swiglu(g, u)
    q, qt, amax = swiglu_quantize_transposed(y, jnp.float32(30.0), dtype=fp8.E4M3, interpret=interp)
    want = fp8._quantize(h, jnp.float32(30.0), fp8.E4M3)  # some |h| * 30 beyond 448: clipped
    assert _same(q.view(jnp.uint8), want.view(jnp.uint8)) and _same(qt.view(jnp.uint8), want.T.view(jnp.uint8))
    assert _same(amax, jnp.max(jnp.abs(h)))
    dy = jnp.concatenate(swiglu_grads(g, u, dh.astype(jnp.float32)), axis=1)
    q, qt, amax = swiglu_bwd_quantize_transposed(y, dh, jnp.float32(3000.0), dtype=fp8.E5M2, interpret=interp)
    want = fp8._quantize(dy, jnp.float32(3000.0), fp8.E5M2)
    assert _same(q.view(jnp.uint8), want.view(jnp.uint8)) and _same(qt.view(jnp.uint8), want.T.view(jnp.uint8))
    assert _same(amax, jnp.max(jnp.abs(dy)))
    other, _, _ = swiglu_quantize_transposed(
        y.at[:128, f:].multiply(2), jnp.float32(30.0), dtype=fp8.E4M3, interpret=interp
    )
    assert not _same(
        other.view(jnp.uint8),
        swiglu_quantize_transposed(y, jnp.float32(30.0), dtype=fp8.E4M3, interpret=interp)[0].view(jnp.uint8),
    )
    # scale_index (as the model passes the scales): element i of a scale set gives that element's bytes
    s3 = jnp.array([30.0, 1.0, 3000.0], jnp.float32)
    fwd = swiglu_quantize_transposed(y, s3, dtype=fp8.E4M3, interpret=interp, scale_index=0)
    bwd = swiglu_bwd_quantize_transposed(y, dh, s3, dtype=fp8.E5M2, interpret=interp, scale_index=2)
    for got, want in (
        (fwd, swiglu_quantize_transposed(y, jnp.float32(30.0), dtype=fp8.E4M3, interpret=interp)),
        (bwd, swiglu_bwd_quantize_transposed(y, dh, jnp.float32(3000.0), dtype=fp8.E5M2, interpret=interp)),
    ):
        assert all(_same(a.view(jnp.uint8), b.view(jnp.uint8)) for a, b in zip(got[:2], want[:2], strict=True))
        assert _same(got[2], want[2])
    other = swiglu_quantize_transposed(y, s3, dtype=fp8.E4M3, interpret=interp, scale_index=1)[0]
    assert not _same(other.view(jnp.uint8), fwd[0].view(jnp.uint8)), "negative control: the index is read"
    # amax_tiles (as the model takes them): per-tile amaxes whose maximum is the reduced amax's bytes
    tiles_f = swiglu_quantize_transposed(y, s3, dtype=fp8.E4M3, interpret=interp, scale_index=0, amax_tiles=True)
    tiles_b = swiglu_bwd_quantize_transposed(
        y, dh, s3, dtype=fp8.E5M2, interpret=interp, scale_index=2, amax_tiles=True
    )
    assert tiles_f[2].size > 1 and tiles_b[2].size > 1
    assert _same(qz.amax_of(tiles_f[2], tiles_b[2]), jnp.stack([fwd[2], bwd[2]]))


def test_amax_of_reduces_each_part_exactly():
    """quantize.amax_of: parts of different sizes (a scalar amax, per-tile amaxes) reduced in one op give the
    bytes of each part's own jnp.max, with NaN kept and a part of zeros giving 0. Negative control:
    a larger value in one part changes that part's entry and no other."""
    from detjax.pallas_kernels.matmul.quantize import amax_of

    ks = jax.random.split(jax.random.key(3), 2)
    tiles = jnp.abs(jax.random.normal(ks[0], (4, 8)))
    small = jnp.abs(jax.random.normal(ks[1], (3,)))
    parts = (jnp.float32(0.25), tiles, small, jnp.zeros((2, 2)), jnp.array([1.0, jnp.nan]))
    want = jnp.stack([jnp.max(p) for p in parts])
    got = amax_of(*parts)
    assert got.shape == (5,) and _same(got, want) and bool(jnp.isnan(got[4]))
    bumped = amax_of(parts[0], tiles.at[1, 2].set(100.0), *parts[2:])
    assert not _same(bumped, got) and _same(jnp.delete(bumped, 1), jnp.delete(got, 1)), "negative control"


def test_fp8_ce_grad_kernel_matches_its_formula_and_replays():
    """quantize.ce_grad_quantize_transposed (the fp8 LM head's cross-entropy gradient, quantized in one pass;
    Triton on the GPU, the interpreter on CPU), on a shape of partial tiles padded to 384 x 512: q is the
    e5m2 quantization of quantize.ce_grad (dce * (softmax - onehot)) padded with zeros, q^T its transpose,
    amax max |ce_grad|. On CPU byte-equal to that XLA formula; on the GPU the kernel's exp is Triton's, so
    at most 1 % of the bytes may differ, each by one e5m2 step (adjacent codes). On every platform 20
    replays under matmul contention give the same bytes. Negative control: other row cotangents give
    another q."""
    from detjax.model import fp8
    from detjax.pallas_kernels.matmul import quantize as qz

    interp = interpret_mode()
    m, n = 300, 400
    ks = jax.random.split(jax.random.key(9), 3)
    logits = (4 * jax.random.normal(ks[0], (m, n))).astype(jnp.bfloat16)
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    t = jax.random.randint(ks[1], (m,), 0, n)
    dce = jax.random.normal(ks[2], (m,))

    def run(dce):
        return qz.ce_grad_quantize_transposed(
            logits, lse, t, dce, jnp.float32(3000.0), dtype=fp8.E5M2, interpret=interp, rows_to=384, cols_to=512
        )

    q, qt, amax = run(dce)
    d = qz.ce_grad(logits, lse, t, dce)
    want = jnp.pad(fp8._quantize(d, jnp.float32(3000.0), fp8.E5M2), ((0, 84), (0, 112)))
    assert q.shape == (384, 512) and _same(qt.view(jnp.uint8), q.T.view(jnp.uint8))
    got_u8, want_u8 = np.asarray(q.view(jnp.uint8)).astype(int), np.asarray(want.view(jnp.uint8)).astype(int)
    if jax.default_backend() == "cpu":
        assert np.array_equal(got_u8, want_u8) and _same(amax, fp8._amax(d))
    else:
        differ = got_u8 != want_u8
        assert differ.mean() <= 0.01 and np.abs(got_u8 - want_u8).max() <= 1, (
            differ.mean(),
            np.abs(got_u8 - want_u8).max(),
        )
        assert abs(float(amax) - float(fp8._amax(d))) <= 1e-5 * float(fp8._amax(d))
    assert_replays_bit_exact(jax.jit(run), (dce,), replays=20, contention=matmul_contention(256 if interp else 2048, 5))
    assert not _same(run(dce * 1.5)[0].view(jnp.uint8), q.view(jnp.uint8)), "negative control: dce is used"


def _with_acc(kind_tiles, x, g, acc):
    """(acc + dw, dw with acc) of matmul_kernel under the tile options `kind_tiles` (None: the pinned path)."""
    t = tuple(sorted(kind_tiles.items())) if kind_tiles else None
    run = functools.partial(matmul_kernel, kind="dw", out_dtype=jnp.float32, interpret=True, sweep_tiles=t)
    return acc + run(x, g), run(x, g, acc=acc)


def test_dw_adds_into_the_running_sum():
    """matmul_kernel's `acc` (the gradient accumulation fusion): acc + dw with the bits of adding them apart,
    on the Triton path and on the Mosaic kernel's in-place epilogue (interpreted; one loop, and token chunks),
    with an output that is not a whole number of tiles (the running sum is padded and cut). Negative control:
    one running-sum element moved by one ulp moves that output element only."""
    x, _, g = _inputs(11, 192, 64, 250)
    g = g.astype(jnp.bfloat16)
    acc = jax.random.normal(jax.random.key(12), (64, 250), jnp.float32) * 30
    for tiles in (None, {"backend": "mosaic", "r_chunk": 0}, {"backend": "mosaic", "r_chunk": 64}):
        want, got = _with_acc(tiles, x, g, acc)
        assert _same(got, want), tiles
    moved = acc.at[5, 7].set(jnp.nextafter(acc[5, 7], jnp.inf))
    _, got_moved = _with_acc({"backend": "mosaic", "r_chunk": 0}, x, g, moved)
    differ = np.argwhere(_bits(got_moved) != _bits(got))
    assert differ.tolist() == [[5, 7]]
    with pytest.raises(ValueError, match="float32 dw"):
        matmul_kernel(x, g, kind="fwd", out_dtype=jnp.float32, interpret=True, acc=acc)


def test_mosaic_dw_into_a_running_sum_lowers_for_cuda(monkeypatch):
    """The Mosaic kernel's in-place epilogue (acc_ref: each output piece loaded, added to and written back)
    goes through the Mosaic GPU lowering for CUDA (jax.export, no GPU), in both pipelines: the dense dw, and
    the experts' grouped dw whose sums are rounded to bf16 before the add (group_blocks, acc_round)."""
    from detjax.pallas_kernels.matmul import mosaic

    monkeypatch.setattr(mosaic, "_num_sms", lambda: 132)
    x, g = jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((512, 512), jnp.bfloat16)
    blocks = jnp.asarray([[0, 4], [4, 4]], jnp.int32)  # two groups of 4 blocks of 64 rows
    cases = {"dense": ({}, (256, 512)), "grouped": ({"group_blocks": blocks, "acc_round": jnp.bfloat16}, (512, 512))}
    for name, (kw, shape) in cases.items():
        for stream in (True, False):

            def into(x, g, acc, stream=stream, kw=kw):
                ref = jax.new_ref(acc)
                mosaic.mosaic_matmul(
                    x, g, kind="dw", out_dtype=jnp.float32, r_chunk=0, acc_ref=ref, stream=stream, **kw
                )
                return jax.freeze(ref)

            acc = jnp.zeros(shape, jnp.float32)
            text = jax.export.export(jax.jit(into), platforms=["cuda"])(x, g, acc).mlir_module()
            assert "mosaic_gpu" in text, (name, stream)


@pytest.mark.gpu
def test_dw_into_a_running_sum_on_gpu():
    """On the GPU, a weight large enough for the Mosaic kernel's one-loop dw (the gradient accumulation
    fusion's in-place epilogue): acc + dw byte-equal to adding them apart, and replayed byte-equal, quiet and
    under a GEMM stream."""
    from detjax.pallas_kernels.matmul.kernel import DW_UNCHUNKED_SIZE

    k, n = 4096, DW_UNCHUNKED_SIZE // 4096
    ks = jax.random.split(jax.random.key(21), 3)
    x = jax.random.normal(ks[0], (4096, k), jnp.bfloat16)
    g = jax.random.normal(ks[1], (4096, n), jnp.bfloat16)
    acc = jax.random.normal(ks[2], (k, n), jnp.float32) * 30
    run = functools.partial(matmul_kernel, kind="dw", out_dtype=jnp.float32, interpret=False)
    fused = jax.jit(lambda x, g, acc: run(x, g, acc=acc))
    assert _same(fused(x, g, acc), acc + jax.jit(run)(x, g))
    assert_replays_bit_exact(fused, (x, g, acc), replays=3)
    assert_replays_bit_exact(fused, (x, g, acc), replays=3, contention=matmul_contention(2048, 5))
