"""gated_norm(y, x, z, d, w): the Mamba2 mixer's gate and gated RMSNorm in the Pallas kernels of kernel.py,
with a custom_vjp whose weight gradients (the norm's scale w and the skip weight d, per column) are added
over tokens by a fixed tree (ordered.tree_sum) of the kernel's per-program partials."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.gated_norm.kernel import gated_norm_bwd, gated_norm_fwd
from detjax.pallas_kernels.ordered import tree_sum


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def gated_norm(y_ND, x_ND, z_NZ, d_D, w_D, eps: float = 1e-5, out_dtype=None, z_col: int = 0) -> jax.Array:
    """rmsnorm((y + d x) silu(z)) w over rows of width D (reference.gated_norm_ref), in out_dtype (default
    float32). y, x float32 (N, D); z any float dtype: columns z_col .. z_col + D of z_NZ (a multiple of D; the
    kernels read them in place, so z may be a block of a wider product's output, whose cotangent is then zero
    outside those columns); d, w (D,)."""
    return _fwd(y_ND, x_ND, z_NZ, d_D, w_D, eps, out_dtype, z_col)[0]


def _fwd(y_ND, x_ND, z_NZ, d_D, w_D, eps, out_dtype, z_col):
    out, rstd = gated_norm_fwd(
        y_ND, x_ND, z_NZ, d_D, w_D, eps=eps, interpret=interpret_mode(), out_dtype=out_dtype, z_col=z_col
    )
    return out, (y_ND, x_ND, z_NZ, d_D, w_D, rstd)


def _bwd(eps, out_dtype, z_col, res, do_ND):
    y_ND, x_ND, z_NZ, d_D, w_D, rstd = res
    dy, dz, dw_p, dd_p = gated_norm_bwd(
        y_ND, x_ND, z_NZ, d_D, w_D, rstd, do_ND, interpret=interpret_mode(), z_col=z_col
    )
    if dz.shape != z_NZ.shape:  # z's columns of a wider array
        dz = jnp.pad(dz, ((0, 0), (z_col, z_NZ.shape[1] - z_col - dz.shape[1])))
    dx = dy * d_D[None, :].astype(dy.dtype)  # the skip term's share of x's gradient
    dw, dd = (tree_sum(p, 0)[0] for p in (dw_p, dd_p))
    return dy, dx, dz, dd.astype(d_D.dtype), dw.astype(w_D.dtype)


gated_norm.defvjp(_fwd, _bwd)
