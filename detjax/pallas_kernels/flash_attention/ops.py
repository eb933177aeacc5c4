"""flash_attention(q, k, v): causal GQA attention on (B, L, H, Q) / (B, L, K, Q) with a deterministic backward."""

from __future__ import annotations

import jax

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.flash_attention.kernel import blocks, flash_bwd, flash_fwd


def flash_fits(length: int) -> bool:
    """Whether the kernel's tiles fit a sequence of `length` (a multiple of 16)."""
    return blocks(length, "fwd") is not None and blocks(length, "bwd") is not None


def _to_heads(x_BLHQ):
    b, length, h, q = x_BLHQ.shape
    return x_BLHQ.transpose(0, 2, 1, 3).reshape(b * h, length, q)


def _from_heads(x, b, h):
    bh, length, q = x.shape
    return x.reshape(b, h, length, q).transpose(0, 2, 1, 3)


@jax.custom_vjp
def flash_attention(q_BLHQ: jax.Array, k_BLKQ: jax.Array, v_BLKQ: jax.Array) -> jax.Array:
    return _fwd(q_BLHQ, k_BLKQ, v_BLKQ)[0]


def _fwd(q_BLHQ, k_BLKQ, v_BLKQ):
    b, _, h, _ = q_BLHQ.shape
    g = h // k_BLKQ.shape[2]
    q, k, v = _to_heads(q_BLHQ), _to_heads(k_BLKQ), _to_heads(v_BLKQ)
    o, lse = flash_fwd(q, k, v, g=g, interpret=interpret_mode())
    return _from_heads(o, b, h), (q, k, v, o, lse)


def _bwd(res, do_BLHQ):
    q, k, v, o, lse = res
    b, _, h, _ = do_BLHQ.shape
    kh = k.shape[0] // b
    g = h // kh
    dq, dk, dv = flash_bwd(q, k, v, o, lse, _to_heads(do_BLHQ), g=g, interpret=interpret_mode())
    return _from_heads(dq, b, h), _from_heads(dk, b, kh), _from_heads(dv, b, kh)


flash_attention.defvjp(_fwd, _bwd)
