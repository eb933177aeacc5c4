"""MoE dispatch primitives shared by the local path (detjax.model.moe) and expert parallelism
(detjax.sharding.expert): row permutations without scatter-add, the stable sort of (token, slot) rows by
expert, the experts' grouped SwiGLU and the slot-ordered combine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from detjax.model.fp8 import fp8_grouped_matmul, fp8_grouped_matmul_copy
from detjax.pallas_kernels.gmm import ops as gmm_ops
from detjax.pallas_kernels.gmm.ops import (
    grouped_matmul,
    grouped_matmul_acc,
    grouped_matmul_copy,
    grouped_swiglu_padded,
    swiglu_on_padded_layout,
)
from detjax.sharding import tensor as tp_ops
from detjax.sharding.tensor import TensorSplit


@jax.custom_vjp
def permute_rows(x_TD: jax.Array, perm_T: jax.Array, inv_T: jax.Array) -> jax.Array:
    """x[perm] where perm is a permutation and inv its inverse; the backward is g[inv]."""
    return jnp.take(x_TD, perm_T, axis=0)


def _perm_fwd(x_TD, perm_T, inv_T):
    return permute_rows(x_TD, perm_T, inv_T), (perm_T, inv_T)


def _perm_bwd(res, g_TD):
    perm_T, inv_T = res
    return permute_rows(g_TD, inv_T, perm_T), None, None


permute_rows.defvjp(_perm_fwd, _perm_bwd)


# Whether sort_by_expert sorts one int32 key per row (expert * R + row: unique, so no stability to keep, and the
# row comes back as the remainder) instead of argsort's stable sort of (expert, row) pairs: the same permutation
# (integers), half the data sorted.
# Off: not yet timed on a GPU (docs/BENCHMARKS.md, "Where gpu_medium's step goes at `3bad40e`").
SORT_KEYS = False


def sort_by_expert(idx_TX: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(expert of each row R = T*X, sort order, its inverse, group sizes E). The sort is stable: inside an
    expert's group the rows keep global token order, so its weight-gradient sum runs in token order.

    One sort: the inverse is counted, not sorted. Row r of expert e lands at (rows of experts < e) + (rows of
    expert e before r), both integer prefix sums of the (R, E) one-hot (exact in any order)."""
    expert_R = idx_TX.reshape(-1)
    rows = expert_R.shape[0]
    if SORT_KEYS and n_experts * rows < 2**31:
        row_R = jnp.arange(rows, dtype=jnp.int32)
        order_R = jax.lax.rem(jnp.sort(expert_R.astype(jnp.int32) * rows + row_R), jnp.int32(rows))
    else:
        order_R = jnp.argsort(expert_R, stable=True)
    onehot_RE = jax.nn.one_hot(expert_R, n_experts, dtype=jnp.int32)
    gs_E = jnp.sum(onehot_RE, axis=0)
    before_RE = jnp.cumsum(onehot_RE, axis=0) - onehot_RE  # rows of each expert strictly before row r
    start_E = jnp.cumsum(gs_E) - gs_E
    inv_R = start_E[expert_R] + jnp.take_along_axis(before_RE, expert_R[:, None], axis=1)[:, 0]
    return expert_R, order_R, inv_R, gs_E


# Whether expert_ffn, given the rows' sort (`rows`), composes it with the padded layout's row copies where the
# whole SwiGLU runs there (gmm.ops.grouped_swiglu_padded's `rows`): one row gather into the layout and one out
# of it, instead of a permutation and a copy each way. Data movement only, so the same bytes. With
# gmm.ops.DOWN_WRITES_OUT_DTYPE, the gpu_medium step 1.4 % faster pipelined on an H100 (docs/BENCHMARKS.md, "The
# experts' row copies and weight-gradient sums").
COMPOSED_GATHERS = True


def expert_ffn(
    xs_RD: jax.Array,
    gs_E: jax.Array,
    w_gate_EDF,
    w_up_EDF,
    w_down_EFD,
    dtype,
    kernels: str = "reference",
    fp8_scales: tuple | None = None,
    weight_copies: tuple | None = None,
    out_dtype=jnp.float32,
    accs: tuple | None = None,
    rows: tuple | None = None,
) -> jax.Array:
    """SwiGLU per expert over rows sorted by expert (group sizes gs_E): grouped matmuls (XLA's ragged_dot,
    or with kernels=pallas the fixed-order Pallas gmm/tgmm; `kernels` here is the resolved experts_impl).
    fp8_scales: (gate, up, down) scale vectors of model.fp8 (detjax.model.fp8.fp8_grouped_matmul);
    weight_copies: the (gate, up, down) weights' copies the trainer made once per step, or None: with
    fp8_scales fp8.grouped_weight_copy, else (kernels=pallas) gmm.ops.grouped_compute_copy. Where the bf16
    products take the Mosaic kernel (gmm.ops.swiglu_on_padded_layout), the whole SwiGLU runs on the padded
    group layout (gmm.ops.grouped_swiglu_padded): the same bytes, fewer row copies. The result is the float32
    sums in out_dtype (a caller that casts them to the compute dtype next passes it here: the padded layout's
    down product then writes it from its kernel). `accs`: the gradient accumulation fusion's float32 running
    sums of the three stacks (detjax.step; with kernels=pallas, the weight copies and no fp8), which receive
    the weight gradients in place of the stacks (gmm.ops.grouped_matmul_acc). `rows` (order_R, inv_R, from
    sort_by_expert): xs_RD is in token-slot order, sorted here (permute_rows, or composed with the padded
    layout's copies: COMPOSED_GATHERS), and the result comes back in that order."""
    d, f = w_gate_EDF.shape[1:]
    if accs is not None and (kernels != "pallas" or fp8_scales is not None or weight_copies is None):
        raise ValueError("expert_ffn: running sums (accs) need kernels=pallas, the weight copies and no fp8")
    padded = (
        kernels == "pallas" and fp8_scales is None and xs_RD.dtype == dtype and swiglu_on_padded_layout(dtype, d, f)
    )
    weights = (w_gate_EDF, w_up_EDF, w_down_EFD)
    if padded and COMPOSED_GATHERS:
        return grouped_swiglu_padded(xs_RD, gs_E, weights, dtype, weight_copies, out_dtype, accs, rows)
    if rows is not None:
        xs_RD = permute_rows(xs_RD, *rows)
    if padded:
        ys_RD = grouped_swiglu_padded(xs_RD, gs_E, weights, dtype, weight_copies, out_dtype, accs)
    else:
        ys_RD = _grouped_swiglu(xs_RD, gs_E, weights, dtype, kernels, fp8_scales, weight_copies, accs)
        ys_RD = ys_RD.astype(out_dtype)
    return ys_RD if rows is None else permute_rows(ys_RD, rows[1], rows[0])


def _grouped_swiglu(xs_RD, gs_E, weights, dtype, kernels, fp8_scales, weight_copies, accs) -> jax.Array:
    """expert_ffn's SwiGLU as three grouped products (float32 out) where the padded layout does not take it."""
    w_gate_EDF, w_up_EDF, w_down_EFD = weights
    scales, copies, sums = iter(fp8_scales or ()), iter(weight_copies or ()), iter(accs or ())

    def gmm(a, w):
        if accs is not None:
            return grouped_matmul_acc(a.astype(dtype), next(sums), gs_E, next(copies))
        if fp8_scales is not None and weight_copies is not None:
            return fp8_grouped_matmul_copy(a.astype(dtype), w, gs_E, next(scales), next(copies), kernels, dtype)
        if fp8_scales is not None:
            return fp8_grouped_matmul(a.astype(dtype), w, gs_E, next(scales), kernels, dtype)
        if kernels == "pallas" and weight_copies is not None:
            return grouped_matmul_copy(a.astype(dtype), w, gs_E, next(copies))
        if kernels == "pallas":
            return grouped_matmul(a.astype(dtype), w.astype(dtype), gs_E)
        return jax.lax.ragged_dot(a.astype(dtype), w.astype(dtype), gs_E, preferred_element_type=jnp.float32)

    g_RF, u_RF = gmm(xs_RD, w_gate_EDF), gmm(xs_RD, w_up_EDF)
    if gmm_ops.GATE_UP_IN_DTYPE and kernels == "pallas" and fp8_scales is None:  # as the padded layout writes them
        g_RF, u_RF = (v.astype(dtype).astype(jnp.float32) for v in (g_RF, u_RF))
    return gmm((nn.silu(g_RF) * u_RF).astype(dtype), w_down_EFD)


def expert_ffn_chunked(
    split: TensorSplit, xs_RD, gs_E, weights: tuple, dtype, kernels: str = "reference", fp8_scales: tuple | None = None
) -> jax.Array:
    """expert_ffn under canonical tensor parallelism: this device's chunks of the experts' width (weights:
    gate, up, down), each chunk's expert_ffn on its own (float32) copy of the rows, the down products'
    partials added by the chunk tree (detjax.sharding.tensor); float32 result. fp8_scales: (gate, up, down)
    scale vectors, each chunk its copy (tensor.max_copies)."""
    n = split.local
    w_gate_EDF, w_up_EDF, w_down_EFD = weights
    x_cRD = tp_ops.fanout(split, xs_RD)
    wg_c, wu_c, wd_c = (
        tp_ops.chunked(w_gate_EDF, 2, n),
        tp_ops.chunked(w_up_EDF, 2, n),
        tp_ops.chunked(w_down_EFD, 1, n),
    )
    scales = [tp_ops.max_copies(split, sc, n) for sc in fp8_scales or ()]

    def chunk(x_RD, wg, wu, wd, *rest):  # one loop body per chunk: the same program whatever the tensor degree
        *s, gs = rest
        return expert_ffn(x_RD, gs, wg, wu, wd, dtype, kernels, tuple(s) or None)

    return tp_ops.combine(split, tp_ops.per_chunk(chunk, x_cRD, wg_c, wu_c, wd_c, *scales, consts=(gs_E,)))


def combine_slots(y_TXD: jax.Array, gate_TX: jax.Array) -> jax.Array:
    """Weighted sum over the k slots in a fixed order (slot 0 first)."""
    y_TD = y_TXD[:, 0] * gate_TX[:, 0:1]
    for slot in range(1, y_TXD.shape[1]):
        y_TD = y_TD + y_TXD[:, slot] * gate_TX[:, slot : slot + 1]
    return y_TD
