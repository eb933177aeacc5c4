from detjax.pallas_kernels.support import Problem


def supports(m) -> list[Problem]:
    """The grouped matmul tiles the expert width by 16 or more."""
    if "E" in m.pattern + m.mtp.pattern and m.moe.ffn_dim % 16:
        return [
            ("model.moe.ffn_dim", m.moe.ffn_dim, "the Pallas grouped matmul needs a multiple of 16", "use e.g. 768")
        ]
    return []
