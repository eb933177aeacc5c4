"""Token losses and their weighting: the one objective that every path (the step, the pipeline) computes.

Gradients are taken of token-loss *sums* per microbatch; the division by the token count happens once, at
the end of the step, so the microbatch size never enters a loss weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from detjax.config import Config


def token_ce_sum(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Sum of token cross-entropies. The label logit is picked by a masked sum over the vocabulary (no
    gather, whose transpose would be a scatter-add; no tokens x vocab one-hot: XLA fuses the compare into
    the reduction, and the backward is one elementwise select)."""
    logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    vocab_11V = jax.lax.broadcasted_iota(jnp.int32, (1, 1, logits_BLV.shape[-1]), 2)
    label_BL = jnp.sum(jnp.where(vocab_11V == targets_BL[..., None], logits_BLV, 0.0), axis=-1)
    return jnp.sum(logz_BL - label_BL)


@dataclass(frozen=True)
class Objective:
    """j = lm_sum + mtp_coef * mtp_sum * n_tok / n_mtp + aux_coef * aux * n_tok / n_micro per microbatch: the
    step's gradient of j, divided once by the step's token count n_tok, is that of lm_loss + mtp_coef *
    mtp_loss + aux_coef * aux_loss, each a per-token (aux: per-microbatch) mean over the whole step."""

    n_tok: int  # LM-loss tokens per step
    n_mtp: int  # MTP-loss tokens per step
    n_micro: int
    mtp_coef: float
    aux_coef: float

    @classmethod
    def from_config(cls, cfg: Config) -> Objective:
        t, m = cfg.train, cfg.model
        n_tok, n_mtp = t.global_batch * t.seq_len, t.global_batch * (t.seq_len - 1)
        return cls(n_tok, n_mtp, t.n_micro, m.mtp.loss_coef, m.moe.aux_loss_coef)

    @property
    def aux_weight(self) -> float:
        """d j / d aux: what a pipeline stage seeds its blocks' aux losses with."""
        return self.aux_coef * (self.n_tok / self.n_micro)

    def terms(self, logits_BLV, mtp_logits_BLV, aux, tokens_BL1) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(LM CE sum, MTP CE sum, aux loss) of one microbatch of (ids + next token) rows."""
        targets_BL = tokens_BL1[:, 1:]
        lm = token_ce_sum(logits_BLV, targets_BL)
        mtp = token_ce_sum(mtp_logits_BLV, targets_BL[:, 1:]) if mtp_logits_BLV is not None else jnp.zeros(())
        return lm, mtp, aux

    def total(self, terms: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        lm, mtp, aux = terms
        return lm + self.mtp_coef * mtp * (self.n_tok / self.n_mtp) + self.aux_coef * aux * (self.n_tok / self.n_micro)

    def losses(self, sums: tuple[jax.Array, jax.Array, jax.Array]) -> dict[str, jax.Array]:
        """The step's reported losses from the summed terms."""
        lm, mtp, aux = sums
        return {"lm_loss": lm / self.n_tok, "mtp_loss": mtp / self.n_mtp, "aux_loss": aux / self.n_micro}
