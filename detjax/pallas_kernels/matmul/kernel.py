"""Dense matmul in Pallas with pinned tiles: one kernel for y = x @ w and both backward products.

out[i, j] = sum over the reduction dim R of a[i, r] * b[r, j], where a and b may be read transposed:
- "fwd": y  = x  @ w     a = x  (M, K),           b = w  (K, N)
- "dx":  dx = dy @ w^T   a = dy (M, N),           b = w  (K, N) read transposed
- "dw":  dw = x^T @ dy   a = x  (M, K) read transposed, b = dy (M, N)
One program per (bm x bn) output tile reduces R by ONE ascending loop over blocks of block_r,
accumulating in float32 -- no stream-K, no atomics, one writer per output element. The weight gradient dw
(R = tokens) of a weight with fewer than DW_UNCHUNKED_SIZE elements follows one more fixed rule: tokens are
taken in chunks of `dw_row_chunk(k, n)` rows (2048 for weights of at most 2**20 elements, else 4096: a
function of the weight's shape, never of M); each chunk is reduced by the
ascending loop and the chunk sums are added in ascending chunk order. A tile set either runs that chunk
loop inside one program, or ("split") gives each (chunk, tile) its own program and adds the float32 chunk
sums afterwards in the same order -- the same operations in the same order, so the choice changes speed,
never bits. Splitting is how small dw outputs
(attention o: 1024 x 1024) fill the GPU's 132 SMs without a reduction order that depends on the shape.

Batch invariance by construction: the tile set of every call comes from `tile_set(kind, dtype, weight
shape)` -- never from the row count M or a run-time measurement --, every set of one dtype reduces in the
same order, and every operand is zero-padded to whole tiles and chunks. An output element therefore sees
the same reduction order whatever the rows or columns around it and wherever it sits: rows of x[:m] @ w
equal the same rows of x @ w bit for bit, and zero rows appended to the reduction (masked tokens) add exact
zeros (a float32 sum that starts at +0 is never -0, so adding +0 leaves it unchanged).
tests/test_matmul.py checks both properties, on CPU and on the GPU.

The tile sets and shape classes were chosen offline by scripts/gemm_bench.py --sweep on the H200 (table
and command in docs/BENCHMARKS.md), never at run time. float32 operands (the MoE router) are multiplied as
IEEE float32 (no TF32).

On Hopper, bfloat16 products of weights of at least MOSAIC_MIN_SIZE elements run the same rule in a Mosaic GPU
kernel instead (mosaic.py, `use_mosaic`): the same bits, faster on large weights. model.fp8's products of
weights of at least MOSAIC_FP8_MIN_SIZE elements run that kernel with fp8 wgmma (`fp8_nt`), by the same rule
with 128-element reduction blocks.

Speed (H200, `python3 scripts/gemm_bench.py --rounds 3`, docs/benchmarks-history.md set 16): over every
projection shape of gpu_dense / gpu_medium, weighted by use, 0.989 / 0.989 x the speed of XLA's autotuned
GEMMs (median of three passes, all of them 0.974 or more), where the Triton kernel alone gave 0.935 / 0.942.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params
from detjax.pallas_kernels.matmul import mosaic

DW_UNCHUNKED_SIZE = 1 << 23  # weights with this many elements or more: dw in one loop (enough tiles already)


def dw_row_chunk(k: int, n: int) -> int:
    """Tokens per chunk of the weight-gradient reduction of a (k, n) weight (0: one loop, no chunks). Weights
    of at most 2**20 elements fill the GPU with 2048-row chunks; larger ones are faster with 4096 (fewer
    float32 partial sums to write and add; sweep in docs/benchmarks-history.md set 15)."""
    size = k * n
    return 0 if size >= DW_UNCHUNKED_SIZE else 2048 if size <= 1 << 20 else 4096


# Named tile sets: bm x bn output tile, block_r reduction block, Triton warps and pipeline stages, and for
# dw whether each token chunk gets its own program ("split"). Every bfloat16 set reduces in blocks of 64
# and every float32 set in IEEE float32 FMAs, and dw always in dw_row_chunk's chunks, so the tile set changes
# speed, never bits (checked on the H200 for every set: scripts/gemm_bench.py --tile-bits and
# tests/test_matmul.py::test_tile_sets_give_the_same_bits_on_gpu).
TILE_SETS: dict[str, dict[str, int]] = {
    "128x256": {"bm": 128, "bn": 256, "block_r": 64, "num_warps": 8, "num_stages": 3},
    "128x256s4": {"bm": 128, "bn": 256, "block_r": 64, "num_warps": 8, "num_stages": 4},
    "128x128w8": {"bm": 128, "bn": 128, "block_r": 64, "num_warps": 8, "num_stages": 3},
    "64x128": {"bm": 64, "bn": 128, "block_r": 64, "num_warps": 4, "num_stages": 4},
    "128x256 split": {"bm": 128, "bn": 256, "block_r": 64, "num_warps": 8, "num_stages": 3, "split": 1},
    "128x128w8 split": {"bm": 128, "bn": 128, "block_r": 64, "num_warps": 8, "num_stages": 3, "split": 1},
    "f32_16x16": {"bm": 16, "bn": 16, "block_r": 64, "num_warps": 2, "num_stages": 3},
    "f32_64x64": {"bm": 64, "bn": 64, "block_r": 16, "num_warps": 4, "num_stages": 2},
    "f32_16x16 split": {"bm": 16, "bn": 16, "block_r": 64, "num_warps": 2, "num_stages": 3, "split": 1},
}


def tile_set(kind: str, dtype, k: int, n: int) -> str:
    """The pinned tile set for a product with weight shape (k, n). The shape class depends on the weight
    alone -- never on the number of rows M -- and follows the offline sweep (docs/BENCHMARKS.md)."""
    name = "bfloat16" if mosaic.is_fp8(dtype) else jnp.dtype(dtype).name  # fp8: the bf16 tiles (not swept for fp8)
    if name == "float32":
        return {"fwd": "f32_16x16", "dx": "f32_64x64", "dw": "f32_16x16 split"}[kind]
    if name != "bfloat16":
        raise ValueError(f"no pinned matmul tiles for {name} operands; use bfloat16 or float32")
    if kind == "fwd":
        return "128x256" if n >= 8192 else "64x128" if n <= 128 else "128x256s4" if k >= 2048 else "128x128w8"
    if kind == "dx":
        return "128x128w8" if n <= 128 else "128x256s4"
    # dw (K x N output): small outputs split the token chunks over programs to fill the SMs
    size = k * n
    return "128x256" if size >= DW_UNCHUNKED_SIZE else "128x256 split" if size <= 1 << 21 else "128x128w8 split"


def _mm_kernel(a_ref, b_ref, o_ref, *, br: int, nr: int, chunk: int, trans_a: bool, trans_b: bool, precision):
    """One output tile: R reduced in blocks of br, ascending; with chunk < nr blocks, in chunks of `chunk`
    blocks whose sums are added in ascending chunk order (the dw rule, see dw_row_chunk)."""
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))

    def body(r, acc):
        blk = pl.ds(pl.multiple_of(r * br, br), br)
        a = a_ref[blk, :] if trans_a else a_ref[:, blk]
        b = b_ref[:, blk] if trans_b else b_ref[blk, :]
        if a.dtype != b.dtype:  # e5m2 x e4m3 (fp8 backward): Pallas' Triton dot takes one element type, so both
            a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)  # go to bf16 -- exactly (fewer bits than bf16)
        return acc + jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)

    def chunk_sum(c):
        return jax.lax.fori_loop(c * chunk, c * chunk + chunk, body, jnp.zeros(o_ref.shape, jnp.float32))

    if chunk >= nr:
        acc = jax.lax.fori_loop(0, nr, body, jnp.zeros(o_ref.shape, jnp.float32))
    else:  # the first chunk's sum starts the total (no 0 + x), later chunks are added in order
        acc = jax.lax.fori_loop(1, nr // chunk, lambda c, tot: tot + chunk_sum(c), chunk_sum(0))
    o_ref[...] = acc.astype(o_ref.dtype)


MOSAIC_MIN_SIZE = 1 << 22  # weights with this many elements or more: the Mosaic GPU kernel on Hopper


def use_mosaic(a_dtype, b_dtype, k: int, n: int, interpret: bool) -> bool:
    """Whether the product of a (k, n) weight runs the Mosaic GPU kernel (mosaic.py): bfloat16 operands on a
    Hopper GPU and a weight of at least MOSAIC_MIN_SIZE elements, where it was as fast as the Triton kernel or
    faster (up to 1.17 x: the LM head); smaller weights, float32 and fp8 products and other devices run the
    Triton kernel. Both kernels give the same bits (byte-equal on the H200 for every product of gpu_dense and
    gpu_medium, docs/benchmarks-history.md set 16), so this choice, like the tile set, changes speed, never bits."""
    return not interpret and a_dtype == b_dtype == jnp.bfloat16 and k * n >= MOSAIC_MIN_SIZE and mosaic.available()


def _mosaic_product(a, b, *, kind, out_dtype, k_w, n_w, m, n, r, t, interpret, acc=None):
    """kind's product through mosaic.mosaic_matmul: the same reduction rule as the Triton path (one
    ascending loop of 64-row blocks per output tile; dw of weights under DW_UNCHUNKED_SIZE elements in
    dw_row_chunk chunks whose float32 sums are added in ascending order here). `acc` (dw): acc + the product,
    added in the kernel's epilogue in place (a Ref of acc, padded to whole tiles where it is not) when dw
    runs in one loop, else added to the chunks' sum here."""
    trans_a, trans_b = kind == "dw", kind == "dx"
    chunk_rows = t.get("r_chunk", dw_row_chunk(k_w, n_w)) if kind == "dw" else 0
    r_chunk = chunk_rows if 0 < chunk_rows < r else 0
    r_mult = r_chunk or mosaic.block_r(a.dtype)
    cm, cn = mosaic.cta_tile(kind)
    a = _pad_to(a, (r_mult, cm) if trans_a else (cm, r_mult))
    b = _pad_to(b, (cn, r_mult) if trans_b else (r_mult, cn))
    knobs = {"stages": t.get("stages", mosaic.STAGES), "interpret": interpret}
    if acc is not None and not r_chunk:
        ref = jax.new_ref(_pad_to(acc, (cm, cn)))
        mosaic.mosaic_matmul(a, b, kind=kind, out_dtype=out_dtype, r_chunk=0, acc_ref=ref, **knobs)
        out = jax.freeze(ref)
        return out[:m, :n] if out.shape != (m, n) else out
    out = mosaic.mosaic_matmul(a, b, kind=kind, out_dtype=out_dtype, r_chunk=r_chunk, **knobs)
    if r_chunk:
        out = _add_in_order(out).astype(out_dtype)
    out = out[:m, :n] if out.shape != (m, n) else out
    return out if acc is None else acc + out


MOSAIC_FP8_MIN_SIZE = 1 << 20  # fp8 products of weights with this many elements or more: Mosaic on Hopper


def use_mosaic_fp8(a_dtype, b_dtype, k: int, n: int, interpret: bool) -> bool:
    """Whether an fp8 product of a (k, n) weight runs the Mosaic GPU kernel (fp8_nt): fp8 operands on a
    Hopper GPU, a weight of at least MOSAIC_FP8_MIN_SIZE elements (the smallest measured, 1024 x 1024, ran
    2.2 x faster there than in the Triton kernel), and an e5m2 x e4m3 pair only where this jax's wgmma takes
    it (mosaic.mixed_fp8). Like use_mosaic, a function of dtypes, shapes, device and jax version: the
    choice changes speed and bits together, never between two runs of one setup."""
    if interpret or not (mosaic.is_fp8(a_dtype) and mosaic.is_fp8(b_dtype)) or k * n < MOSAIC_FP8_MIN_SIZE:
        return False
    return mosaic.available() and (a_dtype == b_dtype or mosaic.mixed_fp8())


@functools.partial(jax.jit, static_argnames=("out_dtype", "r_chunk", "interpret"))
def fp8_nt(lhs, rhs, inv_scale, *, out_dtype, r_chunk: int, interpret: bool):
    """(lhs @ rhs^T, float32 sums) * inv_scale rounded to out_dtype, for fp8 lhs (m, R) and rhs (n, R) -- the
    layout Hopper's fp8 wgmma reads -- through the Mosaic GPU kernel: one ascending loop of 128-element
    blocks of R per output tile, the scale applied in the kernel's epilogue (no float32 output array).
    r_chunk > 0 (a weight gradient, R = tokens): R in chunks of r_chunk rows, each chunk's float32 sums
    added in ascending order, then scaled -- the dw rule of the bf16 products (dw_row_chunk)."""
    m, n, r = lhs.shape[0], rhs.shape[0], lhs.shape[1]
    r_chunk = r_chunk if 0 < r_chunk < r else 0
    cm, cn = mosaic.cta_tile("nt")
    r_mult = r_chunk or mosaic.block_r(lhs.dtype)
    lhs, rhs = _pad_to(lhs, (cm, r_mult)), _pad_to(rhs, (cn, r_mult))
    inv_scale = jnp.asarray(inv_scale, jnp.float32)
    knobs = {"delay": mosaic.FP8_DELAY}
    if r_chunk:
        parts = mosaic.mosaic_matmul(
            lhs, rhs, kind="nt", out_dtype=jnp.float32, r_chunk=r_chunk, interpret=interpret, **knobs
        )
        out = (_add_in_order(parts) * inv_scale).astype(out_dtype)
    else:
        out = mosaic.mosaic_matmul(
            lhs, rhs, inv_scale.reshape(1), kind="nt", out_dtype=out_dtype, r_chunk=0, interpret=interpret, **knobs
        )
    return out[:m, :n] if out.shape != (m, n) else out


@functools.partial(jax.jit, static_argnames=("kind", "out_dtype", "interpret", "backend"))
def fp8_product(a, b, inv_scale, *, kind: str, out_dtype, interpret: bool, backend: str | None = None):
    """(kind's product of fp8 a and b, float32 sums) * inv_scale, rounded to out_dtype, from operands in the
    bf16 kinds' layouts. "triton": matmul_kernel's float32 sums, scaled by XLA. "mosaic": the operands laid
    out for fp8_nt by XLA transposes (fwd transposes the weight, dw both activations), then fp8_nt with the
    dw token chunks of dw_row_chunk. Both multiply the float32 sum by inv_scale once and round once. The
    model calls fp8_nt itself on the Mosaic path, with the transposed copies made while quantizing
    (quantize.quantize_transposed; detjax.model.fp8); this function is the path's reference for the tests
    and scripts/gemm_bench.py. backend None: use_mosaic_fp8 decides."""
    k_w, n_w = {"fwd": (b.shape[0], b.shape[1]), "dx": b.shape, "dw": (a.shape[1], b.shape[1])}[kind]
    if backend is None:
        backend = "mosaic" if use_mosaic_fp8(a.dtype, b.dtype, k_w, n_w, interpret) else "triton"
    inv_scale = jnp.asarray(inv_scale, jnp.float32)
    if backend != "mosaic":
        out = matmul_kernel(a, b, kind=kind, out_dtype=jnp.float32, interpret=interpret)
        return (out * inv_scale).astype(out_dtype)
    lhs, rhs = {"fwd": (a, b.T), "dx": (a, b), "dw": (a.T, b.T)}[kind]
    r_chunk = dw_row_chunk(k_w, n_w) if kind == "dw" else 0
    return fp8_nt(lhs, rhs, inv_scale, out_dtype=out_dtype, r_chunk=r_chunk, interpret=interpret)


def _add_in_order(parts: jax.Array) -> jax.Array:
    """((parts[0] + parts[1]) + parts[2]) + ...: the dw rule's ascending sum of float32 chunk sums."""
    acc = parts[0]
    for c in range(1, parts.shape[0]):
        acc = acc + parts[c]
    return acc


def _pad_to(x: jax.Array, mult: tuple[int, int]) -> jax.Array:
    pads = [(0, -d % m) for d, m in zip(x.shape, mult, strict=True)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


@functools.partial(jax.jit, static_argnames=("kind", "out_dtype", "interpret", "sweep_tiles"))
def matmul_kernel(a, b, *, kind: str, out_dtype, interpret: bool, sweep_tiles: tuple | None = None, acc=None):
    """The product named by `kind` (see the module docstring); a and b share one dtype, or are both fp8
    (e4m3 / e5m2: model.fp8's products, float32 accumulation).

    `acc` (float32 dw only, the output's shape): returns acc + the product, one float32 add per element after
    the product's own sum (so the bits of adding them apart). The Mosaic kernel adds it in its epilogue when
    dw runs in one loop (weights of DW_UNCHUNKED_SIZE elements or more): the gradient accumulation fusion of
    detjax.step, which then needs no pass of its own over the weight gradient; elsewhere XLA adds it.

    `sweep_tiles` (sorted (name, value) pairs) replaces the pinned tiles: for the offline sweep in
    scripts/gemm_bench.py and the tests only (they may also set `r_chunk`, or `backend`: "mosaic" / "triton"
    to force one kernel); the model never passes it."""
    if a.dtype != b.dtype and not (mosaic.is_fp8(a.dtype) and mosaic.is_fp8(b.dtype)):
        raise ValueError(f"matmul operands must share a dtype (or both be fp8), got {a.dtype} and {b.dtype}")
    trans_a, trans_b = kind == "dw", kind == "dx"
    k_w, n_w = {"fwd": (b.shape[0], b.shape[1]), "dx": b.shape, "dw": (a.shape[1], b.shape[1])}[kind]
    t = dict(sweep_tiles) if sweep_tiles else TILE_SETS[tile_set(kind, a.dtype, k_w, n_w)]
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    r = a.shape[0] if trans_a else a.shape[1]
    if acc is not None and (
        kind != "dw" or jnp.float32 != jnp.dtype(out_dtype) or acc.dtype != jnp.float32 or acc.shape != (m, n)
    ):
        raise ValueError(f"matmul {kind}: acc is for float32 dw products, a float32 sum of the output's shape {(m, n)}")
    if t.get("backend", "mosaic" if use_mosaic(a.dtype, b.dtype, k_w, n_w, interpret) else "triton") == "mosaic":
        return _mosaic_product(
            a, b, kind=kind, out_dtype=out_dtype, k_w=k_w, n_w=n_w, m=m, n=n, r=r, t=t, interpret=interpret, acc=acc
        )
    if acc is not None:
        return acc + matmul_kernel(a, b, kind=kind, out_dtype=out_dtype, interpret=interpret, sweep_tiles=sweep_tiles)
    bm, bn, br = t["bm"], t["bn"], t["block_r"]
    # dw reduces over tokens: in chunks of dw_row_chunk rows once there is more than one (rows padded with
    # zeros to whole chunks, which add exact zeros), except for weights of DW_UNCHUNKED_SIZE elements or
    # more; fwd and dx reduce over a weight dim in one loop
    chunk_rows = t.get("r_chunk", dw_row_chunk(k_w, n_w)) if kind == "dw" else 0
    if chunk_rows % br:
        raise ValueError(f"r_chunk {chunk_rows} is not a multiple of block_r {br}")
    r_chunk = chunk_rows if 0 < chunk_rows < r else 0
    r_mult = r_chunk or br
    a = _pad_to(a, (r_mult, bm) if trans_a else (bm, r_mult))
    b = _pad_to(b, (bn, r_mult) if trans_b else (r_mult, bn))
    r = a.shape[0] if trans_a else a.shape[1]
    mp = a.shape[1] if trans_a else a.shape[0]
    np_ = b.shape[0] if trans_b else b.shape[1]
    n_chunks = r // r_chunk if r_chunk else 1
    # float32 operands: IEEE products (HIGHEST), unless the tile set asks for TF32 (Triton's default, HIGH)
    precision = (
        None if a.dtype != jnp.float32 else (jax.lax.Precision.HIGH if t.get("tf32") else jax.lax.Precision.HIGHEST)
    )
    kernel = functools.partial(_mm_kernel, br=br, trans_a=trans_a, trans_b=trans_b, precision=precision)
    params = triton_params(t["num_warps"], t["num_stages"], interpret)
    if t.get("split") and n_chunks > 1:
        # one program per (chunk, output tile) writes the chunk's float32 sum; the sums are then added in
        # ascending chunk order -- the same operations, in the same order, as the in-kernel chunk loop
        mt = mp // bm
        parts = pl.pallas_call(
            functools.partial(kernel, nr=r_chunk // br, chunk=r_chunk // br),
            grid=(n_chunks, mt, np_ // bn),
            in_specs=[
                pl.BlockSpec((r_chunk, bm), lambda c, i, j: (c, i)),
                pl.BlockSpec((r_chunk, bn), lambda c, i, j: (c, j)),
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda c, i, j: (c * mt + i, j)),
            out_shape=jax.ShapeDtypeStruct((n_chunks * mp, np_), jnp.float32),
            name=f"matmul_{kind}_split",
            interpret=interpret,
            compiler_params=params,
        )(a, b).reshape(n_chunks, mp, np_)
        out = _add_in_order(parts).astype(out_dtype)
    else:
        out = pl.pallas_call(
            functools.partial(kernel, nr=r // br, chunk=(r_chunk or r) // br),
            grid=(mp // bm, np_ // bn),
            in_specs=[
                pl.BlockSpec((r, bm), lambda i, j: (0, i)) if trans_a else pl.BlockSpec((bm, r), lambda i, j: (i, 0)),
                pl.BlockSpec((bn, r), lambda i, j: (j, 0)) if trans_b else pl.BlockSpec((r, bn), lambda i, j: (0, j)),
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
            name=f"matmul_{kind}",
            interpret=interpret,
            compiler_params=params,
        )(a, b)
    return out[:m, :n] if (mp, np_) != (m, n) else out
