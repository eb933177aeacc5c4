"""Pallas kernels with fixed-order reductions (no atomics), one folder per kernel.

Each folder: kernel.py (Pallas), ops.py (public function with custom_vjp), reference.py (plain jnp oracle),
and in its __init__.py `supports(model_cfg)`: what the kernel cannot run, as (key, value, problem, fix)
tuples (the config turns them into errors). MANIFEST maps every kernel-bearing file to its determinism
tests (tests/test_pallas.py::test_manifest_gate gates it). Kernels run compiled on GPU (Pallas Triton
backend) and with interpret=True elsewhere (backend.py). Importing this package imports no JAX, so the
config can ask the kernels what they support before JAX starts.
"""

from __future__ import annotations

from typing import Any

from detjax.pallas_kernels import ce, conv, flash_attention, gated_norm, gmm, matmul, rmsnorm, rope, segment_sum, ssd
from detjax.pallas_kernels.support import Problem

KERNELS = (rmsnorm, segment_sum, flash_attention, ssd, gmm, matmul, rope, ce, conv, gated_norm)


def support_problems(model_cfg: Any) -> list[Problem]:
    """What model.kernels=pallas cannot run for this model config (empty: every kernel supports it)."""
    return [p for kernel in KERNELS for p in kernel.supports(model_cfg)]
