from detjax.pallas_kernels.support import Problem


def supports(m) -> list[Problem]:
    """The embedding-gradient segment sum tiles features by 16 or more."""
    if m.d_model % 16:
        return [("model.d_model", m.d_model, "the Pallas segment sum needs a multiple of 16", "use e.g. 512")]
    return []
