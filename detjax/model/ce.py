"""The per-token cross-entropy: the one formula every head and loss reads (detjax.loss sums it). In training the
LM head under model.kernels=pallas returns TokenCE in place of logits: the bf16 head through token_ce_of
(below), the fused fp8 head through detjax.model.fp8.fp8_head_ce; both differentiate it with the same formula
(matmul.quantize.ce_grad)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TokenCE(NamedTuple):
    """What the model returns in place of logits when its LM head computed the loss itself (token_ce_of,
    fp8_head_ce): the per-token cross-entropy (B, L), float32. detjax.loss sums it as it sums logsumexp - label."""

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


@jax.custom_vjp
def token_ce_of(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Per-token cross-entropy (B, L), float32, of logits in the compute dtype (the bf16 LM head's): the forward
    is token_ce of the logits widened to float32, the same values and bits (with KERNEL_FWD, the one-pass
    Pallas kernel's, the same formula in another fixed order). The backward writes the logits'
    gradient in their own dtype in one elementwise pass, dce * (exp(logits - lse) - onehot) in float32 then
    rounded (matmul.quantize.ce_grad, the fp8 head's formula), from the stored compute-dtype logits and the
    rows' logsumexp. Differentiating token_ce of widened logits instead stores the float32 logits for the
    backward, writes their float32 gradient and rounds it in a second pass: about three times the memory
    traffic over a (tokens x vocabulary) array, in every microbatch and head."""
    return _ce_of_fwd(logits_BLV, targets_BL)[0]


# Whether token_ce_of's forward runs the one-pass Pallas kernel (pallas_kernels/ce) where it takes the shape.
# On: 0.566 against XLA's 0.640 ms at gpu_medium's head on an H100 (`scripts/kernel_bench.py --kernels ce`),
# and a gpu_medium step 0.4 % faster with it (docs/BENCHMARKS.md, "Kernel switches in the gpu_medium step").
KERNEL_FWD = True


def _ce_of_fwd(logits_BLV, targets_BL):
    fused = None
    if KERNEL_FWD:
        from detjax.pallas_kernels.ce.ops import token_ce_fwd

        fused = token_ce_fwd(logits_BLV, targets_BL)
    ce_BL, logz_BL = fused if fused is not None else token_ce(logits_BLV.astype(jnp.float32), targets_BL)
    return ce_BL, (logits_BLV, logz_BL, targets_BL)


def _ce_of_bwd(res, dce_BL):
    from detjax.pallas_kernels.matmul.quantize import ce_grad

    logits_BLV, logz_BL, targets_BL = res
    v = logits_BLV.shape[-1]
    g_MV = ce_grad(logits_BLV.reshape(-1, v), logz_BL.reshape(-1), targets_BL.reshape(-1), dce_BL.reshape(-1))
    return g_MV.astype(logits_BLV.dtype).reshape(logits_BLV.shape), None


token_ce_of.defvjp(_ce_of_fwd, _ce_of_bwd)
