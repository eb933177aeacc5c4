"""grouped_matmul(x, w, group_sizes): rows sorted by expert times their expert's weight, float32 out; the
backward is a gmm against the transposed weights (dx) and a tgmm (dw), both fixed-order Pallas kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.gmm.kernel import gmm, tgmm


@jax.custom_vjp
def grouped_matmul(x_RK: jax.Array, w_EKN: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    return gmm(x_RK, w_EKN, group_sizes_E, out_dtype=jnp.float32, interpret=interpret_mode())


def _fwd(x_RK, w_EKN, group_sizes_E):
    return grouped_matmul(x_RK, w_EKN, group_sizes_E), (x_RK, w_EKN, group_sizes_E)


def _bwd(res, dy_RN):
    x_RK, w_EKN, gs_E = res
    dy = dy_RN.astype(x_RK.dtype)  # low-precision operands, float32 accumulation (as in the forward)
    dx = gmm(dy, jnp.swapaxes(w_EKN, 1, 2), gs_E, out_dtype=x_RK.dtype, interpret=interpret_mode())
    dw = tgmm(x_RK, dy, gs_E, out_dtype=w_EKN.dtype, interpret=interpret_mode())
    return dx, dw, None


grouped_matmul.defvjp(_fwd, _bwd)
