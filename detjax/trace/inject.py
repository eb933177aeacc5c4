"""Fault injection for testing the tracer: a deliberately nondeterministic op.

`perturb(x, step, at_step)` returns x, except at `at_step` where one nonzero element has its fourth-highest
mantissa bit flipped (about 6 % of its value: large enough that the next bf16 rounding or a gated sum cannot
absorb it). Identical inputs, different outputs: exactly what a nondeterministic kernel looks like to the
tracer. The element differs run to run: a per-process random offset (os.urandom) plus a per-process count of
flips, so two flips in one process never pick the same element of an array with more than one candidate (and
runs in two processes pick the same one with probability 1/candidates).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

_MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10, "float64": 52}
_OFFSET = int.from_bytes(os.urandom(8), "little")
_CALLS: dict[tuple, int] = {}


def _flip_one_bit(x: np.ndarray, step: np.ndarray, at_step: int) -> np.ndarray:
    x = np.array(x)  # writable copy
    if int(step) != at_step or x.size == 0:
        return x
    flat = x.reshape(-1).view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])
    candidates = np.flatnonzero(np.isfinite(x.reshape(-1)) & (x.reshape(-1) != 0))
    if candidates.size == 0:
        candidates = np.arange(flat.size)
    key = (x.shape, x.dtype.name, at_step)
    _CALLS[key] = _CALLS.get(key, -1) + 1
    i = candidates[(_OFFSET + _CALLS[key]) % candidates.size]
    flat[i] ^= flat.dtype.type(1 << (_MANTISSA_BITS[x.dtype.name] - 4))
    return x


def perturb(x: jax.Array, step: jax.Array, at_step: int) -> jax.Array:
    @jax.custom_jvp
    def _op(x, step):
        return jax.pure_callback(
            lambda a, s: _flip_one_bit(a, s, at_step), jax.ShapeDtypeStruct(x.shape, x.dtype), x, step
        )

    @_op.defjvp
    def _jvp(primals, tangents):
        return _op(*primals), tangents[0]

    return _op(x, jnp.asarray(step, jnp.int32))
