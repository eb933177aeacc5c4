from detjax.pallas_kernels.support import Problem, pow2_at_least


def supports(m) -> list[Problem]:
    """The SSD scan holds a chunk and the state in power-of-two blocks >= 16, and a head in blocks of its head
    dim's largest power-of-two divisor, which must be >= 16 (ops.py splits a head of 96, 160, 192, ... into
    sub-heads of 32 or 64)."""
    mb = m.mamba
    if "M" not in m.pattern + m.mtp.pattern:
        return []
    p = mb.expand * m.d_model // max(mb.n_heads, 1)
    problems = pow2_at_least("model.mamba.d_state", mb.d_state, 16, "SSD kernel") + pow2_at_least(
        "model.mamba.chunk_size", mb.chunk_size, 16, "SSD kernel"
    )
    if p < 16 or (p & -p) < 16:
        problems.append(
            (
                "model.mamba head dim (expand*d_model/n_heads)",
                p,
                "the Pallas SSD kernel needs a multiple of 16",
                "choose model.mamba.n_heads so that the head dim is a multiple of 16 (e.g. 64), or "
                "model.kernels=reference",
            )
        )
    return problems
