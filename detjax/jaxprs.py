"""Walking a (closed) jaxpr: every equation, entering the sub-jaxprs of calls, scans, conds, custom
derivatives and shard_map bodies. Used by the step checks (detjax.determinism) and the golden sharding
records (detjax.sharding.rules). Duck-typed, so importing it imports no JAX."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def sub_jaxprs(params: dict[str, Any]) -> Iterator[Any]:
    for v in params.values():
        for item in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr


def iter_eqns(jaxpr: Any, skip: tuple[str, ...] = ()) -> Iterator[Any]:
    """Every equation in program order, depth first; equations whose primitive is in `skip` are yielded
    but not entered (e.g. pallas_call: a kernel body is the kernel's business)."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        if eqn.primitive.name not in skip:
            for sub in sub_jaxprs(eqn.params):
                yield from iter_eqns(sub, skip)
