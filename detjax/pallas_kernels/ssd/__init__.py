from detjax.pallas_kernels.support import Problem, pow2_at_least


def supports(m) -> list[Problem]:
    """The SSD scan holds a chunk, the state and a head in power-of-two blocks >= 16."""
    mb = m.mamba
    if "M" not in m.pattern + m.mtp.pattern:
        return []
    return (
        pow2_at_least("model.mamba.d_state", mb.d_state, 16, "SSD kernel")
        + pow2_at_least("model.mamba.chunk_size", mb.chunk_size, 16, "SSD kernel")
        + pow2_at_least(
            "model.mamba head dim (expand*d_model/n_heads)",
            mb.expand * m.d_model // max(mb.n_heads, 1),
            16,
            "SSD kernel",
        )
    )
