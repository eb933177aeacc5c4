"""Pipeline parallelism: layer stages over `pipeline` by shard_map + ppermute, with a static schedule.

Layout. The layer pattern is cut into C = pipeline x pipeline_virtual chunks of equal, identical block
sequences (config validation says so otherwise). Chunk c runs on pipeline rank c % S as its virtual stage
c // S (Megatron's interleaving). Chunk parameters are stacked: every leaf of `params["stages"]` has shape
(V, S, ...) and is split over `pipeline` on dimension 1; everything else (embedding, norms, LM head, MTP
head) is replicated over `pipeline`. The first chunk embeds the tokens; the last computes the LM head, the
MTP head and the losses.

Schedule. A Python simulator (detjax.sharding.schedule) turns the per-rank action order of GPipe (all
forwards, then all backwards) or 1F1B (warm-up forwards, then one forward / one backward, then cool-down;
Megatron's interleaved order when V > 1) into a table of ticks: at each tick every rank runs one action —
forward F(v, m), backward B(v, m) or nothing — then sends its forward output to the next rank and its
input gradient to the previous rank (two ppermutes). A backward recomputes its chunk's forward from the
stored chunk input (jax.vjp), so a rank stores one input and one output-gradient per (virtual stage,
microbatch).

Order. Every rank accumulates a chunk's parameter gradient over microbatches in ascending microbatch
order, as the single-device step does; the replicated parameters' partial gradients (embedding on the
first rank, heads on the last) and the loss sums are summed over `pipeline` once, at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from detjax.config import Config
from detjax.sharding import canonical as canon
from detjax.sharding import rules as ax
from detjax.sharding.schedule import build_schedule


def _chunking(cfg: Config) -> tuple[int, int, int]:
    s, v = cfg.mesh.pipeline, cfg.mesh.pipeline_virtual
    return s, v, len(cfg.model.pattern) // (s * v)


def stack_params(params: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """Canonical params (layer_0 ... layer_{N-1}) -> pipeline layout with params["stages"] of (V, S, ...)."""
    s, v, n = _chunking(cfg)
    out = {k: x for k, x in params.items() if not k.startswith("layer_")}
    blocks = {}
    for j in range(n):
        per_chunk = [params[f"layer_{c * n + j}"] for c in range(s * v)]
        blocks[f"block_{j}"] = jax.tree.map(lambda *xs: jnp.stack(xs).reshape((v, s) + xs[0].shape), *per_chunk)
    out["stages"] = blocks
    return out


def unstack_params(params: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """The inverse of stack_params."""
    s, v, n = _chunking(cfg)
    out = {k: x for k, x in params.items() if k != "stages"}
    for j in range(n):
        flat = jax.tree.map(lambda x: x.reshape((v * s,) + x.shape[2:]), params["stages"][f"block_{j}"])
        for c in range(s * v):
            out[f"layer_{c * n + j}"] = jax.tree.map(lambda x, c=c: x[c], flat)
    return dict(sorted(out.items()))


def stack_specs(specs: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """Logical specs for the pipeline layout: stacked leaves get (virtual, stages, *their own names)."""
    _, _, n = _chunking(cfg)
    out = {k: x for k, x in specs.items() if not k.startswith("layer_")}
    out["stages"] = {
        f"block_{j}": jax.tree.map(
            lambda sp: P(ax.VIRTUAL, ax.STAGES, *sp), specs[f"layer_{j}"], is_leaf=lambda x: isinstance(x, P)
        )
        for j in range(n)
    }
    return out


# ---------------------------------------------------------------------------------------------- executor


def _get(buf: jax.Array, v: jax.Array, m: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(buf, v, 0, False), m, 0, False)


def _put(buf: jax.Array, x: jax.Array, v: jax.Array, m: jax.Array) -> jax.Array:
    """buf[v, m] = x as a dynamic_update_slice (an indexed .at[].set would lower to a scatter)."""
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(buf, x[None, None], (v, m) + (zero,) * x.ndim)


def _tree_get(tree: Any, v: jax.Array) -> Any:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, v, 0, False), tree)


def _tree_add_at(tree: Any, delta: Any, v: jax.Array) -> Any:
    def f(acc, d):
        cur = jax.lax.dynamic_index_in_dim(acc, v, 0, False)
        return jax.lax.dynamic_update_index_in_dim(acc, cur + d, v, 0)

    return jax.tree.map(f, tree, delta)


def _tree_max_at(tree: Any, amax: Any, v: jax.Array) -> Any:
    """tree[v] = max(tree[v], amax) leaf by leaf (fp8 amaxes over microbatches: exact in any order)."""

    def f(acc, a):
        cur = jax.lax.dynamic_index_in_dim(acc, v, 0, False)
        return jax.lax.dynamic_update_index_in_dim(acc, jnp.maximum(cur, a), v, 0)

    return jax.tree.map(f, tree, amax)


def _acc_push_at(acc: canon.TreeAccumulator, state: Any, x: Any, v: jax.Array, m: jax.Array) -> Any:
    """Push x as leaf m into the accumulator state of virtual stage v (every state leaf has a leading V axis)."""
    cur = _tree_get(state, v)
    new = acc.push(cur, x, m)
    return jax.tree.map(lambda a, n: jax.lax.dynamic_update_index_in_dim(a, n, v, 0), state, new)


def _from_rank(x: jax.Array, rank: int, s: jax.Array) -> jax.Array:
    """rank's x on every rank, bit for bit: a sum of the bits as integers (a float psum with zeros would turn
    a -0.0 into +0.0)."""
    if jnp.dtype(x.dtype).itemsize != 4:
        raise ValueError(f"_from_rank moves 4-byte values, got {x.dtype}")
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = jax.lax.psum(jnp.where(s == rank, bits, jnp.zeros_like(bits)), "pipeline")
    return jax.lax.bitcast_convert_type(bits, x.dtype)


@dataclass(frozen=True)
class StageFns:
    """What a pipeline runs, as functions (the model stays in detjax.model; the Trainer builds these):
    chunk(chunk_params, h, key, chunk_index, aux=None, scales=None) -> (h, aux: aux + the chunk's aux losses
    in layer order, or the chunk's own sum); embed(outer_params, ids, scales=None) -> h;
    head(outer_params, h, tokens, key, e=None, scales=None) -> (objective j, (lm sum, MTP sum, MTP aux)) with
    e the MTP's embedding of ids[:, 1:] when the caller made it; aux_weight = d j / d aux. scales: the
    chunk's / the outer layers' fp8 scale sets (model.fp8), or None."""

    chunk: Callable[..., tuple[jax.Array, jax.Array]]
    embed: Callable[..., jax.Array]
    head: Callable[..., tuple[jax.Array, Any]]
    aux_weight: float
    d_model: int


def pipeline_grads(
    fns: StageFns,
    cfg: Config,
    layout: ax.Layout,
    params: dict[str, Any],
    micro_tokens,
    step_key,
    canonical: bool = False,
    batch_axes: tuple[str, ...] = (),
    tensor_specs: Any = None,
    fp8_scales: Any = None,
):
    """Gradient sums of the step objective, the (lm, mtp, aux) sums, like the single-device scan, and the
    step's fp8 amaxes (None without fp8_scales).

    fp8_scales (model.fp8): the scale sets in the pipeline layout (`stack_params`' split: "stages" and the
    outer layers). Every forward and backward of a chunk or head runs with them, and its amaxes -- their
    "gradient", detjax.model.fp8 -- are taken as the maximum over microbatches, ranks and batch shards (exact
    in any order, so under canonical numerics they are the one-device step's too).

    canonical: each microbatch is one leaf of canonical numerics' pair tree (detjax.sharding.canonical), and
    the sums are the one-device canonical step's, bit for bit:
    - every parameter gradient and the loss terms go, leaf by leaf in ascending microbatch order, into a
      TreeAccumulator on the rank that computes them (one per virtual stage for the stacked blocks);
    - the aux losses are summed in layer order across stages (the running sum travels with the activations);
    - the embedding, used by the first stage and by the MTP head on the last, gets both of a leaf's
      contributions added on the first rank before its tree (the last rank sends the cotangent of the MTP's
      embedding there, and the first rank takes its gradient), as one device adds them;
    - the replicated parameters' sums and the loss sums are then taken from their owning rank, bit for bit
      (never a float psum with zeros).
    batch_axes: the mesh axes the batch is split over. Canonical: shard k of S runs its own pipeline over the
    contiguous block of leaves [k N/S, (k+1) N/S) (each with the dropout key of its global index), and the S
    block sums meet in the top levels of the same pair tree inside the shard_map (canonical.reduce_to_shards,
    whole on every batch shard), as in Trainer.canonical_grad_sums. Default numerics: below.
    tensor_specs (canonical only): each parameter's PartitionSpec over `tensor` in the pipeline layout
    (stacked leaves' specs start with their virtual and stage dims): the stages run canonical tensor
    parallelism's chunks (detjax.sharding.tensor) on their tensor shards, manual over `tensor` too.

    Default numerics with batch_axes: every batch shard runs the pipeline on its own rows of every
    microbatch (train.micro_batch / shards each), and the sums are taken at the end, over the pipeline ranks
    and then over each batch axis. The batch axes are manual, not left to the partitioner, because a
    partitioner-made collective inside a stage's branch would need every device, while at one tick only one
    stage's devices run that branch (XLA's CPU runtime aborted such a step after waiting for the others: a
    collective permute of the Mamba2 decay gradient's pair tree over batch-sharded tokens). Each shard's rows
    are one aux-loss group (loss.Objective.from_config's aux_shards), as each rank's microbatch is in
    Megatron."""
    n_stages, n_virtual, _ = _chunking(cfg)
    n_shards = math.prod(layout.degrees[a] for a in batch_axes)
    # microbatches per pipeline: canonical shards pipeline blocks of whole leaves, default shards split rows
    n_micro = cfg.train.n_micro // n_shards if canonical else cfg.train.n_micro
    sched = build_schedule(cfg.mesh.schedule, n_stages, n_virtual, n_micro)
    chunk_fn, embed_fn, head_objective, aux_w = fns.chunk, fns.embed, fns.head, fns.aux_weight
    mtp = cfg.model.mtp.depth > 0
    acc = canon.TreeAccumulator(n_micro) if canonical else None
    last_c = n_stages * n_virtual - 1

    outer0 = {k: x for k, x in params.items() if k != "stages"}
    fp8_on = fp8_scales is not None
    s_outer0 = {k: x for k, x in fp8_scales.items() if k != "stages"} if fp8_on else {}
    s_stages0 = fp8_scales.get("stages", {}) if fp8_on else {}

    def body(outer, stages, tokens, skey, s_outer, s_stages):
        s = jax.lax.axis_index("pipeline")
        s_stages = jax.tree.map(lambda x: x[:, 0], s_stages)  # (V, 1, ...) -> (V, ...)
        s_out = s_outer or None  # the outer layers' fp8 scale sets (the model's setup declares them), or None
        shard = jax.lax.axis_index(batch_axes) if batch_axes else 0
        leaf0 = shard * n_micro if canonical else 0  # canonical: this shard's first global leaf
        stages = jax.tree.map(lambda x: x[:, 0], stages)  # (V, 1, ...) -> (V, ...)
        mb, length = tokens.shape[1], tokens.shape[2] - 1
        h_shape = (mb, length, fns.d_model)
        zeros_h = jnp.zeros(h_shape, jnp.float32)
        carry = {
            "act": jnp.zeros((n_virtual, n_micro) + h_shape, jnp.float32),
            "grad": jnp.zeros((n_virtual, n_micro) + h_shape, jnp.float32),
            "g_stages": jax.tree.map(jnp.zeros_like, stages),
            "g_outer": jax.tree.map(jnp.zeros_like, outer),
            "sums": jnp.zeros((3,), jnp.float32),
        }
        if fp8_on:  # amaxes are >= 0: zero is the identity of their maximum
            carry["amax_stages"] = jax.tree.map(jnp.zeros_like, s_stages)
            carry["amax_outer"] = jax.tree.map(jnp.zeros_like, s_outer)
        if canonical:
            carry["g_stages"] = acc.init(stages)
            carry["g_outer"] = acc.init(outer)
            carry["sums"] = acc.init(jnp.zeros((3,), jnp.float32))
            carry["aux"] = jnp.zeros((n_virtual, n_micro), jnp.float32)  # the running aux sum arriving per (v, m)
            if mtp:  # first rank: the cotangent of the MTP's embedding per microbatch, sent by the last rank
                e_sd = jax.eval_shape(lambda o, t: embed_fn(o, t[:, 1:-1], s_out), outer, tokens[0])
                carry["e_ct"] = jnp.zeros((n_micro,) + e_sd.shape, e_sd.dtype)

        def tick(carry, rows):
            act_row, rf_row, rb_row = (jax.lax.dynamic_index_in_dim(r, s, 0, False) for r in rows)
            kind, v, m = act_row[0], act_row[1], act_row[2]
            c_idx = v * n_stages + s
            first, last = c_idx == 0, c_idx == last_c
            tok_m = jax.lax.dynamic_index_in_dim(tokens, m, 0, False)
            key_m = jax.random.fold_in(skey, leaf0 + m)
            if batch_axes and not canonical:  # default: each shard's rows their own dropout masks
                key_m = jax.random.fold_in(key_m, shard)
            p_v = _tree_get(stages, v)
            sc_v = _tree_get(s_stages, v) if fp8_on else None

            def chunk_input():
                return jax.lax.cond(
                    first, lambda: embed_fn(outer, tok_m[:, :-1], s_out), lambda: _get(carry["act"], v, m)
                )

            zero = jnp.zeros((), jnp.float32)
            zeros_e = jnp.zeros(carry["e_ct"].shape[1:], carry["e_ct"].dtype) if canonical and mtp else None

            def aux_in(c):  # canonical: the running aux sum of the layers before this chunk
                return jnp.where(first, zero, _get(c["aux"], v, m)) if canonical else None

            def idle(c):
                return c, zeros_h, zeros_h, zero, zeros_e

            def fwd(c):
                y, aux = chunk_fn(p_v, chunk_input(), key_m, c_idx, aux_in(c), sc_v)
                e_out = zeros_e

                def head(c):
                    _, vjp, terms = jax.vjp(
                        lambda o, h, sc: head_objective(o, h, tok_m, key_m, None, sc or None),
                        outer,
                        y,
                        s_outer,
                        has_aux=True,
                    )
                    d_outer, dy, amax = vjp(jnp.ones((), jnp.float32))
                    c = dict(c, grad=_put(c["grad"], dy, v, m))
                    if fp8_on:
                        c["amax_outer"] = jax.tree.map(jnp.maximum, c["amax_outer"], amax)
                    c["g_outer"] = jax.tree.map(jnp.add, c["g_outer"], d_outer)
                    c["sums"] = c["sums"] + jnp.stack(terms)
                    return c

                def canonical_head(c):
                    e = embed_fn(outer, tok_m[:, 1:-1], s_out) if mtp else None

                    def objective(o, h, e, sc):
                        return head_objective(o, h, tok_m, key_m, e, sc or None)

                    _, vjp, (lm, mtp_sum, mtp_aux) = jax.vjp(objective, outer, y, e, s_outer, has_aux=True)
                    d_outer, dy, d_e, amax = vjp(jnp.ones((), jnp.float32))
                    if fp8_on:
                        c = dict(c, amax_outer=jax.tree.map(jnp.maximum, c["amax_outer"], amax))
                    terms = jnp.stack([lm, mtp_sum, aux + mtp_aux])  # one device: (main aux) + MTP aux
                    d_outer, terms = jax.lax.optimization_barrier((d_outer, terms))
                    c = dict(c, grad=_put(c["grad"], dy, v, m))
                    c["g_outer"] = acc.push(c["g_outer"], d_outer, m)  # its embedding part is not used
                    c["sums"] = acc.push(c["sums"], terms, m)
                    return c, (d_e if mtp else zeros_e)

                if canonical:
                    c, e_out = jax.lax.cond(last, canonical_head, lambda c: (c, zeros_e), c)
                else:
                    c = jax.lax.cond(last, head, lambda c: c, c)
                    c = dict(c, sums=c["sums"] + jnp.stack([0.0, 0.0, aux]))
                return c, y, zeros_h, aux, e_out

            def bwd(c):
                x = chunk_input()
                dy = _get(c["grad"], v, m)
                a_in = aux_in(c)
                _, vjp = jax.vjp(lambda p, h, sc: chunk_fn(p, h, key_m, c_idx, a_in, sc), p_v, x, sc_v)
                dp, dx, amax = vjp((dy, jnp.asarray(aux_w, jnp.float32)))
                if fp8_on:
                    c = dict(c, amax_stages=_tree_max_at(c["amax_stages"], amax, v))
                if canonical:
                    dp = jax.lax.optimization_barrier(dp)
                    c = dict(c, g_stages=_acc_push_at(acc, c["g_stages"], dp, v, m))
                else:
                    c = dict(c, g_stages=_tree_add_at(c["g_stages"], dp, v))

                def embed_grad(c):
                    _, evjp = jax.vjp(lambda o: embed_fn(o, tok_m[:, :-1], s_out), outer)
                    (d_outer,) = evjp(dx)
                    if not canonical:
                        return dict(c, g_outer=jax.tree.map(jnp.add, c["g_outer"], d_outer))
                    if mtp:  # the leaf's other use of the embedding (the MTP head's), added as one device adds it
                        _, mvjp = jax.vjp(lambda o: embed_fn(o, tok_m[:, 1:-1], s_out), outer)
                        (d_mtp,) = mvjp(jax.lax.dynamic_index_in_dim(c["e_ct"], m, 0, False))
                        d_outer = dict(d_outer, embed=jax.tree.map(jnp.add, d_mtp["embed"], d_outer["embed"]))
                    d_outer = jax.lax.optimization_barrier(d_outer)
                    return dict(c, g_outer=acc.push(c["g_outer"], d_outer, m))  # only its embedding part is used

                c = jax.lax.cond(first, embed_grad, lambda c: c, c)
                return c, zeros_h, dx, zero, zeros_e

            carry, send_f, send_b, send_aux, send_e = jax.lax.switch(kind, [idle, fwd, bwd], carry)
            ring_next = [(i, (i + 1) % n_stages) for i in range(n_stages)]
            ring_prev = [(i, (i - 1) % n_stages) for i in range(n_stages)]
            recv_f = jax.lax.ppermute(send_f, "pipeline", ring_next)
            recv_b = jax.lax.ppermute(send_b, "pipeline", ring_prev)
            carry = dict(carry)
            carry["act"] = jnp.where(rf_row[0] == 1, _put(carry["act"], recv_f, rf_row[1], rf_row[2]), carry["act"])
            carry["grad"] = jnp.where(rb_row[0] == 1, _put(carry["grad"], recv_b, rb_row[1], rb_row[2]), carry["grad"])
            if canonical:
                recv_aux = jax.lax.ppermute(send_aux, "pipeline", ring_next)
                put_aux = jax.lax.dynamic_update_slice(carry["aux"], recv_aux[None, None], (rf_row[1], rf_row[2]))
                carry["aux"] = jnp.where(rf_row[0] == 1, put_aux, carry["aux"])
            if canonical and mtp:  # the last rank's MTP embedding cotangent, to the first rank
                recv_e = jax.lax.ppermute(send_e, "pipeline", [(n_stages - 1, 0)])
                sender = rows[0][n_stages - 1]  # the last rank's action this tick: (kind, v, m)
                sent = (sender[0] == 1) & (sender[1] * n_stages + n_stages - 1 == last_c) & (s == 0)
                put_e = jax.lax.dynamic_update_index_in_dim(carry["e_ct"], recv_e, sender[2], 0)
                carry["e_ct"] = jnp.where(sent, put_e, carry["e_ct"])
            return carry, None

        tables = tuple(jnp.asarray(a) for a in (sched.action, sched.recv_f, sched.recv_b))
        carry, _ = jax.lax.scan(tick, carry, tables)
        amax = ()
        if fp8_on:  # the maximum over ranks (outer layers: zeros where a rank ran no head) and batch shards
            a_outer = jax.lax.pmax(carry["amax_outer"], ("pipeline", *batch_axes))
            a_stages = jax.lax.pmax(carry["amax_stages"], batch_axes) if batch_axes else carry["amax_stages"]
            amax = (a_outer, jax.tree.map(lambda x: x[:, None], a_stages))
        if canonical:  # each sum from the rank that made it: the embedding's on the first, the rest on the last
            g_outer = {
                k: jax.tree.map(lambda x, r=(0 if k == "embed" else n_stages - 1): _from_rank(x, r, s), sub)
                for k, sub in carry["g_outer"]["total"].items()
            }
            sums = _from_rank(carry["sums"]["total"], n_stages - 1, s)
            g_stages = jax.tree.map(lambda x: x[:, None], carry["g_stages"]["total"])
            if batch_axes:  # the batch shards' subtrees: the top of the pair tree (canonical.reduce_to_shards)
                leaves, tdef = jax.tree.flatten((g_outer, g_stages, sums))
                degrees = {a: layout.degrees[a] for a in batch_axes}
                leaves = canon.reduce_to_shards(leaves, [()] * len(leaves), batch_axes, degrees)
                g_outer, g_stages, sums = jax.tree.unflatten(tdef, leaves)
            return g_outer, g_stages, sums, amax
        # Partial gradients of the replicated parameters and the loss sums: summed over the pipeline ranks, then
        # over each batch axis; the stages' gradients over each batch axis. One axis per psum keeps each sum
        # to that axis's degree of operands (two on dp2-tp2-pp2: a + b == b + a, so a multi-process run's
        # transport cannot order them apart from one process's: tests/test_mesh.py).
        g_outer, sums, g_stages = jax.lax.psum((carry["g_outer"], carry["sums"]), "pipeline") + (carry["g_stages"],)
        for a in batch_axes:
            g_outer, sums, g_stages = jax.lax.psum((g_outer, sums, g_stages), a)
        g_stages = jax.tree.map(lambda x: x[:, None], g_stages)
        return g_outer, g_stages, sums, amax

    # canonical: manual over tensor (the chunks with tensor_specs, else whole on every tensor device, as one
    # device computes); default: tensor stays automatic, the partitioner splits the stages' products
    manual_tensor = canonical and layout.degrees["tensor"] > 1
    if tensor_specs is None:
        tensor_specs = jax.tree.map(lambda x: P(*([None] * x.ndim)), params)
    is_p = {"is_leaf": lambda x: isinstance(x, P)}
    t_outer = {k: v for k, v in tensor_specs.items() if k != "stages"}
    stage_spec = jax.tree.map(lambda t: P(None, "pipeline", *tuple(t)[2:]), tensor_specs["stages"], **is_p)
    outer_spec = jax.tree.map(lambda t: P(*t), t_outer, **is_p)
    out_specs = (outer_spec, stage_spec, P())  # canonical: the sums whole on every batch shard
    # canonical: each batch shard (k) its own block of microbatches; default: rows of every microbatch split
    tok_spec = P(batch_axes or None) if canonical else P(None, batch_axes or None)
    # fp8 scale sets: replicated except the stages' split over `pipeline`; their amaxes come out the same way
    s_outer_spec = jax.tree.map(lambda x: P(), s_outer0)
    s_stage_spec = jax.tree.map(lambda x: P(None, "pipeline"), s_stages0)
    amax_specs = (s_outer_spec, s_stage_spec) if fp8_on else ()
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(outer_spec, stage_spec, tok_spec, P(), s_outer_spec, s_stage_spec),
        out_specs=(*out_specs, amax_specs),
        axis_names=frozenset({"pipeline", *batch_axes, *(["tensor"] if manual_tensor else [])}),
        check_vma=False,
    )
    g_outer, g_stages, sums, amax = fn(outer0, params["stages"], micro_tokens, step_key, s_outer0, s_stages0)
    grads = dict(g_outer, stages=g_stages)
    amax = dict(amax[0], stages=amax[1]) if fp8_on else None
    return grads, (sums[0], sums[1], sums[2]), amax
