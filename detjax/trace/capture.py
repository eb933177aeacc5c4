"""Phase- and module-level capture inside the compiled step.

Digests are computed on device (detjax.fingerprint) and returned as ordinary outputs of the step; the
static description of each record (identity, shapes) is collected in Python while the step is traced,
once. Nothing here adds a collective or a host callback.
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass, field
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


@dataclass
class Recorder:
    """Collects (static meta, digest array) pairs during one trace of the step."""

    level: str
    scope: str = ""
    meta: list[dict[str, Any]] = field(default_factory=list)
    values: list[jax.Array] = field(default_factory=list)
    _counts: dict[tuple, int] = field(default_factory=dict)

    def wants(self, path: str) -> bool:
        return not self.scope or re.search(self.scope, path) is not None

    def add(self, kind: str, name: str, inputs: list[jax.Array], outputs: list[jax.Array], **extra: Any) -> None:
        key = (kind, name)
        occ = self._counts.get(key, 0)
        self._counts[key] = occ + 1
        self.meta.append(
            {
                "kind": kind,
                "name": name,
                "occurrence": occ,
                "n_in": len(inputs),
                "in_shapes": [f"{x.dtype}{list(x.shape)}" for x in inputs],
                "out_shapes": [f"{x.dtype}{list(x.shape)}" for x in outputs],
                **extra,
            }
        )
        self.values.append(_digest_list(inputs + outputs))

    def add_rows(self, kind: str, name: str, x: jax.Array) -> None:
        """Row-wise digest (one per leading-axis slice), for permutation-sensitive tensors."""
        self.meta.append(
            {
                "kind": kind,
                "name": name,
                "occurrence": 0,
                "n_in": 0,
                "rowwise": True,
                "in_shapes": [],
                "out_shapes": [f"{x.dtype}{list(x.shape)}"],
            }
        )
        self.values.append(fp.row_digest(x))


_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("detjax_module_capture", default=None)


def tap_rows(module: nn.Module, name: str, x: jax.Array) -> None:
    """Called by model code for routing maps / dispatch orders; a no-op unless module capture is on."""
    rec = _ACTIVE.get()
    if rec is not None and rec.level == "module":
        path = "/".join(module.path)
        if rec.wants(path):
            rec.add_rows("rows", f"{path}:{name}", x)


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
        if rec is not None and rec.level == "module" and rec.wants(path):
            name = path if context.method_name == "__call__" else f"{path}.{context.method_name}"
            rec.add("module", name, _arrays((args, kwargs)), _arrays(out))
        return out


def activate(recorder: Recorder | None) -> contextvars.Token:
    return _ACTIVE.set(recorder)


def deactivate(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)


def records_from(meta: list[dict[str, Any]], values: list[Any], step: int, level: str, micro: int | None = None):
    """Host-side: turn (meta, digest arrays) into JSON-ready records."""
    out = []
    for m, v in zip(meta, values, strict=True):
        v = jax.device_get(v)
        n_in = m["n_in"]
        digs = [fp.digest_hex(r) for r in v]
        rec = dict(m, level=level, step=step, inputs=digs[:n_in], outputs=digs[n_in:])
        if micro is not None:
            rec["micro"] = micro
        out.append(rec)
    return out
