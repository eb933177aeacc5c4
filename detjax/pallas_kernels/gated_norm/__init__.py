"""The Mamba2 mixer's gate and gated RMSNorm in one Pallas kernel (kernel.py), its op (ops.py) and its jnp
oracle (reference.py)."""

from detjax.pallas_kernels.support import Problem


def supports(m) -> list[Problem]:
    """The gate kernel refuses no config: where the RMSNorm kernel does not take the mixer's inner width or row
    count (model.mamba2.gated_norm_kernel_fits), the mixer keeps XLA's gate and norm."""
    return []
