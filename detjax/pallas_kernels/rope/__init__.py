def supports(m) -> list:
    """RoPE's backward kernel has no requirement of its own: attention shapes whose tiles do not fit
    (kernel.fits) keep XLA's backward."""
    return []
