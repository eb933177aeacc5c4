"""token_ce_fwd(logits, targets): the per-token cross-entropy and logsumexp by the one-pass kernel, where it
takes the shape (kernel.usable), else None (the caller keeps XLA's formula)."""

from __future__ import annotations

import math

import jax

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.ce.kernel import ce_fwd, usable


def token_ce_fwd(logits_BLV: jax.Array, targets_BL: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """(ce, lse) (B, L) float32 of logits (B, L, V) in any float dtype, or None where the kernel does not fit."""
    *lead, v = logits_BLV.shape
    rows = math.prod(lead)
    if not usable(rows, v):
        return None
    ce, lse = ce_fwd(logits_BLV.reshape(rows, v), targets_BL.reshape(rows), interpret=interpret_mode())
    return ce.reshape(lead), lse.reshape(lead)
