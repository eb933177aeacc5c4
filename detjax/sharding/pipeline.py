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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from detjax.config import Config
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


@dataclass(frozen=True)
class StageFns:
    """What a pipeline runs, as functions (the model stays in detjax.model; the Trainer builds these):
    chunk(chunk_params, h, key, chunk_index) -> (h, aux); embed(outer_params, ids) -> h;
    head(outer_params, h, tokens, key) -> (objective j, (lm sum, MTP sum, aux)); aux_weight = d j / d aux."""

    chunk: Callable[..., tuple[jax.Array, jax.Array]]
    embed: Callable[..., jax.Array]
    head: Callable[..., tuple[jax.Array, Any]]
    aux_weight: float
    d_model: int


def pipeline_grads(fns: StageFns, cfg: Config, layout: ax.Layout, params: dict[str, Any], micro_tokens, step_key):
    """Gradient sums of the step objective and the (lm, mtp, aux) sums, like the single-device scan."""
    n_stages, n_virtual, _ = _chunking(cfg)
    n_micro = cfg.train.n_micro
    sched = build_schedule(cfg.mesh.schedule, n_stages, n_virtual, n_micro)
    chunk_fn, embed_fn, head_objective, aux_w = fns.chunk, fns.embed, fns.head, fns.aux_weight

    outer0 = {k: x for k, x in params.items() if k != "stages"}

    def body(outer, stages, tokens, skey):
        s = jax.lax.axis_index("pipeline")
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

        def tick(carry, rows):
            act_row, rf_row, rb_row = (jax.lax.dynamic_index_in_dim(r, s, 0, False) for r in rows)
            kind, v, m = act_row[0], act_row[1], act_row[2]
            c_idx = v * n_stages + s
            first, last = c_idx == 0, c_idx == n_stages * n_virtual - 1
            tok_m = jax.lax.dynamic_index_in_dim(tokens, m, 0, False)
            key_m = jax.random.fold_in(skey, m)
            p_v = _tree_get(stages, v)

            def chunk_input():
                return jax.lax.cond(first, lambda: embed_fn(outer, tok_m[:, :-1]), lambda: _get(carry["act"], v, m))

            def idle(c):
                return c, zeros_h, zeros_h

            def fwd(c):
                y, aux = chunk_fn(p_v, chunk_input(), key_m, c_idx)

                def head(c):
                    _, vjp, terms = jax.vjp(lambda o, h: head_objective(o, h, tok_m, key_m), outer, y, has_aux=True)
                    d_outer, dy = vjp(jnp.ones((), jnp.float32))
                    c = dict(c, grad=_put(c["grad"], dy, v, m))
                    c["g_outer"] = jax.tree.map(jnp.add, c["g_outer"], d_outer)
                    c["sums"] = c["sums"] + jnp.stack(terms)
                    return c

                c = jax.lax.cond(last, head, lambda c: c, c)
                c = dict(c, sums=c["sums"] + jnp.stack([0.0, 0.0, aux]))
                return c, y, zeros_h

            def bwd(c):
                x = chunk_input()
                dy = _get(c["grad"], v, m)
                _, vjp = jax.vjp(lambda p, h: chunk_fn(p, h, key_m, c_idx), p_v, x)
                dp, dx = vjp((dy, jnp.asarray(aux_w, jnp.float32)))
                c = dict(c, g_stages=_tree_add_at(c["g_stages"], dp, v))

                def embed_grad(c):
                    _, evjp = jax.vjp(lambda o: embed_fn(o, tok_m[:, :-1]), outer)
                    (d_outer,) = evjp(dx)
                    return dict(c, g_outer=jax.tree.map(jnp.add, c["g_outer"], d_outer))

                c = jax.lax.cond(first, embed_grad, lambda c: c, c)
                return c, zeros_h, dx

            carry, send_f, send_b = jax.lax.switch(kind, [idle, fwd, bwd], carry)
            ring_next = [(i, (i + 1) % n_stages) for i in range(n_stages)]
            ring_prev = [(i, (i - 1) % n_stages) for i in range(n_stages)]
            recv_f = jax.lax.ppermute(send_f, "pipeline", ring_next)
            recv_b = jax.lax.ppermute(send_b, "pipeline", ring_prev)
            carry = dict(carry)
            carry["act"] = jnp.where(rf_row[0] == 1, _put(carry["act"], recv_f, rf_row[1], rf_row[2]), carry["act"])
            carry["grad"] = jnp.where(rb_row[0] == 1, _put(carry["grad"], recv_b, rb_row[1], rb_row[2]), carry["grad"])
            return carry, None

        tables = tuple(jnp.asarray(a) for a in (sched.action, sched.recv_f, sched.recv_b))
        carry, _ = jax.lax.scan(tick, carry, tables)
        # Partial gradients of the replicated parameters and the loss sums: one sum over the pipeline ranks.
        g_outer = jax.lax.psum(carry["g_outer"], "pipeline")
        sums = jax.lax.psum(carry["sums"], "pipeline")
        g_stages = jax.tree.map(lambda x: x[:, None], carry["g_stages"])
        return g_outer, g_stages, sums

    stage_spec = jax.tree.map(lambda _: P(None, "pipeline"), params["stages"])
    outer_spec = jax.tree.map(lambda _: P(), outer0)
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(outer_spec, stage_spec, P(), P()),
        out_specs=(outer_spec, stage_spec, P()),
        axis_names=frozenset({"pipeline"}),
        check_vma=False,
    )
    g_outer, g_stages, sums = fn(outer0, params["stages"], micro_tokens, step_key)
    grads = dict(g_outer, stages=g_stages)
    return grads, (sums[0], sums[1], sums[2])
