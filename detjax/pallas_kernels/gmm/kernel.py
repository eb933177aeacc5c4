"""MoE grouped matmuls in Pallas: gmm (rows sorted by expert times that expert's weight) and tgmm (the
weight gradient: per expert, its rows' x^T dy).

Rows are sorted by expert; group e owns rows [off[e], off[e+1]). Offsets travel as a vector; a program
reads the numbers it needs by masked sums (no scalar prefetch on the Triton backend).
- gmm: one program per (row tile, output-column tile). It computes its tile once for every expert whose
  group meets the tile and stores, per row, the result of that row's own expert (a masked store, not a sum;
  rows past the last group get zeros), so each output element is written once.
  Each output element is one dot over K, accumulated over K tiles in ascending order: no reduction
  across rows, no atomics.
- tgmm: one program per (expert, K tile, N tile) owns dW[e] for its tile and walks the group's rows in
  ascending tiles *aligned to the group's first row* (rows past the group's end, or past the last row, are
  loaded as zeros by masked loads). The token reduction order is therefore fixed by the group's own rows
  alone: it does not change when other groups grow or shrink, which a tiling aligned to global row positions
  would not guarantee.
Tiles (pinned in TILES, no autotuning): block_m rows; K and N tiles are the largest of
block_k (tgmm: tgmm_block_k) / block_n, 64, 32, 16 dividing the dimension; tgmm's warps are pinned apart
from gmm's too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from detjax.pallas_kernels.backend import triton_params

# gmm's K tile 64: on an H100 at gpu_medium's experts 0.143 against 0.164 ms with 128, with the same bytes in
# that sweep; tgmm keeps 128 (0.116 against 0.141 ms with 64). scripts/tile_sweep.py --kernels gmm,
# docs/BENCHMARKS.md
TILES = {
    "block_m": 64,
    "block_k": 64,
    "block_n": 128,
    "num_warps": 4,
    "num_stages": 3,
    "tgmm_block_k": 128,
    "tgmm_num_warps": 4,
}


def _tile(dim: int, largest: int) -> int:
    for t in (largest, 64, 32, 16):
        if t <= largest and dim % t == 0:
            return t
    raise ValueError(f"grouped matmul dims must be multiples of 16; got {dim}")


def _pick(vec_1E, e):
    """vec[e] for a traced scalar e, as a masked sum over a (1, E) vector (exact: one nonzero term)."""
    idx = jax.lax.broadcasted_iota(jnp.int32, vec_1E.shape, 1)
    return jnp.sum(jnp.where(idx == e, vec_1E, 0))


def _gmm_kernel(x_ref, w_ref, ends_ref, o_ref, *, bm: int, bk: int, nk: int, n_groups: int):
    i = pl.program_id(0)
    ends = ends_ref[...]  # (1, E): exclusive end row of each group
    first, last = i * bm, i * bm + bm - 1
    e_lo = jnp.sum((ends <= first).astype(jnp.int32))  # the group holding the tile's first row
    e_hi = jnp.minimum(jnp.sum((ends <= last).astype(jnp.int32)), n_groups - 1)
    rows = jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0) + first

    def per_expert(e, carry):
        def per_k(kk, acc):
            xk = x_ref[:, pl.ds(kk * bk, bk)]
            wk = w_ref[e, pl.ds(kk * bk, bk), :]
            return acc + jnp.dot(xk, wk, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, nk, per_k, jnp.zeros(o_ref.shape, jnp.float32))
        start = jnp.where(e > 0, _pick(ends, e - 1), 0)
        mine = (rows >= start) & (rows < _pick(ends, e))  # each row is its own expert's once
        plt.store(o_ref, acc.astype(o_ref.dtype), mask=jnp.broadcast_to(mine, o_ref.shape))
        return carry

    jax.lax.fori_loop(e_lo, e_hi + 1, per_expert, 0)
    past = jnp.broadcast_to(rows >= _pick(ends, n_groups - 1), o_ref.shape)  # no group's rows: zeros
    plt.store(o_ref, jnp.zeros(o_ref.shape, o_ref.dtype), mask=past)


def _tgmm_kernel(x_ref, dy_ref, ends_ref, o_ref, *, bm: int):
    e = pl.program_id(0)
    ends = ends_ref[...]
    start = jnp.where(e > 0, _pick(ends, e - 1), 0)
    end = _pick(ends, e)
    n_tiles = (end - start + bm - 1) // bm
    local = jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)

    def body(t, acc):
        r0 = start + t * bm
        keep = (local + r0) < end
        xs = plt.load(x_ref.at[pl.ds(r0, bm), :], mask=jnp.broadcast_to(keep, (bm, x_ref.shape[1])), other=0)
        dys = plt.load(dy_ref.at[pl.ds(r0, bm), :], mask=jnp.broadcast_to(keep, (bm, dy_ref.shape[1])), other=0)
        return acc + jnp.dot(xs.T, dys, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, n_tiles, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def group_ends(group_sizes_E: jax.Array) -> jax.Array:
    """(1, E') exclusive group ends, padded with empty groups to a power of two (Triton vector sizes)."""
    ends = jnp.cumsum(group_sizes_E.astype(jnp.int32))
    e = ends.shape[0]
    width = 1 << (e - 1).bit_length()
    return jnp.pad(ends, (0, width - e), mode="edge").reshape(1, width)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def gmm(x_RK, w_EKN, group_sizes_E, *, out_dtype, interpret: bool):
    """out[r] = x[r] @ w[expert of r]; rows beyond sum(group_sizes) come out zero."""
    r, k = x_RK.shape
    e, _, n = w_EKN.shape
    bm, bk, bn = TILES["block_m"], _tile(k, TILES["block_k"]), _tile(n, TILES["block_n"])
    rp = -(-r // bm) * bm
    x = jnp.pad(x_RK, ((0, rp - r), (0, 0)))
    ends = group_ends(group_sizes_E)
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, bm=bm, bk=bk, nk=k // bk, n_groups=e),
        grid=(rp // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((e, k, bn), lambda i, j: (0, 0, j)),
            pl.BlockSpec((1, ends.shape[1]), lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rp, n), out_dtype),
        name="gmm",
        interpret=interpret,
        compiler_params=triton_params(TILES["num_warps"], TILES["num_stages"], interpret),
    )(x, w_EKN, ends)
    return out[:r]


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def tgmm(x_RK, dy_RN, group_sizes_E, *, out_dtype, interpret: bool):
    """dw[e] = sum over the rows r of group e, in ascending order, of x[r]^T dy[r] -> (E, K, N)."""
    r, k = x_RK.shape
    n = dy_RN.shape[1]
    e = group_sizes_E.shape[0]
    bm, bk, bn = TILES["block_m"], _tile(k, TILES["tgmm_block_k"]), _tile(n, TILES["block_n"])
    # a group's last tile may reach past the last row: those rows are masked off in the kernel, so x and dy
    # go in unpadded (no copy of either before the kernel)
    ends = group_ends(group_sizes_E)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, bm=bm),
        grid=(e, k // bk, n // bn),
        in_specs=[
            pl.BlockSpec((r, bk), lambda g, i, j: (0, i)),
            pl.BlockSpec((r, bn), lambda g, i, j: (0, j)),
            pl.BlockSpec((1, ends.shape[1]), lambda g, i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((e, k, n), out_dtype),
        name="tgmm",
        interpret=interpret,
        compiler_params=triton_params(TILES["tgmm_num_warps"], TILES["num_stages"], interpret),
    )(x_RK, dy_RN, ends)
