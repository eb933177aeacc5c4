"""Causal GQA flash attention in Pallas: forward, and a backward with no atomics.

Layout: q (B*H, L, Q), k and v (B*K, L, Q), G = H // K query heads per kv head. Tiles are pinned in TILES.
- forward: one program per (query head, query block); online softmax over kv blocks 0..i in order; writes
  o and the row log-sum-exp.
- dK/dV: one program per (kv head, kv block) owns its dK/dV tile and loops, in a fixed order, over the G
  query heads of its group and the query blocks that can see it (i >= j). One writer per tile: the sum
  order is fixed by construction — the "separate writers in space" rule, with no slots left to order.
- dQ: one program per (query head, query block) loops over kv blocks 0..i in order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TILES = {"block_q": 16, "block_k": 16}
_NEG = -1e30


def _causal(s, i, j, bq, bk):
    rows = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0) + i * bq
    cols = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1) + j * bk
    return jnp.where(rows >= cols, s, _NEG)


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, bq, bk):
    i = pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)
    d = q.shape[-1]

    def body(j, carry):
        m, l, acc = carry
        k = k_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)
        v = v_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)
        s = _causal(jnp.dot(q, k.T) * scale, i, j, bq, bk)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        return m_new, l * alpha + jnp.sum(p, axis=1, keepdims=True), acc * alpha + jnp.dot(p, v)

    n_kv = (i * bq + bq + bk - 1) // bk  # causal: blocks 0 .. the one holding the last query row
    init = (jnp.full((bq, 1), _NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_kv, body, init)
    o_ref[...] = (acc / l).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, bq, bk, g, n_q):
    j = pl.program_id(1)
    k = k_ref[...].astype(jnp.float32)
    v = v_ref[...].astype(jnp.float32)
    first_q = (j * bk) // bq

    def per_block(h, i, carry):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q = q_ref[h, rows, :].astype(jnp.float32)
        do = do_ref[h, rows, :].astype(jnp.float32)
        p = jnp.exp(_causal(jnp.dot(q, k.T) * scale, i, j, bq, bk) - lse_ref[h, rows, :])
        dv = dv + jnp.dot(p.T, do)
        ds = p * (jnp.dot(do, v.T) - delta_ref[h, rows, :])
        return dk + jnp.dot(ds.T, q) * scale, dv

    def per_head(h, carry):  # fixed order: group heads ascending, then query blocks ascending
        return jax.lax.fori_loop(first_q, n_q, lambda i, c: per_block(h, i, c), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, g, per_head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, bq, bk):
    i = pl.program_id(1)
    q = q_ref[...].astype(jnp.float32)
    do = do_ref[...].astype(jnp.float32)
    lse, delta = lse_ref[...], delta_ref[...]

    def body(j, dq):
        k = k_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)
        v = v_ref[pl.ds(j * bk, bk), :].astype(jnp.float32)
        p = jnp.exp(_causal(jnp.dot(q, k.T) * scale, i, j, bq, bk) - lse)
        ds = p * (jnp.dot(do, v.T) - delta)
        return dq + jnp.dot(ds, k) * scale

    n_kv = (i * bq + bq + bk - 1) // bk
    dq = jax.lax.fori_loop(0, n_kv, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _check(length: int, d: int) -> tuple[int, int]:
    bq, bk = TILES["block_q"], TILES["block_k"]
    if length % bq or length % bk or d & (d - 1) or d < 16:
        raise ValueError(
            f"flash attention needs L % {bq} == 0 and a power-of-two head dim >= 16; got L={length}, d={d}"
        )
    return bq, bk


@functools.partial(jax.jit, static_argnames=("g", "interpret"))
def flash_fwd(q, k, v, *, g: int, interpret: bool):
    """q (BH, L, Q), k/v (BK, L, Q) -> o (BH, L, Q), lse (BH, L, 1)."""
    bh, length, d = q.shape
    bq, bk = _check(length, d)
    scale = d**-0.5
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, bq=bq, bk=bk),
        grid=(bh, length // bq),
        in_specs=[
            pl.BlockSpec((None, bq, d), lambda h, i: (h, i, 0)),
            pl.BlockSpec((None, length, d), lambda h, i: (h // g, 0, 0)),
            pl.BlockSpec((None, length, d), lambda h, i: (h // g, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, d), lambda h, i: (h, i, 0)),
            pl.BlockSpec((None, bq, 1), lambda h, i: (h, i, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((bh, length, 1), jnp.float32)],
        name="flash_attention_fwd",
        interpret=interpret,
    )(q, k, v)


@functools.partial(jax.jit, static_argnames=("g", "interpret"))
def flash_bwd(q, k, v, o, lse, do, *, g: int, interpret: bool):
    bh, length, d = q.shape
    bkv = k.shape[0]
    bq, bk = _check(length, d)
    scale = d**-0.5
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    full_q = pl.BlockSpec((g, length, d), lambda c, j: (c, 0, 0))
    full_r = pl.BlockSpec((g, length, 1), lambda c, j: (c, 0, 0))
    kv_blk = pl.BlockSpec((None, bk, d), lambda c, j: (c, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, bq=bq, bk=bk, g=g, n_q=length // bq),
        grid=(bkv, length // bk),
        in_specs=[full_q, kv_blk, kv_blk, full_q, full_r, full_r],
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="flash_attention_dkv",
        interpret=interpret,
    )(q, k, v, do, lse, delta)
    q_blk = pl.BlockSpec((None, bq, d), lambda h, i: (h, i, 0))
    r_blk = pl.BlockSpec((None, bq, 1), lambda h, i: (h, i, 0))
    kv_full = pl.BlockSpec((None, length, d), lambda h, i: (h // g, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, bq=bq, bk=bk),
        grid=(bh, length // bq),
        in_specs=[q_blk, kv_full, kv_full, q_blk, r_blk, r_blk],
        out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_attention_dq",
        interpret=interpret,
    )(q, k, v, do, lse, delta)
    return dq, dk, dv
