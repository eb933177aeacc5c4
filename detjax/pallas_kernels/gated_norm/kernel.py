"""The Mamba2 mixer's gate and gated RMSNorm, forward and backward, each in one Pallas pass.

Forward, per token row (D = the mixer's inner width, all heads): with d the skip weight broadcast over each
head's columns,
    u = y + d x,   g = u silu(z),   out = g rsqrt(mean(g^2) + eps) w.
y is the SSD scan's output, x the scan's input before its dt scaling (the convolution's output), z the gate
projection's output. XLA would write g (float32) for the RMSNorm to read, and its backward would read g, y, x
and z again in passes of their own; here the forward reads y, x and z once and writes out, and the backward
reads them and the incoming gradient once and writes dy (float32) and dz (z's dtype):
    dg = rstd (dghat - ghat mean(dghat ghat)),  dghat = dout w,  ghat = g rstd,
    dy = dg silu(z),  dz = dg u silu'(z),
and the column partials of dw = sum_t dout ghat and dd = sum_t dy x. x's own gradient from the skip term,
dy d, is left to the caller, which adds it to the scan's.

Tiles and orders are the RMSNorm kernel's (rmsnorm.kernel.TILES per width class, its column chunks and row
sums in ascending order), except that the backward takes enough warps for a thread to hold at most
BWD_ELEMS_PER_THREAD elements of a sub-block: it keeps about a dozen float32 values an element live (at
gpu_medium's width 2048, 4 warps, 16 elements a thread: 234 registers; 8 warps: 126; scripts/triton_regs.py).
The warps are a function of the width class, so pinned as the rest of the tile (a change changes bits: the
order of a sum inside a chunk follows the threads' layout). A program walks its `rows` tokens in sub-blocks
of `block_rows` in ascending order and adds the sub-blocks' column sums into one private slot; the caller adds
the slots by a fixed pairwise tree (ordered.tree_sum). No atomics; every output element has one writer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params
from detjax.pallas_kernels.rmsnorm.kernel import (
    _chunks,
    _pad_rows,
    _row_sum,
    _store_chunks,
    _tiles,
    chunk_width,
    width_class,
)

BWD_ELEMS_PER_THREAD = 8
MAX_WARPS = 16


def bwd_tiles(width: int) -> tuple[int, dict]:
    """(rows a program, tile) of the backward at this width: the RMSNorm backward's, with its warps raised
    until a thread holds at most BWD_ELEMS_PER_THREAD elements of a sub-block (at most MAX_WARPS)."""
    r, t = _tiles("bwd", width)
    warps = t["num_warps"]
    while warps < MAX_WARPS and t["block_rows"] * width_class(width) > 32 * warps * BWD_ELEMS_PER_THREAD:
        warps *= 2
    return r, {**t, "num_warps": warps}


def _gate(ys, xs, zs, ds):
    """Per chunk: (u, sigmoid(z), z, silu(z)) in float32, u = y + d x."""
    out = []
    for y, x, z, d in zip(ys, xs, zs, ds, strict=True):
        s = jax.nn.sigmoid(z)
        out.append((y + d * x, s, z, z * s))
    return out


def _fwd_kernel(y_ref, x_ref, z_ref, d_ref, w_ref, o_ref, rstd_ref, *, eps: float, br: int, nsub: int, c: int, nc: int):
    ws, ds = _chunks(w_ref, slice(None), c, nc), _chunks(d_ref, slice(None), c, nc)
    width = c * nc

    def body(s, carry):
        rows = pl.ds(pl.multiple_of(s * br, br), br)
        parts = _gate(*(_chunks(r, rows, c, nc) for r in (y_ref, x_ref, z_ref)), ds)
        gs = [u * silu for u, _, _, silu in parts]
        rstd = jax.lax.rsqrt(_row_sum([g * g for g in gs], width) + eps)
        _store_chunks(o_ref, rows, c, [g * rstd * w for g, w in zip(gs, ws, strict=True)])
        rstd_ref[rows, :] = rstd
        return carry

    jax.lax.fori_loop(0, nsub, body, 0)


def _bwd_kernel(y_ref, x_ref, z_ref, d_ref, w_ref, rstd_ref, do_ref, *outs, br: int, nsub: int, c: int, nc: int):
    dy_ref, dz_ref, dw_ref, dd_ref = outs
    ws, ds = _chunks(w_ref, slice(None), c, nc), _chunks(d_ref, slice(None), c, nc)
    width = c * nc

    def body(s, acc):
        dw_acc, dd_acc = acc
        rows = pl.ds(pl.multiple_of(s * br, br), br)
        rstd = rstd_ref[rows, :]
        xs = _chunks(x_ref, rows, c, nc)
        parts = _gate(_chunks(y_ref, rows, c, nc), xs, _chunks(z_ref, rows, c, nc), ds)
        ghat = [u * silu * rstd for u, _, _, silu in parts]
        dos = _chunks(do_ref, rows, c, nc)
        dghat = [do * w for do, w in zip(dos, ws, strict=True)]
        mean = _row_sum([a * b for a, b in zip(dghat, ghat, strict=True)], width)
        dg = [rstd * (a - b * mean) for a, b in zip(dghat, ghat, strict=True)]
        dy = [g * silu for g, (_, _, _, silu) in zip(dg, parts, strict=True)]
        dz = [g * u * (s_ * (1.0 + z * (1.0 - s_))) for g, (u, s_, z, _) in zip(dg, parts, strict=True)]
        _store_chunks(dy_ref, rows, c, dy)
        _store_chunks(dz_ref, rows, c, dz)
        dw_acc = tuple(a + jnp.sum(do * gh, axis=0, keepdims=True) for a, do, gh in zip(dw_acc, dos, ghat, strict=True))
        dd_acc = tuple(a + jnp.sum(v * x, axis=0, keepdims=True) for a, v, x in zip(dd_acc, dy, xs, strict=True))
        return dw_acc, dd_acc

    # this program's private slots: its sub-blocks' column sums in ascending order, from +0
    zero = tuple(jnp.zeros((1, c), jnp.float32) for _ in range(nc))
    dw, dd = jax.lax.fori_loop(0, nsub, body, (zero, zero))
    _store_chunks(dw_ref, slice(None), c, list(dw))
    _store_chunks(dd_ref, slice(None), c, list(dd))


def _check(y, x, z, d, w, z_col: int = 0):
    n, width = y.shape
    z_ok = z.shape[0] == n and z_col % width == 0 and z_col + width <= z.shape[1]
    if x.shape != y.shape or not z_ok or d.shape != (width,) or w.shape != (width,):
        got = f"y {y.shape}, x {x.shape}, z {z.shape} from column {z_col}, d {d.shape}, w {w.shape}"
        raise ValueError(f"gated_norm: y, x and z's D columns must be (N, D) and d, w (D,); got {got}")
    if y.dtype != jnp.float32 or x.dtype != jnp.float32:
        raise ValueError(f"gated_norm: y and x must be float32; got {y.dtype}, {x.dtype}")
    return n, width


def _z_rows(r: int, width: int, z_col: int) -> pl.BlockSpec:
    """z's blocks: its D columns from column z_col (a multiple of D) of a possibly wider array."""
    zb = z_col // width
    return pl.BlockSpec((r, width), lambda i: (i, zb))


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "out_dtype", "z_col"))
def gated_norm_fwd(y_ND, x_ND, z_NZ, d_D, w_D, *, eps: float, interpret: bool, out_dtype=None, z_col: int = 0):
    """(out (N, D) in out_dtype, default float32; rstd (N, 1) float32) of the module docstring's forward; z is
    columns z_col .. z_col + D of z_NZ (a multiple of D: the kernel reads them in place)."""
    n, width = _check(y_ND, x_ND, z_NZ, d_D, w_D, z_col)
    r, t = _tiles("fwd", width)
    c = chunk_width(width)
    ins = [_pad_rows(a, r) for a in (y_ND, x_ND, z_NZ)]
    np_ = ins[0].shape[0]
    rows, vec = pl.BlockSpec((r, width), lambda i: (i, 0)), pl.BlockSpec((1, width), lambda i: (0, 0))
    out, rstd = pl.pallas_call(
        functools.partial(_fwd_kernel, eps=eps, br=t["block_rows"], nsub=r // t["block_rows"], c=c, nc=width // c),
        grid=(np_ // r,),
        in_specs=[rows, rows, _z_rows(r, width, z_col), vec, vec],
        out_specs=[rows, pl.BlockSpec((r, 1), lambda i: (i, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((np_, width), out_dtype or jnp.float32),
            jax.ShapeDtypeStruct((np_, 1), jnp.float32),
        ],
        name="gated_norm_fwd",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(*ins, d_D.reshape(1, width).astype(jnp.float32), w_D.reshape(1, width).astype(jnp.float32))
    return (out, rstd) if np_ == n else (out[:n], rstd[:n])


@functools.partial(jax.jit, static_argnames=("interpret", "z_col"))
def gated_norm_bwd(y_ND, x_ND, z_NZ, d_D, w_D, rstd_N1, do_ND, *, interpret: bool, z_col: int = 0):
    """(dy (N, D) float32, dz (N, D) in z's dtype, dw partials (P, D), dd partials (P, D)) of the forward, for
    the incoming gradient do: one float32 partial row per program of `rows` tokens, for ordered.tree_sum. z as
    in gated_norm_fwd; dz holds its D columns only."""
    n, width = _check(y_ND, x_ND, z_NZ, d_D, w_D, z_col)
    r, t = bwd_tiles(width)
    c = chunk_width(width)
    ins = [_pad_rows(a, r) for a in (y_ND, x_ND, z_NZ)]
    rp, dop = _pad_rows(rstd_N1, r), _pad_rows(do_ND, r)
    np_ = ins[0].shape[0]
    nb = np_ // r
    rows, vec = pl.BlockSpec((r, width), lambda i: (i, 0)), pl.BlockSpec((1, width), lambda i: (0, 0))
    part = pl.BlockSpec((1, width), lambda i: (i, 0))
    br = t["block_rows"]
    dy, dz, dw, dd = pl.pallas_call(
        functools.partial(_bwd_kernel, br=br, nsub=r // br, c=c, nc=width // c),
        grid=(nb,),
        in_specs=[rows, rows, _z_rows(r, width, z_col), vec, vec, pl.BlockSpec((r, 1), lambda i: (i, 0)), rows],
        out_specs=[rows, rows, part, part],
        out_shape=[
            jax.ShapeDtypeStruct((np_, width), jnp.float32),
            jax.ShapeDtypeStruct((np_, width), z_NZ.dtype),
            jax.ShapeDtypeStruct((nb, width), jnp.float32),
            jax.ShapeDtypeStruct((nb, width), jnp.float32),
        ],
        name="gated_norm_bwd",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(*ins, d_D.reshape(1, width).astype(jnp.float32), w_D.reshape(1, width).astype(jnp.float32), rp, dop)
    if np_ != n:
        dy, dz = dy[:n], dz[:n]
    return dy, dz, dw, dd
