"""rmsnorm(x, w): the fused Pallas RMSNorm with a custom_vjp whose weight gradient is reduced in fixed order.
rmsnorm_stream(x, w, a): (s, rmsnorm(s, w)) for a pre-norm residual block, whose stream s is both normed and
added to the block's output: s = x, or s = x + a with the previous block's output a added in the forward
kernel. Its backward adds the stream's cotangent to the norm's input gradient inside the kernel. Both adds
are the bytes of XLA's (the forward's exactly; the backward's up to the compiler contracting the kernel's
last product into an fma, which the H200's does not: docs/BENCHMARKS.md), without their passes.

`out_dtype` writes y in that dtype straight from the kernel's float32 result: the same bits as computing y in
x's dtype and casting afterwards, without the extra pass (the incoming gradient then arrives in out_dtype,
whose values the backward reads exactly)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def rmsnorm_stream(
    x_ND: jax.Array, w_D: jax.Array, a_ND: jax.Array | None = None, eps: float = 1e-5, out_dtype=None
) -> tuple[jax.Array, jax.Array]:
    """(s, rmsnorm(s, w)) for the residual stream s = x (a None) or s = x + a (a the previous block's output,
    widened to float32: that add done in the kernel). The caller adds this block's output to s, so s's
    cotangent reaches the backward, which adds it to the norm's dx in the kernel; a receives the same sum."""
    return _stream_fwd(x_ND, w_D, a_ND, eps, out_dtype)[0]


def _stream_fwd(x_ND, w_D, a_ND, eps, out_dtype):
    if a_ND is None:
        y, rstd = rmsnorm_fwd(x_ND, w_D, eps=eps, interpret=interpret_mode(), out_dtype=out_dtype)
        s_ND = x_ND
    else:
        y, rstd, s_ND = rmsnorm_fwd(x_ND, w_D, a_ND, eps=eps, interpret=interpret_mode(), out_dtype=out_dtype)
    return (s_ND, y), (s_ND, w_D, rstd, None if a_ND is None else jnp.zeros((0,), a_ND.dtype))


def _stream_bwd(eps, out_dtype, res, cts):
    s_ND, w_D, rstd, a_dtype = res
    g_ND, dy = cts
    dx, dw = rmsnorm_bwd(s_ND, w_D, rstd, dy, g_ND.astype(s_ND.dtype), interpret=interpret_mode())
    return dx, dw.astype(w_D.dtype), None if a_dtype is None else dx.astype(a_dtype.dtype)


rmsnorm_stream.defvjp(_stream_fwd, _stream_bwd)
