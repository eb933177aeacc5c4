"""Canonical numerics' gradient accumulation (docs/DETERMINISM.md, "Canonical numerics"): the step's gradient
and loss-term sums as one pair tree over leaves of sequences in global order, on one device, across the batch
shards of a mesh, and through a pipeline. The Trainer (detjax.step) calls these with itself as `trainer`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from detjax.sharding import canonical, pipeline
from detjax.sharding.rules import tree_shardings

# canonical numerics: leaves whose gradients one scan stacks before their pair tree (a power of two; more
# leaves per device go through a TreeAccumulator in groups of this many)
STACK = 4
# Whether each scan step of a leaf group runs two leaves and adds their gradients (the pair tree's first level)
# before the scan stacks the sum, instead of stacking every leaf's gradient: the same adds in the same order,
# so the same bits (tests/test_canonical.py). It saves writing every leaf's gradient into the stack and
# reading it back: on an H100, gpu_medium's canonical step took 132.7 against 135.5 ms unpaired, and 12.7
# against 13.5 GiB peak memory (docs/BENCHMARKS.md, "Canonical numerics"; the second leaf runs after the first,
# so one leaf's activations live at a time: pairs with no order between the two leaves held 17.9 GiB). A scan
# step holds two leaf programs, which take XLA longer to compile, so None (the default) pairs leaves on a GPU
# only, where the step time is won back; True or False forces it.
PAIRS: bool | None = None


def pairs_here() -> bool:
    """Whether canonical_grad_sums pairs leaves in its scan (PAIRS; None: on a GPU)."""
    return jax.default_backend() == "gpu" if PAIRS is None else PAIRS


ROUTED_EXPERTS = ("w_gate", "w_up", "w_down")  # the routed experts' stacked weights (model.moe.Experts)


def is_routed_expert(path: tuple) -> bool:
    """Whether a parameter path (jax tree path) names a routed expert weight stack."""
    names = dict_path(path)
    return len(names) >= 2 and names[-2] == "experts" and names[-1] in ROUTED_EXPERTS


def dict_path(path: tuple) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def canonical_grad_sums(trainer: Any, params: Any, batch_GL1: jax.Array, step_key: jax.Array, fp8_scales: Any = None):
    """Gradient and loss-term sums under canonical numerics (docs/DETERMINISM.md, "Canonical numerics"),
    and the step's fp8 amaxes (None without fp8).

    The leaves of the tree are blocks of C = determinism.canonical_leaf sequences in global batch order.
    Each of the S batch shards (data x fsdp: device s holds the contiguous block of leaves
    [s N/S, (s+1) N/S) of the N = G/C leaves) runs inside shard_map, so its program is the explicit
    per-device one (no partitioner choice inside it): its leaves one at a time (lax.scan: the same
    batch-C program whatever the mesh or the microbatch size), each with the dropout key of its global
    leaf index, with the weights whole. Up to STACK leaves' gradients are stacked by the scan and summed
    by their pair tree (with pairs_here, the scan runs two leaves a step and stacks their sum: the tree's
    first level); longer blocks push those STACK-leaf subtrees into a TreeAccumulator. The S block
    sums then meet in the top levels of the same tree (pair_sum over S), on each device's piece of the
    elements (canonical.reduce_to_shards: an all-to-all, the tree's adds, an all-gather into the stored
    shards): the same adds, so the same bits, for about the bytes of an all-reduce. With expert dispatch
    (trainer.expert_split) each device keeps its experts and their gradients come back one per source
    device, which meet over their owners in the same tree. fp8 amaxes are maxima over the leaves and
    devices (exact in any order)."""
    g_rows, width = batch_GL1.shape
    leaf = trainer.cfg.determinism.canonical_leaf
    axes = trainer.batch_axes()
    per_shard = g_rows // leaf // trainer.batch_shards()  # leaves per device
    stack = min(per_shard, STACK)
    groups = per_shard // stack
    fp8_on = fp8_scales is not None

    def leaf_grad(params, tokens_CL1, key, scales, compute):
        if fp8_on:  # the amaxes come back as the "gradient" with respect to the scales (detjax.model.fp8)
            grad = jax.grad(trainer.leaf_objective, argnums=(0, 3), has_aux=True)
            (g, amax), terms = grad(params, tokens_CL1, key, scales, compute=compute)
            return (g, terms), amax
        g, terms = jax.grad(trainer.leaf_objective, has_aux=True)(params, tokens_CL1, key, compute=compute)
        return jax.lax.optimization_barrier((g, terms)), ()

    def amax_max(a_K):
        return jax.tree.map(lambda a: jnp.max(a, axis=0), a_K)

    def block_sums(params, tokens_NCL1, key, first, scales):
        compute = trainer.compute_copies(params, scales)  # once per device and step, before the leaf loop

        def leaf_body(_, xs):
            tokens_CL1, j = xs
            return None, leaf_grad(params, tokens_CL1, jax.random.fold_in(key, first + j), scales, compute)

        def pair_body(_, xs):
            tokens_2CL1, j = xs
            s0, a0 = leaf_body(None, (tokens_2CL1[0], j))[1]
            # the second leaf reads its tokens after the first leaf's gradient exists: one leaf's activations
            # live at a time, as in the unpaired scan
            (s0, a0), tokens_CL1 = jax.lax.optimization_barrier(((s0, a0), tokens_2CL1[1]))
            s1, a1 = leaf_body(None, (tokens_CL1, j + 1))[1]
            with jax.named_scope("grad_accumulate"):
                return None, (jax.tree.map(jnp.add, s0, s1), jax.tree.map(jnp.maximum, a0, a1))

        def group_sum(tokens_KCL1, j0):
            if stack > 1 and pairs_here():
                pairs = (tokens_KCL1.reshape(stack // 2, 2, *tokens_KCL1.shape[1:]), j0 + 2 * jnp.arange(stack // 2))
                _, (grads_K, amax_K) = jax.lax.scan(pair_body, None, pairs)
            else:
                _, (grads_K, amax_K) = jax.lax.scan(leaf_body, None, (tokens_KCL1, j0 + jnp.arange(stack)))
            with jax.named_scope("grad_accumulate"):
                return canonical.tree_pair_sum(grads_K), amax_max(amax_K)

        tokens_GKCL1 = tokens_NCL1.reshape(groups, stack, *tokens_NCL1.shape[1:])
        if groups == 1:
            return group_sum(tokens_GKCL1[0], 0)
        acc = canonical.TreeAccumulator(groups)

        def group_body(carry, xs):
            tokens_KCL1, g = xs
            s, amax = group_sum(tokens_KCL1, g * stack)
            with jax.named_scope("grad_accumulate"):
                return acc.push(carry, s, g), amax

        zeros = (jax.tree.map(jnp.zeros_like, params), (jnp.zeros(()), jnp.zeros(()), jnp.zeros(())))
        out, amax_G = jax.lax.scan(group_body, acc.init(zeros), (tokens_GKCL1, jnp.arange(groups)))
        return out["total"], amax_max(amax_G)

    def leaves_of(tokens_BL1):
        return tokens_BL1.reshape(-1, leaf, width)

    def unpack(sums, amax):
        g_sum, terms = sums
        return g_sum, terms, (amax if fp8_on else None)

    if trainer.layout is None:
        return unpack(*block_sums(params, leaves_of(batch_GL1), step_key, 0, fp8_scales))

    ep = trainer.expert_split
    n_ep = ep.degree if ep is not None else 1

    def source_copies(params):  # expert dispatch: this device's experts, one copy per source device
        def one(path, w):
            return jnp.broadcast_to(w[None], (n_ep, *w.shape)) if is_routed_expert(path) else w

        return jax.tree_util.tree_map_with_path(one, params) if ep is not None else params

    if ep is not None and axes[-1] != ep.axis:
        raise AssertionError(f"canonical expert dispatch: the batch axes {axes} do not end with {ep.axis}")
    rest = axes[:-1] if ep is not None else axes  # the axes over which an expert's owners meet

    # How each gradient's device subtrees meet (the top levels of the tree, docs/DETERMINISM.md), by
    # canonical.reduce_to_shards into the shards the parameter is stored in (an all-to-all and an
    # all-gather: about 2 x the shard's bytes per device): "shard", every parameter and the loss terms, over
    # all batch devices; "expert", a dispatched expert stack, its A per-source subtrees over the owners of
    # its experts (the tree's terms q*A + a); "stacked", a parameter with a dimension stored over both
    # `tensor` and a batch axis, whose subtrees leave stacked and meet in pair_sum outside, lowered by XLA
    # (which moved about 15 x the parameters' bytes per device on dp8 and 9.6 x on fsdp 2 x data 4 for the
    # whole step: scripts/collective_bytes.py, docs/benchmarks-history.md set 29). A dispatched expert stack
    # with such a dimension leaves replicated over the owners.
    stored = [sh.spec for sh in jax.tree.leaves(tree_shardings(trainer.layout, trainer.param_logical_specs()))]
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def batch_only(spec, over=axes) -> tuple:  # the storage spec's axes among `over`, per dimension
        return tuple(tuple(n for n in canonical.spec_axes(e) if n in over) or None for e in spec)

    def mixed(spec) -> bool:
        return any("tensor" in canonical.spec_axes(e) and batch_only((e,))[0] for e in spec)

    route = [
        "expert" if ep is not None and is_routed_expert(path) else "stacked" if mixed(sp) else "shard"
        for path, sp in zip(paths, stored, strict=True)
    ]
    degrees = {a: trainer.layout.degrees[a] for a in axes}

    def top_levels(grads, terms):
        if not axes:  # one batch shard: its subtree is the sum
            return grads, terms
        flat = jax.tree.leaves(grads)
        picked = {r: [i for i, rr in enumerate(route) if rr == r] for r in ("shard", "expert")}
        sh_specs = [batch_only(stored[i]) for i in picked["shard"]] + [()] * len(terms)
        sums = canonical.reduce_to_shards([*[flat[i] for i in picked["shard"]], *terms], sh_specs, axes, degrees)
        e_specs = [() if mixed(stored[i]) else batch_only(stored[i], rest)[1:] for i in picked["expert"]]
        e_specs = [(None, *sp) for sp in e_specs]  # the local experts' dimension stays as it is
        rest_degrees = {a: degrees[a] for a in rest}
        exp = canonical.reduce_to_shards([flat[i] for i in picked["expert"]], e_specs, rest, rest_degrees, n_ep)
        out = [g[None] for g in flat]
        for i, v in [*zip(picked["shard"], sums, strict=False), *zip(picked["expert"], exp, strict=True)]:
            out[i] = v
        return jax.tree.unflatten(jax.tree.structure(grads), out), tuple(sums[len(picked["shard"]) :])

    def local(params, tokens_BL1, key, scales):
        first = jax.lax.axis_index(axes) * per_shard if axes else 0
        (grads, terms), amax = block_sums(source_copies(params), leaves_of(tokens_BL1), key, first, scales)
        with jax.named_scope("grad_accumulate"):
            amax = jax.tree.map(lambda a: jax.lax.pmax(a, axes), amax) if axes else amax
            return top_levels(grads, terms), amax

    # the parameters' specs inside shard_map: whole (P()), or this device's tensor shard, or (dispatched
    # experts) its experts; the sums leave as the parameters are stored, except the "stacked" ones (one
    # subtree per device)
    t_specs = trainer.tensor_specs() if trainer.tensor_split is not None and trainer.tensor_split.degree > 1 else None
    t_list = jax.tree.leaves(t_specs, is_leaf=lambda x: isinstance(x, P)) if t_specs is not None else None
    p_list, g_list = [], []
    for i, (w, r) in enumerate(zip(jax.tree.leaves(params), route, strict=True)):
        t = tuple(t_list[i]) if t_list is not None else ()
        t = t + (None,) * (w.ndim - len(t))
        p_list.append(P(ep.axis, *t[1:]) if r == "expert" else P(*t))
        if r == "expert" and mixed(stored[i]):
            r = "expert, replicated"
        g_list.append({"stacked": P(axes or None, *t), "expert, replicated": p_list[-1]}.get(r, stored[i]))
    treedef = jax.tree.structure(params)
    p_spec, g_spec = jax.tree.unflatten(treedef, p_list), jax.tree.unflatten(treedef, g_list)
    spec = P(axes) if axes else P()
    (g_sum, terms), amax = jax.shard_map(
        local,
        mesh=trainer.layout.mesh,
        in_specs=(p_spec, spec, P(), P()),
        out_specs=((g_spec, (P(),) * 3), P()),
        check_vma=False,
    )(params, batch_GL1, step_key, fp8_scales if fp8_on else ())
    with jax.named_scope("grad_accumulate"):
        flat = [
            canonical.pair_sum(g, 0) if r == "stacked" else g
            for g, r in zip(jax.tree.leaves(g_sum), route, strict=True)
        ]
    return unpack((jax.tree.unflatten(treedef, flat), terms), amax)


def canonical_pipeline_grad_sums(trainer: Any, params: Any, batch_GL1: jax.Array, step_key: jax.Array, fp8_scales=None):
    """Canonical numerics' gradient and loss-term sums through the pipeline (config: microbatches of
    determinism.canonical_leaf sequences): each microbatch is one leaf of the same pair tree as
    canonical_grad_sums' (detjax.sharding.pipeline, canonical=True), each batch shard pipelining its own
    block of leaves, so the sums are the one-device run's. The parameters arrive and the gradients leave
    in the one-device layout, and so do the fp8 scales and amaxes."""
    t = trainer.cfg.train
    stacked = pipeline.stack_params(params, trainer.cfg)
    scales = pipeline.stack_params(fp8_scales, trainer.cfg) if fp8_scales is not None else None
    micro_tokens = batch_GL1.reshape(t.n_micro, t.micro_batch, -1)
    g_sum, sums, amax = pipeline.pipeline_grads(
        trainer.pipeline_fns(),
        trainer.cfg,
        trainer.layout,
        stacked,
        micro_tokens,
        step_key,
        canonical=True,
        batch_axes=trainer.batch_axes(),
        tensor_specs=trainer.stage_tensor_specs() if trainer.tensor_split is not None else None,
        fp8_scales=scales,
    )
    amax = pipeline.unstack_params(amax, trainer.cfg) if amax is not None else None
    return pipeline.unstack_params(g_sum, trainer.cfg), sums, amax
