"""conv_silu(x, w, b): silu(causal depthwise conv of x) (channels last, float32 out); the forward is XLA's
(reference.conv_silu_ref, the mixer's own formula), the backward the Pallas kernel (kernel.py), whose dw and db
partials are added by a fixed tree."""

from __future__ import annotations

import jax

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.conv.kernel import conv_silu_bwd
from detjax.pallas_kernels.conv.reference import conv_silu_ref
from detjax.pallas_kernels.ordered import tree_sum


@jax.custom_vjp
def conv_silu(x_BLC: jax.Array, w_WC: jax.Array, b_C: jax.Array) -> jax.Array:
    return conv_silu_ref(x_BLC, w_WC, b_C)


def _fwd(x_BLC, w_WC, b_C):
    return conv_silu_ref(x_BLC, w_WC, b_C), (x_BLC, w_WC, b_C)


def _bwd(res, ds_BLC):
    x_BLC, w_WC, b_C = res
    dx, dw_p, db_p = conv_silu_bwd(x_BLC, w_WC, b_C, ds_BLC, interpret=interpret_mode())
    tiles = dw_p.shape[0] * dw_p.shape[1]
    dw = tree_sum(dw_p.reshape(tiles, *dw_p.shape[2:]), 0)[0]
    db = tree_sum(db_p.reshape(tiles, -1), 0)[0]
    return dx, dw.astype(w_WC.dtype), db.astype(b_C.dtype)


conv_silu.defvjp(_fwd, _bwd)
