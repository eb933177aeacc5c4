"""Plain-jnp gate and RMSNorm of the Mamba2 mixer: the oracle for the Pallas kernel, the mixer's own formula
(model.mamba2: the skip term, the SiLU gate, then the RMSNorm over the inner width), float32 math."""

import jax
import jax.numpy as jnp


def gated_norm_ref(
    y_ND: jax.Array, x_ND: jax.Array, z_ND: jax.Array, d_D: jax.Array, w_D: jax.Array, eps: float, out_dtype=None
) -> jax.Array:
    """rmsnorm((y + d x) silu(z)) w, rows over the last axis, in out_dtype (default float32)."""
    g = (y_ND + d_D[None, :] * x_ND) * jax.nn.silu(z_ND.astype(jnp.float32))
    out = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps) * w_D[None, :]
    return out.astype(out_dtype or jnp.float32)
