"""RoPE in plain jnp: the forward the model runs (XLA) and the oracle of the backward kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tables(length: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotation angles, (length, head_dim / 2) float32: position p, pair i ->
    p / theta^(2i / head_dim)."""
    freq_Q2 = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang_LQ2 = jnp.arange(length, dtype=jnp.float32)[:, None] * freq_Q2[None, :]
    return jnp.cos(ang_LQ2), jnp.sin(ang_LQ2)


def rope(x_BLHQ: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding on the last dim (pairs: first half with second half), in float32, rounded
    to x's dtype."""
    cos_LQ2, sin_LQ2 = tables(x_BLHQ.shape[1], x_BLHQ.shape[-1], theta)
    cos_1L1Q2, sin_1L1Q2 = cos_LQ2[None, :, None, :], sin_LQ2[None, :, None, :]
    x32_BLHQ = x_BLHQ.astype(jnp.float32)
    x1_BLHQ2, x2_BLHQ2 = jnp.split(x32_BLHQ, 2, axis=-1)
    return jnp.concatenate(
        [x1_BLHQ2 * cos_1L1Q2 - x2_BLHQ2 * sin_1L1Q2, x2_BLHQ2 * cos_1L1Q2 + x1_BLHQ2 * sin_1L1Q2], axis=-1
    ).astype(x_BLHQ.dtype)


def rope_grad(d1: jax.Array, d2: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE's backward on one head's halves, float32: the cotangents (d1 cos + d2 sin, d2 cos - d1 sin) of
    its input halves for the cotangents d1, d2 of its output halves -- the products and sums of XLA's
    autodiff of `rope`, each rounded once."""
    return d1 * cos + d2 * sin, d2 * cos - d1 * sin
