"""The optax chain: global-norm clipping (pair trees under canonical numerics), AdamW on fp32 masters,
warmup + cosine schedule."""

from __future__ import annotations

import jax
import optax

from detjax.config import TrainConfig
from detjax.sharding import canonical


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    decay = t.decay_steps or t.steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=t.warmup_steps,
        decay_steps=max(decay, t.warmup_steps + 1),
        end_value=t.lr * t.min_lr_ratio,
    )


def _decay_mask(params):
    # no weight decay on vectors (norm scales, biases, SSM A/D/dt parameters)
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def clip_by_canonical_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with the norm of canonical numerics: each leaf's square sum and the sum
    over leaves are fixed pair trees (detjax.sharding.canonical), so the clip factor has the same bits
    however the gradients are sharded. The same rule as optax: scale by max_norm / norm when norm >= max_norm."""

    def update_fn(updates, state, params=None):
        del params
        g_norm = canonical.global_norm(updates)
        keep = g_norm < max_norm
        return jax.tree.map(lambda u: jax.lax.select(keep, u, (u / g_norm.astype(u.dtype)) * max_norm), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(t: TrainConfig, canonical_numerics: bool = False) -> optax.GradientTransformation:
    clip = clip_by_canonical_norm if canonical_numerics else optax.clip_by_global_norm
    return optax.chain(
        clip(t.clip_norm),
        optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=_decay_mask),
    )
