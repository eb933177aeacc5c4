"""Oracle for the cross-entropy forward: model.ce.token_ce (XLA's logsumexp and the masked label sum) of the
logits widened to float32."""

import jax
import jax.numpy as jnp

from detjax.model.ce import token_ce


def token_ce_ref(logits_MV: jax.Array, targets_M: jax.Array) -> tuple[jax.Array, jax.Array]:
    return token_ce(logits_MV.astype(jnp.float32), targets_M)
