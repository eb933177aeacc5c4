"""rmsnorm(x, w): the fused Pallas RMSNorm with a custom_vjp whose weight gradient is reduced in fixed order.
rmsnorm_stream(x, w): (x, rmsnorm(x, w)) for a pre-norm residual block, whose stream x is both normed and
added to the block's output; its backward adds the stream's cotangent to the norm's input gradient inside the
kernel, without that pass: XLA's bytes up to the compiler contracting the kernel's last product and the add
into an fma (the H200's does not: 0 of 33.5 M elements differ, docs/benchmarks-history.md set 32; the CPU's
interpreted kernel may, one rounding apart).

`out_dtype` writes y in that dtype straight from the kernel's float32 result: the same bits as computing y in
x's dtype and casting afterwards, without the extra pass (the incoming gradient then arrives in out_dtype,
whose values the backward reads exactly)."""

from __future__ import annotations

import functools

import jax

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.rmsnorm.kernel import rmsnorm_bwd, rmsnorm_fwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rmsnorm(x_ND: jax.Array, w_D: jax.Array, eps: float = 1e-5, out_dtype=None) -> jax.Array:
    return rmsnorm_fwd(x_ND, w_D, eps=eps, interpret=interpret_mode(), out_dtype=out_dtype)[0]


def _fwd(x_ND, w_D, eps, out_dtype):
    y, rstd = rmsnorm_fwd(x_ND, w_D, eps=eps, interpret=interpret_mode(), out_dtype=out_dtype)
    return y, (x_ND, w_D, rstd)


def _bwd(eps, out_dtype, res, dy):
    x_ND, w_D, rstd = res
    dx, dw = rmsnorm_bwd(x_ND, w_D, rstd, dy, interpret=interpret_mode())
    return dx, dw.astype(w_D.dtype)


rmsnorm.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rmsnorm_stream(x_ND: jax.Array, w_D: jax.Array, eps: float = 1e-5, out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """(x, rmsnorm(x, w)): the stream passed through beside its norm. The caller adds the block's output to
    the first, so the stream's cotangent reaches the backward, which adds it to the norm's dx in the kernel."""
    return x_ND, rmsnorm(x_ND, w_D, eps, out_dtype)


def _stream_fwd(x_ND, w_D, eps, out_dtype):
    y, rstd = rmsnorm_fwd(x_ND, w_D, eps=eps, interpret=interpret_mode(), out_dtype=out_dtype)
    return (x_ND, y), (x_ND, w_D, rstd)


def _stream_bwd(eps, out_dtype, res, cts):
    x_ND, w_D, rstd = res
    g_ND, dy = cts
    dx, dw = rmsnorm_bwd(x_ND, w_D, rstd, dy, g_ND.astype(x_ND.dtype), interpret=interpret_mode())
    return dx, dw.astype(w_D.dtype)


rmsnorm_stream.defvjp(_stream_fwd, _stream_bwd)
