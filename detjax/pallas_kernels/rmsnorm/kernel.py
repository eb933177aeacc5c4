"""Fused RMSNorm forward and backward in Pallas.

Tiles (pinned, recorded in TILES; no autotuning): each program owns `rows` consecutive rows and walks them in
sub-blocks of `block_rows` rows (the whole feature dim in one block), in ascending order. A row's own sums
(its mean square, and the backward's mean of dxhat * xhat) are reduced inside one sub-block, so their order
depends on the pinned tile only. The weight gradient is reduced over rows without atomics -- "separate
writers in space, then order once": each program adds its sub-blocks' sums in ascending order into one
private slot (starting from +0), and a second kernel adds the slots in ascending order. Row counts that are
not a whole number of `rows` are padded with zero rows, which add exact zeros to the weight gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

# scripts/tile_sweep.py on the H200 (docs/BENCHMARKS.md). A change here changes bits (the row sums' and the
# weight gradient's reduction order): it is a new trajectory.
TILES = {
    "fwd": {"rows": 8, "block_rows": 8, "num_warps": 4, "num_stages": 1},
    "bwd": {"rows": 32, "block_rows": 8, "num_warps": 4, "num_stages": 2},
    "wgrad": {"block_cols": 32},
}
MIN_ROWS = 8  # the layers use the kernel for row counts that are multiples of this (see `fits`)


def _fwd_kernel(x_ref, w_ref, y_ref, rstd_ref, *, eps: float, br: int, nsub: int):
    w = w_ref[...].astype(jnp.float32)

    def body(s, carry):
        rows = pl.ds(pl.multiple_of(s * br, br), br)
        x = x_ref[rows, :].astype(jnp.float32)
        rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
        y_ref[rows, :] = (x * rstd * w).astype(y_ref.dtype)
        rstd_ref[rows, :] = rstd
        return carry

    jax.lax.fori_loop(0, nsub, body, 0)


def _bwd_kernel(x_ref, w_ref, rstd_ref, dy_ref, *refs, br: int, nsub: int, stream: bool):
    g_ref, dx_ref, dw_part_ref = refs if stream else (None, *refs)
    w = w_ref[...].astype(jnp.float32)

    def body(s, acc):
        rows = pl.ds(pl.multiple_of(s * br, br), br)
        x = x_ref[rows, :].astype(jnp.float32)
        rstd = rstd_ref[rows, :]
        dy = dy_ref[rows, :].astype(jnp.float32)
        xhat = x * rstd
        dxhat = dy * w
        dx = (rstd * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=1, keepdims=True))).astype(dx_ref.dtype)
        if stream:  # the stream's own cotangent, added as the residual add's transpose would add it
            dx = dx + g_ref[rows, :]
        dx_ref[rows, :] = dx
        return acc + jnp.sum(dy * xhat, axis=0, keepdims=True)

    # this program's private slot: its sub-blocks' sums in ascending order, from +0
    dw_part_ref[...] = jax.lax.fori_loop(0, nsub, body, jnp.zeros(dw_part_ref.shape, jnp.float32))


def _ordered_sum_kernel(part_ref, out_ref, *, n: int):
    # fixed ascending order over the slots (a loop, not an unrolled chain: n can be ~1000)
    acc = jax.lax.fori_loop(1, n, lambda i, acc: acc + part_ref[pl.ds(i, 1), :], part_ref[pl.ds(0, 1), :])
    out_ref[...] = acc


def fits(rows: int) -> bool:
    """Whether the layers take the kernel for `rows` rows (other row counts take the jnp path)."""
    return rows % MIN_ROWS == 0


def _tiles(which: str, d: int) -> tuple[int, int]:
    t = TILES[which]
    r, br = t["rows"], t["block_rows"]
    if d & (d - 1) or r % br:
        raise ValueError(f"rmsnorm kernel needs a power-of-two feature dim and rows % block_rows == 0; got d={d}, {t}")
    return r, br


def _pad_rows(x: jax.Array, mult: int) -> jax.Array:
    extra = -x.shape[0] % mult
    return jnp.pad(x, ((0, extra), (0, 0))) if extra else x


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "out_dtype"))
def rmsnorm_fwd(x_ND, w_D, *, eps: float, interpret: bool, out_dtype=None):
    """y = x * rsqrt(mean(x^2) + eps) * w (in `out_dtype`, default x's) and the row rstd (float32)."""
    n, d = x_ND.shape
    r, br = _tiles("fwd", d)
    xp = _pad_rows(x_ND, r)
    np_ = xp.shape[0]
    t = TILES["fwd"]
    y, rstd = pl.pallas_call(
        functools.partial(_fwd_kernel, eps=eps, br=br, nsub=r // br),
        grid=(np_ // r,),
        in_specs=[pl.BlockSpec((r, d), lambda i: (i, 0)), pl.BlockSpec((1, d), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((r, d), lambda i: (i, 0)), pl.BlockSpec((r, 1), lambda i: (i, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((np_, d), out_dtype or x_ND.dtype),
            jax.ShapeDtypeStruct((np_, 1), jnp.float32),
        ],
        name="rmsnorm_fwd",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(xp, w_D.reshape(1, d))
    return (y, rstd) if np_ == n else (y[:n], rstd[:n])


@functools.partial(jax.jit, static_argnames=("interpret",))
def rmsnorm_bwd(x_ND, w_D, rstd_N1, dy_ND, g_ND=None, *, interpret: bool):
    """dx (x's dtype) and dw (float32) of the forward above, for the incoming gradient dy. `g_ND` (x's shape
    and dtype): a cotangent x also receives from elsewhere -- the residual stream's, when x is the stream
    (ops.rmsnorm_stream) -- added to dx in the kernel, without a pass of its own: dx + g, the bytes of adding
    it afterwards where the compiler keeps dx's last product and the add apart (the H200's Triton does; the
    CPU's interpreted kernel may fuse them into an fma)."""
    n, d = x_ND.shape
    r, br = _tiles("bwd", d)
    if g_ND is not None and (g_ND.shape != x_ND.shape or g_ND.dtype != x_ND.dtype):
        got, want = f"{g_ND.shape} {g_ND.dtype}", f"{x_ND.shape} {x_ND.dtype}"
        raise ValueError(f"rmsnorm_bwd: g {got} must have x's shape and dtype {want}")
    xp, rp, dyp = _pad_rows(x_ND, r), _pad_rows(rstd_N1, r), _pad_rows(dy_ND, r)
    nb = xp.shape[0] // r
    t = TILES["bwd"]
    rows = pl.BlockSpec((r, d), lambda i: (i, 0))
    stream = () if g_ND is None else (_pad_rows(g_ND, r),)
    dx, parts = pl.pallas_call(
        functools.partial(_bwd_kernel, br=br, nsub=r // br, stream=g_ND is not None),
        grid=(nb,),
        in_specs=[rows, pl.BlockSpec((1, d), lambda i: (0, 0)), pl.BlockSpec((r, 1), lambda i: (i, 0)), rows]
        + [rows] * len(stream),
        out_specs=[rows, pl.BlockSpec((1, d), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(xp.shape, x_ND.dtype), jax.ShapeDtypeStruct((nb, d), jnp.float32)],
        name="rmsnorm_bwd",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(xp, w_D.reshape(1, d), rp, dyp, *stream)
    bd = min(d, TILES["wgrad"]["block_cols"])
    dw = pl.pallas_call(
        functools.partial(_ordered_sum_kernel, n=nb),
        grid=(d // bd,),
        in_specs=[pl.BlockSpec((nb, bd), lambda j: (0, j))],
        out_specs=pl.BlockSpec((1, bd), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, d), jnp.float32),
        name="rmsnorm_wgrad_ordered_sum",
        interpret=interpret,
    )(parts)
    return (dx if nb * r == n else dx[:n]), dw.reshape(d)
