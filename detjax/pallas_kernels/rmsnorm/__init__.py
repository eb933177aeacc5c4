from detjax.pallas_kernels.support import Problem

WIDEST = 16384  # the widest width class with pinned tiles in kernel.TILES


def takes_width(d: int) -> bool:
    """Whether the RMSNorm kernel takes width d: a power of two >= 32 or a multiple of 128, up to WIDEST (rows
    are loaded in power-of-two column chunks)."""
    return d <= WIDEST and (d >= 32 and d & (d - 1) == 0 or d % 128 == 0)


def supports(m) -> list[Problem]:
    """The RMSNorm kernel takes the widths of takes_width (row counts that are not a multiple of 8, e.g. a
    decode step's, take the jnp path)."""
    d = m.d_model
    if not takes_width(d):
        why = f"the Pallas RMSNorm needs a power of two >= 32 or a multiple of 128, at most {WIDEST}"
        return [("model.d_model", d, why, "use e.g. 1536 or 2048, or model.kernels=reference")]
    return []
