"""Plain-jnp RMSNorm: the oracle for the Pallas kernel (float32 math)."""

import jax
import jax.numpy as jnp


def rmsnorm_ref(x_ND: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
    x = x_ND.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w_D[None, :]).astype(x_ND.dtype)
