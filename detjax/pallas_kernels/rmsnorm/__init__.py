from detjax.pallas_kernels.support import Problem, pow2_at_least


def supports(m) -> list[Problem]:
    """RMSNorm rows span the whole feature dim in one power-of-two block (row counts that are not a multiple
    of the kernel's row block, e.g. the MTP head's L-1 rows, take the jnp path)."""
    return pow2_at_least("model.d_model", m.d_model, 32, "RMSNorm")
