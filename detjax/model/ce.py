"""The per-token cross-entropy: the one formula every head and loss reads (detjax.loss sums it; the fused fp8 LM
head, detjax.model.fp8.fp8_head_ce, computes it in its forward and returns TokenCE in place of logits)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TokenCE(NamedTuple):
    """What the model returns in place of logits when its LM head computed the loss itself (fp8_head_ce): the
    per-token cross-entropy (B, L), float32. detjax.loss sums it as it sums logsumexp - label."""

    ce_BL: jax.Array


def token_ce(logits_BLV: jax.Array, targets_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cross-entropy, logsumexp) of each token, float32 logits over the last axis. The label logit is picked
    by a masked sum over the vocabulary (no gather, whose transpose would be a scatter-add; no tokens x vocab
    one-hot: XLA fuses the compare into the reduction, and the backward is one elementwise select)."""
    logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    vocab = jax.lax.broadcasted_iota(
        jnp.int32, (1,) * (logits_BLV.ndim - 1) + logits_BLV.shape[-1:], logits_BLV.ndim - 1
    )
    label_BL = jnp.sum(jnp.where(vocab == targets_BL[..., None], logits_BLV, 0.0), axis=-1)
    return logz_BL - label_BL, logz_BL
