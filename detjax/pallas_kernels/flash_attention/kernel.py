"""Causal GQA flash attention in Pallas: forward, and a backward with no atomics.

Layout: q (B, L, H, Q), k and v (B, L, K, Q) — the projections' layout, read in place by the BlockSpecs (no
transposes around the kernels) — G = H // K query heads per kv head; the row log-sum-exp is (B*H, L, 1).
Tiles are pinned in TILES.
Products take the inputs' dtype (bf16 in training; p and dS are rounded to it, as cuDNN and FlashAttention
do) and accumulate in float32; float32 inputs multiply as IEEE float32.
- forward: one program per (query head, query block); online softmax over kv blocks 0..i in order; writes
  o and the row log-sum-exp.
- dK/dV: one program per (kv head, kv block) owns its dK/dV tile and loops, in a fixed order, over the G
  query heads of its group and the query blocks that can see it (i >= j). One writer per tile: the sum
  order is fixed by construction — the "separate writers in space" rule, with no slots left to order. It
  computes S^T = K Q^T (keys x queries), so P^T and dS^T feed dV += P^T dO and dK += dS^T Q directly.
- dQ: one program per (query head, query block) loops over kv blocks 0..i in order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

# Pinned tiles (forward: 64 query rows x 64 keys, 4 warps; dQ ("bwd") and dK/dV: 64 x 64, 4 warps, 3 stages), chosen
# with scripts/tile_sweep.py at the gpu_dense shape on the H200, longest query blocks first (docs/BENCHMARKS.md).
# A sequence that is not a multiple of a tile uses the largest power of two >= 16 that divides it
# (`blocks`): the tiles depend on the shape only, never on a measurement.
TILES = {
    "fwd": {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 2},
    "bwd": {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 3},  # dQ
    "dkv": {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 3},
}
_NEG = -1e30


def _fit(tile: int, length: int) -> int | None:
    b = tile
    while b >= 16:
        if length % b == 0:
            return b
        b //= 2
    return None


def blocks(length: int, which: str = "fwd") -> tuple[int, int] | None:
    """(block_q, block_k) for a sequence of `length`, or None when no tile >= 16 divides it."""
    t = TILES[which]
    bq, bk = _fit(t["block_q"], length), _fit(t["block_k"], length)
    return None if bq is None or bk is None else (bq, bk)


def _dot(a, b, trans_b: bool = False):
    """a @ b (or a @ b^T) in the operands' dtype with float32 accumulation; float32 operands multiply as
    IEEE float32 (no TF32)."""
    dims = (((1,), (1,) if trans_b else (0,)), ((), ()))
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _causal(s, i, j, bq, bk):
    rows = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0) + i * bq
    cols = jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1) + j * bk
    return jnp.where(rows >= cols, s, _NEG)


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, bq, bk, n_q):
    i = n_q - 1 - pl.program_id(1)  # the longest rows first (see _heavy_first)
    q = q_ref[...]
    d = q.shape[-1]

    def body(j, carry, masked: bool):
        m, l, acc = carry
        k = k_ref[pl.ds(pl.multiple_of(j * bk, bk), bk), :]
        v = v_ref[pl.ds(pl.multiple_of(j * bk, bk), bk), :]
        s = _dot(q, k, trans_b=True) * scale
        if masked:
            s = _causal(s, i, j, bq, bk)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        return m_new, l * alpha + jnp.sum(p, axis=1, keepdims=True), acc * alpha + _dot(p.astype(v.dtype), v)

    # kv blocks 0 .. n_full-1 are visible to every row of this query block; n_full .. n_kv-1 need the mask.
    # The mask leaves visible scores unchanged, so the split does not change any bit.
    n_full = (i * bq) // bk
    n_kv = (i * bq + bq + bk - 1) // bk
    init = (jnp.full((bq, 1), _NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, d), jnp.float32))
    carry = jax.lax.fori_loop(0, n_full, lambda j, c: body(j, c, False), init)
    m, l, acc = jax.lax.fori_loop(n_full, n_kv, lambda j, c: body(j, c, True), carry)
    o_ref[...] = (acc / l).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, bq, bk, g, n_q):
    """Works in the transposed orientation (keys x queries), so that P^T and dS^T come out of their products
    in the layout the next products take: no register transposes. lse and delta arrive as (1, L) rows."""
    j = pl.program_id(1)
    k, v = k_ref[...], v_ref[...]
    first_q = (j * bk) // bq  # the first query block that sees this kv block
    last_masked = (j * bk + bk - 1) // bq  # query blocks after it see the whole kv block

    def per_block(h, i, carry, masked: bool):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        q = q_ref[rows, h, :]
        do = do_ref[rows, h, :]
        s_t = _dot(k, q, trans_b=True) * scale  # (bk, bq)
        if masked:
            keys = jax.lax.broadcasted_iota(jnp.int32, (bk, bq), 0) + j * bk
            queries = jax.lax.broadcasted_iota(jnp.int32, (bk, bq), 1) + i * bq
            s_t = jnp.where(queries >= keys, s_t, _NEG)
        p_t = jnp.exp(s_t - lse_ref[h, :, rows])
        dv = dv + _dot(p_t.astype(do.dtype), do)
        ds_t = p_t * (_dot(v, do, trans_b=True) - delta_ref[h, :, rows])
        return dk + _dot(ds_t.astype(q.dtype), q) * scale, dv

    def per_head(h, carry):  # fixed order: group heads ascending, then query blocks ascending
        carry = jax.lax.fori_loop(first_q, last_masked + 1, lambda i, c: per_block(h, i, c, True), carry)
        return jax.lax.fori_loop(last_masked + 1, n_q, lambda i, c: per_block(h, i, c, False), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, g, per_head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, bq, bk, n_q):
    i = n_q - 1 - pl.program_id(1)  # the longest rows first (see _heavy_first)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(j, dq, masked: bool):
        k = k_ref[pl.ds(pl.multiple_of(j * bk, bk), bk), :]
        v = v_ref[pl.ds(pl.multiple_of(j * bk, bk), bk), :]
        s = _dot(q, k, trans_b=True) * scale
        if masked:
            s = _causal(s, i, j, bq, bk)
        p = jnp.exp(s - lse)
        ds = p * (_dot(do, v, trans_b=True) - delta)
        return dq + _dot(ds.astype(k.dtype), k) * scale

    n_full = (i * bq) // bk
    n_kv = (i * bq + bq + bk - 1) // bk
    dq = jax.lax.fori_loop(0, n_full, lambda j, c: body(j, c, False), jnp.zeros(q.shape, jnp.float32))
    dq = jax.lax.fori_loop(n_full, n_kv, lambda j, c: body(j, c, True), dq)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _heavy_first(n_q: int, heads: int | None = None):
    """Index map of a query-block operand for grid (batch x head, step): step 0 is the LAST query block. Under a
    causal mask query block i does i + 1 blocks of work, and the GPU launches programs in grid order (the head
    axis fastest), so the longest programs start first and the short ones fill the tail. Which program runs
    when never changes what it computes: the order changes time, not bits. `heads`: the operand is
    (B, L, H, Q) (block (None, bq, None, Q)); else it is (B*H, L, 1)."""
    if heads is None:
        return lambda h, i: (h, n_q - 1 - i, 0)
    return lambda h, i: (h // heads, n_q - 1 - i, h % heads, 0)


def _check(length: int, d: int, which: str) -> tuple[int, int]:
    b = blocks(length, which)
    if b is None or d & (d - 1) or d < 16:
        raise ValueError(
            f"flash attention needs L divisible by 16 and a power-of-two head dim >= 16; got L={length}, d={d}"
        )
    return b


@functools.partial(jax.jit, static_argnames=("interpret",))
def flash_fwd(q, k, v, *, interpret: bool):
    """q (B, L, H, Q), k/v (B, L, K, Q) -> o (B, L, H, Q), lse (B*H, L, 1)."""
    b, length, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    bq, bk = _check(length, d, "fwd")
    scale = d**-0.5
    t = TILES["fwd"]
    n_q = length // bq
    q_blk = pl.BlockSpec((None, bq, None, d), _heavy_first(n_q, h))
    kv_full = pl.BlockSpec((None, length, None, d), lambda c, i: (c // h, 0, (c % h) // g, 0))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, bq=bq, bk=bk, n_q=n_q),
        grid=(b * h, n_q),
        in_specs=[q_blk, kv_full, kv_full],
        out_specs=[q_blk, pl.BlockSpec((None, bq, 1), _heavy_first(n_q))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b * h, length, 1), jnp.float32)],
        name="flash_attention_fwd",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(q, k, v)


@functools.partial(jax.jit, static_argnames=("interpret",))
def flash_bwd(q, k, v, o, lse, do, *, interpret: bool):
    """q, o, do (B, L, H, Q), k/v (B, L, K, Q), lse (B*H, L, 1) -> dq, dk, dv in the layouts of q, k, v."""
    b, length, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    scale = d**-0.5
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # (B, L, H), exact per row
    delta = delta.transpose(0, 2, 1).reshape(b * h, length, 1)
    # dK/dV: grid (batch x kv head, kv block); a program reads the G query heads of its group, and lse / delta
    # as rows (B*H, 1, L): the same bytes as (B*H, L, 1)
    bq, bk = _check(length, d, "dkv")
    t = TILES["dkv"]
    group_q = pl.BlockSpec((None, length, g, d), lambda c, j: (c // kh, 0, c % kh, 0))
    group_r = pl.BlockSpec((g, 1, length), lambda c, j: (c, 0, 0))
    kv_blk = pl.BlockSpec((None, bk, None, d), lambda c, j: (c // kh, j, c % kh, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, bq=bq, bk=bk, g=g, n_q=length // bq),
        grid=(b * kh, length // bk),
        in_specs=[group_q, kv_blk, kv_blk, group_q, group_r, group_r],
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="flash_attention_dkv",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(q, k, v, do, lse.reshape(b * h, 1, length), delta.reshape(b * h, 1, length))
    bq, bk = _check(length, d, "bwd")
    t = TILES["bwd"]
    n_q = length // bq
    q_blk = pl.BlockSpec((None, bq, None, d), _heavy_first(n_q, h))
    r_blk = pl.BlockSpec((None, bq, 1), _heavy_first(n_q))
    kv_full = pl.BlockSpec((None, length, None, d), lambda c, i: (c // h, 0, (c % h) // g, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, bq=bq, bk=bk, n_q=n_q),
        grid=(b * h, n_q),
        in_specs=[q_blk, kv_full, kv_full, q_blk, r_blk, r_blk],
        out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_attention_dq",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(q, k, v, do, lse, delta)
    return dq, dk, dv
