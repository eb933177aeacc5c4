"""Where the Pallas kernels run: compiled (Triton) on GPU, the Pallas interpreter elsewhere (CPU CI)."""

import jax


def interpret_mode() -> bool:
    return jax.default_backend() != "gpu"


def triton_params(num_warps: int, num_stages: int, interpret: bool):
    """Triton launch parameters of a kernel (None under the interpreter, which ignores them)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
