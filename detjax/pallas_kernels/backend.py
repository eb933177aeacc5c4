"""Where the Pallas kernels run: compiled (Triton) on GPU, the Pallas interpreter elsewhere (CPU CI)."""

import jax


def interpret_mode() -> bool:
    return jax.default_backend() != "gpu"
