from detjax.pallas_kernels.support import Problem, pow2_at_least


def supports(m) -> list[Problem]:
    """Flash attention loads whole heads: a power-of-two head_dim >= 16 (sequences that are not a multiple
    of 16, e.g. MTP attention blocks' L-1 rows, take the jnp path)."""
    return pow2_at_least("model.head_dim", m.head_dim, 16, "flash attention")
