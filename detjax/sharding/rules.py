"""Logical axes: the only sharding words in model code, and the one table that maps them to mesh axes.

Each logical name has exactly one entry, so order never matters. A name maps to a tuple of mesh axes; a
dimension is split over the product of those axes that have degree > 1 and are not already used by an
earlier dimension of the same array (expert weights: `experts` takes `expert`, so their `embed` dimension
keeps only `fsdp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from detjax.config import MeshConfig
from detjax.jaxprs import iter_eqns

# ---- parameter dimensions
VOCAB = "vocab"  # embedding rows / LM-head columns
EMBED = "embed"  # d_model dimension of dense weights
HEADS = "heads"  # attention query heads
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"  # feed-forward width (dense MLP, shared expert)
SSM_HEADS = "ssm_heads"  # Mamba2 heads (x, z, dt, output projection)
SSM_STATE = "ssm_state"  # Mamba2 B/C state width (ngroups = 1: never split)
CONV = "conv"  # conv taps
EXPERTS = "experts"
EXPERT_EMBED = "expert_embed"  # d_model dimension of expert weights
EXPERT_MLP = "expert_mlp"
STAGES = "stages"  # pipeline stage dimension of stacked layer parameters
VIRTUAL = "virtual"  # interleaved virtual-stage dimension
NORM = "norm"  # norm scales and other small vectors
# ---- activation dimensions
BATCH = "batch"
SEQ = "seq"  # sequence dimension of the residual stream (split over tensor with sequence parallel)
LENGTH = "length"  # sequence dimension elsewhere
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV_HEADS = "act_kv_heads"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"

# The parameter dimensions tensor parallelism splits (canonical numerics cuts each into fixed chunks:
# detjax.sharding.tensor).
TENSOR_PARAM_AXES = (VOCAB, HEADS, KV_HEADS, MLP, SSM_HEADS, EXPERT_MLP)

RULES: dict[str, tuple[str, ...]] = {
    VOCAB: ("tensor",),
    EMBED: ("fsdp",),
    HEADS: ("tensor",),
    KV_HEADS: ("tensor",),
    HEAD_DIM: (),
    MLP: ("tensor",),
    SSM_HEADS: ("tensor",),
    SSM_STATE: (),
    CONV: (),
    EXPERTS: ("expert",),
    EXPERT_EMBED: ("fsdp",),
    EXPERT_MLP: ("tensor",),
    STAGES: ("pipeline",),
    VIRTUAL: (),
    NORM: (),
    BATCH: ("data", "fsdp", "expert"),
    SEQ: ("tensor",),  # only with mesh.sequence_parallel
    LENGTH: (),
    ACT_EMBED: (),
    ACT_HEADS: ("tensor",),
    ACT_KV_HEADS: ("tensor",),
    ACT_MLP: ("tensor",),
    ACT_VOCAB: ("tensor",),
}


@dataclass(frozen=True, eq=False)
class Layout:
    """A mesh plus the switches that change the rules (sequence parallel, kv replication).

    Passed explicitly to the model. Immutable in use: `activation_specs` reads the pinned activation
    specs back from a traced step (for the golden files).
    """

    mesh: Mesh
    cfg: MeshConfig
    replicate_kv: bool = False  # fewer kv heads than the tensor degree: kv projections are replicated

    def __hash__(self) -> int:
        return hash((self.mesh, self.cfg, self.replicate_kv))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (self.mesh, self.cfg, self.replicate_kv) == (
            other.mesh,
            other.cfg,
            other.replicate_kv,
        )

    @property
    def degrees(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def spec(self, names: tuple[str | None, ...]) -> PartitionSpec:
        used: set[str] = set()
        out: list[Any] = []
        for name in names:
            axes: tuple[str, ...] = RULES[name] if name is not None else ()
            if name == SEQ and not self.cfg.sequence_parallel:
                axes = ()
            if name in (KV_HEADS, ACT_KV_HEADS) and self.replicate_kv:
                axes = ()
            axes = tuple(a for a in axes if self.mesh.shape[a] > 1 and a not in used)
            used.update(axes)
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        while out and out[-1] is None:
            out.pop()
        return PartitionSpec(*out)

    def sharding(self, names: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names))

    @property
    def trivial(self) -> bool:
        return self.mesh.size == 1


def constrain(x: jax.Array, layout: Layout | None, names: tuple[str | None, ...], what: str = "") -> jax.Array:
    """Pin an activation's sharding by logical names (identity without a layout or on one device)."""
    if layout is None or layout.trivial:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"constrain({what}): {len(names)} logical names for a rank-{x.ndim} array")
    spec = layout.spec(names)
    with jax.named_scope(f"{CONSTRAIN_SCOPE}{what}" if what else "constrain"):
        return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))


CONSTRAIN_SCOPE = "constrain:"


def activation_specs(jaxpr: Any) -> dict[str, list]:
    """{name: spec} of every named activation constraint in a traced step (the first of each name: the
    forward's), read from the jaxpr's name scopes."""
    out: dict[str, list] = {}
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name != "sharding_constraint":
            continue
        stack = str(eqn.source_info.name_stack)
        if CONSTRAIN_SCOPE in stack:
            what = stack.rsplit(CONSTRAIN_SCOPE, 1)[1].split("/")[0]
            out.setdefault(what, spec_json(eqn.params["sharding"].spec))
    return out


def spec_json(spec: PartitionSpec) -> list:
    """A PartitionSpec as plain JSON (stable across JAX versions, unlike its repr)."""
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def tree_shardings(layout: Layout, logical_specs: Any) -> Any:
    """Map a tree of logical PartitionSpecs (from flax's boxed params) to NamedShardings."""
    return jax.tree.map(
        lambda s: layout.sharding(tuple(s)),
        logical_specs,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )
