"""rmsnorm(x, w): the fused Pallas RMSNorm with a custom_vjp whose weight gradient is reduced in fixed order.

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
