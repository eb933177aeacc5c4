"""Oracles for the grouped matmuls: jax.lax.ragged_dot (XLA's grouped matmul) and a masked einsum per expert."""

import jax
import jax.numpy as jnp


def gmm_ref(x_RK, w_EKN, group_sizes_E):
    return jax.lax.ragged_dot(x_RK, w_EKN, group_sizes_E, preferred_element_type=jnp.float32)


def tgmm_ref(x_RK, dy_RN, group_sizes_E):
    ends = jnp.cumsum(group_sizes_E)
    rows = jnp.arange(x_RK.shape[0])
    expert_R = jnp.sum(rows[:, None] >= ends[None, :], axis=1)  # rows past the last group match no expert
    onehot_RE = (expert_R[:, None] == jnp.arange(group_sizes_E.shape[0])[None, :]).astype(jnp.float32)
    return jnp.einsum(
        "re,rk,rn->ekn",
        onehot_RE,
        x_RK.astype(jnp.float32),
        dy_RN.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
