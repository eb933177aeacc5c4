"""Expert parallelism: experts split over `expert`, tokens exchanged by all-to-all inside shard_map.

Dropless: each device sends every (token, slot) row to the device owning its expert, in a buffer with room
for all of its rows (T*X per destination), so no row is ever dropped whatever the routing. Row order is a
function of the routing only:
  source: rows sorted by expert (stable: token order inside an expert) -> one contiguous run per destination;
  owner:  received rows regrouped by (local expert, source device, position) -> each expert sees its rows in
          source-device order, then token order, and reduces its weight gradient over them in that order.
Packing rows into the send buffer and unpacking them again are gathers whose backward is the other gather
(each real row has exactly one slot), so neither direction needs a scatter-add.
Letters beyond the model legend (detjax/model/__init__.py): A expert-parallel peers, U send-buffer slots
(A x R), G an owner's (local expert, source) groups.

Canonical numerics (`canonical_expert_moe`, called inside the trainer's leaf program, which already runs in
shard_map): the same exchange, but the owner multiplies each source's rows with that source's own copy of
its experts' weights (the leaf program passes A copies, A x E/A x ...), so the backward returns one weight
gradient per source -- per leaf of the gradient tree, where one tgmm would sum all sources' rows together.
Each (local expert, source) group holds exactly the rows that the source's own leaf sends its expert, in
token order, and the fixed-order Pallas gmm/tgmm compute a group's rows and its weight gradient the same at
any row offset (tiles aligned to the group's first row; tests/test_pallas.py), so every leaf's values are
the one-device leaf program's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from detjax.model.dispatch import combine_slots, expert_ffn, expert_ffn_chunked, permute_rows, sort_by_expert
from detjax.sharding import rules as ax
from detjax.sharding import tensor as tp_ops


def _take_padded(x_RD: jax.Array, idx_U: jax.Array) -> jax.Array:
    """x[idx] with idx == len(x) meaning a zero row."""
    xp = jnp.concatenate([x_RD, jnp.zeros((1,) + x_RD.shape[1:], x_RD.dtype)], axis=0)
    return jnp.take(xp, idx_U, axis=0)


@jax.custom_vjp
def pack_rows(x_RD: jax.Array, idx_U: jax.Array, inv_R: jax.Array) -> jax.Array:
    """out[s] = x[idx[s]] (a zero row where idx[s] == R); inv[r] = the one slot s holding row r."""
    return _take_padded(x_RD, idx_U)


def _pack_fwd(x_RD, idx_U, inv_R):
    return pack_rows(x_RD, idx_U, inv_R), (idx_U, inv_R)


def _pack_bwd(res, g_UD):
    idx_U, inv_R = res
    return unpack_rows(g_UD, inv_R, idx_U), None, None


@jax.custom_vjp
def unpack_rows(y_UD: jax.Array, inv_R: jax.Array, idx_U: jax.Array) -> jax.Array:
    """The inverse of pack_rows: row r comes from slot inv[r]."""
    return jnp.take(y_UD, inv_R, axis=0)


def _unpack_fwd(y_UD, inv_R, idx_U):
    return unpack_rows(y_UD, inv_R, idx_U), (inv_R, idx_U)


def _unpack_bwd(res, g_RD):
    inv_R, idx_U = res
    return pack_rows(g_RD, idx_U, inv_R), None, None


pack_rows.defvjp(_pack_fwd, _pack_bwd)
unpack_rows.defvjp(_unpack_fwd, _unpack_bwd)


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """Canonical expert parallelism inside the trainer's leaf program (which runs in shard_map over `axis`):
    `degree` devices exchange their leaves' rows, each owning n_experts / degree experts."""

    degree: int
    axis: str = "expert"


def _local(
    x_TD,
    idx_TX,
    gate_TX,
    w_gate,
    w_up,
    w_down,
    *scales,
    n_ep: int,
    n_experts: int,
    tensor: bool,
    dtype,
    kernels: str = "reference",
    per_source: bool = False,
    axis: str = "expert",
    split: tp_ops.TensorSplit | None = None,
):
    """One device's expert-parallel MoE. per_source: the weights are n_ep copies (A, E/A, ...), source a's rows
    multiplied by copy a (canonical numerics: one weight gradient per source); `split`: canonical tensor
    parallelism's feature chunks of the experts' width (dispatch.expert_ffn_chunked)."""
    t, k = idx_TX.shape
    d = x_TD.shape[-1]
    r = t * k
    e_loc = n_experts // n_ep
    # ---- source side: sort rows by expert, one contiguous run per destination device
    expert_R, order_R, inv_R, gs_E = sort_by_expert(idx_TX, n_experts)
    x_RD = jnp.broadcast_to(x_TD[:, None, :], (t, k, d)).reshape(r, d)
    xs_RD = permute_rows(x_RD, order_R, inv_R)
    cnt_A = jnp.sum(gs_E.reshape(n_ep, e_loc), axis=1)
    start_A = jnp.cumsum(cnt_A) - cnt_A
    j_R = jnp.arange(r)
    slot_AR = jnp.where(j_R[None, :] < cnt_A[:, None], start_A[:, None] + j_R[None, :], r).reshape(-1)
    dest_R = jnp.take(expert_R, order_R) // e_loc
    slot_of_R = dest_R * r + (j_R - jnp.take(start_A, dest_R))
    send_ARD = pack_rows(xs_RD, slot_AR, slot_of_R).reshape(n_ep, r, d)
    recv_ARD = jax.lax.all_to_all(send_ARD, axis, 0, 0)
    recv_cnt_AE = jax.lax.all_to_all(gs_E.reshape(n_ep, e_loc), axis, 0, 0)
    # ---- owner side: regroup by (local expert, source, position); unused slots go last
    cum_AE = jnp.cumsum(recv_cnt_AE, axis=1)
    e_AR = jnp.sum(j_R[None, :, None] >= cum_AE[:, None, :], axis=-1)  # == e_loc for unused slots
    key_U = (e_AR * (n_ep * r) + jnp.arange(n_ep * r).reshape(n_ep, r)).reshape(-1)
    order_U = jnp.argsort(key_U)
    inv_U = jnp.argsort(order_U)
    xg_UD = permute_rows(recv_ARD.reshape(n_ep * r, d), order_U, inv_U)
    fp8_scales = tuple(c[0] for c in scales) or None  # this device's copy of each fp8 scale set
    if per_source:  # groups (local expert, source), in the rows' order; group (e, a) reads copy a of expert e
        gs_G = recv_cnt_AE.T.reshape(-1)
        ws = [w.swapaxes(0, 1).reshape(e_loc * n_ep, *w.shape[2:]) for w in (w_gate, w_up, w_down)]
        if split is not None:
            y_UD = expert_ffn_chunked(split, xg_UD, gs_G, tuple(ws), dtype, kernels, fp8_scales)
        else:
            y_UD = expert_ffn(xg_UD, gs_G, *ws, dtype, kernels, fp8_scales)
    else:
        gs_loc = jnp.sum(recv_cnt_AE, axis=0)
        y_UD = expert_ffn(xg_UD, gs_loc, w_gate, w_up, w_down, dtype, fp8_scales=fp8_scales)
    if tensor:  # expert ffn width split over `tensor`: partial sums of the down projection
        y_UD = jax.lax.psum(y_UD, "tensor")
    y_UD = y_UD.astype(dtype)
    back_ARD = jax.lax.all_to_all(permute_rows(y_UD, inv_U, order_U).reshape(n_ep, r, d), axis, 0, 0)
    ys_RD = unpack_rows(back_ARD.reshape(n_ep * r, d), slot_of_R, slot_AR)
    y_TXD = permute_rows(ys_RD, inv_R, order_R).reshape(t, k, d)
    return combine_slots(y_TXD, gate_TX.astype(dtype))


def expert_parallel_moe(
    x_TD, idx_TX, gate_TX, weights, layout: ax.Layout, dtype, fp8_scales: tuple | None = None
) -> jax.Array:
    """The MoE expert computation with experts split over `expert` (see the module docstring).

    fp8_scales (model.fp8): the (gate, up, down) scale vectors. Each device multiplies its rows with its own
    copy of each (tensor.max_copies over the mesh's devices), so a scale set's "gradient" -- its amaxes,
    detjax.model.fp8 -- leaves as the maximum over the devices' amaxes (exact in any order), where the
    transpose of one replicated input would add them."""
    w_gate, w_up, w_down = weights
    deg = layout.degrees
    tensor = "tensor" if deg["tensor"] > 1 else None
    rows = P(layout.spec((ax.BATCH,))[0], None) if layout.spec((ax.BATCH,)) else P()
    body = functools.partial(
        _local, n_ep=deg["expert"], n_experts=w_gate.shape[0], tensor=tensor is not None, dtype=dtype
    )
    copies, c_specs = (), ()
    if fp8_scales is not None:
        n_dev = layout.mesh.size
        copies = tuple(tp_ops.max_copies(tp_ops.TensorSplit(1), s, n_dev) for s in fp8_scales)
        c_specs = (P(tuple(layout.mesh.axis_names), None),) * len(copies)  # one copy per device
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(
            rows,
            rows,
            rows,
            P("expert", None, tensor),
            P("expert", None, tensor),
            P("expert", tensor, None),
            *c_specs,
        ),
        out_specs=rows,
        check_vma=False,
    )
    return fn(x_TD, idx_TX, gate_TX, w_gate, w_up, w_down, *copies)


def canonical_expert_moe(
    x_TD,
    idx_TX,
    gate_TX,
    copies,
    split: ExpertSplit,
    dtype,
    kernels: str,
    fp8_scales: tuple | None = None,
    tp: tp_ops.TensorSplit | None = None,
) -> jax.Array:
    """The MoE expert computation of canonical numerics' leaf program on an `expert` axis of split.degree
    devices (module docstring): copies (gate, up, down), each (A, E/A, ...) -- this device's experts, one copy
    per source device (with `tp`, this device's chunks of their width). Called inside the trainer's shard_map
    (no shard_map of its own). fp8_scales: the (gate, up, down) scale vectors, which every device holds whole
    there."""
    if kernels != "pallas":
        raise ValueError("canonical expert dispatch needs the Pallas grouped matmuls (model.kernels=pallas)")
    n_ep = split.degree
    scales = tuple(s[None] for s in fp8_scales) if fp8_scales is not None else ()
    per_source = dict(n_ep=n_ep, n_experts=n_ep * copies[0].shape[1], tensor=False, dtype=dtype, kernels=kernels)
    return _local(x_TD, idx_TX, gate_TX, *copies, *scales, **per_source, per_source=True, axis=split.axis, split=tp)
