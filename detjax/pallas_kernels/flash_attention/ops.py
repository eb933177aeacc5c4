"""flash_attention(q, k, v, backend): causal GQA attention on (B, L, H, Q) / (B, L, K, Q) with a deterministic
backward. Two backends, each fixed-order and each with its own bits (model.flash_backend):
"triton" (kernel.py, every GPU and the CPU interpreter) and "mosaic" (mosaic.py, Hopper's wgmma; the Mosaic
GPU interpreter on CPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.flash_attention import kernel, mosaic


def resolve_backend(backend: str, length: int, head_dim: int, dtype, hopper: bool | None = None) -> str:
    """ "auto" for attention over `length` positions: "mosaic" on a Hopper GPU (`hopper`; None: this process's
    device, mosaic.available()) where its kernels take the shape in bf16, else "triton"; other backends
    unchanged. A training run applies it once to its config (config_checks.auto_flash_backend)."""
    if backend != "auto":
        return backend
    if jnp.dtype(dtype) != jnp.bfloat16 or not mosaic.fits(length, head_dim, dtype):
        return "triton"
    return "mosaic" if (mosaic.available() if hopper is None else hopper) else "triton"


def flash_fits(length: int, head_dim: int | None = None, backend: str = "triton") -> bool:
    """Whether the backend's tiles fit a sequence of `length` (and `head_dim`, for "mosaic")."""
    if backend == "mosaic":
        return mosaic.fits(length, head_dim)
    return all(kernel.blocks(length, w) is not None for w in ("fwd", "bwd", "dkv"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def flash_attention(q_BLHQ: jax.Array, k_BLKQ: jax.Array, v_BLKQ: jax.Array, backend: str = "triton") -> jax.Array:
    return _fwd(q_BLHQ, k_BLKQ, v_BLKQ, backend)[0]


def _fwd(q_BLHQ, k_BLKQ, v_BLKQ, backend):
    impl = mosaic if backend == "mosaic" else kernel
    o_BLHQ, lse = impl.flash_fwd(q_BLHQ, k_BLKQ, v_BLKQ, interpret=interpret_mode())
    return o_BLHQ, (q_BLHQ, k_BLKQ, v_BLKQ, o_BLHQ, lse)


def _bwd(backend, res, do_BLHQ):
    q_BLHQ, k_BLKQ, v_BLKQ, o_BLHQ, lse = res
    impl = mosaic if backend == "mosaic" else kernel
    return impl.flash_bwd(q_BLHQ, k_BLKQ, v_BLKQ, o_BLHQ, lse, do_BLHQ, interpret=interpret_mode())


flash_attention.defvjp(_fwd, _bwd)
