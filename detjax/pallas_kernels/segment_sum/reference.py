"""Oracle for the segment sum: out[v] = sum of g[t] over tokens t with ids[t] == v (a one-hot contraction)."""

import jax
import jax.numpy as jnp


def segment_sum_ref(ids_T: jax.Array, g_TD: jax.Array, n_segments: int) -> jax.Array:
    onehot_TV = jax.nn.one_hot(ids_T, n_segments, dtype=jnp.float32)
    return jnp.einsum("tv,td->vd", onehot_TV, g_TD.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
