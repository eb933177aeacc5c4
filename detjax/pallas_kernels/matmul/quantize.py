"""fp8 quantization with a transposed copy and the amax, in one pass (model.fp8 on the Mosaic GPU path).

Hopper's fp8 wgmma reads both operands with the reduced dimension contiguous, so the weight gradient
dw = x^T @ dy needs x and dy transposed, and the forward needs the weight transposed (kernel.fp8_nt). XLA's
transposes of one-byte arrays ran at about a quarter of the H200's memory bandwidth and took a quarter of
gpu_dense's fp8 step (docs/BENCHMARKS.md, session 22). This kernel reads v once and writes
q = fp8(clip(v * scale)) in both layouts, zero-padded to the product's tiles (so no pad copy follows), plus the
largest |v| of each tile.

Bits: the quantization is elementwise -- a float32 product, a clip, one round-to-nearest-even conversion --
the same function (`quantize`) as detjax.model.fp8's XLA path, so q does not depend on the tile (tests/test_matmul.py
checks it against the XLA quantization on the GPU). The padding is zeros, which add nothing to a product's
float32 sums. The amax is a maximum: exact in any order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

BLOCK = 128  # a program's tile is BLOCK x BLOCK (not swept; speed only: the values are elementwise)
NUM_WARPS = 8


def padded(size: int, multiple: int) -> int:
    """size rounded up to a multiple of `multiple`."""
    return -(-size // multiple) * multiple


def quantize(v: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """dtype(clip(v * scale, -fmax, fmax)) in float32: model.fp8's quantization, here and in XLA alike."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(v.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)


def _kernel(v_ref, s_ref, q_ref, qt_ref, amax_ref, *, m: int, n: int, padding: bool):
    v = v_ref[...].astype(jnp.float32)
    if padding:  # a tile over v's edge or past it (it loaded v's last tile): what lies outside v becomes 0
        rows = pl.program_id(0) * BLOCK + jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
        cols = pl.program_id(1) * BLOCK + jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
        v = jnp.where((rows < m) & (cols < n), v, 0.0)
    q = quantize(v, s_ref[0], q_ref.dtype)
    q_ref[...] = q
    qt_ref[...] = q.T
    amax_ref[...] = jnp.broadcast_to(jnp.max(jnp.abs(v)), (1, 1))


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "rows_to", "cols_to"))
def quantize_transposed(
    v: jax.Array, scale: jax.Array, *, dtype, interpret: bool, rows_to: int = BLOCK, cols_to: int = BLOCK
):
    """(q, q^T, amax) of a 2-D v: q = dtype(clip(v * scale, -fmax, fmax)), zero-padded to rows_to x
    cols_to multiples (multiples of BLOCK: the padding the Mosaic fp8 product needs, written here instead
    of by a copy), its transpose, and max |v| (float32, over v alone)."""
    m, n = v.shape
    if rows_to % BLOCK or cols_to % BLOCK:
        raise ValueError(f"quantize_transposed: rows_to={rows_to}, cols_to={cols_to} must be multiples of {BLOCK}")
    mp, np_ = padded(m, rows_to), padded(n, cols_to)
    gm, gn = mp // BLOCK, np_ // BLOCK
    last_i, last_j = -(-m // BLOCK) - 1, -(-n // BLOCK) - 1  # v's last tile: tiles past v load it, then mask
    q, qt, amax = pl.pallas_call(
        functools.partial(_kernel, m=m, n=n, padding=(mp, np_) != (m, n)),
        grid=(gm, gn),
        in_specs=[
            pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (jnp.minimum(i, last_i), jnp.minimum(j, last_j))),
            pl.BlockSpec((1,), lambda i, j: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j)),
            pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (j, i)),
            pl.BlockSpec((1, 1), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((mp, np_), dtype),
            jax.ShapeDtypeStruct((np_, mp), dtype),
            jax.ShapeDtypeStruct((gm, gn), jnp.float32),
        ],
        name="fp8_quantize_transposed",
        interpret=interpret,
        compiler_params=triton_params(NUM_WARPS, 1, interpret),
    )(v, jnp.asarray(scale, jnp.float32).reshape(1))
    return q, qt, jnp.max(amax)
