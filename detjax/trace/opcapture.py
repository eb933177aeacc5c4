"""Op-level capture: re-evaluate the step's jaxpr equation by equation inside one jit, digesting each
selected equation's inputs and outputs on device.

Calls (jit, custom_jvp/vjp, remat) are entered, scans are re-run with digests as extra per-iteration
outputs, so ops inside them are captured with their iteration; other higher-order primitives (while,
cond, shard_map) are captured as one op. Each record's identity is (scope, primitive, occurrence) —
independent of device count and of timing.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from detjax import fingerprint as fp

_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call"}
_TRANSFORMS = re.compile(r"\b(jvp|transpose|vmap|remat|checkpoint)\(")


def module_path(name_stack: str) -> str:
    """'transpose(jvp(HybridLM))/layer_1/mixer/bld,dk->blk' -> 'HybridLM/layer_1/mixer/bld,dk->blk'."""
    return _TRANSFORMS.sub("", name_stack).replace(")", "")


def _source(eqn) -> str:
    from jax._src import source_info_util

    return source_info_util.summarize(eqn.source_info)


def _digestable(x: Any) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and dt != jax.dtypes.float0 and hasattr(x, "shape")


def _scan_layout(params: dict[str, Any]) -> tuple[int, int]:
    if "num_consts" in params:  # jax <= 0.11
        return params["num_consts"], params["num_carry"]
    ft_in = params["ft_in"]  # newer jax: a flat tree of (consts, carry, xs); len() counts leaves
    groups = ft_in.elts if hasattr(ft_in, "elts") else ft_in.unpack()
    return len(groups[0]), len(groups[1])


class OpRecorder:
    def __init__(self, scope: str) -> None:
        self.scope = re.compile(scope) if scope else None
        self.meta: list[dict[str, Any]] = []
        self._occ: dict[tuple[str, str], int] = {}

    def wants(self, path: str) -> bool:
        return self.scope is None or self.scope.search(path) is not None

    def describe(self, path, prim, eqn, ins, outs, iteration_of: str | None, backward: bool) -> None:
        key = (path, prim)
        occ = self._occ.get(key, 0)
        self._occ[key] = occ + 1
        self.meta.append(
            {
                "kind": "op",
                "name": f"{path}:{prim}",
                "scope": path,
                "primitive": prim,
                "occurrence": occ,
                "source": _source(eqn),
                "n_in": len(ins),
                "in_shapes": [f"{x.dtype}{list(x.shape)}" for x in ins],
                "out_shapes": [f"{x.dtype}{list(x.shape)}" for x in outs],
                "scan": iteration_of,
                "backward": backward,
            }
        )


def interpret(rec: OpRecorder, jaxpr: Any, consts: list[Any], args: list[Any], prefix: str, in_scan: str | None):
    """Evaluate `jaxpr`; returns (outputs, list of per-record digest arrays)."""
    env: dict[Any, Any] = {}
    values: list[jax.Array] = []
    digest_of: dict[Any, jax.Array] = {}  # each variable is digested once, however many ops read it

    def dig(v, x):
        if v not in digest_of:
            digest_of[v] = fp.tensor_digest(x)
        return digest_of[v]

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        ns = "/".join(s for s in (prefix, str(eqn.source_info.name_stack)) if s)
        prim = eqn.primitive.name
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if prim in _CALLS and sub is not None:
            closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
            if len(closed.jaxpr.invars) == len(invals):
                outs, inner = interpret(rec, closed.jaxpr, list(closed.consts), invals, ns, in_scan)
                values += inner
                for v, x in zip(eqn.outvars, outs, strict=True):
                    env[v] = x
                continue
        if prim == "scan":
            outs = _scan(rec, eqn, invals, ns, values)
        elif prim == "shard_map" and in_scan is None:
            # the body's per-shard records stand for it: a digest of the global result would need a collective
            for v, x in zip(eqn.outvars, _shard_map(rec, eqn, invals, ns, values), strict=True):
                env[v] = x
            continue
        else:
            out = eqn.primitive.bind(*invals, **eqn.params)
            outs = list(out) if eqn.primitive.multiple_results else [out]
        path = module_path(ns)
        if rec.wants(path):
            ins = [
                (v, x)
                for v, x in zip(eqn.invars, invals, strict=True)
                if not isinstance(v, jcore.Literal) and _digestable(x)
            ]
            outd = [(v, x) for v, x in zip(eqn.outvars, outs, strict=True) if _digestable(x)]
            rec.describe(path, prim, eqn, [x for _, x in ins], [x for _, x in outd], in_scan, "transpose(" in ns)
            ds = [dig(v, x) for v, x in ins + outd]
            values.append(jnp.stack(ds) if ds else jnp.zeros((0, 2), jnp.uint32))
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars], values


def _scan(rec: OpRecorder, eqn, invals, ns, values) -> list[Any]:
    p = eqn.params
    n_consts, n_carry = _scan_layout(p)
    body = p["jaxpr"]
    consts, init, xs = invals[:n_consts], invals[n_consts : n_consts + n_carry], invals[n_consts + n_carry :]
    scan_id = f"{module_path(ns)}:scan#{sum(1 for m in rec.meta if m['primitive'] == 'scan')}"

    def f(carry, x):
        outs, inner = interpret(rec, body.jaxpr, list(body.consts), [*consts, *carry, *x], ns, scan_id)
        return outs[:n_carry], (outs[n_carry:], inner)

    carry, (ys, inner) = jax.lax.scan(f, init, xs, length=p["length"], reverse=p["reverse"], unroll=p.get("unroll", 1))
    values += inner  # each stacked along the iteration axis
    return [*carry, *ys]


_CACHE: dict[Any, Any] = {}


def _shard_map(rec: OpRecorder, eqn, invals, ns, values) -> list[Any]:
    """Re-run the shard_map with the interpreted body; each device digests its own shard (no collective),
    and the digests come out stacked along the manual mesh axes: one record per device shard."""
    from jax.sharding import PartitionSpec as P

    p = eqn.params
    mesh, body = p["mesh"], p["jaxpr"]
    manual = p.get("newly_manual_axes", p.get("manual_axes"))
    if manual is None:
        manual = frozenset(mesh.axis_names) - frozenset(p.get("auto", ()))
    manual_t = tuple(a for a in mesh.axis_names if a in manual)
    n_before = len(rec.meta)

    def f(*xs):
        outs, inner = interpret(rec, body, [], list(xs), ns, None)
        return list(outs), [v[None] for v in inner]

    outs, inner = jax.shard_map(
        f,
        mesh=mesh,
        in_specs=tuple(p["in_specs"]),
        out_specs=(list(p["out_specs"]), P(manual_t)),
        axis_names=set(manual),
        check_vma=False,
    )(*invals)
    names = list(mesh.axis_names)
    order = [names.index(a) for a in manual_t] + [i for i, a in enumerate(names) if a not in manual]
    devs = np.transpose(np.vectorize(lambda d: d.id)(mesh.devices), order).reshape(len(inner[0]) if inner else 1, -1)
    for m in rec.meta[n_before:]:
        m["shard_map"] = f"{module_path(ns)}:{manual_t}"
        m["shard_devices"] = [int(d) for d in devs[:, 0]]
    values += inner
    return outs


def traced_step_fn(step_fn, example_args: tuple, scope: str, cache_key: Any = None):
    """Build f(*args) -> (outputs pytree, digest list) and its record descriptions (filled at first call).

    With a cache_key, reruns in one process (e.g. the two runs of a hunt) reuse the compiled function."""
    if cache_key is not None and (cache_key, scope) in _CACHE:
        return _CACHE[(cache_key, scope)]
    closed, out_shape = jax.make_jaxpr(step_fn, return_shape=True)(*example_args)
    out_tree = jax.tree.structure(out_shape)
    rec = OpRecorder(scope)

    def run(*args):
        rec.meta.clear()
        rec._occ.clear()
        outs, values = interpret(rec, closed.jaxpr, list(closed.consts), jax.tree.leaves(args), "", None)
        return jax.tree.unflatten(out_tree, outs), values

    out = (jax.jit(run), rec)
    if cache_key is not None:
        _CACHE[(cache_key, scope)] = out
    return out
