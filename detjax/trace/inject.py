"""Fault injection for testing the tracer: a deliberately nondeterministic op.

`perturb(x, step, at_step)` returns x, except at `at_step` where one element (position drawn from
os.urandom, so it differs run to run) changes by one ulp of bfloat16 precision: the lowest mantissa bit of
a 16-bit float, or bit 16 of a float32 (a float32 one-ulp change would mostly vanish in the next cast to
the bf16 compute dtype). Identical inputs, different outputs: exactly what a nondeterministic kernel looks
like to the tracer. It is a host callback with an
identity tangent, so it sits in forward passes under jax.grad.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np


def _flip_one_bit(x: np.ndarray, step: np.ndarray, at_step: int) -> np.ndarray:
    x = np.array(x)  # writable copy
    if int(step) != at_step or x.size == 0:
        return x
    flat = x.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])
    i = int.from_bytes(os.urandom(8), "little") % flat.size
    flat[i] ^= 1 << 16 if x.dtype.itemsize >= 4 else 1
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
