"""Dropless mixture of experts: router, stable top-k, permutation dispatch, grouped matmul, ordered combine.

Dispatch and combine are a row permutation (with the inverse permutation as its backward) and a
fixed-order sum over the k slots, so neither the forward nor the backward needs a scatter-add.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from detjax.config import MoEConfig
from detjax.model.dispatch import combine_slots, expert_ffn, expert_ffn_chunked, permute_rows, sort_by_expert
from detjax.model.fp8 import scale_var
from detjax.model.layers import MLP, acc_of, normal_init, param, pinned_normalize, pinned_softmax, proj, tree_sum_last
from detjax.sharding import rules as ax
from detjax.sharding.expert import ExpertSplit, canonical_expert_moe, expert_parallel_moe
from detjax.sharding.tensor import TensorSplit


def route(logits_TE: jax.Array, top_k: int, router: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (expert index T×X, gate T×X, router probabilities T×E); ties go to the lower expert id.

    The sums over experts (softmax, gate normalisation) are layers.tree_sum_last, forward and backward: no
    reduce op whose order XLA's fusion could pick differently in another program (docs/DETERMINISM.md)."""
    logits_TE = logits_TE.astype(jnp.float32)
    probs_TE = pinned_softmax(logits_TE) if router == "softmax" else jax.nn.sigmoid(logits_TE)
    # stable sort on -p: equal scores keep ascending expert order (an explicit, platform-free tie-break)
    idx_TX = jnp.argsort(-jax.lax.stop_gradient(probs_TE), axis=-1, stable=True)[:, :top_k]
    onehot_TXE = jax.nn.one_hot(idx_TX, probs_TE.shape[-1], dtype=probs_TE.dtype)
    # a gather written as a masked sum (one nonzero term: exact in any order, and so is its transpose), not a
    # dot: nothing for a GEMM library to pick
    gate_TX = pinned_normalize(jnp.sum(probs_TE[:, None, :] * onehot_TXE, axis=-1))
    return idx_TX, gate_TX, probs_TE


def load_balance_loss(idx_TX: jax.Array, probs_TE: jax.Array) -> jax.Array:
    """Switch-style aux loss E * sum_e f_e * P_e (f: routed fraction, P: mean normalised probability). Its sums
    over experts are tree_sum_last (see `route`)."""
    n_exp = probs_TE.shape[-1]
    counts_E = jnp.sum(jax.nn.one_hot(idx_TX, n_exp, dtype=jnp.float32), axis=(0, 1))  # integers: exact
    f_E = jax.lax.stop_gradient(counts_E / idx_TX.size)
    # the token mean stays a reduce: tokens may be sharded over devices (a halving tree would need collective
    # permutes), and its gradient is a broadcast, so its order never reaches the weights
    p_E = jnp.mean(pinned_normalize(probs_TE), axis=0)
    return n_exp * tree_sum_last(f_E * p_E)[0]


class Experts(nn.Module):
    """Dispatch, the experts' grouped matmuls and the ordered combine: (T×D tokens, routing) -> T×D.

    With `mesh.expert > 1` the experts are split over the `expert` axis and tokens travel to them by
    all-to-all inside shard_map (detjax.sharding.expert); otherwise every expert is local. With `ep`
    (canonical numerics' leaf program, already inside shard_map) the weights are this device's experts, one
    copy per source device (expert.canonical_expert_moe).
    """

    n_experts: int
    d_model: int
    ffn_dim: int
    init_std: float
    dtype: jnp.dtype
    combine: str = "gather"
    layout: ax.Layout | None = None
    kernels: str = "reference"
    fp8: bool = False  # model.fp8.enabled: the grouped matmuls in fp8 with delayed scaling
    tp: TensorSplit | None = None  # canonical tensor parallelism: the experts' width in fixed chunks
    ep: ExpertSplit | None = None  # canonical expert dispatch

    @nn.compact
    def __call__(self, x_TD: jax.Array, idx_TX: jax.Array, gate_TX: jax.Array) -> jax.Array:
        e, d, f, dtype, tp = self.n_experts, self.d_model, self.ffn_dim, self.dtype, self.tp
        init = normal_init(self.init_std)
        # with `ep` the leaf program passes (A, E/A, ...) per-source copies in place of the (E, ...) stacks
        lead, lead_axes = ((e,), (ax.EXPERTS,))
        if self.ep is not None:
            lead, lead_axes = (self.ep.degree, e // self.ep.degree), (None, ax.EXPERTS)
        w_gate_EDF = param(self, "w_gate", init, (*lead, d, f), (*lead_axes, ax.EXPERT_EMBED, ax.EXPERT_MLP), tp)
        w_up_EDF = param(self, "w_up", init, (*lead, d, f), (*lead_axes, ax.EXPERT_EMBED, ax.EXPERT_MLP), tp)
        w_down_EFD = param(self, "w_down", init, (*lead, f, d), (*lead_axes, ax.EXPERT_MLP, ax.EXPERT_EMBED), tp)
        weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
        scales = tuple(scale_var(self, n, True) for n in ("gate", "up", "down")) if self.fp8 else None
        if self.ep is not None:  # the params are per-source copies: (A, E/A, ...) each
            return canonical_expert_moe(x_TD, idx_TX, gate_TX, weights, self.ep, dtype, self.kernels, scales, tp)
        if self.layout is not None and self.layout.degrees["expert"] > 1:
            return expert_parallel_moe(x_TD, idx_TX, gate_TX, weights, self.layout, dtype, scales)

        t, k = idx_TX.shape
        _, order_R, inv_R, gs_E = sort_by_expert(idx_TX, e)
        self.sow("intermediates", "dispatch_order", order_R)  # row-wise trace tap (detjax.trace)
        x_RD = jnp.broadcast_to(x_TD[:, None, :], (t, k, d)).reshape(-1, d)
        if tp is not None:
            xs_RD = permute_rows(x_RD, order_R, inv_R)
            ys_RD = expert_ffn_chunked(tp, xs_RD, gs_E, weights, dtype, self.kernels, scales).astype(dtype)
        else:
            # the trainer's once-per-step weight copies (layers.module_copies) and the gradient accumulation
            # fusion's running sums (layers.module_accumulators), where it made them
            copies = accs = None
            names = ("w_gate", "w_up", "w_down")
            if self.kernels == "pallas" and self.has_variable("compute", "w_gate"):
                copies = tuple(self.get_variable("compute", n) for n in names)
                if self.has_variable("grad_acc", "w_gate"):
                    accs = tuple(acc_of((self, (n,))) for n in names)
            ffn_args = (gs_E, *weights, dtype, self.kernels, scales, copies, dtype, accs)
            if self.combine != "scatter_add":  # expert_ffn sorts the rows and returns them in token-slot order
                y_RD = expert_ffn(x_RD, *ffn_args, rows=(order_R, inv_R))
                return combine_slots(y_RD.reshape(t, k, d), gate_TX.astype(dtype))
            ys_RD = expert_ffn(permute_rows(x_RD, order_R, inv_R), *ffn_args)
        if self.combine == "scatter_add":
            # fast, nondeterministic baseline (refused in strict mode): atomics accumulate per token
            tok_R = jnp.broadcast_to(jnp.arange(t)[:, None], (t, k)).reshape(-1)
            w_R = gate_TX.reshape(-1)[order_R].astype(dtype)
            return jnp.zeros_like(x_TD).at[tok_R[order_R]].add(ys_RD * w_R[:, None])
        y_TXD = permute_rows(ys_RD, inv_R, order_R).reshape(t, k, d)
        return combine_slots(y_TXD, gate_TX.astype(dtype))


class MoE(nn.Module):
    d_model: int
    cfg: MoEConfig
    init_std: float
    dtype: jnp.dtype
    layout: ax.Layout | None = None
    kernels: str = "reference"
    fp8: bool = False  # model.fp8.enabled: the experts and shared expert in fp8 (the router stays float32)
    tp: TensorSplit | None = None  # canonical tensor parallelism (the router stays whole on every device)
    ep: ExpertSplit | None = None  # canonical expert dispatch (Experts)

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.cfg
        e, f, d, k = c.n_experts, c.ffn_dim, self.d_model, c.top_k
        init = normal_init(self.init_std)
        w_router_DE = param(self, "w_router", init, (d, e), (ax.EMBED, None))

        bsz, length, _ = x_BLD.shape
        x_TD = x_BLD.reshape(bsz * length, d).astype(self.dtype)
        logits_TE = proj("td,de->te", x_TD, w_router_DE, jnp.float32, self.kernels)  # float32 router
        idx_TX, gate_TX, probs_TE = route(logits_TE, k, c.router)
        aux = load_balance_loss(idx_TX, probs_TE)
        self.sow("intermediates", "routing", idx_TX)  # row-wise trace tap: a swapped pair of rows is caught
        gmm = c.experts_kernels(self.kernels)
        experts = Experts(
            e, d, f, self.init_std, self.dtype, c.combine, self.layout, gmm, self.fp8, self.tp, self.ep, name="experts"
        )
        y_BLD = experts(x_TD, idx_TX, gate_TX).reshape(bsz, length, d)
        if c.shared_expert:
            # whole-sequence output (it is added to the routed experts'): no reduce-scatter to a piece
            tp = dataclasses.replace(self.tp, sequence=False) if self.tp is not None else None
            shared = MLP(d, f, self.init_std, self.dtype, self.layout, self.kernels, self.fp8, tp, name="shared")
            y_BLD = y_BLD + shared(x_BLD)
        return y_BLD, aux


def moe_dense_reference(params, x_BLD, cfg: MoEConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """Oracle: per token, loop over its selected experts and apply each expert densely."""
    bsz, length, d = x_BLD.shape
    x_TD = x_BLD.reshape(-1, d).astype(dtype)
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), params["w_router"])
    idx_TX, gate_TX, probs_TE = route(logits_TE, cfg.top_k, cfg.router)

    w = params["experts"]

    def expert(ei, x_D):
        g = proj("d,df->f", x_D, w["w_gate"][ei], dtype)
        u = proj("d,df->f", x_D, w["w_up"][ei], dtype)
        return proj("f,fd->d", nn.silu(g) * u, w["w_down"][ei], dtype)

    def per_token(x_D, idx_X, gate_X):
        out = jnp.zeros((d,), dtype)
        for slot in range(cfg.top_k):
            out = out + expert(idx_X[slot], x_D) * gate_X[slot].astype(dtype)
        return out

    y_TD = jax.vmap(per_token)(x_TD, idx_TX, gate_TX)
    return y_TD.reshape(bsz, length, d), load_balance_loss(idx_TX, probs_TE)
