"""Mamba2 SSD chunked scan in Pallas: forward, and a backward whose every reduction has a fixed order.

Layout: x, y, dy and dx in the model's own (B, L, H*P) (a head's P columns side by side, so no transpose
on either side of the kernel); a = A*dt as a row (B*H, 1, L); B and C (B, L, N), shared by the H heads of a
batch row. A program's row g is batch row g // H, head g % H.

Within a chunk of Q rows (acs = cumsum of a inside the chunk, S = the state entering the chunk):
    y  = ((C B^T) o D) x + e^{acs} o (C S^T),          D[i, j] = e^{acs_i - acs_j} for i >= j, else 0
    S' = e^{acs_last} S + x^T (w o B),                  w = e^{acs_last - acs}
Chunk-parallel (the Mamba2 "chunk state / state passing / chunk scan" split), three launches each way:
- forward: every (row, chunk) computes its state increment x^T (w o B) and its decay e^{last} in parallel;
  one program per (row, block of TILES["pass_rows"] state rows) then walks the chunks in ascending order,
  S_{c+1} = e^{last_c} S_c + inc_c, writing the state entering every chunk (kept for the backward, with the
  decays); every (row, chunk) then forms y in parallel.
- backward: every (row, chunk) computes (dy o e^{acs})^T C in parallel; one program per (row, block of state
  rows) walks the chunks in descending order, G_{c-1} = inc_c + e^{last_c} G_c (G_c: the gradient of the
  state leaving chunk c), with the forward's decays; every (row, chunk) then forms dx, da, dB, dC in
  parallel from S_c and G_c.
Only the two walks are serial, and they are elementwise over a (P, N) state (so splitting its rows over
programs changes no value), and the matmul work runs on B*H*L/Q programs at once.

Fixed-order reductions:
- each recurrence step is one elementwise multiply-add in a fixed chunk order, the same expression as a
  serial scan would use;
- dx, da: one writer per (batch row, head) and row; the sums over the chunk's rows are tile-local dots.
- dB, dC are shared by all heads, so each program writes its head's contribution to a private slot
  (B, H, L, N); the slots are then added in ascending head order ("separate writers in space, then order
  once"). No atomics anywhere.
- cumsum and its transpose are masked row sums; moving a (Q, 1) column to a (1, Q) row is a masked sum
  with exactly one nonzero term, so both views hold the same bits.
dt, A and D are outside the kernel (a = A*dt and x*dt are formed by the caller), so ddt, dA and dD come
from XLA's autodiff of elementwise products and per-head sums.
Tiles: the chunk Q is the model's `mamba.chunk_size`; P, N and Q must be powers of two >= 16 on GPU. TILES
pins the warps (the backward's last kernel its own; other warps may give other bits on the GPU, which
scripts/tile_sweep.py reports) and the walks' state rows a program (time only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

TILES = {
    "program": "one (batch row, head, chunk); the two walks one (batch row, head, block of pass_rows state rows)",
    "chunk": "model.mamba.chunk_size",
    "num_warps": 4,  # every kernel but the backward's last
    "bwd_num_warps": 4,  # ssd_bwd, which holds the most tiles at once
    "pass_rows": 32,  # the walks: rows of the (P, N) state per program (P / pass_rows programs per row)
    "sum_rows": 32,  # sum_heads: token rows per program
    "sum_stages": 3,  # sum_heads: Triton pipeline stages (time only: every program adds its heads in order)
}


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


def _state_kernel(x_ref, arow_ref, b_ref, inc_ref, el_ref, *, q: int):
    """One (row, chunk): what the chunk adds to the state it passes on, x^T (w o B), and the chunk's decay
    e^{last} (as a (1, N) row, for the two walks)."""
    _, _, acs_col, _, last = _chunk_terms(arow_ref[...].astype(jnp.float32), q)
    w = jnp.exp(last - acs_col)
    inc_ref[...] = jnp.dot(x_ref[...].astype(jnp.float32).T, b_ref[...].astype(jnp.float32) * w)
    el_ref[...] = jnp.broadcast_to(jnp.exp(last), el_ref.shape)


def _pass_kernel(el_ref, inc_ref, s_ref, *, nc: int, reverse: bool):
    """One row's block of state rows: the short recurrence over chunks, in chunk order, elementwise.

    Forward: s_ref[c] = the state entering chunk c; S_{c+1} = e^{last_c} S_c + inc_c.
    Reverse: s_ref[c] = the gradient of the state leaving chunk c; G_{c-1} = inc_c + e^{last_c} G_c.
    """
    rows, n = inc_ref.shape[-2:]

    def body(k, carry_RN):
        ci = nc - 1 - k if reverse else k
        el_1N = el_ref[ci, :, :]
        s_ref[ci, :, :] = carry_RN
        if reverse:
            return inc_ref[ci, :, :] + el_1N * carry_RN
        return el_1N * carry_RN + inc_ref[ci, :, :]

    jax.lax.fori_loop(0, nc, body, jnp.zeros((rows, n), jnp.float32))


def _out_kernel(x_ref, arow_ref, b_ref, c_ref, s_ref, y_ref, *, q: int):
    """One (row, chunk): y = ((C B^T) o D) x + e^{acs} o (C S^T), S the state entering the chunk."""
    x = x_ref[...].astype(jnp.float32)
    b = b_ref[...].astype(jnp.float32)
    c = c_ref[...].astype(jnp.float32)
    _, _, acs_col, decay, _ = _chunk_terms(arow_ref[...].astype(jnp.float32), q)
    cb = jnp.dot(c, b.T)
    y = jnp.dot(cb * decay, x) + jnp.exp(acs_col) * jnp.dot(c, s_ref[...].T)
    y_ref[...] = y.astype(y_ref.dtype)


def _dstate_kernel(arow_ref, c_ref, dy_ref, inc_ref, *, q: int):
    """One (row, chunk): the chunk's own term of the gradient of the state entering it, (dy o e^{acs})^T C."""
    _, _, acs_col, _, _ = _chunk_terms(arow_ref[...].astype(jnp.float32), q)
    dye = dy_ref[...].astype(jnp.float32) * jnp.exp(acs_col)
    inc_ref[...] = jnp.dot(dye.T, c_ref[...].astype(jnp.float32))


def _bwd_operands(arow_ref, b_ref, c_ref, dy_ref, ds_ref, q: int):
    """What every backward kernel reads first: the chunk's terms, w = e^{last - acs}, B, C, dy and dS."""
    i, j, acs_col, decay, last = _chunk_terms(arow_ref[...].astype(jnp.float32), q)
    w = jnp.exp(last - acs_col)
    f32 = jnp.float32
    return (
        i,
        j,
        acs_col,
        decay,
        last,
        w,
        b_ref[...].astype(f32),
        c_ref[...].astype(f32),
        dy_ref[...].astype(f32),
        ds_ref[...],
    )


def _state_terms(dy, acs_col, c, s, ds_PN):
    """y_off = e^{acs} o (C S^T): its dC and dacs terms, and (with dS) the sum of the d(last) term."""
    dye = dy * jnp.exp(acs_col)
    dc_off = jnp.dot(dye, s)
    dacs_off = jnp.sum(dye * jnp.dot(c, s.T), axis=1, keepdims=True)
    dlast_s = jnp.sum(jnp.sum(ds_PN * s, axis=1, keepdims=True), axis=0, keepdims=True)
    return dc_off, dacs_off, dlast_s


def _diag_dacs(g, i, j):
    """y_diag's dacs from g = (dy x^T o D) o C B^T: its row sums minus its column sums."""
    return jnp.sum(g, axis=1, keepdims=True) - _row_to_col(jnp.sum(g, axis=0, keepdims=True), i, j)


def _da(dacs, dacs_off, dww, dlast_s, last, i, j, q: int):
    """da from the chunk's dacs terms: with d(last) on the last row, then acs = cumsum(a) transposed (da_j = the
    sum over i >= j of dacs_i)."""
    dacs = dacs + dacs_off
    dlast = jnp.exp(last) * dlast_s + jnp.sum(dww, axis=0, keepdims=True)
    dacs = dacs - dww + jnp.where(_is_last(q), dlast, 0.0)
    return jnp.sum(jnp.where(j >= i, _col_to_row(dacs, i, j), 0.0), axis=1, keepdims=True)


def _bwd_kernel(x_ref, arow_ref, b_ref, c_ref, s_ref, ds_ref, dy_ref, dx_ref, da_ref, db_ref, dc_ref, *, q: int):
    """One (row, chunk), given S (the state entering it) and dS (the gradient of the state leaving it).

    The terms are formed in the order that keeps the fewest float32 tiles live at once (each operand loaded
    where it is first used, dx stored before dB and dC are formed, the inter-chunk terms first); every output
    is the same expression with the same order of sums as in any other order (scripts/triton_regs.py: 356
    bytes a thread spilled at 4 warps, against 788 in the order of the formulas)."""
    i, j, acs_col, decay, last, w, b, c, dy, ds_PN = _bwd_operands(arow_ref, b_ref, c_ref, dy_ref, ds_ref, q)
    # dx: from y_diag = (CB^T o D) x and from S' = e^{last} S + x^T (w o B)
    cb = jnp.dot(c, b.T)
    dx = jnp.dot((cb * decay).T, dy)
    dx = dx + w * jnp.dot(b, ds_PN.T)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    s = s_ref[...]
    dc_off, dacs_off, dlast_s = _state_terms(dy, acs_col, c, s, ds_PN)
    # y_diag's dC, dB, dacs; S's dB and dw
    x = x_ref[...].astype(jnp.float32)
    dmd = jnp.dot(dy, x.T) * decay
    dacs = _diag_dacs(dmd * cb, i, j)
    dc_ref[...] = jnp.dot(dmd, b) + dc_off
    xds = jnp.dot(x, ds_PN)
    db_ref[...] = jnp.dot(dmd.T, c) + w * xds
    dww = jnp.sum(xds * b, axis=1, keepdims=True) * w
    da_ref[...] = _da(dacs, dacs_off, dww, dlast_s, last, i, j, q)


def _check(length: int, chunk: int, p: int, n: int) -> int:
    if length % chunk:
        raise ValueError(f"SSD length {length} is not divisible by chunk {chunk}; choose chunk dividing seq_len")
    for name, v in (("chunk", chunk), ("head dim P", p), ("d_state N", n)):
        if v & (v - 1) or v < 16:
            raise ValueError(f"the Pallas SSD kernel needs {name} a power of two >= 16; got {v}")
    return length // chunk


class _Specs:
    """Block specs: per (row, chunk) for the chunk-parallel kernels, whole rows for the chunk pass."""

    def __init__(self, h: int, length: int, chunk: int, p: int, n: int):
        nc = length // chunk
        self.x = pl.BlockSpec((None, chunk, p), lambda g, c: (g // h, c, g % h))
        self.arow = pl.BlockSpec((None, 1, chunk), lambda g, c: (g, 0, c))
        self.shared = pl.BlockSpec((None, chunk, n), lambda g, c: (g // h, c, 0))
        self.slot = pl.BlockSpec((None, chunk, n), lambda g, c: (g, c, 0))
        self.col = pl.BlockSpec((None, chunk, 1), lambda g, c: (g, c, 0))
        self.state = pl.BlockSpec((None, None, p, n), lambda g, c: (g, c, 0, 0))
        self.decay = pl.BlockSpec((None, None, 1, n), lambda g, c: (g, c, 0, 0))
        rows = min(TILES["pass_rows"], p)
        self.pass_grid = p // rows
        self.row_decays = pl.BlockSpec((None, nc, 1, n), lambda g, r: (g, 0, 0, 0))
        self.row_states = pl.BlockSpec((None, nc, rows, n), lambda g, r: (g, 0, r, 0))


def _chunk_call(kernel, grid, in_specs, out_specs, out_shape, name, interpret, num_warps=None):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name=name,
        interpret=interpret,
        compiler_params=triton_params(num_warps or TILES["num_warps"], 1, interpret),
    )


def _pass(el_GC1N, inc_GCPN, *, chunk, reverse, name, interpret):
    g, nc, p, n = inc_GCPN.shape
    sp = _Specs(1, nc * chunk, chunk, p, n)
    return _chunk_call(
        functools.partial(_pass_kernel, nc=nc, reverse=reverse),
        (g, sp.pass_grid),
        [sp.row_decays, sp.row_states],
        sp.row_states,
        jax.ShapeDtypeStruct(inc_GCPN.shape, jnp.float32),
        name,
        interpret,
    )(el_GC1N, inc_GCPN)


@functools.partial(jax.jit, static_argnames=("h", "chunk", "interpret"))
def ssd_fwd(x_BLK, arow_G1L, b_BLN, c_BLN, *, h: int, chunk: int, interpret: bool):
    """x (B, L, K = H*P), G = B*H rows -> y (B, L, K), the state entering every chunk (G, nc, P, N) and every
    chunk's decay e^{last} (G, nc, 1, N), both kept for the backward."""
    bsz, length, width = x_BLK.shape
    g, p, n = bsz * h, width // h, b_BLN.shape[-1]
    nc = _check(length, chunk, p, n)
    sp = _Specs(h, length, chunk, p, n)
    states_shape = jax.ShapeDtypeStruct((g, nc, p, n), jnp.float32)
    inc, el = _chunk_call(
        functools.partial(_state_kernel, q=chunk),
        (g, nc),
        [sp.x, sp.arow, sp.shared],
        [sp.state, sp.decay],
        [states_shape, jax.ShapeDtypeStruct((g, nc, 1, n), jnp.float32)],
        "ssd_chunk_state",
        interpret,
    )(x_BLK, arow_G1L, b_BLN)
    states = _pass(el, inc, chunk=chunk, reverse=False, name="ssd_state_pass", interpret=interpret)
    y = _chunk_call(
        functools.partial(_out_kernel, q=chunk),
        (g, nc),
        [sp.x, sp.arow, sp.shared, sp.shared, sp.state],
        sp.x,
        jax.ShapeDtypeStruct((bsz, length, width), jnp.float32),
        "ssd_fwd",
        interpret,
    )(x_BLK, arow_G1L, b_BLN, c_BLN, states)
    return y, states, el


@functools.partial(jax.jit, static_argnames=("h", "chunk", "interpret"))
def ssd_bwd(x_BLK, arow_G1L, b_BLN, c_BLN, s_GCPN, el_GC1N, dy_BLK, *, h: int, chunk: int, interpret: bool):
    """-> dx (B, L, K), da (G, L, 1), and per-head slots dB, dC (G, L, N) for the caller to add in order."""
    bsz, length, width = x_BLK.shape
    g, p, n = bsz * h, width // h, b_BLN.shape[-1]
    nc = _check(length, chunk, p, n)
    sp = _Specs(h, length, chunk, p, n)
    dinc = _chunk_call(
        functools.partial(_dstate_kernel, q=chunk),
        (g, nc),
        [sp.arow, sp.shared, sp.x],
        sp.state,
        jax.ShapeDtypeStruct(s_GCPN.shape, jnp.float32),
        "ssd_chunk_dstate",
        interpret,
    )(arow_G1L, c_BLN, dy_BLK)
    ds = _pass(el_GC1N, dinc, chunk=chunk, reverse=True, name="ssd_dstate_pass", interpret=interpret)
    f32 = jnp.float32
    dx_shape = jax.ShapeDtypeStruct((bsz, length, width), f32)
    slot_shape = jax.ShapeDtypeStruct((g, length, n), f32)
    return _chunk_call(
        functools.partial(_bwd_kernel, q=chunk),
        (g, nc),
        [sp.x, sp.arow, sp.shared, sp.shared, sp.state, sp.state, sp.x],
        [sp.x, sp.col, sp.slot, sp.slot],
        [dx_shape, jax.ShapeDtypeStruct((g, length, 1), f32), slot_shape, slot_shape],
        "ssd_bwd",
        interpret,
        TILES["bwd_num_warps"],
    )(x_BLK, arow_G1L, b_BLN, c_BLN, s_GCPN, ds, dy_BLK)


def _sum_heads_kernel(db_ref, dc_ref, db_out, dc_out, *, h: int):
    """One (batch row, block of token rows): the H heads' dB and dC slots added in ascending head order, the
    chain ((s_0 + s_1) + s_2) + ... of float32 adds, elementwise."""
    for ref, out in ((db_ref, db_out), (dc_ref, dc_out)):
        acc = ref[0, :, :]
        for k in range(1, h):
            acc = acc + ref[k, :, :]
        out[...] = acc


def sum_heads_usable(h: int, length: int, n: int) -> bool:
    """Whether sum_heads takes H heads of (L, N) slots: H and N powers of two (whole Triton blocks), L a
    multiple of TILES["sum_rows"]."""
    return h & (h - 1) == 0 and n & (n - 1) == 0 and n >= 16 and length % TILES["sum_rows"] == 0


@functools.partial(jax.jit, static_argnames=("h", "interpret"))
def sum_heads(db_GLN, dc_GLN, *, h: int, interpret: bool):
    """(dB, dC) (B, L, N): ssd_bwd's per-head slots (G = B*H, L, N) added in ascending head order, the same
    chain of float32 adds, so the same bits, as XLA's (ops._sum_heads_in_order); one pass that reads every
    slot once with its loads in flight together."""
    g, length, n = db_GLN.shape
    bsz, rows = g // h, TILES["sum_rows"]
    slots = pl.BlockSpec((None, h, rows, n), lambda b, r: (b, 0, r, 0))
    out = pl.BlockSpec((None, rows, n), lambda b, r: (b, r, 0))
    shape = jax.ShapeDtypeStruct((bsz, length, n), jnp.float32)
    return pl.pallas_call(
        functools.partial(_sum_heads_kernel, h=h),
        grid=(bsz, length // rows),
        in_specs=[slots, slots],
        out_specs=[out, out],
        out_shape=[shape, shape],
        name="ssd_sum_heads",
        interpret=interpret,
        compiler_params=triton_params(TILES["num_warps"], TILES["sum_stages"], interpret),
    )(db_GLN.reshape(bsz, h, length, n), dc_GLN.reshape(bsz, h, length, n))
