"""RoPE's backward for the attention block's fused q/k/v product, in one pass.

The block's q, k and v come out of one product over the concatenated weights, y = [q | k | v] (tokens,
(H + 2K) Q), and RoPE rotates q and k. The backward hands that product the cotangent of y: RoPE's backward
on dq and dk, beside dv. XLA ran it as one fusion that recomputed the angles' cos and sin per element
(`loop_add_fusion_114`, 2.26 ms of gpu_dense's step at 35 us a call: docs/benchmarks-history.md set 30). This
kernel reads dq, dk and dv once, with cos and sin from a (L, Q/2) table, and writes
- dy in the compute dtype (`rope_grad_concat`: the bf16 product's incoming gradient), or
- dy's fp8 copies in both layouts and its amax (`rope_grad_quantize_transposed`: the fp8 product's
  quantized gradient, quantize.quantize_transposed's outputs), so that dy is never written in bf16.

Grid: one program per (row tile, column tile) of dy; a column tile lies in dq, dk or dv (whole heads), and
a row tile in one sequence (its positions are contiguous). Bits: elementwise -- per element two float32
products and a sum, rounded to the compute dtype (reference.rope_grad, the operations of XLA's autodiff of
reference.rope), then in the fp8 variant quantize.quantize's function of that rounded value. No reduction
but the amax, a maximum: no tile changes a bit. Against XLA's backward, dy is within one step of the
compute dtype: XLA contracts some products and sums into one fma where the kernel rounds them apart (on the
CPU 4 of 262,144 elements differ, tests/test_pallas.py; on the H200 fewer than 0.1 %). So it is a new
trajectory of the Pallas path, and deterministic like the old one. The fp8 variant is byte-equal to
quantizing the bf16 variant's output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params
from detjax.pallas_kernels.matmul.quantize import _tiles_call, quantize
from detjax.pallas_kernels.rope.reference import rope_grad

# Speed only (elementwise: no tile changes a bit). block_n holds whole heads; block_m divides the sequence.
# `python3 scripts/tile_sweep.py --kernels rope` on the H200 (docs/benchmarks-history.md set 31): the e5m2 variant
# 19.6 us a call at gpu_dense's shape (128 x 128, 8 warps: 26.9); the bf16 variant 14.5-15.5 us with every tile.
TILES = {"block_m": 32, "block_n": 128, "num_warps": 4}


def fits(tokens: int, length: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel's tiles fit: rows in whole tiles of whole sequences, heads in whole column tiles."""
    bm, bn = TILES["block_m"], TILES["block_n"]
    return (
        head_dim % 2 == 0
        and bn % head_dim == 0
        and length % bm == 0
        and tokens % length == 0
        and (heads * head_dim) % bn == 0
        and (kv_heads * head_dim) % bn == 0
    )


def _check(dq, dk, dv, length: int, head_dim: int) -> tuple[int, int, int]:
    m = dq.shape[0]
    heads, kv_heads = dq.shape[1] // head_dim, dk.shape[1] // head_dim
    if dk.shape != dv.shape or dk.shape[0] != m or not fits(m, length, heads, kv_heads, head_dim):
        raise ValueError(
            f"rope backward: dq {dq.shape}, dk {dk.shape}, dv {dv.shape} (length {length}, head_dim {head_dim})"
            " do not fit the kernel's tiles (rope.kernel.fits)"
        )
    bn = TILES["block_n"]
    return m, dq.shape[1] // bn, dk.shape[1] // bn


def _pieces(dq_ref, dk_ref, dv_ref, cos_ref, sin_ref, *, nq: int, nk: int, head_dim: int, length: int, write):
    """Calls write([(column offset, values), ...]) once with this program's tile of dy in pieces: the rotated
    head halves (block_m, head_dim / 2) of a dq or dk tile, or dv's whole tile; float32 values already
    rounded to dq's dtype."""
    j = pl.program_id(1)
    bm, bn = dq_ref.shape
    half = head_dim // 2
    dtype = dq_ref.dtype
    p0 = pl.multiple_of((pl.program_id(0) * bm) % length, bm)  # the tile's first position in its sequence

    def rotated(ref):
        c, s = cos_ref[pl.ds(p0, bm), :], sin_ref[pl.ds(p0, bm), :]
        pieces = []
        for h in range(bn // head_dim):
            d1 = ref[:, pl.ds(h * head_dim, half)].astype(jnp.float32)
            d2 = ref[:, pl.ds(h * head_dim + half, half)].astype(jnp.float32)
            x1, x2 = rope_grad(d1, d2, c, s)
            pieces += [(h * head_dim, x1.astype(dtype).astype(jnp.float32))]
            pieces += [(h * head_dim + half, x2.astype(dtype).astype(jnp.float32))]
        write(pieces)

    @pl.when(j < nq)
    def _():
        rotated(dq_ref)

    @pl.when((j >= nq) & (j < nq + nk))
    def _():
        rotated(dk_ref)

    @pl.when(j >= nq + nk)
    def _():
        write([(0, dv_ref[...].astype(jnp.float32))])


def _in_specs(nq: int, nk: int, length: int, head_dim: int) -> list:
    """dq's, dk's and dv's tiles, each block index clamped into its own array (a program reads only the one
    its column tile lies in: _pieces), and the two whole tables."""
    bm, bn = TILES["block_m"], TILES["block_n"]
    table = pl.BlockSpec((length, head_dim // 2), lambda i, j: (0, 0))
    return [
        pl.BlockSpec((bm, bn), lambda i, j: (i, jnp.minimum(j, nq - 1))),
        pl.BlockSpec((bm, bn), lambda i, j: (i, jnp.clip(j - nq, 0, nk - 1))),
        pl.BlockSpec((bm, bn), lambda i, j: (i, jnp.clip(j - nq - nk, 0, nk - 1))),
        table,
        table,
    ]


def _concat_kernel(dq_ref, dk_ref, dv_ref, cos_ref, sin_ref, out_ref, **kw):
    def write(pieces):
        for col, v in pieces:
            out_ref[:, pl.ds(col, v.shape[1])] = v.astype(out_ref.dtype)

    _pieces(dq_ref, dk_ref, dv_ref, cos_ref, sin_ref, write=write, **kw)


@functools.partial(jax.jit, static_argnames=("length", "head_dim", "interpret"))
def rope_grad_concat(dq, dk, dv, cos, sin, *, length: int, head_dim: int, interpret: bool):
    """dy = [rope backward of dq | of dk | dv] (m, (H + 2K) Q) in dq's dtype, for dq (m, H Q), dk and dv
    (m, K Q) (token-major: row r is position r mod length), cos and sin (length, Q / 2) (reference.tables)."""
    m, nq, nk = _check(dq, dk, dv, length, head_dim)
    bm, bn = TILES["block_m"], TILES["block_n"]
    kw = {"nq": nq, "nk": nk, "head_dim": head_dim, "length": length}
    return pl.pallas_call(
        functools.partial(_concat_kernel, **kw),
        grid=(m // bm, nq + 2 * nk),
        in_specs=_in_specs(nq, nk, length, head_dim),
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, (nq + 2 * nk) * bn), dq.dtype),
        name="rope_grad_concat",
        interpret=interpret,
        compiler_params=triton_params(TILES["num_warps"], 1, interpret),
    )(dq, dk, dv, cos, sin)


def _quantize_kernel(dq_ref, dk_ref, dv_ref, cos_ref, sin_ref, s_ref, q_ref, qt_ref, amax_ref, **kw):
    def write(pieces):
        for col, v in pieces:
            q = quantize(v, s_ref[0], q_ref.dtype)
            q_ref[:, pl.ds(col, v.shape[1])] = q
            qt_ref[pl.ds(col, v.shape[1]), :] = q.T
        amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(v)) for _, v in pieces])
        amax_ref[...] = jnp.broadcast_to(amax, (1, 1))

    _pieces(dq_ref, dk_ref, dv_ref, cos_ref, sin_ref, write=write, **kw)


@functools.partial(jax.jit, static_argnames=("length", "head_dim", "dtype", "interpret", "scale_index", "amax_tiles"))
def rope_grad_quantize_transposed(
    dq,
    dk,
    dv,
    cos,
    sin,
    scale,
    *,
    length: int,
    head_dim: int,
    dtype,
    interpret: bool,
    scale_index: int | None = None,
    amax_tiles: bool = False,
):
    """(q, q^T, amax) of dy = rope_grad_concat(dq, dk, dv, cos, sin): q = dtype(clip(dy * scale)) (m, (H + 2K)
    Q), its transpose, and max |dy| (float32) -- quantize.quantize_transposed(dy, scale) without dy in
    memory. No padding: the shapes are whole tiles (fits), as the fp8 product's are where it is used.
    `scale_index`: scale is a scale set and the kernel reads this element of it (quantize.scale_input).
    `amax_tiles`: the amax unreduced, one per tile (quantize.amax_of reduces it)."""
    m, nq, nk = _check(dq, dk, dv, length, head_dim)
    bm, bn = TILES["block_m"], TILES["block_n"]
    kw = {"nq": nq, "nk": nk, "head_dim": head_dim, "length": length}
    tile = (bm, bn, TILES["num_warps"])
    specs = _in_specs(nq, nk, length, head_dim)
    kernel = functools.partial(_quantize_kernel, **kw)
    shape = (m, (nq + 2 * nk) * bn)
    head = (kernel, "fp8_rope_grad_quantize", specs, shape, tile, dtype, interpret)
    return _tiles_call(*head, dq, dk, dv, cos, sin, scale=scale, scale_index=scale_index, amax_tiles=amax_tiles)
