"""split_rope(y): the fused q/k/v product's output split into q, k, v, with RoPE on q and k, and its backward
through the Pallas kernel (kernel.rope_grad_concat) instead of XLA's fusion.

`shape` = (batch, length, heads, kv_heads, head_dim); y is (batch * length, (heads + 2 kv_heads) head_dim),
token-major. The forward is reference.rope on y's column blocks, the bits of splitting first and rotating
after (detjax.model.attention)."""

from __future__ import annotations

import functools

import jax

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.rope.kernel import fits, rope_grad_concat, rope_grad_quantize_transposed
from detjax.pallas_kernels.rope.reference import rope, tables

__all__ = ["fits", "rope_cotangent_quantized", "split_rope", "split_rope_forward"]


def split_rope_forward(y_MC: jax.Array, shape: tuple[int, int, int, int, int], theta: float):
    """(rope(q), rope(k), v) of y = [q | k | v], q (B, L, H, Q), k and v (B, L, K, Q)."""
    b, length, h, kh, q = shape
    if y_MC.shape != (b * length, (h + 2 * kh) * q):
        raise ValueError(f"split_rope: y {y_MC.shape} is not (batch * length, (H + 2 K) Q) for {shape}")
    q_BLHQ = y_MC[:, : h * q].reshape(b, length, h, q)
    k_BLKQ = y_MC[:, h * q : (h + kh) * q].reshape(b, length, kh, q)
    v_BLKQ = y_MC[:, (h + kh) * q :].reshape(b, length, kh, q)
    return rope(q_BLHQ, theta), rope(k_BLKQ, theta), v_BLKQ


def _flat(cts, shape):
    b, length = shape[:2]
    return [c.reshape(b * length, -1) for c in cts]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def split_rope(y_MC: jax.Array, shape: tuple[int, int, int, int, int], theta: float):
    """split_rope_forward, whose backward writes y's cotangent in one kernel pass (kernel.fits(shape))."""
    return split_rope_forward(y_MC, shape, theta)


def _fwd(y_MC, shape, theta):
    return split_rope_forward(y_MC, shape, theta), None


def _bwd(shape, theta, _, cts):
    length, q = shape[1], shape[4]
    cos, sin = tables(length, q, theta)
    return (rope_grad_concat(*_flat(cts, shape), cos, sin, length=length, head_dim=q, interpret=interpret_mode()),)


split_rope.defvjp(_fwd, _bwd)


def rope_cotangent_quantized(
    cts, shape, theta: float, scale: jax.Array, dtype, scale_index: int | None = None, amax_tiles: bool = False
):
    """(q, q^T, amax) of the cotangent of y for the cotangents (dq, dk, dv) of split_rope_forward: the fp8
    product's quantized incoming gradient (kernel.rope_grad_quantize_transposed; `scale_index` and
    `amax_tiles` as there)."""
    length, q = shape[1], shape[4]
    cos, sin = tables(length, q, theta)
    return rope_grad_quantize_transposed(
        *_flat(cts, shape),
        cos,
        sin,
        scale,
        length=length,
        head_dim=q,
        dtype=dtype,
        interpret=interpret_mode(),
        scale_index=scale_index,
        amax_tiles=amax_tiles,
    )
