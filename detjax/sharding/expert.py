"""Expert parallelism: experts split over `expert`, tokens exchanged by all-to-all inside shard_map.

Dropless: each device sends every (token, slot) row to the device owning its expert, in a buffer with room
for all of its rows (T*X per destination), so no row is ever dropped whatever the routing. Row order is a
function of the routing only:
  source: rows sorted by expert (stable: token order inside an expert) -> one contiguous run per destination;
  owner:  received rows regrouped by (local expert, source device, position) -> each expert sees its rows in
          source-device order, then token order, and reduces its weight gradient over them in that order.
Packing rows into the send buffer and unpacking them again are gathers whose backward is the other gather
(each real row has exactly one slot), so neither direction needs a scatter-add.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from detjax.model.layers import permute_rows
from detjax.sharding import rules as ax


def _take_padded(x_RD: jax.Array, idx_S: jax.Array) -> jax.Array:
    """x[idx] with idx == len(x) meaning a zero row."""
    xp = jnp.concatenate([x_RD, jnp.zeros((1,) + x_RD.shape[1:], x_RD.dtype)], axis=0)
    return jnp.take(xp, idx_S, axis=0)


@jax.custom_vjp
def pack_rows(x_RD: jax.Array, idx_S: jax.Array, inv_R: jax.Array) -> jax.Array:
    """out[s] = x[idx[s]] (a zero row where idx[s] == R); inv[r] = the one slot s holding row r."""
    return _take_padded(x_RD, idx_S)


def _pack_fwd(x_RD, idx_S, inv_R):
    return pack_rows(x_RD, idx_S, inv_R), (idx_S, inv_R)


def _pack_bwd(res, g_SD):
    idx_S, inv_R = res
    return unpack_rows(g_SD, inv_R, idx_S), None, None


@jax.custom_vjp
def unpack_rows(y_SD: jax.Array, inv_R: jax.Array, idx_S: jax.Array) -> jax.Array:
    """The inverse of pack_rows: row r comes from slot inv[r]."""
    return jnp.take(y_SD, inv_R, axis=0)


def _unpack_fwd(y_SD, inv_R, idx_S):
    return unpack_rows(y_SD, inv_R, idx_S), (inv_R, idx_S)


def _unpack_bwd(res, g_RD):
    inv_R, idx_S = res
    return pack_rows(g_RD, idx_S, inv_R), None, None


pack_rows.defvjp(_pack_fwd, _pack_bwd)
unpack_rows.defvjp(_unpack_fwd, _unpack_bwd)


def _local(x_TD, idx_TX, gate_TX, w_gate, w_up, w_down, *, n_ep: int, n_experts: int, tensor: bool, dtype):
    from detjax.model.moe import combine_slots, expert_ffn

    t, k = idx_TX.shape
    d = x_TD.shape[-1]
    r = t * k
    e_loc = n_experts // n_ep
    # ---- source side: sort rows by expert, one contiguous run per destination device
    expert_R = idx_TX.reshape(-1)
    order_R = jnp.argsort(expert_R, stable=True)
    inv_R = jnp.argsort(order_R)
    x_RD = jnp.broadcast_to(x_TD[:, None, :], (t, k, d)).reshape(r, d)
    xs_RD = permute_rows(x_RD, order_R, inv_R)
    gs_E = jnp.sum(jax.nn.one_hot(expert_R, n_experts, dtype=jnp.int32), axis=0)
    cnt_N = jnp.sum(gs_E.reshape(n_ep, e_loc), axis=1)
    start_N = jnp.cumsum(cnt_N) - cnt_N
    j_R = jnp.arange(r)
    slot_NR = jnp.where(j_R[None, :] < cnt_N[:, None], start_N[:, None] + j_R[None, :], r).reshape(-1)
    dest_R = jnp.take(expert_R, order_R) // e_loc
    slot_of_R = dest_R * r + (j_R - jnp.take(start_N, dest_R))
    send_NRD = pack_rows(xs_RD, slot_NR, slot_of_R).reshape(n_ep, r, d)
    recv_NRD = jax.lax.all_to_all(send_NRD, "expert", 0, 0)
    recv_cnt_NE = jax.lax.all_to_all(gs_E.reshape(n_ep, e_loc), "expert", 0, 0)
    # ---- owner side: regroup by (local expert, source, position); unused slots go last
    cum_NE = jnp.cumsum(recv_cnt_NE, axis=1)
    e_NR = jnp.sum(j_R[None, :, None] >= cum_NE[:, None, :], axis=-1)  # == e_loc for unused slots
    key_S = (e_NR * (n_ep * r) + jnp.arange(n_ep * r).reshape(n_ep, r)).reshape(-1)
    order_S = jnp.argsort(key_S)
    inv_S = jnp.argsort(order_S)
    xg_SD = permute_rows(recv_NRD.reshape(n_ep * r, d), order_S, inv_S)
    gs_loc = jnp.sum(recv_cnt_NE, axis=0)
    y_SD = expert_ffn(xg_SD, gs_loc, w_gate, w_up, w_down, dtype)
    if tensor:  # expert ffn width split over `tensor`: partial sums of the down projection
        y_SD = jax.lax.psum(y_SD, "tensor")
    y_SD = y_SD.astype(dtype)
    back_NRD = jax.lax.all_to_all(permute_rows(y_SD, inv_S, order_S).reshape(n_ep, r, d), "expert", 0, 0)
    ys_RD = unpack_rows(back_NRD.reshape(n_ep * r, d), slot_of_R, slot_NR)
    y_TXD = permute_rows(ys_RD, inv_R, order_R).reshape(t, k, d)
    return combine_slots(y_TXD, gate_TX.astype(dtype))


def expert_parallel_moe(x_TD, idx_TX, gate_TX, weights, layout: ax.Layout, dtype) -> jax.Array:
    """The MoE expert computation with experts split over `expert` (see the module docstring)."""
    w_gate, w_up, w_down = weights
    deg = layout.degrees
    tensor = "tensor" if deg["tensor"] > 1 else None
    rows = P(layout.spec((ax.BATCH,))[0], None) if layout.spec((ax.BATCH,)) else P()
    body = functools.partial(
        _local, n_ep=deg["expert"], n_experts=w_gate.shape[0], tensor=tensor is not None, dtype=dtype
    )
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(rows, rows, rows, P("expert", None, tensor), P("expert", None, tensor), P("expert", tensor, None)),
        out_specs=rows,
        check_vma=False,
    )
    return fn(x_TD, idx_TX, gate_TX, w_gate, w_up, w_down)
