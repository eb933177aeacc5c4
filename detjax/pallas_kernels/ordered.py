"""Sums whose order is written in the code, not chosen by a compiler: pairs of halves added elementwise.

A reduce op's summation order is XLA's (or Triton's) choice and can differ between programs (the fusion
decides: e.g. a one-device program and an eight-device one of the same per-sequence math). A sum written as
halving elementwise adds has one order everywhere: element i of a level is level[i] + level[i + h]. These trees
combine the kernels' private partial slots ("separate writers in space, then order once"), and the model's
small sums (the MoE router's softmax and gate normalisation, the reference attention's softmax), whose
gradients every broadcast transposes by the same tree (`pinned_broadcast`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def pad_to_power_of_two(x: jax.Array, axis: int) -> jax.Array:
    """x with zeros appended along `axis` up to a power-of-two length (zeros add exactly)."""
    n = x.shape[axis]
    width = 1 << max(n - 1, 0).bit_length()
    if width == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, width - n)
    return jnp.pad(x, pad)


def tree_sum(x: jax.Array, axis: int) -> jax.Array:
    """Sum over `axis`, keepdims: pairs of halves added elementwise, the axis zero-padded to a power of two."""
    axis = axis % x.ndim
    x = pad_to_power_of_two(x, axis)
    while x.shape[axis] > 1:
        h = x.shape[axis] // 2
        x = jax.lax.slice_in_dim(x, 0, h, axis=axis) + jax.lax.slice_in_dim(x, h, 2 * h, axis=axis)
    return x


def tree_sum_last(x: jax.Array) -> jax.Array:
    """Sum over the last axis, keepdims, as pairs of halves added elementwise (tree_sum)."""
    return tree_sum(x, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def pinned_broadcast(s: jax.Array, n: int) -> jax.Array:
    """s (..., 1) -> (..., n); its transpose sums the cotangent with tree_sum_last (not a reduce op)."""
    return jnp.broadcast_to(s, (*s.shape[:-1], n))


def _pinned_broadcast_fwd(s, n):
    return pinned_broadcast(s, n), None


def _pinned_broadcast_bwd(n, _, g):
    return (tree_sum_last(g),)


pinned_broadcast.defvjp(_pinned_broadcast_fwd, _pinned_broadcast_bwd)


def pinned_normalize(x: jax.Array) -> jax.Array:
    """x / sum(x) over the last axis, the sum (and its gradient's) tree_sum_last."""
    # the divisor behind a barrier: XLA may otherwise turn the division by a broadcast into a multiplication by
    # its reciprocal in some programs and not in others (other bits)
    return x / jax.lax.optimization_barrier(pinned_broadcast(tree_sum_last(x), x.shape[-1]))


def pinned_softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis whose sums, forward and backward, are tree_sum_last."""
    return pinned_normalize(jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))))  # max: exact
