"""The SwiGLU MLP's backward elementwise pass folded into the down projection's dx matmul (Pallas, pinned tiles).

The gate and up weights are interleaved in blocks of BLOCK columns, w_gu = [gate_0 | up_0 | gate_1 | up_1 | ...]
(K x 2F), so that the gate and up columns of the same hidden units sit side by side in the gate/up product
gu = x @ w_gu (the matmul kernel's forward: column-invariant, so each column has the bits it has without the
interleaving) and in its cotangent.
- `down_dx_silu_bwd`: one program per (bm rows, BLOCK hidden units) computes dh = dy @ w_downᵀ by ONE
  ascending loop over D in blocks of 64 (float32, never rounded: the matmul kernel's dx rule), then
  d gate = dh * up * silu'(gate) and d up = dh * silu(gate) from the saved gate and up (float32), and writes
  them interleaved -- the gate/up product's cotangent in w_gu's column order, with no dh round trip through
  memory and no separate elementwise kernel.
One writer per output element and a reduction order fixed by D alone: batch-invariant as the matmul kernel is
(rows of a row subset give the same bits). The forward's silu(gate) * up stays an XLA fusion: a kernel that
wrote h from the gate/up product measured slower than the matmul plus that fusion (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

BLOCK = 128  # hidden units per interleaved block: part of the numerics (the column order of w_gu)
# bm 64, 4 warps, 4 stages: best of six at gpu_dense (M 8192, D 1024, F 4096) on the H200 (docs/BENCHMARKS.md);
# rows are independent, so bm, warps and stages change speed, never bits (same bits in that sweep)
TILES = {"bwd": {"bm": 64, "block_r": 64, "num_warps": 4, "num_stages": 4}}


def interleave(gate_KF: jax.Array, up_KF: jax.Array) -> jax.Array:
    """(K, F), (K, F) -> (K, 2F) in blocks of BLOCK columns: gate block 0, up block 0, gate block 1, ..."""
    k, f = gate_KF.shape
    return jnp.stack([gate_KF.reshape(k, f // BLOCK, BLOCK), up_KF.reshape(k, f // BLOCK, BLOCK)], 2).reshape(k, 2 * f)


def deinterleave(gu_RF2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(R, 2F) interleaved (weights or the gate/up product) -> the gate part (R, F), the up part (R, F)."""
    r, f2 = gu_RF2.shape
    blocks = gu_RF2.reshape(r, f2 // (2 * BLOCK), 2, BLOCK)
    return blocks[:, :, 0].reshape(r, f2 // 2), blocks[:, :, 1].reshape(r, f2 // 2)


def _silu_parts(g):
    """(sigmoid(g), silu(g)) in float32."""
    s = 1.0 / (1.0 + jnp.exp(-g))
    return s, g * s


def _bwd_kernel(dy_ref, w_ref, gu_ref, dgu_ref, *, br: int, nr: int):
    dims = (((1,), (1,)), ((), ()))  # dy (bm, br) . w (BLOCK, br)^T

    def body(r, acc):
        blk = pl.ds(pl.multiple_of(r * br, br), br)
        return acc + jax.lax.dot_general(dy_ref[:, blk], w_ref[:, blk], dims, preferred_element_type=jnp.float32)

    dh = jax.lax.fori_loop(0, nr, body, jnp.zeros((dy_ref.shape[0], BLOCK), jnp.float32))
    g = gu_ref[:, :BLOCK].astype(jnp.float32)
    u = gu_ref[:, BLOCK:].astype(jnp.float32)
    s, silu = _silu_parts(g)
    dgu_ref[:, :BLOCK] = (dh * u * (s + silu * (1.0 - s))).astype(dgu_ref.dtype)
    dgu_ref[:, BLOCK:] = (dh * silu).astype(dgu_ref.dtype)


def _pad_rows(x: jax.Array, bm: int) -> jax.Array:
    return jnp.pad(x, ((0, -x.shape[0] % bm), (0, 0))) if x.shape[0] % bm else x


def _check(k: int, f2: int, br: int) -> None:
    if f2 % (2 * BLOCK) or k % br:
        raise ValueError(
            f"the fused SwiGLU needs ffn_dim a multiple of {BLOCK} and d_model a multiple of {br}; got ffn_dim "
            f"{f2 // 2}, d_model {k}"
        )


@functools.partial(jax.jit, static_argnames=("interpret",))
def down_dx_silu_bwd(dy_MD: jax.Array, w_down_FD: jax.Array, gu_MF2: jax.Array, *, interpret: bool) -> jax.Array:
    """dy (M, D), w_down (F, D), gu (M, 2F) interleaved, one dtype -> d gu (M, 2F) interleaved, in that dtype."""
    m, d = dy_MD.shape
    f2 = gu_MF2.shape[1]
    t = TILES["bwd"]
    bm, br = t["bm"], t["block_r"]
    _check(d, f2, br)
    dy, gu = _pad_rows(dy_MD, bm), _pad_rows(gu_MF2, bm)
    mp = dy.shape[0]
    dgu = pl.pallas_call(
        functools.partial(_bwd_kernel, br=br, nr=d // br),
        grid=(mp // bm, f2 // (2 * BLOCK)),
        in_specs=[
            pl.BlockSpec((bm, d), lambda i, j: (i, 0)),
            pl.BlockSpec((BLOCK, d), lambda i, j: (j, 0)),
            pl.BlockSpec((bm, 2 * BLOCK), lambda i, j: (i, j)),
        ],
        out_specs=pl.BlockSpec((bm, 2 * BLOCK), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, f2), dy.dtype),
        name="swiglu_down_dx_silu_bwd",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(dy, w_down_FD, gu)
    return dgu[:m] if mp != m else dgu
