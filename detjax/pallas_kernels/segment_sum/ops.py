"""segment_sum(ids, g, n): fixed-order Pallas segment sum; used as the embedding gradient."""

from __future__ import annotations

import jax

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.segment_sum.kernel import segment_sum as _segment_sum


def segment_sum(ids_T: jax.Array, g_TD: jax.Array, n_segments: int) -> jax.Array:
    return _segment_sum(ids_T, g_TD, n_segments=n_segments, interpret=interpret_mode())
