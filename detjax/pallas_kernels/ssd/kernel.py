"""Mamba2 SSD chunked scan in Pallas: forward, and a backward whose every reduction has a fixed order.

Layout: x and dy (B*H, L, P); a = A*dt as a column (B*H, L, 1) and as a row (B*H, 1, L); B and C
(B, L, N), shared by the H heads of a batch row. One program per (batch row, head) walks the chunks
in order (forward: ascending, carrying the state; backward: descending, carrying the state gradient).

Within a chunk of Q rows (acs = cumsum of a inside the chunk, S = the state entering the chunk):
    y  = ((C B^T) o D) x + e^{acs} o (C S^T),          D[i, j] = e^{acs_i - acs_j} for i >= j, else 0
    S' = e^{acs_last} S + x^T (w o B),                  w = e^{acs_last - acs}
The forward also writes S for every chunk, so the backward need not re-run the recurrence.

Fixed-order reductions:
- dx, da: one writer per (batch row, head) and row; the sums over the chunk's rows are tile-local dots.
- dB, dC are shared by all heads, so each program writes its head's contribution to a private slot
  (B, H, L, N); the slots are then added in ascending head order ("separate writers in space, then order
  once", ../shared/seeds/001). No atomics anywhere.
- cumsum and its transpose are masked row sums; moving a (Q, 1) column to a (1, Q) row is a masked sum
  with exactly one nonzero term, so both views hold the same bits.
dt, A and D are outside the kernel (a = A*dt and x*dt are formed by the caller), so ddt, dA and dD come
from XLA's autodiff of elementwise products and per-head sums.
Tiles: the chunk Q is the model's `mamba.chunk_size`; P, N and Q must be powers of two >= 16 on GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TILES = {"rows_per_program": "one (batch row, head)", "chunk": "model.mamba.chunk_size", "num_warps": 4}


def _tri(q: int):
    i = jax.lax.broadcasted_iota(jnp.int32, (q, q), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (q, q), 1)
    return i, j


def _is_last(q: int):
    return jax.lax.broadcasted_iota(jnp.int32, (q, 1), 0) == q - 1


def _col_to_row(v_Q1, i, j):
    return jnp.sum(jnp.where(i == j, v_Q1, 0.0), axis=0, keepdims=True)


def _row_to_col(v_1Q, i, j):
    return jnp.sum(jnp.where(i == j, v_1Q, 0.0), axis=1, keepdims=True)


def _chunk_terms(a_row, q):
    """acs as a column and a row (same bits), the decay matrix D, acs_last (1, 1)."""
    i, j = _tri(q)
    acs_col = jnp.sum(jnp.where(i >= j, a_row, 0.0), axis=1, keepdims=True)
    acs_row = _col_to_row(acs_col, i, j)
    decay = jnp.where(i >= j, jnp.exp(jnp.where(i >= j, acs_col - acs_row, 0.0)), 0.0)
    last = jnp.sum(jnp.where(_is_last(q), acs_col, 0.0), axis=0, keepdims=True)
    return i, j, acs_col, decay, last


def _fwd_kernel(x_ref, arow_ref, b_ref, c_ref, y_ref, s_ref, *, q: int, nc: int):
    p, n = x_ref.shape[-1], b_ref.shape[-1]

    def body(ci, state_PN):
        rows = pl.ds(ci * q, q)
        x = x_ref[rows, :].astype(jnp.float32)
        b = b_ref[rows, :].astype(jnp.float32)
        c = c_ref[rows, :].astype(jnp.float32)
        _, _, acs_col, decay, last = _chunk_terms(arow_ref[:, rows].astype(jnp.float32), q)
        s_ref[ci, :, :] = state_PN
        cb = jnp.dot(c, b.T)
        y = jnp.dot(cb * decay, x) + jnp.exp(acs_col) * jnp.dot(c, state_PN.T)
        y_ref[rows, :] = y.astype(y_ref.dtype)
        w = jnp.exp(last - acs_col)
        return jnp.exp(last) * state_PN + jnp.dot(x.T, b * w)

    jax.lax.fori_loop(0, nc, body, jnp.zeros((p, n), jnp.float32))


def _bwd_kernel(x_ref, arow_ref, b_ref, c_ref, s_ref, dy_ref, dx_ref, da_ref, db_ref, dc_ref, *, q: int, nc: int):
    p, n = x_ref.shape[-1], b_ref.shape[-1]

    def body(k, ds_PN):  # ds: gradient of the state leaving chunk ci
        ci = nc - 1 - k
        rows = pl.ds(ci * q, q)
        x = x_ref[rows, :].astype(jnp.float32)
        b = b_ref[rows, :].astype(jnp.float32)
        c = c_ref[rows, :].astype(jnp.float32)
        dy = dy_ref[rows, :].astype(jnp.float32)
        s = s_ref[ci, :, :]
        i, j, acs_col, decay, last = _chunk_terms(arow_ref[:, rows].astype(jnp.float32), q)
        # y_diag = (CB^T o D) x
        cb = jnp.dot(c, b.T)
        dx = jnp.dot((cb * decay).T, dy)
        dmd = jnp.dot(dy, x.T) * decay
        dc = jnp.dot(dmd, b)
        db = jnp.dot(dmd.T, c)
        g = dmd * cb
        dacs = jnp.sum(g, axis=1, keepdims=True) - _row_to_col(jnp.sum(g, axis=0, keepdims=True), i, j)
        # y_off = e^{acs} o (C S^T)
        e = jnp.exp(acs_col)
        dye = dy * e
        dc = dc + jnp.dot(dye, s)
        ds_in = jnp.dot(dye.T, c)
        dacs = dacs + jnp.sum(dye * jnp.dot(c, s.T), axis=1, keepdims=True)
        # S' = e^{last} S + x^T (w o B)
        el = jnp.exp(last)
        ds_in = ds_in + el * ds_PN
        w = jnp.exp(last - acs_col)
        xds = jnp.dot(x, ds_PN)
        dx = dx + w * jnp.dot(b, ds_PN.T)
        db = db + w * xds
        dww = jnp.sum(xds * b, axis=1, keepdims=True) * w
        dlast = el * jnp.sum(jnp.sum(ds_PN * s, axis=1, keepdims=True), axis=0, keepdims=True)
        dlast = dlast + jnp.sum(dww, axis=0, keepdims=True)
        dacs = dacs - dww + jnp.where(_is_last(q), dlast, 0.0)
        # acs = cumsum(a): da_j = sum over i >= j of dacs_i
        da = jnp.sum(jnp.where(j >= i, _col_to_row(dacs, i, j), 0.0), axis=1, keepdims=True)
        dx_ref[rows, :] = dx.astype(dx_ref.dtype)
        da_ref[rows, :] = da
        db_ref[rows, :] = db
        dc_ref[rows, :] = dc
        return ds_in

    jax.lax.fori_loop(0, nc, body, jnp.zeros((p, n), jnp.float32))


def _check(length: int, chunk: int, p: int, n: int) -> int:
    if length % chunk:
        raise ValueError(f"SSD length {length} is not divisible by chunk {chunk}; choose chunk dividing seq_len")
    for name, v in (("chunk", chunk), ("head dim P", p), ("d_state N", n)):
        if v & (v - 1) or v < 16:
            raise ValueError(f"the Pallas SSD kernel needs {name} a power of two >= 16; got {v}")
    return length // chunk


def _specs(h: int, length: int, p: int, n: int):
    per_head = pl.BlockSpec((None, length, p), lambda g: (g, 0, 0))
    arow = pl.BlockSpec((None, 1, length), lambda g: (g, 0, 0))
    shared = pl.BlockSpec((None, length, n), lambda g: (g // h, 0, 0))
    return per_head, arow, shared


@functools.partial(jax.jit, static_argnames=("h", "chunk", "interpret"))
def ssd_fwd(x_GLP, arow_G1L, b_BLN, c_BLN, *, h: int, chunk: int, interpret: bool):
    """G = B*H programs -> y (G, L, P) and the state entering every chunk (G, nc, P, N)."""
    g, length, p = x_GLP.shape
    n = b_BLN.shape[-1]
    nc = _check(length, chunk, p, n)
    per_head, arow, shared = _specs(h, length, p, n)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, q=chunk, nc=nc),
        grid=(g,),
        in_specs=[per_head, arow, shared, shared],
        out_specs=[per_head, pl.BlockSpec((None, nc, p, n), lambda i: (i, 0, 0, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((g, length, p), jnp.float32),
            jax.ShapeDtypeStruct((g, nc, p, n), jnp.float32),
        ],
        name="ssd_fwd",
        interpret=interpret,
    )(x_GLP, arow_G1L, b_BLN, c_BLN)


@functools.partial(jax.jit, static_argnames=("h", "chunk", "interpret"))
def ssd_bwd(x_GLP, arow_G1L, b_BLN, c_BLN, s_GCPN, dy_GLP, *, h: int, chunk: int, interpret: bool):
    """-> dx (G, L, P), da (G, L, 1), and per-head slots dB, dC (G, L, N) for the caller to add in order."""
    g, length, p = x_GLP.shape
    n = b_BLN.shape[-1]
    nc = _check(length, chunk, p, n)
    per_head, arow, shared = _specs(h, length, p, n)
    slot = pl.BlockSpec((None, length, n), lambda i: (i, 0, 0))
    return pl.pallas_call(
        functools.partial(_bwd_kernel, q=chunk, nc=nc),
        grid=(g,),
        in_specs=[per_head, arow, shared, shared, pl.BlockSpec((None, nc, p, n), lambda i: (i, 0, 0, 0)), per_head],
        out_specs=[per_head, pl.BlockSpec((None, length, 1), lambda i: (i, 0, 0)), slot, slot],
        out_shape=[
            jax.ShapeDtypeStruct((g, length, p), jnp.float32),
            jax.ShapeDtypeStruct((g, length, 1), jnp.float32),
            jax.ShapeDtypeStruct((g, length, n), jnp.float32),
            jax.ShapeDtypeStruct((g, length, n), jnp.float32),
        ],
        name="ssd_bwd",
        interpret=interpret,
    )(x_GLP, arow_G1L, b_BLN, c_BLN, s_GCPN, dy_GLP)
