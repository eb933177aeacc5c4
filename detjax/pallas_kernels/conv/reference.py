"""Oracle and forward for the causal depthwise convolution and SiLU of the Mamba2 mixer (channels last), the
formula of model.mamba2.causal_conv then silu: b first, then the shifted products in ascending k."""

import jax
import jax.numpy as jnp


def conv_silu_ref(x_BLC: jax.Array, w_WC: jax.Array, b_C: jax.Array) -> jax.Array:
    x = x_BLC.astype(jnp.float32)
    width, length = w_WC.shape[0], x.shape[1]
    xpad = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
    out = jnp.broadcast_to(b_C.astype(jnp.float32).reshape(1, 1, -1), x.shape)
    for k in range(width):
        out = out + xpad[:, k : k + length] * w_WC[k].astype(jnp.float32).reshape(1, 1, -1)
    return jax.nn.silu(out)
