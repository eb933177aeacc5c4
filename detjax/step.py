"""State construction and the pure train step. `compile_train_step` is the one jit of the train step; the
tracer (detjax.trace) compiles its own instrumented variants, built from the same pieces."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from detjax import fingerprint as fp
from detjax import step_canonical
from detjax.config import Config, ConfigError, expert_dispatch, with_canonical_leaf, with_flash_backend
from detjax.loss import Objective, token_ce_sum
from detjax.model import fp8, layers
from detjax.model.layers import DTYPES, module_copies
from detjax.model.lm import HybridLM, block_class, layer_key
from detjax.optim import lr_schedule, make_optimizer
from detjax.sharding import canonical, pipeline
from detjax.sharding import rules as ax
from detjax.sharding.expert import ExpertSplit
from detjax.sharding.rules import Layout, constrain, tree_shardings
from detjax.sharding.tensor import TensorSplit
from detjax.step_canonical import dict_path

# Purposes for key derivation: every key is fold_in(seed key, step, purpose, logical index).
PURPOSE_INIT, PURPOSE_DROPOUT = 0, 1


class TrainState(struct.PyTreeNode):
    step: jax.Array  # int32 scalar: the number of updates applied so far
    params: Any
    opt_state: Any
    rng: jax.Array  # typed key of the run seed; per-step keys are derived, never stored
    # Extra state collections, checkpointed as they are; empty until a feature needs one.
    collections: Any = struct.field(default_factory=dict)


def leaf_square_sums(tree: Any) -> list[jax.Array]:
    """Each leaf's sum of squares (float32), in pytree order."""
    return [jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(tree)]


def global_norm(tree: Any, squares: list[jax.Array] | None = None) -> jax.Array:
    """sqrt of the sum of squares, leaves summed in pytree order."""
    total = jnp.zeros((), jnp.float32)
    for sq in leaf_square_sums(tree) if squares is None else squares:
        total = total + sq
    return jnp.sqrt(total)


class Trainer:
    """Model, optimizer, objective and the pieces of the train step for one config and layout."""

    def __init__(self, cfg: Config, layout: Layout | None = None) -> None:
        # an auto canonical leaf for this layout and an auto flash backend for this device (detjax.train resolves
        # both before, so its run records them)
        cfg = with_canonical_leaf(cfg, layout.degrees if layout is not None else {})
        cfg = with_flash_backend(cfg, layout.mesh.devices.flat[0] if layout is not None else None)
        self.cfg = cfg
        self.layout = layout
        self.pipelined = layout is not None and layout.degrees["pipeline"] > 1
        self.one_device = layout is None or layout.trivial
        self.canonical = cfg.determinism.canonical
        # the state's parameters stacked per pipeline stage; under canonical numerics the state keeps the
        # one-device layout (so its digests, norm and checkpoints are the one-device run's) and the step stacks
        # a copy for the pipeline
        self.stacked = self.pipelined and not self.canonical
        self.model = HybridLM(cfg.model, layout)
        # canonical numerics run the model one leaf at a time inside shard_map: no layout constraints inside;
        # with determinism.max_tensor > 1 each device runs its share of the fixed feature chunks
        self.tensor_split = self._tensor_split()
        # and with an `expert` axis (where expert_dispatch allows it) the leaves' rows travel to their experts
        self.expert_split = ExpertSplit(cfg.mesh.expert) if layout is not None and expert_dispatch(cfg) else None
        self.leaf_model = HybridLM(cfg.model, None, self.tensor_split, self.expert_split) if self.canonical else None
        shards = self.batch_shards()
        leaves = cfg.train.global_batch // max(cfg.determinism.canonical_leaf, 1)  # (0: not canonical numerics)
        if self.canonical and (not canonical.is_power_of_two(shards) or leaves % shards):
            raise ConfigError(
                f"config key 'determinism.numerics' = 'canonical': the batch is split over {shards} devices "
                f"(data x fsdp), which must be a power of two dividing the {leaves} leaves of "
                f"determinism.canonical_leaf = {cfg.determinism.canonical_leaf} sequences. Fix: use 1, 2, 4, ... "
                f"data x fsdp devices, at most {leaves}, or a smaller determinism.canonical_leaf"
            )
        per_pipeline, stages = leaves // shards, cfg.mesh.pipeline
        if self.canonical and self.pipelined and cfg.mesh.pipeline_virtual > 1 and per_pipeline % stages:
            raise ConfigError(
                f"config key 'mesh.pipeline_virtual' = {cfg.mesh.pipeline_virtual}: the interleaved schedule needs "
                f"each pipeline's microbatch count ({per_pipeline} leaves: {leaves} over {shards} batch shards) "
                f"divisible by mesh.pipeline = {stages}. Fix: fewer batch shards, a larger train.global_batch, or "
                "mesh.pipeline_virtual=1"
            )
        self.fp8 = cfg.model.fp8.enabled
        # the non-finite guard's on-device checks; only scripts/det_tax.py's `+noguard` mode turns them off, to
        # price them (train.on_nonfinite needs them)
        self.guard_nonfinite = True
        if (
            self.fp8
            and cfg.determinism.mode == "strict"
            and cfg.model.kernels != "pallas"
            and jax.default_backend() == "gpu"
        ):
            raise ConfigError(
                "config key 'model.fp8.enabled' = True: on the GPU, strict mode runs the fp8 products only through "
                "detjax's fixed-tile matmul (XLA's fp8 GEMMs are picked by autotuning). Fix: set model.kernels=pallas"
            )
        # canonical numerics stack small parameter leaves of one shape and logical sharding in the optimizer
        self.leaf_keys = (
            [
                str(s)
                for s in jax.tree.leaves(self.param_logical_specs(), is_leaf=lambda x: x is None or isinstance(x, P))
            ]
            if self.canonical
            else None
        )
        self.tx = make_optimizer(cfg.train, self.canonical, self.leaf_keys)
        self.schedule = lr_schedule(cfg.train)
        # a default-numerics pipeline splits each microbatch's rows over the batch shards (build_layout checks
        # that they divide it): each shard's rows are one aux-loss group (detjax.sharding.pipeline)
        default_pipeline = self.pipelined and not self.canonical
        self.objective = Objective.from_config(cfg, self.batch_shards() if default_pipeline else 1)

    def _tensor_split(self) -> TensorSplit | None:
        """Canonical tensor parallelism's chunks over this mesh's tensor axis, or None (no chunks)."""
        big = self.cfg.determinism.max_tensor
        if not self.canonical or big == 1:
            return None
        degree = self.layout.degrees["tensor"] if self.layout is not None else 1
        sequence = degree > 1 and self.cfg.mesh.sequence_parallel
        return TensorSplit(big, degree, "tensor" if degree > 1 else None, sequence)

    def tensor_specs(self) -> Any:
        """Each parameter's PartitionSpec over the tensor axis alone (what a canonical device holds of it)."""

        def one(names):
            spec = self.layout.spec(tuple(names))
            return P(*["tensor" if e == "tensor" or (isinstance(e, tuple) and "tensor" in e) else None for e in spec])

        return jax.tree.map(one, self.param_logical_specs(), is_leaf=lambda s: isinstance(s, P))

    def stage_tensor_specs(self) -> Any:
        """tensor_specs in the pipeline layout (stacked leaves: their virtual and stage dims first)."""
        stacked = pipeline.stack_specs(self.tensor_specs(), self.cfg)
        stacked["stages"] = jax.tree.map(
            lambda s: P(None, None, *tuple(s)[2:]), stacked["stages"], is_leaf=lambda s: isinstance(s, P)
        )
        return stacked

    # ------------------------------------------------------------------------------------------ state
    def _boxed_params(self, seed_key: jax.Array) -> Any:
        t = self.cfg.train
        ids = jnp.zeros((t.micro_batch, t.seq_len), jnp.int32)
        return self.model.init({"params": jax.random.fold_in(seed_key, PURPOSE_INIT)}, ids)["params"]

    def init_state(self, seed_key: jax.Array) -> TrainState:
        params = nn.unbox(self._boxed_params(seed_key))
        if self.stacked:  # the same initial values, stacked per pipeline stage
            params = pipeline.stack_params(params, self.cfg)
        collections = {}
        if self.fp8:  # every projection's scales start at 1 with an empty (zero) amax history
            t = self.cfg.train
            ids = jnp.zeros((t.micro_batch, t.seq_len), jnp.int32)
            scales = self.model.init({"params": jax.random.key(0)}, ids)["fp8"]
            if self.stacked:  # in the parameters' layout: the stages' scale sets stacked like their weights
                scales = pipeline.stack_params(scales, self.cfg)
            collections["fp8"] = fp8.init_collection(scales, self.cfg.model.fp8.amax_history_len)
        return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params), seed_key, collections)

    def abstract_state(self) -> TrainState:
        return jax.eval_shape(self.init_state, jax.random.key(0))

    def param_logical_specs(self) -> Any:
        """PartitionSpecs of logical axis names, one per parameter (the model's annotations)."""
        specs = nn.get_partition_spec(jax.eval_shape(self._boxed_params, jax.random.key(0)))
        if self.stacked:
            specs = pipeline.stack_specs(specs, self.cfg)
        return specs

    def state_shardings(self) -> TrainState:
        """Explicit shardings for every state leaf: parameters by the rules table, optimizer moments like
        their parameter, scalars and keys replicated."""
        layout = self.layout
        if layout is None:
            raise ValueError("state_shardings needs a Trainer built with a layout")
        abstract = self.abstract_state()
        param_sh = tree_shardings(layout, self.param_logical_specs())
        by_path = {
            dict_path(p): (sh, leaf.shape)
            for (p, sh), leaf in zip(
                jax.tree_util.tree_flatten_with_path(param_sh)[0], jax.tree.leaves(abstract.params), strict=True
            )
        }
        rep = layout.sharding(())

        def opt_leaf(path, leaf):
            dp = dict_path(path)
            for i in range(len(dp)):  # an optimizer leaf mirrors the parameter at the end of its path
                hit = by_path.get(dp[i:])
                if hit is not None and hit[1] == leaf.shape:
                    return hit[0]
            return rep

        opt_sh = jax.tree_util.tree_map_with_path(opt_leaf, abstract.opt_state)
        return TrainState(rep, param_sh, opt_sh, rep, jax.tree.map(lambda _: rep, abstract.collections))

    def batch_sharding(self) -> Any:
        return self.layout.sharding((ax.BATCH, None))

    # ------------------------------------------------------------------------------------------ pieces
    def step_key(self, state: TrainState) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(state.rng, state.step), PURPOSE_DROPOUT)

    def micro_tokens(self, batch_GL1: jax.Array) -> jax.Array:
        t = self.cfg.train
        return constrain(batch_GL1.reshape(t.n_micro, t.micro_batch, -1), self.layout, (None, ax.BATCH, None))

    def compute_copies(self, params: Any, fp8_scales: Any = None) -> Any:
        """The model's "compute" collection: the projection weights cast to the compute dtype, and fused
        where the model multiplies several as one product (detjax.model.layers.COMPUTE_COPIES), or None
        where nothing reads them (model.kernels other than pallas, a float32 compute dtype, canonical
        tensor chunks; fp8 without its scales or on a multi-device mesh).

        A step makes them once, before its microbatch (or leaf) loop, instead of casting and concatenating
        the float32 masters again in every microbatch's forward and backward (3.2 ms of gpu_dense's step in
        2026-12-01 profile; the step was 2.6 ms faster with the copies, docs/benchmarks-history.md set 18). The
        same casts and concatenations, so the same bits; the products' gradients still reach the masters.
        The routed experts' stacks get a cast copy and its transpose (gmm.ops.grouped_compute_copy; the
        forward reads one, dx the other) where the experts run on the device's whole stacks. With model.fp8
        (`fp8_scales`: the step's scale sets), the fp8 projections' weights are copied as their products read
        them -- quantized with the step's scale, with the transposed copy and the amax (layers.FP8_SCALES,
        fp8.weight_copy) -- the same bytes each microbatch would make."""
        dtype = DTYPES[self.cfg.model.compute_dtype]
        if self.cfg.model.kernels != "pallas" or dtype == jnp.float32 or self.tensor_split is not None:
            return None  # (canonical tensor chunks cast their own weight chunks)
        if self.fp8 and (fp8_scales is None or (self.layout is not None and not self.layout.trivial)):
            return None

        # the routed experts read their copies where they run the Pallas products on the device's whole stacks:
        # not with XLA's ragged_dot, nor where their rows travel to other devices (expert dispatch)
        m = self.cfg.model
        if self.canonical:
            experts = self.expert_split is None
        else:
            experts = self.layout is None or self.layout.degrees["expert"] == 1
        experts = experts and m.moe.experts_kernels(m.kernels) == "pallas"

        def walk(tree, scales):
            out = module_copies(tree, dtype, scales if self.fp8 else None, experts)
            for name, sub in tree.items():
                sub_scales = scales.get(name) if isinstance(scales, Mapping) else None
                if isinstance(sub, Mapping) and (copies := walk(sub, sub_scales)):
                    out[name] = copies
            return out

        with jax.named_scope("compute_copies"):
            return walk(params, fp8_scales if self.fp8 else None)

    def fuses_accumulation(self) -> bool:
        """Whether the microbatch loop runs the gradient accumulation fusion (train.grad_accumulation_fusion):
        the projections' weight gradients are added to the loop's running sums by the dw kernel
        (pallas_kernels.matmul.ops.matmul's acc_KN) rather than by a pass over each microbatch's gradient.
        It needs the compute copies (model.kernels=pallas, a low-precision compute dtype) on one device or a
        trivial mesh, and no fp8, canonical numerics, pipeline or tensor chunks (their loops keep the sums)."""
        m = self.cfg.model
        return (
            self.cfg.train.grad_accumulation_fusion
            and m.kernels == "pallas"
            and DTYPES[m.compute_dtype] != jnp.float32
            and not (self.fp8 or self.canonical or self.pipelined)
            and self.tensor_split is None
            and self.one_device
        )

    def accumulators(self, params: Any) -> dict:
        """The fusion's running sums at zero: a float32 array per fused projection group, in its compute copy's
        layout (layers.module_accumulators), nested as the parameters are. The LM head is left out when the
        MTP heads share it (its gradient is the sum of two products' there). The routed experts' stacks join
        where their products are the Pallas grouped ones (layers.EXPERT_ACCUMULATORS)."""
        m = self.cfg.model
        exclude = (("w_head",),) if m.mtp.depth else ()
        experts = m.moe.experts_kernels(m.kernels) == "pallas"

        def walk(tree):
            out = layers.module_accumulators(tree, exclude, experts)
            for name, sub in tree.items():
                if isinstance(sub, Mapping) and (sums := walk(sub)):
                    out[name] = sums
            return out

        return walk(params)

    def apply_model(
        self,
        params: Any,
        ids_BL: jax.Array,
        key: jax.Array,
        fp8_scales: Any = None,
        model=None,
        compute=None,
        targets_BL: jax.Array | None = None,
        accs=None,
    ):
        """The training forward of `model` (default: the step's model; canonical numerics: the leaf model),
        reading `compute` (compute_copies of params) where given. `targets_BL`: a fused fp8 head may return
        the per-token losses instead of logits (detjax.model.ce.TokenCE). `accs`: the gradient accumulation
        fusion's running sums (accumulators), which the projections pass to their dw kernels."""
        variables = {"params": params} if fp8_scales is None else {"params": params, "fp8": fp8_scales}
        if compute:
            variables["compute"] = compute
        if accs:
            variables["grad_acc"] = accs
        return (model or self.model).apply(variables, ids_BL, train=True, key=key, targets_BL=targets_BL)

    def fp8_scales(self, state: TrainState) -> Any:
        """The scales this step's fp8 projections use (computed at the end of the step before), or None."""
        return state.collections["fp8"]["scale"] if self.fp8 else None

    def micro_objective(
        self,
        params: Any,
        tokens_BL1: jax.Array,
        key: jax.Array,
        fp8_scales: Any = None,
        model=None,
        compute=None,
        accs=None,
    ):
        """(j, (lm sum, MTP sum, aux)) of one microbatch (with model=self.leaf_model: one leaf of canonical
        numerics' gradient tree); the gradient is taken of j, not of the compute copies."""
        outs = self.apply_model(params, tokens_BL1[:, :-1], key, fp8_scales, model, compute, tokens_BL1[:, 1:], accs)
        with jax.named_scope("loss"):
            terms = self.objective.terms(*outs, tokens_BL1, split=getattr(model, "tp", None))
        return self.objective.total(terms), terms

    def accumulate(
        self,
        params: Any,
        micro_tokens: jax.Array,
        step_key: jax.Array,
        micro_fn: Callable | None = None,
        fp8_scales: Any = None,
    ):
        """Gradient sums and loss-term sums over the microbatches, in index order (a fixed sequential order).

        micro_fn(params, tokens, key, accumulated grads) -> (grads, terms, extras) per microbatch; extras come
        back stacked along the microbatch axis. The default is the gradient of micro_objective, whose extras
        are the fp8 amaxes when fp8_scales are given (the "gradient" with respect to the scales,
        detjax.model.fp8), else none. Those come back as their maximum over the microbatches, kept as a running
        maximum in the loop's carry: one vector of every projection's amaxes, so each microbatch updates it in
        one elementwise op. A maximum is exact in any order, and the amaxes are >= 0 or NaN, so this gives the
        bytes of the stacked amaxes' maximum. It saves the stacking's write per projection and microbatch: on
        the GPU, a small kernel of its own each. gpu_dense's fp8 profile has 260 such dynamic-update-slice
        kernels a step, for 65 projections x 4 microbatches (docs/benchmarks-history.md set 34)."""

        compute = self.compute_copies(params, fp8_scales) if micro_fn is None else None
        if compute is not None and self.fuses_accumulation():
            return self.fused_accumulate(params, micro_tokens, step_key, compute)
        running_max = micro_fn is None and bool(jax.tree.leaves(fp8_scales))  # (None has no leaves)

        def plain(params, tokens, key, g_acc):
            if fp8_scales is not None:
                grad = jax.grad(self.micro_objective, argnums=(0, 3), has_aux=True)
                (g, amax), terms = grad(params, tokens, key, fp8_scales, compute=compute)
                return g, terms, amax
            g, terms = jax.grad(self.micro_objective, has_aux=True)(params, tokens, key, compute=compute)
            return g, terms, ()

        fn = micro_fn or plain

        def body(carry, xs):
            g_acc, sums, *amax = carry
            tokens, i = xs
            g, terms, extras = fn(params, tokens, jax.random.fold_in(step_key, i), g_acc)
            with jax.named_scope("grad_accumulate"):
                new_acc = jax.tree.map(jnp.add, g_acc, g)
            carry = (new_acc, jax.tree.map(jnp.add, sums, terms))
            if running_max:
                return (*carry, jnp.maximum(amax[0], ravel_pytree(extras)[0])), ()
            return carry, extras

        zeros = (jax.tree.map(jnp.zeros_like, params), (jnp.zeros(()), jnp.zeros(()), jnp.zeros(())))
        if running_max:  # every amax is >= 0 (or NaN, which maximum keeps), so 0 is the maximum's identity
            flat, unravel = ravel_pytree(fp8_scales)  # the amaxes have the scales' tree
            zeros = (*zeros, jnp.zeros_like(flat))
        n = micro_tokens.shape[0]
        (g_sum, sums, *amax), extras = jax.lax.scan(body, zeros, (micro_tokens, jnp.arange(n)))
        return (g_sum, sums), (unravel(amax[0]) if running_max else extras)

    def fused_accumulate(self, params: Any, micro_tokens: jax.Array, step_key: jax.Array, compute: Any):
        """accumulate's sums with the gradient accumulation fusion (fuses_accumulation): the loop carries the
        fused projections' running sums (accumulators) and differentiates each microbatch's objective with
        respect to them, whose gradient is the new sum (the dw kernel adds the microbatch's weight gradient to
        it); the other parameters' gradients are added as accumulate adds them. The fused weights' gradients
        are cut out of the sums after the loop (layers.accumulated_grads). Every element gets the same float32
        additions in the same order as in accumulate, so the bits are the same (tests/test_step.py)."""
        accs0 = self.accumulators(params)
        expected = {dict_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(accs0)[0]}
        fused = {(*sum_path[:-1], name) for sum_path in expected for name in sum_path[-1].split("+")}
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
        paths = [dict_path(p) for p, _ in leaves_with_path]
        leaves = [leaf for _, leaf in leaves_with_path]
        is_fused = [p in fused for p in paths]

        def objective(rest, accs, tokens, key):
            full = treedef.unflatten([f if fu else r for r, f, fu in zip(rest, leaves, is_fused, strict=True)])
            with layers.accumulator_uses() as uses:
                out = self.micro_objective(full, tokens, key, compute=compute, accs=accs)
            if set(uses) != expected or any(n != 1 for n in uses.values()):
                wrong = sorted("/".join(k) for k in expected.symmetric_difference(uses)) or sorted(
                    "/".join(k) for k, n in uses.items() if n != 1
                )
                raise ValueError(
                    f"the gradient accumulation fusion's running sums must each reach one product; these did not: "
                    f"{wrong[:4]}. Fix: set train.grad_accumulation_fusion=false"
                )
            return out

        grad = jax.grad(objective, argnums=(0, 1), has_aux=True)
        rest = [None if fu else leaf for leaf, fu in zip(leaves, is_fused, strict=True)]

        def body(carry, xs):
            g_acc, accs, sums = carry
            tokens, i = xs
            (g, accs), terms = grad(rest, accs, tokens, jax.random.fold_in(step_key, i))
            with jax.named_scope("grad_accumulate"):
                g_acc = jax.tree.map(jnp.add, g_acc, g)
            return (g_acc, accs, jax.tree.map(jnp.add, sums, terms)), ()

        zeros = [None if fu else jnp.zeros_like(leaf) for leaf, fu in zip(leaves, is_fused, strict=True)]
        n = micro_tokens.shape[0]
        init = (zeros, accs0, (jnp.zeros(()), jnp.zeros(()), jnp.zeros(())))
        (g_rest, accs, sums), _ = jax.lax.scan(body, init, (micro_tokens, jnp.arange(n)))

        cut: dict[tuple, jax.Array] = {}
        for *module, key in expected:
            p_tree, a_tree = (functools.reduce(operator.getitem, module, t) for t in (params, accs))
            for name, g in layers.accumulated_grads(p_tree, {key: a_tree[key]}).items():
                cut[(*module, name)] = g
        g_sum = treedef.unflatten([cut[p] if fu else g for p, g, fu in zip(paths, g_rest, is_fused, strict=True)])
        return (g_sum, sums), ()

    def pipeline_fns(self) -> pipeline.StageFns:
        """The model pieces a pipeline stage runs (detjax.sharding.pipeline takes functions, not models)."""
        m_cfg = self.cfg.model
        n_per = len(m_cfg.pattern) // (self.cfg.mesh.pipeline * self.cfg.mesh.pipeline_virtual)
        # no layout inside the stage body: the auto axes follow the parameter shardings; canonical numerics'
        # feature chunks (determinism.max_tensor) run whole on each stage (tensor 1 with a pipeline)
        tp = self.tensor_split
        model = HybridLM(m_cfg, None, tp)
        blocks = [block_class(m_cfg)(m_cfg, letter, None, tp) for letter in m_cfg.pattern[:n_per]]

        def chunk(chunk_params, h, key, chunk_idx, aux=None, scales=None):
            """aux: the running sum of the earlier blocks' aux losses (canonical numerics carries it from stage
            to stage so that it adds up in layer order, as the one-device model does); else this chunk's own.
            scales: the chunk's fp8 scale sets (model.fp8), else None."""
            aux = jnp.zeros((), jnp.float32) if aux is None else aux
            for j, blk in enumerate(blocks):
                variables = {"params": chunk_params[f"block_{j}"]}
                if scales is not None:
                    variables["fp8"] = scales[f"block_{j}"]
                h, a = blk.apply(variables, h, True, layer_key(key, chunk_idx * n_per + j))
                aux = aux + a
            return h, aux

        def embed(outer, ids, scales=None):  # scales: only because the model's setup declares its fp8 variables
            variables = {"params": outer} | ({"fp8": scales} if scales is not None else {})
            return model.apply(variables, ids, method=HybridLM.embed_ids)

        def head(outer, h, tokens, key, e=None, scales=None):
            variables = {"params": outer} | ({"fp8": scales} if scales is not None else {})
            outs = model.apply(variables, h, tokens[:, :-1], True, key, e, tokens[:, 1:], method=HybridLM.outputs)
            terms = self.objective.terms(*outs, tokens, split=tp)
            return self.objective.total(terms), terms

        return pipeline.StageFns(chunk, embed, head, self.objective.aux_weight, m_cfg.d_model)

    def leaf_objective(
        self, params: Any, tokens_CL1: jax.Array, key: jax.Array, fp8_scales: Any = None, compute: Any = None
    ):
        """(j, terms) of one leaf (determinism.canonical_leaf sequences) of canonical numerics' gradient tree."""
        return self.micro_objective(params, tokens_CL1, key, fp8_scales, self.leaf_model, compute)

    def canonical_grad_sums(self, params: Any, batch_GL1: jax.Array, step_key: jax.Array, fp8_scales: Any = None):
        """Gradient and loss-term sums, and fp8 amaxes, under canonical numerics (detjax.step_canonical)."""
        return step_canonical.canonical_grad_sums(self, params, batch_GL1, step_key, fp8_scales)

    def canonical_pipeline_grad_sums(self, params: Any, batch_GL1: jax.Array, step_key: jax.Array, fp8_scales=None):
        """The same under pipeline parallelism (detjax.step_canonical)."""
        return step_canonical.canonical_pipeline_grad_sums(self, params, batch_GL1, step_key, fp8_scales)

    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (degree > 1), major first."""
        if self.layout is None:
            return ()
        spec = self.layout.spec((ax.BATCH,))
        axes = spec[0] if spec else ()
        return (axes,) if isinstance(axes, str) else tuple(axes or ())

    def batch_shards(self) -> int:
        """How many blocks the batch is split into across devices (the product of the batch axes' degrees)."""
        return math.prod(self.layout.degrees[a] for a in self.batch_axes()) if self.layout is not None else 1

    def grad_sums(self, state: TrainState, micro_tokens: jax.Array, step_key: jax.Array):
        """(gradient sums, loss-term sums, the step's fp8 amaxes: the max over microbatches, or None)."""
        if self.pipelined:
            return pipeline.pipeline_grads(
                self.pipeline_fns(),
                self.cfg,
                self.layout,
                state.params,
                micro_tokens,
                step_key,
                batch_axes=self.batch_axes(),
                fp8_scales=self.fp8_scales(state),
            )
        (g_sum, sums), amax = self.accumulate(state.params, micro_tokens, step_key, fp8_scales=self.fp8_scales(state))
        return g_sum, sums, amax if self.fp8 else None

    def finish(self, state: TrainState, g_sum: Any, sums: Any, update_fn: Callable | None = None):
        """Scale the gradient sums, apply the optimizer; -> (new state, grads, updates, losses).

        update_fn(updates) -> updates may transform the optimizer's updates (fault injection only)."""
        with jax.named_scope("grad_scale"):
            grads = jax.tree.map(lambda g: g / self.objective.n_tok, g_sum)
        with jax.named_scope("optimizer"):
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            if update_fn is not None:
                updates = update_fn(updates)
            params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, grads, updates, self.objective.losses(sums)

    def metrics(self, state: TrainState, new_state: TrainState, grads: Any, losses: dict, batch, step_key) -> dict:
        with jax.named_scope("metrics"):
            if self.canonical:
                squares = canonical.square_sums(grads, self.leaf_keys)
                norm = canonical.global_norm(grads, squares)
            else:
                squares = leaf_square_sums(grads)
                norm = global_norm(grads, squares)
            out = dict(losses, grad_norm=norm, lr=self.schedule(state.step))
        if self.cfg.run.fingerprints:
            with jax.named_scope("fingerprint"):
                # on one device small trees take the flat form (fingerprint.FLAT_WORDS: the same bits, less to
                # compile); on a mesh it would gather the leaves and reshard the ops that produce them
                flat = self.one_device
                params_digest, params_finite = fp.tree_digest_and_finite(new_state.params, flat=flat)
                out["digest"] = {
                    "params": params_digest,
                    "grads": fp.tree_digest(grads, flat),
                    "opt_state": fp.tree_digest(new_state.opt_state, flat),
                    "batch": fp.tensor_digest(batch),
                    "rng": fp.tensor_digest(step_key),
                }
                if new_state.collections:  # fp8 scales and amax histories
                    out["digest"]["collections"] = fp.tree_digest(new_state.collections, flat)
        if not self.guard_nonfinite:
            return out
        with jax.named_scope("nonfinite_guard"):  # its own scope: scripts/profile_step.py --scope prices it
            if not self.cfg.run.fingerprints:  # else the params digest's pass counted them
                params_finite = jnp.stack([fp.nonfinite_count(p) == 0 for p in jax.tree.leaves(new_state.params)])
            out["finite"] = {"grads": jnp.stack([jnp.isfinite(sq) for sq in squares]), "params": params_finite}
        return out

    def conclude(self, state: TrainState, new_state: TrainState, grads: Any, losses: dict, batch, step_key):
        """-> (the state the step leaves, its metrics). With train.on_nonfinite=skip_step a step whose losses,
        gradients or updated parameters are not all finite keeps the old parameters, optimizer state and
        collections (the step counter and the data position still advance); metrics["skipped"] says so, and the
        digests are those of the state kept. The decision is one on-device select: the same on every replay."""
        out = self.metrics(state, new_state, grads, losses, batch, step_key)
        if self.cfg.train.on_nonfinite != "skip_step":
            return new_state, out
        with jax.named_scope("skip_nonfinite"):
            ok = jnp.all(jnp.stack([jnp.all(out["finite"]["grads"]), jnp.all(out["finite"]["params"])]))
            ok = ok & jnp.all(jnp.stack([jnp.isfinite(losses[k]) for k in sorted(losses)]))
            pick = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
            kept = new_state.replace(
                params=pick(new_state.params, state.params),
                opt_state=pick(new_state.opt_state, state.opt_state),
                collections=pick(new_state.collections, state.collections),
            )
        out = self.metrics(state, kept, grads, losses, batch, step_key) | {"skipped": ~ok}
        return kept, out

    # ------------------------------------------------------------------------------------------ step
    def train_step(self, state: TrainState, batch_GL1: jax.Array) -> tuple[TrainState, dict[str, Any]]:
        step_key = self.step_key(state)
        if self.canonical and self.pipelined:
            g_sum, sums, amax = self.canonical_pipeline_grad_sums(
                state.params, batch_GL1, step_key, self.fp8_scales(state)
            )
        elif self.canonical:
            g_sum, sums, amax = self.canonical_grad_sums(state.params, batch_GL1, step_key, self.fp8_scales(state))
        else:
            g_sum, sums, amax = self.grad_sums(state, self.micro_tokens(batch_GL1), step_key)
        new_state, grads, _, losses = self.finish(state, g_sum, sums)
        if amax is not None:  # delayed scaling: the next step's scales from the histories through this step
            with jax.named_scope("fp8_scales"):
                coll = fp8.update_collection(state.collections["fp8"], amax, self.cfg.model.fp8.margin)
            new_state = new_state.replace(collections={**new_state.collections, "fp8": coll})
        return self.conclude(state, new_state, grads, losses, batch_GL1, step_key)

    # ------------------------------------------------------------------------------------------ eval
    def eval_sums(self, state: TrainState, batch_GL1: jax.Array) -> jax.Array:
        """The LM cross-entropy sum (float32) of one held-out batch under the state's parameters: no dropout,
        the microbatches in order (lax.scan), the same kernels and sums as training's forward."""
        scales = self.fp8_scales(state)
        variables = {"params": state.params} | ({"fp8": scales} if scales is not None else {})
        compute = self.compute_copies(state.params)
        if compute:  # cast (and fused) once, before the microbatch loop, as in training
            variables["compute"] = compute

        def body(acc, tokens_BL1):
            logits_BLV = self.model.apply(variables, tokens_BL1[:, :-1], train=False)[0]
            return acc + token_ce_sum(logits_BLV, tokens_BL1[:, 1:]), None

        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), self.micro_tokens(batch_GL1))
        return total


def cache_key(trainer: Trainer, kind: str, *shardings: Any) -> Any:
    """What a compiled variant of the step depends on: the trajectory config and the shardings."""
    c = trainer.cfg
    shardings = tuple((jax.tree.structure(s), tuple(jax.tree.leaves(s))) for s in shardings)
    return (kind, c.model, c.train, c.determinism, c.debug, c.run.fingerprints, c.mesh, trainer.layout, *shardings)


# One compiled function per cache key: in-process reruns and resumes reuse it.
_COMPILED: dict[Any, Any] = {}


def compile_cached(key: Any, build: Callable[[], Any]) -> Any:
    if key not in _COMPILED:
        _COMPILED[key] = build()
    return _COMPILED[key]


def compile_train_step(trainer: Trainer, state_sharding: Any, batch_sharding: Any):
    """The one jit of the train step: explicit shardings, state donated."""
    return compile_cached(
        cache_key(trainer, "step", state_sharding, batch_sharding),
        lambda: jax.jit(
            trainer.train_step,
            in_shardings=(state_sharding, batch_sharding),
            out_shardings=(state_sharding, None),
            donate_argnums=(0,),
        ),
    )


def compile_eval_step(trainer: Trainer, state_sharding: Any, batch_sharding: Any):
    """The held-out loss sum of one batch (eval.every); the state is read, not donated."""
    return compile_cached(
        cache_key(trainer, "eval", state_sharding, batch_sharding),
        lambda: jax.jit(trainer.eval_sums, in_shardings=(state_sharding, batch_sharding)),
    )


def compile_init(trainer: Trainer, state_sharding: Any):
    """The initial state, compiled for `state_sharding`. Under canonical numerics on a mesh the state is
    computed whole on every device (the one-device program and values) and then sliced to its shardings: an
    init partitioned over the mesh runs its elementwise ops (the normal transform) as other programs, whose
    FMA contractions can differ (measured on CPU: 11 elements of a Mamba2 dt projection one ulp apart
    between tensor 1 and 2). It needs the whole state in each device's memory once, at the start."""
    if trainer.canonical and trainer.layout is not None:
        whole = jax.tree.map(lambda s: NamedSharding(s.mesh, P()), state_sharding)
        init = compile_cached(
            cache_key(trainer, "init", whole), lambda: jax.jit(trainer.init_state, out_shardings=whole)
        )
        return lambda key: jax.device_put(init(key), state_sharding)
    return compile_cached(
        cache_key(trainer, "init", state_sharding),
        lambda: jax.jit(trainer.init_state, out_shardings=state_sharding),
    )
