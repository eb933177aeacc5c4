"""fp8 quantization with a transposed copy and the amax, in one pass (model.fp8 on the Mosaic GPU path).

Hopper's fp8 wgmma reads both operands with the reduced dimension contiguous, so the weight gradient
dw = x^T @ dy needs x and dy transposed, and the forward needs the weight transposed (kernel.fp8_nt). XLA's
transposes of one-byte arrays ran at about a quarter of the H200's memory bandwidth and took a quarter of
gpu_dense's fp8 step (docs/BENCHMARKS.md, session 22). This kernel reads v once and writes
q = fp8(clip(v * scale)) in both layouts, plus the largest |v| of each tile.

Bits: the quantization is elementwise -- a float32 product, a clip, one round-to-nearest-even conversion --
the same function (`quantize`) as detjax.model.fp8's XLA path, so q does not depend on the tile (tests/test_matmul.py
checks it against the XLA quantization on the GPU). The amax is a maximum: exact in any order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

BLOCK = 128  # a program's tile is BLOCK x BLOCK (not swept; speed only: the values are elementwise)
NUM_WARPS = 8


def fits(shape: tuple[int, ...]) -> bool:
    """Whether the kernel takes a 2-D array of this shape (whole tiles; other shapes use XLA)."""
    return len(shape) == 2 and shape[0] % BLOCK == 0 and shape[1] % BLOCK == 0


def quantize(v: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """dtype(clip(v * scale, -fmax, fmax)) in float32: model.fp8's quantization, here and in XLA alike."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(v.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)


def _kernel(v_ref, s_ref, q_ref, qt_ref, amax_ref):
    v = v_ref[...].astype(jnp.float32)
    q = quantize(v, s_ref[0], q_ref.dtype)
    q_ref[...] = q
    qt_ref[...] = q.T
    amax_ref[...] = jnp.broadcast_to(jnp.max(jnp.abs(v)), (1, 1))


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def quantize_transposed(v: jax.Array, scale: jax.Array, *, dtype, interpret: bool):
    """(q, q^T, amax): q = dtype(clip(v * scale, -fmax, fmax)) for a 2-D v whose dims are whole BLOCKs
    (`fits`), its transpose, and max |v| (float32)."""
    m, n = v.shape
    if not fits(v.shape):
        raise ValueError(f"quantize_transposed: shape {v.shape} is not whole {BLOCK} x {BLOCK} tiles")
    gm, gn = m // BLOCK, n // BLOCK
    q, qt, amax = pl.pallas_call(
        _kernel,
        grid=(gm, gn),
        in_specs=[
            pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j)),
            pl.BlockSpec((1,), lambda i, j: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j)),
            pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (j, i)),
            pl.BlockSpec((1, 1), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((m, n), dtype),
            jax.ShapeDtypeStruct((n, m), dtype),
            jax.ShapeDtypeStruct((gm, gn), jnp.float32),
        ],
        name="fp8_quantize_transposed",
        interpret=interpret,
        compiler_params=triton_params(NUM_WARPS, 1, interpret),
    )(v, jnp.asarray(scale, jnp.float32).reshape(1))
    return q, qt, jnp.max(amax)
