"""flash_attention(q, k, v): causal GQA attention on (B, L, H, Q) / (B, L, K, Q) with a deterministic backward."""

from __future__ import annotations

import jax

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.flash_attention.kernel import blocks, flash_bwd, flash_fwd


def flash_fits(length: int) -> bool:
    """Whether the kernel's tiles fit a sequence of `length` (a multiple of 16)."""
    return all(blocks(length, w) is not None for w in ("fwd", "bwd", "dkv"))


@jax.custom_vjp
def flash_attention(q_BLHQ: jax.Array, k_BLKQ: jax.Array, v_BLKQ: jax.Array) -> jax.Array:
    return _fwd(q_BLHQ, k_BLKQ, v_BLKQ)[0]


def _fwd(q_BLHQ, k_BLKQ, v_BLKQ):
    o_BLHQ, lse = flash_fwd(q_BLHQ, k_BLKQ, v_BLKQ, interpret=interpret_mode())
    return o_BLHQ, (q_BLHQ, k_BLKQ, v_BLKQ, o_BLHQ, lse)


def _bwd(res, do_BLHQ):
    q_BLHQ, k_BLKQ, v_BLKQ, o_BLHQ, lse = res
    return flash_bwd(q_BLHQ, k_BLKQ, v_BLKQ, o_BLHQ, lse, do_BLHQ, interpret=interpret_mode())


flash_attention.defvjp(_fwd, _bwd)
