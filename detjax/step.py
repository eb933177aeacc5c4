"""State construction and the pure train step, jitted in exactly one place (`compile_train_step`)."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct

from detjax import fingerprint as fp
from detjax.config import Config
from detjax.model import HybridLM
from detjax.optim import lr_schedule, make_optimizer
from detjax.sharding import pipeline
from detjax.sharding import rules as ax
from detjax.sharding.rules import Layout, constrain, tree_shardings
from detjax.trace import capture as cap
from detjax.trace.inject import perturb

# Purposes for key derivation: every key is fold_in(seed key, step, purpose, logical index).
PURPOSE_INIT, PURPOSE_DROPOUT = 0, 1


class TrainState(struct.PyTreeNode):
    step: jax.Array  # int32 scalar: the number of updates applied so far
    params: Any
    opt_state: Any
    rng: jax.Array  # typed key of the run seed; per-step keys are derived, never stored
    # Extra state collections (low-precision copies, fp8 scales, amax histories): checkpointed as they are.
    collections: Any = struct.field(default_factory=dict)


def token_ce_sum(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Sum of token cross-entropies; the label logit is a one-hot contraction (no gather, no scatter)."""
    logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    onehot_BLV = jax.nn.one_hot(targets_BL, logits_BLV.shape[-1], dtype=logits_BLV.dtype)
    return jnp.sum(logz_BL - jnp.sum(logits_BLV * onehot_BLV, axis=-1))


def _dict_path(path: tuple) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def global_norm(tree: Any) -> jax.Array:
    """sqrt of the sum of squares, leaves summed in pytree order."""
    total = jnp.zeros((), jnp.float32)
    for leaf in jax.tree.leaves(tree):
        total = total + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
    return jnp.sqrt(total)


class Trainer:
    """Model, optimizer and the step function for one config.

    `capture` = "phase" or "module" adds on-device digests of phase / module inputs and outputs to the
    step's metrics under "trace"; their static description is in `trace_meta` once the step is traced.
    """

    def __init__(self, cfg: Config, capture: str = "none", scope: str = "", layout: Layout | None = None) -> None:
        self.cfg = cfg
        self.layout = layout
        self.pipelined = layout is not None and layout.degrees["pipeline"] > 1
        self.model = HybridLM(cfg.model, layout)
        self.tx = make_optimizer(cfg.train)
        self.schedule = lr_schedule(cfg.train)
        self.capture = capture
        self.scope = scope
        self.trace_meta: dict[str, list[dict[str, Any]]] = {}

    def _boxed_params(self, seed_key: jax.Array) -> Any:
        t = self.cfg.train
        ids = jnp.zeros((t.micro_batch, t.seq_len), jnp.int32)
        return self.model.init({"params": jax.random.fold_in(seed_key, PURPOSE_INIT)}, ids)["params"]

    def init_state(self, seed_key: jax.Array) -> TrainState:
        params = nn.unbox(self._boxed_params(seed_key))
        if self.pipelined:  # the same initial values, stacked per pipeline stage
            params = pipeline.stack_params(params, self.cfg)
        return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params), seed_key)

    def abstract_state(self) -> TrainState:
        return jax.eval_shape(self.init_state, jax.random.key(0))

    def param_logical_specs(self) -> Any:
        """PartitionSpecs of logical axis names, one per parameter (the model's annotations)."""
        specs = nn.get_partition_spec(jax.eval_shape(self._boxed_params, jax.random.key(0)))
        if self.pipelined:
            specs = pipeline.stack_specs(specs, self.cfg)
        return specs

    def state_shardings(self) -> TrainState:
        """Explicit shardings for every state leaf: parameters by the rules table, optimizer moments like
        their parameter, scalars and keys replicated."""
        layout = self.layout
        abstract = self.abstract_state()
        if layout is None:
            raise ValueError("state_shardings needs a Trainer built with a layout")
        param_sh = tree_shardings(layout, self.param_logical_specs())
        by_path = {
            _dict_path(p): (sh, leaf.shape)
            for (p, sh), leaf in zip(
                jax.tree_util.tree_flatten_with_path(param_sh)[0], jax.tree.leaves(abstract.params), strict=True
            )
        }
        rep = layout.sharding(())

        def opt_leaf(path, leaf):
            dp = _dict_path(path)
            for i in range(len(dp)):  # an optimizer leaf mirrors the parameter at the end of its path
                hit = by_path.get(dp[i:])
                if hit is not None and hit[1] == leaf.shape:
                    return hit[0]
            return rep

        opt_sh = jax.tree_util.tree_map_with_path(opt_leaf, abstract.opt_state)
        return TrainState(rep, param_sh, opt_sh, rep, jax.tree.map(lambda _: rep, abstract.collections))

    def batch_sharding(self) -> Any:
        return self.layout.sharding((ax.BATCH, None))

    def loss_terms(self, params, tokens_BL1: jax.Array, key: jax.Array, hooks: Any = None):
        """Per-microbatch sums: (lm CE sum, MTP CE sum, aux loss)."""
        ids_BL, targets_BL = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
        if hooks is None:
            logits, mtp_logits, aux = self.model.apply({"params": params}, ids_BL, train=True, key=key)
        else:
            with nn.intercept_methods(hooks):
                logits, mtp_logits, aux = self.model.apply({"params": params}, ids_BL, train=True, key=key)
        lm_sum = token_ce_sum(logits, targets_BL)
        mtp_sum = token_ce_sum(mtp_logits, targets_BL[:, 1:]) if mtp_logits is not None else jnp.zeros(())
        if self.capture == "phase":  # the forward phase's outputs: losses *and* logits (far more sensitive)
            self._fwd_digests = [fp.tensor_digest(logits)] + (
                [fp.tensor_digest(mtp_logits)] if mtp_logits is not None else []
            )
        return lm_sum, mtp_sum, aux

    def train_step(self, state: TrainState, batch_GL1: jax.Array) -> tuple[TrainState, dict[str, Any]]:
        cfg = self.cfg
        t, m = cfg.train, cfg.model
        n_micro = t.n_micro
        n_tok = t.global_batch * t.seq_len
        n_mtp = t.global_batch * (t.seq_len - 1)
        step_key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), PURPOSE_DROPOUT)

        inj = cfg.debug.inject_nondeterminism
        inject_modules = inj.scope if inj.scope and not re.search(inj.scope, "optimizer") else ""
        capture = self.capture

        def objective(params, tokens, key):
            rec = cap.Recorder("module", self.scope) if capture == "module" else None
            hooks = cap.ModuleHooks(rec, inject_modules, inj.step, state.step) if (rec or inject_modules) else None
            token = cap.activate(rec)
            try:
                lm_sum, mtp_sum, aux = self.loss_terms(params, tokens, key, hooks)
            finally:
                cap.deactivate(token)
            if rec is not None:
                self.trace_meta["micro"] = rec.meta
            fwd = getattr(self, "_fwd_digests", []) if capture == "phase" else []
            # Gradients are of token-loss *sums*; the division by the token count happens once, at the end.
            j = lm_sum + m.mtp.loss_coef * mtp_sum * (n_tok / n_mtp) + m.moe.aux_loss_coef * aux * (n_tok / n_micro)
            return j, ((lm_sum, mtp_sum, aux), rec.values if rec else fwd)

        def micro(carry, xs):
            g_acc, sums = carry
            tokens, i = xs
            key = jax.random.fold_in(step_key, i)
            g, (terms, values) = jax.grad(objective, has_aux=True)(state.params, tokens, key)
            fwd_out = list(terms) + (list(values) if capture == "phase" else [])
            with jax.named_scope("grad_accumulate"):
                new_acc = jax.tree.map(jnp.add, g_acc, g)
            if capture == "phase":
                rec = cap.Recorder("phase")
                fwd_in = [fp.tree_digest(state.params), tokens, key]
                rec.add("phase", "forward", fwd_in, fwd_out)
                rec.add("phase", "backward", fwd_in, [fp.tree_digest(g)])
                rec.add(
                    "phase", "grad_accumulate", [fp.tree_digest(g_acc), fp.tree_digest(g)], [fp.tree_digest(new_acc)]
                )
                self.trace_meta["micro"] = rec.meta
                values = rec.values
            return (new_acc, jax.tree.map(jnp.add, sums, terms)), values

        micro_tokens = constrain(batch_GL1.reshape(n_micro, t.micro_batch, -1), self.layout, (None, ax.BATCH, None))
        if self.pipelined:
            g_sum, (lm_sum, mtp_sum, aux_sum) = pipeline.pipeline_grads(self, state.params, micro_tokens, step_key)
            micro_values = []
        else:
            zeros = jax.tree.map(jnp.zeros_like, state.params)
            zero_terms = (jnp.zeros(()), jnp.zeros(()), jnp.zeros(()))
            # Microbatches accumulate in index order (a fixed sequential order).
            (g_sum, (lm_sum, mtp_sum, aux_sum)), micro_values = jax.lax.scan(
                micro, (zeros, zero_terms), (micro_tokens, jnp.arange(n_micro))
            )
        with jax.named_scope("grad_scale"):
            grads = jax.tree.map(lambda g: g / n_tok, g_sum)
        with jax.named_scope("optimizer"):
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            if inj.scope and re.search(inj.scope, "optimizer"):
                leaves, tree = jax.tree.flatten(updates)
                updates = jax.tree.unflatten(tree, [perturb(leaves[0], state.step, inj.step), *leaves[1:]])
            params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        metrics: dict[str, Any] = {
            "lm_loss": lm_sum / n_tok,
            "mtp_loss": mtp_sum / n_mtp,
            "aux_loss": aux_sum / n_micro,
            "grad_norm": global_norm(grads),
            "lr": self.schedule(state.step),
        }
        if capture == "phase":
            rec = cap.Recorder("phase")
            rec.add("phase", "grad_scale", [fp.tree_digest(g_sum)], [fp.tree_digest(grads)])
            rec.add(
                "phase",
                "optimizer",
                [fp.tree_digest(grads), fp.tree_digest(state.opt_state), fp.tree_digest(state.params)],
                [fp.tree_digest(updates), fp.tree_digest(opt_state), fp.tree_digest(params)],
            )
            self.trace_meta["step"] = rec.meta
            metrics["trace"] = {"micro": micro_values, "step": rec.values}
        elif capture == "module":
            self.trace_meta["step"] = []
            metrics["trace"] = {"micro": micro_values, "step": []}
        if cfg.run.fingerprints:
            metrics["digest"] = {
                "params": fp.tree_digest(params),
                "grads": fp.tree_digest(grads),
                "opt_state": fp.tree_digest(opt_state),
                "batch": fp.tensor_digest(batch_GL1),
                "rng": fp.tensor_digest(step_key),
            }
        return new_state, metrics


# One compiled function per (trajectory config, shardings): in-process reruns and resumes reuse it.
_COMPILED: dict[Any, Any] = {}


def _cache_key(trainer: Trainer, kind: str, *shardings: Any) -> Any:
    c = trainer.cfg
    shardings = tuple((jax.tree.structure(s), tuple(jax.tree.leaves(s))) for s in shardings)
    return (
        kind,
        c.model,
        c.train,
        c.determinism,
        c.debug,
        c.run.fingerprints,
        c.mesh,
        trainer.layout,
        trainer.capture,
        trainer.scope,
        *shardings,
    )


def compile_train_step(trainer: Trainer, state_sharding: Any, batch_sharding: Any):
    """The one jit of the train step: explicit shardings, state donated."""
    key = _cache_key(trainer, "step", state_sharding, batch_sharding)
    if key not in _COMPILED:
        _COMPILED[key] = (
            jax.jit(
                trainer.train_step,
                in_shardings=(state_sharding, batch_sharding),
                out_shardings=(state_sharding, None),
                donate_argnums=(0,),
            ),
            trainer.trace_meta,
        )
    fn, trainer.trace_meta = _COMPILED[key]  # share the trace description filled when fn is traced
    return fn


def compile_init(trainer: Trainer, state_sharding: Any):
    key = _cache_key(trainer, "init", state_sharding)
    if key not in _COMPILED:
        _COMPILED[key] = jax.jit(trainer.init_state, out_shardings=state_sharding)
    return _COMPILED[key]
