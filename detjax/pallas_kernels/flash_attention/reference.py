"""Oracle: causal GQA attention in plain jnp, also the model's reference attention path."""

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.ordered import pinned_softmax


def attention_reference(q_BLHQ, k_BSKQ, v_BSKQ) -> jax.Array:
    """Causal GQA in plain jnp; softmax in float32 with pinned sums (ordered.pinned_softmax). Returns (B, L, H, Q)
    in the input dtype."""
    bsz, length, heads, qd = q_BLHQ.shape
    kv = k_BSKQ.shape[2]
    q_BLKGQ = q_BLHQ.reshape(bsz, length, kv, heads // kv, qd)
    scores_BKGLS = jnp.einsum("blkgq,bskq->bkgls", q_BLKGQ, k_BSKQ, preferred_element_type=jnp.float32)
    scores_BKGLS = scores_BKGLS * (qd**-0.5)
    causal_LS = jnp.tril(jnp.ones((length, k_BSKQ.shape[1]), dtype=bool))
    scores_BKGLS = jnp.where(causal_LS[None, None, None], scores_BKGLS, jnp.finfo(jnp.float32).min)
    probs_BKGLS = pinned_softmax(scores_BKGLS).astype(v_BSKQ.dtype)  # sums in one order in every program
    out_BLKGQ = jnp.einsum("bkgls,bskq->blkgq", probs_BKGLS, v_BSKQ, preferred_element_type=jnp.float32)
    return out_BLKGQ.reshape(bsz, length, heads, qd).astype(q_BLHQ.dtype)


flash_attention_ref = attention_reference
