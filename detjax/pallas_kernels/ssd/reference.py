"""Oracles for the Pallas SSD scan: the plain-JAX chunked form the model uses by default, and the quadratic
'minimal SSD' form over the whole sequence."""

from detjax.model.ssd import ssd_chunked, ssd_quadratic

__all__ = ["ssd_chunked", "ssd_quadratic"]
