"""conv_silu(x, w, b): silu(causal depthwise conv of x) (channels last, float32 out); the forward is XLA's
(reference.conv_silu_ref, the mixer's own formula), the backward the Pallas kernel (kernel.py), whose dw and db
partials are added by a fixed tree."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.conv.kernel import conv_silu_bwd
from detjax.pallas_kernels.conv.reference import conv_silu_ref
from detjax.pallas_kernels.ordered import tree_sum


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def conv_silu(x_BLX: jax.Array, w_WC: jax.Array, b_C: jax.Array, col0: int = 0) -> jax.Array:
    """silu(causal_conv(x, w, b)) of x = channels col0 .. col0 + C of x_BLX (all of it by default; a block of a
    wider product's output, col0 a multiple of kernel.TILES["block_channels"], is read in place by the backward
    kernel and gets a cotangent that is zero outside those channels)."""
    return _fwd(x_BLX, w_WC, b_C, col0)[0]


def _fwd(x_BLX, w_WC, b_C, col0):
    return conv_silu_ref(x_BLX[..., col0 : col0 + b_C.shape[0]], w_WC, b_C), (x_BLX, w_WC, b_C)


def _bwd(col0, res, ds_BLC):
    x_BLX, w_WC, b_C = res
    dx, dw_p, db_p = conv_silu_bwd(x_BLX, w_WC, b_C, ds_BLC, interpret=interpret_mode(), col0=col0)
    if dx.shape != x_BLX.shape:  # x's channels of a wider array
        dx = jnp.pad(dx, ((0, 0), (0, 0), (col0, x_BLX.shape[2] - col0 - dx.shape[2])))
    tiles = dw_p.shape[0] * dw_p.shape[1]
    dw = tree_sum(dw_p.reshape(tiles, *dw_p.shape[2:]), 0)[0]
    db = tree_sum(db_p.reshape(tiles, -1), 0)[0]
    return dx, dw.astype(w_WC.dtype), db.astype(b_C.dtype)


conv_silu.defvjp(_fwd, _bwd)
