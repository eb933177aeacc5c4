"""The optax chain: global-norm clipping (pair trees under canonical numerics), AdamW on fp32 masters,
warmup + cosine schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


def clip_by_canonical_norm(max_norm: float, keys: list | None = None) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with the norm of canonical numerics: each leaf's square sum and the sum
    over leaves are fixed pair trees (detjax.sharding.canonical), so the clip factor has the same bits
    however the gradients are sharded. The same rule as optax: scale by max_norm / norm when norm >= max_norm.
    keys: canonical.stack_groups' per-leaf keys (small leaves' square sums stacked), or None."""

    def update_fn(updates, state, params=None):
        del params
        g_norm = canonical.global_norm(updates, canonical.square_sums(updates, keys))
        keep = g_norm < max_norm
        return jax.tree.map(lambda u: jax.lax.select(keep, u, (u / g_norm.astype(u.dtype)) * max_norm), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _adamw(t: TrainConfig) -> optax.GradientTransformation:
    return optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=_decay_mask)


def pinned_adamw(t: TrainConfig, keys: list | None = None) -> optax.GradientTransformation:
    """optax.adamw (same math, same state pytree, so checkpoints are interchangeable) with every product that
    feeds an add rounded before it (`canonical.rounded`), including the final step -lr * u that
    optax.apply_updates adds to the parameters. XLA contracts a multiply and an add into one FMA when they land
    in one fusion, and which ones do depends on the whole program: measured on CPU, the one-device and the dp8
    programs of the same canonical step had equal gradients at step 1 but other AdamW updates. An elementwise
    rule with rounded products is one rounding sequence in every program, and with `rounded` the whole update
    of a leaf is still one elementwise kernel. keys: canonical.stack_groups' per-leaf keys (small leaves of
    one shape and sharding computed stacked, the same bits in fewer kernels), or None (every leaf alone)."""
    schedule = lr_schedule(t)
    b1, b2, eps, wd = t.b1, t.b2, t.eps, t.weight_decay

    def update_fn(grads, state, params):
        adam, masked, sched = state
        zero = canonical.unseen_zero()

        def _apart(x):
            return canonical.rounded(x, zero)

        count = optax.safe_increment(adam.count)
        c1 = (1 - jnp.asarray(b1, jnp.float32) ** count).astype(jnp.float32)
        c2 = (1 - jnp.asarray(b2, jnp.float32) ** count).astype(jnp.float32)
        step_size = -schedule(sched.count)
        decay = jax.tree.leaves(_decay_mask(params))

        def leaf(g, m, v, p, d):
            mu = _apart((1 - b1) * g) + _apart(b1 * m)
            nu = _apart((1 - b2) * (g * g)) + _apart(b2 * v)
            u = (mu / c1.astype(mu.dtype)) / (jnp.sqrt(nu / c2.astype(nu.dtype)) + eps)
            if d:
                u = u + _apart(wd * p)
            return mu, nu, _apart(u * step_size)

        # small leaves of one shape and sharding stacked (canonical.stacked / unstacked: elementwise, the same bits); a
        # shape decides the decay flag, so a stack shares it
        tree = jax.tree.structure(grads)
        g_l, m_l, v_l, p_l = (tree.flatten_up_to(x) for x in (grads, adam.mu, adam.nu, params))
        out = [None] * len(g_l)
        for idx in canonical.stack_groups(g_l, keys):
            res = leaf(*(canonical.stacked(idx, x) for x in (g_l, m_l, v_l, p_l)), decay[idx[0]])
            for i, r in zip(idx, zip(*(canonical.unstacked(idx, x) for x in res), strict=True), strict=True):
                out[i] = r
        mu, nu, updates = (jax.tree.unflatten(tree, [r[k] for r in out]) for k in range(3))
        new_state = (
            adam._replace(count=count, mu=mu, nu=nu),
            masked,
            sched._replace(count=optax.safe_increment(sched.count)),
        )
        return updates, new_state

    return optax.GradientTransformation(_adamw(t).init, update_fn)


def make_optimizer(
    t: TrainConfig, canonical_numerics: bool = False, keys: list | None = None
) -> optax.GradientTransformation:
    """keys (canonical numerics): one hashable per parameter leaf, equal only for leaves sharded alike (the
    logical partition specs): small leaves that share one are updated stacked (canonical.stack_groups)."""
    if canonical_numerics:
        return optax.chain(clip_by_canonical_norm(t.clip_norm, keys), pinned_adamw(t, keys))
    return optax.chain(optax.clip_by_global_norm(t.clip_norm), _adamw(t))
