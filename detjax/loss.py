"""Token losses and their weighting: the one objective that every path (the step, the pipeline) computes.

Gradients are taken of token-loss *sums* per microbatch; the division by the token count happens once, at
the end of the step, so the microbatch size never enters a loss weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from detjax.config import Config
from detjax.model.ce import TokenCE, token_ce
from detjax.sharding import canonical, tensor


def token_ce_sum(logits_BLV: jax.Array, targets_BL: jax.Array, canonical_sum: bool = False) -> jax.Array:
    """Sum of token cross-entropies (token_ce). canonical_sum: the sum over tokens is the pair tree of
    detjax.sharding.canonical (its bits a function of the token count only)."""
    ce_BL = token_ce(logits_BLV, targets_BL)[0]
    return canonical.full_sum(ce_BL) if canonical_sum else jnp.sum(ce_BL)


@dataclass(frozen=True)
class Objective:
    """j = lm_sum + mtp_coef * mtp_sum * n_tok / n_mtp + aux_coef * aux * n_tok / n_aux per aux group: the
    step's gradient of j, divided once by the step's token count n_tok, is that of lm_loss + mtp_coef *
    mtp_loss + aux_coef * aux_loss, each a per-token (aux: per-group) mean over the whole step.

    An aux group is what one load-balancing loss is computed over: a microbatch by default (a batch shard's
    rows of it in a default-numerics pipeline), one leaf of `determinism.canonical_leaf` sequences under
    canonical numerics (whose gradient is a tree over per-leaf gradients; the microbatch size must not enter
    the bits)."""

    n_tok: int  # LM-loss tokens per step
    n_mtp: int  # MTP-loss tokens per step
    n_aux: int  # aux-loss groups per step
    mtp_coef: float
    aux_coef: float
    canonical: bool = False  # token sums by pair trees (detjax.sharding.canonical)

    @classmethod
    def from_config(cls, cfg: Config, aux_shards: int = 1) -> Objective:
        """aux_shards: the aux groups each microbatch is split into (a default-numerics pipeline's batch
        shards, each computing the load-balancing loss of its own rows: detjax.sharding.pipeline)."""
        t, m = cfg.train, cfg.model
        n_tok, n_mtp = t.global_batch * t.seq_len, t.global_batch * (t.seq_len - 1)
        canonical = cfg.determinism.canonical
        n_aux = t.global_batch // cfg.determinism.canonical_leaf if canonical else t.n_micro * aux_shards
        return cls(n_tok, n_mtp, n_aux, m.mtp.loss_coef, m.moe.aux_loss_coef, canonical)

    @property
    def aux_weight(self) -> float:
        """d j / d aux: what a pipeline stage seeds its blocks' aux losses with -- the float32 value autodiff of
        `total` gives (aux_coef and n_tok / n_aux multiplied in float32, as the one-device backward does), not the
        product of the two in float64 rounded once (one ulp apart: canonical numerics needs the same bits)."""
        with jax.ensure_compile_time_eval():  # a constant, also when asked inside a traced step
            zero = jnp.zeros((), jnp.float32)
            return float(jax.grad(lambda a: self.total((zero, zero, a)))(zero))

    def terms(
        self, logits_BLV, mtp_logits_BLV, aux, tokens_BL1, split: tensor.TensorSplit | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(LM CE sum, MTP CE sum, aux loss) of one aux group of (ids + next token) rows. `split`: the logits
        are vocabulary chunks of canonical tensor parallelism (detjax.sharding.tensor.ce_sum). Either logits
        may be a TokenCE, the per-token losses a fused head computed from the same targets."""
        targets_BL = tokens_BL1[:, 1:]

        def ce(logits, targets):
            if isinstance(logits, TokenCE):  # the head computed the per-token losses (detjax.model.fp8.fp8_head_ce)
                return canonical.full_sum(logits.ce_BL) if self.canonical else jnp.sum(logits.ce_BL)
            return (
                token_ce_sum(logits, targets, self.canonical)
                if split is None
                else tensor.ce_sum(split, logits, targets)
            )

        lm = ce(logits_BLV, targets_BL)
        mtp = jnp.zeros(())
        if mtp_logits_BLV is not None:
            mtp = ce(mtp_logits_BLV, targets_BL[:, 1:])
        return lm, mtp, aux

    def total(self, terms: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        lm, mtp, aux = terms
        return lm + self.mtp_coef * mtp * (self.n_tok / self.n_mtp) + self.aux_coef * aux * (self.n_tok / self.n_aux)

    def losses(self, sums: tuple[jax.Array, jax.Array, jax.Array]) -> dict[str, jax.Array]:
        """The step's reported losses from the summed terms."""
        lm, mtp, aux = sums
        return {"lm_loss": lm / self.n_tok, "mtp_loss": mtp / self.n_mtp, "aux_loss": aux / self.n_aux}
