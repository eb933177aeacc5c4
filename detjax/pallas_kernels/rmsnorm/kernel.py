"""Fused RMSNorm forward and backward in Pallas.

Tiles (pinned, recorded in TILES; no autotuning): BLOCK_ROWS rows per program, the whole feature dim in
one block. The weight gradient is reduced over rows without atomics — "separate writers in space, then
order once": each program writes its block's partial sum to a private slot, and a second kernel adds the
slots in ascending order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

TILES = {"block_rows": 8, "num_warps": 4}  # scripts/tile_sweep.py on the H200 (docs/BENCHMARKS.md)


def _fwd_kernel(x_ref, w_ref, y_ref, rstd_ref, *, eps: float):
    x = x_ref[...].astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
    y_ref[...] = (x * rstd * w_ref[...].astype(jnp.float32)).astype(y_ref.dtype)
    rstd_ref[...] = rstd


def _bwd_kernel(x_ref, w_ref, rstd_ref, dy_ref, dx_ref, dw_part_ref):
    x = x_ref[...].astype(jnp.float32)
    rstd = rstd_ref[...]
    dy = dy_ref[...].astype(jnp.float32)
    xhat = x * rstd
    dxhat = dy * w_ref[...].astype(jnp.float32)
    dx = rstd * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=1, keepdims=True))
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dw_part_ref[...] = jnp.sum(dy * xhat, axis=0, keepdims=True)  # this program's private slot


def _ordered_sum_kernel(part_ref, out_ref, *, n: int):
    # fixed ascending order over the slots (a loop, not an unrolled chain: n can be ~1000)
    acc = jax.lax.fori_loop(1, n, lambda i, acc: acc + part_ref[pl.ds(i, 1), :], part_ref[pl.ds(0, 1), :])
    out_ref[...] = acc


def fits(rows: int) -> bool:
    """Whether `rows` is a whole number of the kernel's row blocks (other row counts take the jnp path)."""
    return rows % TILES["block_rows"] == 0


def _check(n: int, d: int) -> int:
    br = TILES["block_rows"]
    if n % br or d & (d - 1):
        raise ValueError(f"rmsnorm kernel needs rows % {br} == 0 and a power-of-two feature dim; got ({n}, {d})")
    return br


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rmsnorm_fwd(x_ND, w_D, *, eps: float, interpret: bool):
    n, d = x_ND.shape
    br = _check(n, d)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, eps=eps),
        grid=(n // br,),
        in_specs=[pl.BlockSpec((br, d), lambda i: (i, 0)), pl.BlockSpec((1, d), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((br, d), lambda i: (i, 0)), pl.BlockSpec((br, 1), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, d), x_ND.dtype), jax.ShapeDtypeStruct((n, 1), jnp.float32)],
        name="rmsnorm_fwd",
        interpret=interpret,
        compiler_params=triton_params(TILES["num_warps"], 1, interpret),
    )(x_ND, w_D.reshape(1, d))


@functools.partial(jax.jit, static_argnames=("interpret",))
def rmsnorm_bwd(x_ND, w_D, rstd_N1, dy_ND, *, interpret: bool):
    n, d = x_ND.shape
    br = _check(n, d)
    nb = n // br
    dx, parts = pl.pallas_call(
        _bwd_kernel,
        grid=(nb,),
        in_specs=[
            pl.BlockSpec((br, d), lambda i: (i, 0)),
            pl.BlockSpec((1, d), lambda i: (0, 0)),
            pl.BlockSpec((br, 1), lambda i: (i, 0)),
            pl.BlockSpec((br, d), lambda i: (i, 0)),
        ],
        out_specs=[pl.BlockSpec((br, d), lambda i: (i, 0)), pl.BlockSpec((1, d), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((n, d), x_ND.dtype), jax.ShapeDtypeStruct((nb, d), jnp.float32)],
        name="rmsnorm_bwd",
        interpret=interpret,
        compiler_params=triton_params(TILES["num_warps"], 1, interpret),
    )(x_ND, w_D.reshape(1, d), rstd_N1, dy_ND)
    bd = min(d, 128)
    dw = pl.pallas_call(
        functools.partial(_ordered_sum_kernel, n=nb),
        grid=(d // bd,),
        in_specs=[pl.BlockSpec((nb, bd), lambda j: (0, j))],
        out_specs=pl.BlockSpec((1, bd), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, d), jnp.float32),
        name="rmsnorm_wgrad_ordered_sum",
        interpret=interpret,
    )(parts)
    return dx, dw.reshape(d)
