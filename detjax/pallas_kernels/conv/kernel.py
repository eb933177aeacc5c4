"""The backward of the Mamba2 mixer's causal depthwise convolution and its SiLU, fixed order.

Forward (model.mamba2.causal_conv then silu, left to XLA): per channel c and token t of a sequence,
    conv[t] = b + sum_k w[k] x[t - W + 1 + k]   (x = 0 before the sequence),   s = silu(conv).
Backward, from ds (the gradient of s), with dconv = ds * silu'(conv):
    dx[t] = sum_k w[k] dconv[t + W - 1 - k],   dw[k] = sum_t x[t - W + 1 + k] dconv[t],   db = sum_t dconv[t].
A program owns a (TILES["block_rows"] tokens x TILES["block_channels"] channels) tile of one sequence. It
recomputes conv from x (the terms in the forward's order, b first, then k ascending; x's shifted windows loaded
once each, zero outside the sequence by masked loads) and forms dconv from ds. Then, by TILES["dx_in_kernel"]:
- True (one pass): it recomputes conv and dconv on the W row windows its dx needs (2W - 1 windows of x; dconv
  zero past the end of the sequence: no gradient comes from there) and adds dx in the order k = W - 1 .. 0.
  That evaluates the SiLU's sigmoid W times an element.
- False (two passes, pinned): it writes its tile's dconv (float32), once an element, and XLA adds dx from it,
  the same sum in the same order (k = W - 1 .. 0) over a copy of dconv with W - 1 zero rows after the
  sequence.
No padded copy of x or ds is made on the GPU (the interpreter gets one of x: see conv_silu_bwd). Its tile's dw
and db are row sums of a pinned shape, written as partials (one per row tile); the caller adds the partials of
the batch's tiles by a fixed tree (ordered.tree_sum). No atomics; every output element has one writer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from detjax.pallas_kernels.backend import triton_params

# dx_in_kernel False (two passes): in the gpu_medium step, with the fused gate, 0.6 % faster synced and 0.1 %
# pipelined than XLA's autodiff on an H100 (docs/BENCHMARKS.md); the tiles are the one-pass form's sweep winner,
# not swept in this form yet (scripts/tile_sweep.py --kernels conv has both forms' candidates)
TILES = {"block_rows": 32, "block_channels": 128, "num_warps": 4, "num_stages": 1, "dx_in_kernel": False}


def usable(length: int, channels: int) -> bool:
    """Whether the kernel takes a (B, length, channels) input: whole row tiles and whole channel tiles."""
    return length % TILES["block_rows"] == 0 and channels % TILES["block_channels"] == 0


def _dsilu(c):
    s = jax.nn.sigmoid(c)
    return s * (1.0 + c * (1.0 - s))


def _kernel(
    x_ref, ds_ref, w_ref, b_ref, dx_ref, dw_ref, db_ref, *, width: int, bt: int, length: int, front: int, dx_in: bool
):
    """dx_in: the one pass (dx_ref gets dx); else dx_ref gets the tile's dconv."""
    r = pl.program_id(1)
    t0 = pl.multiple_of(r * bt, bt)
    w = [w_ref[pl.ds(k, 1), :].astype(jnp.float32) for k in range(width)]  # (1, bc) each
    b = b_ref[...].astype(jnp.float32)
    rows = jax.lax.broadcasted_iota(jnp.int32, (bt, x_ref.shape[-1]), 0)
    windows = {}

    def x_rows(o):
        """x at tokens t0 + o .. t0 + o + bt - 1 (o from 1 - W to W - 1), zero outside the sequence, each window
        loaded once. `front` zero rows lead x_ref (the interpreter's copy; on the GPU none, and the rows
        before the sequence are masked off)."""
        if o not in windows:
            start = t0 + o + front
            pos = rows + (t0 + o)
            keep = (pos >= 0) & (pos < length)
            windows[o] = plt.load(x_ref.at[pl.ds(start, bt), :], mask=keep, other=0).astype(jnp.float32)
        return windows[o]

    def dconv(m):  # dconv at tokens t0 + m .. (m = 0 .. W - 1); no gradient from past the sequence
        conv = b
        for k in range(width):
            conv = conv + x_rows(m - width + 1 + k) * w[k]
        keep = rows + (t0 + m) < length
        ds = plt.load(ds_ref.at[pl.ds(t0 + m, bt), :], mask=keep, other=0).astype(jnp.float32)
        return ds * _dsilu(conv)

    d0 = dconv(0)
    for k in range(width):
        dw_ref[pl.ds(k, 1), :] = jnp.sum(x_rows(k - width + 1) * d0, axis=0, keepdims=True)
    db_ref[...] = jnp.sum(d0, axis=0, keepdims=True)
    if not dx_in:
        dx_ref[...] = d0
        return
    dx = w[width - 1] * d0
    for k in range(width - 2, -1, -1):  # dx[t] = sum_k w[k] dconv[t + W - 1 - k], k = W - 1 first
        dx = dx + w[k] * dconv(width - 1 - k)
    dx_ref[...] = dx.astype(dx_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "col0"))
def conv_silu_bwd(x_BLX, w_WC, b_C, ds_BLC, *, interpret: bool, col0: int = 0):
    """(dx (B, L, C) in x's dtype, dw partials (B, L / block_rows, W, C), db partials (B, L / block_rows, 1, C)),
    float32 partials, of silu(causal_conv(x, w, b)) given the gradient ds of its output; dx in the kernel or
    from its dconv by XLA (TILES["dx_in_kernel"]). x is channels col0 .. col0 + C of x_BLX (col0 a multiple of
    block_channels: the kernel reads them in place)."""
    bsz, length, ch = ds_BLC.shape
    width = w_WC.shape[0]
    bt, bc, dx_in = TILES["block_rows"], TILES["block_channels"], TILES["dx_in_kernel"]
    if not usable(length, ch) or col0 % bc or x_BLX.shape[:2] != (bsz, length) or col0 + ch > x_BLX.shape[2]:
        raise ValueError(
            f"conv_silu_bwd takes tokens in blocks of {bt} and channels in blocks of {bc} (from a channel that is "
            f"a multiple of {bc}); got x {x_BLX.shape} from channel {col0}, ds {ds_BLC.shape}"
        )
    cb = col0 // bc
    # The GPU kernel masks the rows before the sequence off; the interpreter clamps a window that starts
    # before its array instead, so there x gets W - 1 leading zero rows (the same values either way)
    front = width - 1 if interpret else 0
    xp = jnp.pad(x_BLX, ((0, 0), (front, 0), (0, 0))) if front else x_BLX
    nt = length // bt
    dx, dw, db = pl.pallas_call(
        functools.partial(_kernel, width=width, bt=bt, length=length, front=front, dx_in=dx_in),
        grid=(bsz, nt, ch // bc),
        in_specs=[
            pl.BlockSpec((None, length + front, bc), lambda i, r, c: (i, 0, c + cb)),
            pl.BlockSpec((None, length, bc), lambda i, r, c: (i, 0, c)),
            pl.BlockSpec((width, bc), lambda i, r, c: (0, c)),
            pl.BlockSpec((1, bc), lambda i, r, c: (0, c)),
        ],
        out_specs=[
            pl.BlockSpec((None, bt, bc), lambda i, r, c: (i, r, c)),
            pl.BlockSpec((None, None, width, bc), lambda i, r, c: (i, r, 0, c)),
            pl.BlockSpec((None, None, 1, bc), lambda i, r, c: (i, r, 0, c)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(ds_BLC.shape, x_BLX.dtype if dx_in else jnp.float32),
            jax.ShapeDtypeStruct((bsz, nt, width, ch), jnp.float32),
            jax.ShapeDtypeStruct((bsz, nt, 1, ch), jnp.float32),
        ],
        name="conv_silu_bwd",
        interpret=interpret,
        compiler_params=triton_params(TILES["num_warps"], TILES["num_stages"], interpret),
    )(xp, ds_BLC, w_WC, b_C.reshape(1, ch))
    if not dx_in:
        dx = _dx_from_dconv(dx, w_WC).astype(x_BLX.dtype)
    return dx, dw, db


def _dx_from_dconv(dconv_BLC, w_WC):
    """dx[t] = sum_k w[k] dconv[t + W - 1 - k], added for k = W - 1 .. 0 as the one-pass kernel adds it, dconv
    zero past the end of the sequence."""
    width, length = w_WC.shape[0], dconv_BLC.shape[1]
    dpad = jnp.pad(dconv_BLC, ((0, 0), (0, width - 1), (0, 0)))
    w = w_WC.astype(jnp.float32).reshape(width, 1, 1, -1)
    dx = w[width - 1] * dpad[:, :length]
    for k in range(width - 2, -1, -1):
        m = width - 1 - k
        dx = dx + w[k] * dpad[:, m : m + length]
    return dx
