"""The optax chain: global-norm clipping, AdamW on fp32 masters, warmup + cosine schedule."""

from __future__ import annotations

import jax
import optax

from detjax.config import TrainConfig


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


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(t.clip_norm),
        optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=_decay_mask),
    )
