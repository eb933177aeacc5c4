"""Phase- and module-level capture and fault injection: instrumented variants of the train step.

The plain step (detjax.step.Trainer.train_step) knows nothing of this module. `instrumented_step` composes
the Trainer's pieces again, with on-device digests around every phase (level "phase") or around every Flax
module call plus the row-wise taps the model sows into "intermediates" (level "module"), and with fault
injection when the config asks for it. The digests come back as a pytree {record identity: digests}; the
identity is the record's static description as a JSON string, so the metadata is the tree structure and
nothing is collected on the side. Capture adds no collective; fault injection adds a host callback
(detjax.trace.inject).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from detjax import fingerprint as fp
from detjax.trace.inject import perturb


def _arrays(tree: Any) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) or hasattr(x, "aval")]


def _digest_list(xs: list[jax.Array]) -> jax.Array:
    if not xs:
        return jnp.zeros((0, 2), jnp.uint32)
    return jnp.stack([fp.tensor_digest(x) for x in xs])


def _shapes(xs: list[jax.Array]) -> list[str]:
    return [f"{x.dtype}{list(x.shape)}" for x in xs]


class Recorder:
    """Builds one trace's {identity: digest array}; a fresh one per traced call, never shared."""

    def __init__(self, scope: str = "") -> None:
        self.scope = scope
        self.tree: dict[str, jax.Array] = {}
        self._counts: dict[tuple, int] = {}

    def wants(self, path: str) -> bool:
        return not self.scope or re.search(self.scope, path) is not None

    def _key(self, meta: dict[str, Any]) -> str:
        # a sequence number first: dict pytrees flatten in key order, so the records keep recording order
        return f"{len(self.tree):05d}" + json.dumps(meta, sort_keys=True)

    def add(self, kind: str, name: str, inputs: list[jax.Array], outputs: list[jax.Array]) -> None:
        occ = self._counts.get((kind, name), 0)
        self._counts[(kind, name)] = occ + 1
        meta = {"kind": kind, "name": name, "occurrence": occ, "n_in": len(inputs)}
        meta |= {"in_shapes": _shapes(inputs), "out_shapes": _shapes(outputs)}
        self.tree[self._key(meta)] = _digest_list(inputs + outputs)

    def add_rows(self, kind: str, name: str, x: jax.Array) -> None:
        """Row-wise digest (one per leading-axis slice), for permutation-sensitive tensors."""
        meta = {"kind": kind, "name": name, "occurrence": 0, "n_in": 0, "rowwise": True}
        meta |= {"in_shapes": [], "out_shapes": _shapes([x])}
        self.tree[self._key(meta)] = fp.row_digest(x)

    def add_sown(self, intermediates: dict[str, Any]) -> None:
        """The row-wise taps the model sowed (MoE routing maps, dispatch orders), named path:name."""
        for path, x in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
            keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
            module, name = "/".join(keys[:-1]), keys[-1]
            if self.wants(module):
                self.add_rows("rows", f"{module}:{name}", x)


def meta_of(key: str) -> dict[str, Any]:
    return json.loads(key[5:])


class ModuleHooks:
    """A Flax method interceptor: module-level capture and/or fault injection."""

    def __init__(self, recorder: Recorder | None, inject_scope: str, inject_step: int, step: jax.Array) -> None:
        self.recorder = recorder
        self.inject_scope = inject_scope
        self.inject_step = inject_step
        self.step = step

    def __call__(self, next_fun, args, kwargs, context):
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        out = next_fun(*args, **kwargs)
        path = "/".join(context.module.path) or type(context.module).__name__
        if self.inject_scope and re.search(self.inject_scope, path) and context.method_name == "__call__":
            leaves, tree = jax.tree.flatten(out)
            # perturb the first float output (e.g. the MoE block's y, not its aux loss)
            for i, leaf in enumerate(leaves):
                if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim > 0:
                    leaves[i] = perturb(leaf, self.step, self.inject_step)
                    break
            out = jax.tree.unflatten(tree, leaves)
        rec = self.recorder
        if rec is not None and rec.wants(path):
            name = path if context.method_name == "__call__" else f"{path}.{context.method_name}"
            rec.add("module", name, _arrays((args, kwargs)), _arrays(out))
        return out


def injection(cfg) -> tuple[str, bool]:
    """(module-path regex to perturb, whether the optimizer update is perturbed) from debug.inject_*."""
    scope = cfg.debug.inject_nondeterminism.scope
    on_optimizer = bool(scope) and re.search(scope, "optimizer") is not None
    return ("" if on_optimizer else scope), on_optimizer


def instrumented_step(trainer: Any, level: str = "none", scope: str = ""):
    """step(state, batch) -> (state, metrics, taps): the train step of `trainer` with capture at `level`
    ("none", "phase" or "module") and the config's fault injection. taps = {"micro": {identity: digests
    stacked over microbatches}, "step": {identity: digests}}."""
    if level not in ("none", "phase", "module"):
        raise ValueError(f"instrumented_step: level must be none, phase or module, got {level!r}")
    if trainer.pipelined:
        raise ValueError("capture and fault injection do not run inside pipeline stages")
    inj_step = trainer.cfg.debug.inject_nondeterminism.step
    inject_modules, inject_optimizer = injection(trainer.cfg)
    objective = trainer.objective

    def tree_digest(tree):  # the flat form where the trees are on one device (fingerprint.FLAT_WORDS)
        return fp.tree_digest(tree, trainer.one_device)

    def step(state, batch):
        step_key = trainer.step_key(state)

        def micro(params, tokens, key, g_acc):
            def obj(params):
                rec = Recorder(scope)
                hooks = ModuleHooks(rec if level == "module" else None, inject_modules, inj_step, state.step)
                with nn.intercept_methods(hooks):
                    outs, sown = trainer.model.apply(
                        {"params": params}, tokens[:, :-1], train=True, key=key, mutable=["intermediates"]
                    )
                if level == "module":
                    rec.add_sown(sown.get("intermediates", {}))
                terms = objective.terms(*outs, tokens)
                logits = [fp.tensor_digest(x) for x in outs[:2] if x is not None]  # far more sensitive than losses
                return objective.total(terms), (terms, rec.tree, logits)

            g, (terms, module_taps, logits) = jax.grad(obj, has_aux=True)(params)
            if level != "phase":
                return g, terms, module_taps
            rec = Recorder()
            fwd_in = [tree_digest(params), tokens, key]
            rec.add("phase", "forward", fwd_in, list(terms) + logits)
            rec.add("phase", "backward", fwd_in, [tree_digest(g)])
            new_acc = jax.tree.map(jnp.add, g_acc, g)  # the accumulation the scan body does (same op)
            rec.add("phase", "grad_accumulate", [tree_digest(g_acc), tree_digest(g)], [tree_digest(new_acc)])
            return g, terms, rec.tree

        (g_sum, sums), micro_taps = trainer.accumulate(state.params, trainer.micro_tokens(batch), step_key, micro)

        def perturb_first(updates):
            leaves, tree = jax.tree.flatten(updates)
            return jax.tree.unflatten(tree, [perturb(leaves[0], state.step, inj_step), *leaves[1:]])

        new_state, grads, updates, losses = trainer.finish(
            state, g_sum, sums, perturb_first if inject_optimizer else None
        )
        rec = Recorder()
        if level == "phase":
            rec.add("phase", "grad_scale", [tree_digest(g_sum)], [tree_digest(grads)])
            rec.add(
                "phase",
                "optimizer",
                [tree_digest(grads), tree_digest(state.opt_state), tree_digest(state.params)],
                [tree_digest(updates), tree_digest(new_state.opt_state), tree_digest(new_state.params)],
            )
        new_state, metrics = trainer.conclude(state, new_state, grads, losses, batch, step_key)
        return new_state, metrics, {"micro": micro_taps, "step": rec.tree}

    return step
