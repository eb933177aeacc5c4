"""The experts' grouped products on Hopper, bf16 or fp8: wgmma through the Mosaic GPU kernel of
detjax.pallas_kernels.matmul.mosaic, on rows laid out in groups padded to whole tiles.

Layout. Rows come sorted by expert (group e: sorted rows S_e .. S_e + g_e - 1). Each group is copied to
its own run of GROUP_ROWS-row tiles, zero rows after its last (`padded_layout`; a group with no rows still
gets one tile, of zeros). The padded array has a static row count, an upper bound for any group sizes:
ceil(R / GROUP_ROWS) + E tiles; the tiles past the last group are zeros. So no tile mixes two experts:
- gmm (the forward, and dx): each row tile multiplies one expert's weight (mosaic `tile_groups`);
- tgmm (dw): expert e's weight gradient reduces the transposed copies' columns of its own tiles, in
  ascending blocks of block_r tokens (128 fp8, 64 bf16) from the group's first row (mosaic `group_blocks`).
  The order is fixed by the group's own rows: other groups' sizes move where its rows sit, never how they are
  added (the rule of the Triton tgmm, gmm/kernel.py).
The zero rows add +0 to the float32 sums (the products of finite values with 0 are 0), and the outputs of
padding rows are dropped when the real rows are gathered back. The copies in and out are row gathers:
data movement only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.matmul import mosaic

GROUP_ROWS = 2 * mosaic.TILE  # one row tile of the "nt" product (mosaic.cta_tile("nt")[0])
BLOCK = 128  # fp8 reduction block (mosaic.block_r of a one-byte type); GROUP_ROWS is a multiple of it and of bf16's 64


class GroupLayout(NamedTuple):
    pos_R: jax.Array  # int32 (R,): the padded row of each sorted row
    src_P: jax.Array  # int32 (P,): the sorted row each padded row copies (clamped; see valid_P)
    valid_P: jax.Array  # bool (P,): whether the padded row holds a row (False: a zero row)
    tile_groups: jax.Array  # int32 (P / GROUP_ROWS,): the expert of each row tile
    group_blocks: jax.Array  # int32 (2, E): first block and number of blocks of each group (blocks of `block` rows)


def padded_rows(rows: int, n_groups: int) -> int:
    """The static padded row count for `rows` sorted rows in `n_groups` groups."""
    return (-(-rows // GROUP_ROWS) + n_groups) * GROUP_ROWS


def _count_at_or_below(edges_E: jax.Array, v: jax.Array) -> jax.Array:
    """For each v, how many of the E edges are <= v, as int32: searchsorted(edges, v, side="right") for sorted
    edges, formed as one compare-and-count over (len(v), E) that XLA fuses into one elementwise pass (E is the
    expert count, small) instead of a binary search's loop."""
    return jnp.sum((edges_E[None, :] <= v[:, None]).astype(jnp.int32), axis=1)


def padded_layout(gs_E: jax.Array, rows: int, block: int = BLOCK) -> GroupLayout:
    """Integer bookkeeping of the padded layout for group sizes gs_E summing to at most `rows`; group_blocks
    counts in blocks of `block` rows (the dw product's block_r: BLOCK for fp8, 64 for bf16)."""
    gs = gs_E.astype(jnp.int32)
    e = gs.shape[0]
    tiles_E = jnp.maximum(1, -(-gs // GROUP_ROWS))
    pstart_E = jnp.cumsum(tiles_E * GROUP_ROWS) - tiles_E * GROUP_ROWS
    end_E = jnp.cumsum(gs)
    start_E = end_E - gs
    r_idx = jnp.arange(rows, dtype=jnp.int32)
    expert_R = jnp.minimum(_count_at_or_below(end_E, r_idx), e - 1)
    pos_R = r_idx - start_E[expert_R] + pstart_E[expert_R]
    p = padded_rows(rows, e)
    tile_start = jnp.arange(p // GROUP_ROWS, dtype=jnp.int32) * GROUP_ROWS
    tile_groups = jnp.minimum(_count_at_or_below(pstart_E, tile_start) - 1, e - 1)
    p_idx = jnp.arange(p, dtype=jnp.int32)
    tile_of = tile_groups[p_idx // GROUP_ROWS]
    offset = p_idx - pstart_E[tile_of]
    valid_P = offset < gs[tile_of]
    src_P = jnp.minimum(start_E[tile_of] + offset, rows - 1)
    blocks = jnp.stack([pstart_E // block, tiles_E * (GROUP_ROWS // block)]).astype(jnp.int32)
    return GroupLayout(pos_R, src_P, valid_P, tile_groups, blocks)


def to_padded(x_RK: jax.Array, lay: GroupLayout) -> jax.Array:
    """The sorted rows copied into the padded layout (zeros elsewhere)."""
    return jnp.where(lay.valid_P[:, None], jnp.take(x_RK, lay.src_P, axis=0), jnp.zeros((), x_RK.dtype))


def from_padded(y_PN: jax.Array, lay: GroupLayout) -> jax.Array:
    """The rows of the padded layout that hold sorted rows, back in sorted order."""
    return jnp.take(y_PN, lay.pos_R, axis=0)


def _scale_args(inv_scale, dtype) -> tuple[tuple, dict]:
    """fp8: the dequantizing scale (applied in the epilogue) and one wgmma kept in flight; bf16: neither."""
    if inv_scale is None:
        return (), {}
    if not mosaic.is_fp8(dtype):
        raise ValueError("grouped Mosaic products: a dequantizing scale is for fp8 operands")
    return (jnp.asarray(inv_scale, jnp.float32).reshape(1),), {"delay": mosaic.FP8_DELAY}


def grouped_nt(x_PK, w_ENK, lay: GroupLayout, inv_scale=None, *, out_dtype, interpret: bool) -> jax.Array:
    """(x @ w[expert]^T, float32 sums) [* inv_scale] per padded row tile -> (P, N) in out_dtype. x (P, K) in
    the padded layout, w (E, N, K), both with K contiguous: fp8 with inv_scale, or bf16 without (the gmm
    forward with w's transposed copy; dx with w itself)."""
    scale, knobs = _scale_args(inv_scale, x_PK.dtype)
    return mosaic.mosaic_matmul(
        x_PK,
        w_ENK,
        *scale,
        kind="nt",
        out_dtype=out_dtype,
        r_chunk=0,
        interpret=interpret,
        tile_groups=lay.tile_groups,
        **knobs,
    )


def grouped_tnt(x_KP, g_NP, lay: GroupLayout, inv_scale=None, *, interpret: bool) -> jax.Array:
    """dw[e] = (x_e^T-copy @ g_e^T-copy^T, float32 sums over group e's padded rows in ascending order)
    [* inv_scale] -> (E, K, N) float32, from the transposed copies x^T (K, P) and g^T (N, P); `lay` counts
    group_blocks in the operands' block_r."""
    e = lay.group_blocks.shape[1]
    k, n = x_KP.shape[0], g_NP.shape[0]
    scale, knobs = _scale_args(inv_scale, x_KP.dtype)
    out = mosaic.mosaic_matmul(
        x_KP,
        g_NP,
        *scale,
        kind="nt",
        out_dtype=jnp.float32,
        r_chunk=0,
        interpret=interpret,
        group_blocks=lay.group_blocks,
        **knobs,
    )
    return out.reshape(e, k, n)


def grouped_dw(x_PK, g_PN, lay: GroupLayout, *, interpret: bool, acc=None) -> jax.Array:
    """bf16 dw[e] = x_e^T g_e (float32 sums over group e's padded rows in ascending blocks of 64) -> (E, K, N)
    float32, reading x and g as stored (the "dw" product reads x through a transposed shared-memory view), so
    without grouped_tnt's transposed copies; the same reduction order. `lay` counts group_blocks in 64-row
    blocks (mosaic.block_r of bf16). Needs dw_usable(K, N).
    `acc` (float32 (E, K, N)): a running sum; the result is then acc + dw rounded to x's dtype, added in the
    kernel's epilogue (mosaic_matmul's acc_ref and acc_round): the bits of
    `acc + dw.astype(x_PK.dtype).astype(float32)` without a pass over dw."""
    e = lay.group_blocks.shape[1]
    k, n = x_PK.shape[1], g_PN.shape[1]
    into = {}
    if acc is not None:
        if acc.shape != (e, k, n) or acc.dtype != jnp.float32:
            raise ValueError(f"grouped dw: running sum {acc.shape} {acc.dtype}, want float32 {(e, k, n)}")
        into = {"acc_ref": jax.new_ref(acc.reshape(e * k, n)), "acc_round": x_PK.dtype}
    out = mosaic.mosaic_matmul(
        x_PK,
        g_PN,
        kind="dw",
        out_dtype=jnp.float32,
        r_chunk=0,
        interpret=interpret,
        group_blocks=lay.group_blocks,
        **into,
    )
    return (jax.freeze(into["acc_ref"]) if into else out).reshape(e, k, n)


def dw_usable(k: int, n: int, dtype) -> bool:
    """Whether grouped_dw takes an expert weight (K, N): bf16 operands (fp8 wgmma reads no transposed view) and
    whole "dw" output tiles, cta_tile("dw") = 128 x 256 of (K, N)."""
    rows, cols = mosaic.cta_tile("dw")
    return jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and k % rows == 0 and n % cols == 0


def usable(k: int, n: int) -> bool:
    """Whether an expert weight (K, N) has the whole tiles the grouped Mosaic products need: dw's output
    tiles are GROUP_ROWS x 128 of (K, N); the forward's and dx's are 128 columns wide and reduce N or K in
    128-element blocks."""
    return k % GROUP_ROWS == 0 and n % BLOCK == 0
