"""Pallas kernels with fixed-order reductions (no atomics), one folder per kernel.

Each folder: kernel.py (Pallas), ops.py (public function with custom_vjp), reference.py (plain jnp oracle).
MANIFEST maps every kernel-bearing file to its determinism tests (tests/test_pallas_manifest.py gates it).
Kernels run compiled on GPU (Pallas Triton backend) and with interpret=True elsewhere (CPU CI).
"""

import jax


def interpret_mode() -> bool:
    """Compiled Pallas on GPU; the Pallas interpreter on CPU (CI)."""
    return jax.default_backend() != "gpu"
