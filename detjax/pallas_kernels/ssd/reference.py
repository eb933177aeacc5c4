"""Mamba2 state-space duality (SSD) scans in plain JAX: chunked (the model path), quadratic and sequential
(the oracles).

All three compute, per head h, the recurrence with a scalar decay a_t = A_h * dt_t <= 0:
    state_t = exp(a_t) * state_{t-1} + x_t B_t^T        (x_t already multiplied by dt_t)
    y_t     = state_t C_t
B and C are shared by all heads (one group). Computation is in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segsum(a_L: jax.Array) -> jax.Array:
    """out[..., i, j] = sum_{k=j+1..i} a[..., k] for i >= j, -inf above the diagonal (a: (..., L))."""
    t = a_L.shape[-1]
    rep = jnp.broadcast_to(a_L[..., :, None], (*a_L.shape, t))
    strict_lower = jnp.tril(jnp.ones((t, t), dtype=bool), -1)
    cs = jnp.cumsum(jnp.where(strict_lower, rep, 0.0), axis=-2)
    return jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool), 0), cs, -jnp.inf)


def ssd_chunked(x_BLHP, a_BLH, b_BLN, c_BLN, chunk: int) -> jax.Array:
    """Chunked SSD: quadratic attention-like form inside chunks, a linear recurrence across chunks."""
    bsz, length, heads, p = x_BLHP.shape
    n = b_BLN.shape[-1]
    if length % chunk:
        raise ValueError(f"SSD length {length} is not divisible by chunk {chunk}; choose chunk dividing seq_len")
    nc = length // chunk
    x_BCLHP = x_BLHP.reshape(bsz, nc, chunk, heads, p)
    a_BHCL = a_BLH.reshape(bsz, nc, chunk, heads).transpose(0, 3, 1, 2)
    b_BCLN = b_BLN.reshape(bsz, nc, chunk, n)
    c_BCLN = c_BLN.reshape(bsz, nc, chunk, n)

    acs_BHCL = jnp.cumsum(a_BHCL, axis=-1)
    # 1. within-chunk (diagonal blocks)
    decay_BHCLS = jnp.exp(segsum(a_BHCL))
    y_diag = jnp.einsum("bcln,bcsn,bhcls,bcshp->bclhp", c_BCLN, b_BCLN, decay_BHCLS, x_BCLHP)
    # 2. state at the end of each chunk
    decay_states_BHCL = jnp.exp(acs_BHCL[..., -1:] - acs_BHCL)
    states_BCHPN = jnp.einsum("bcln,bhcl,bclhp->bchpn", b_BCLN, decay_states_BHCL, x_BCLHP)
    # 3. recurrence across chunk boundaries (zero initial state)
    states_BCHPN = jnp.concatenate([jnp.zeros_like(states_BCHPN[:, :1]), states_BCHPN], axis=1)
    chunk_ends_BHC = jnp.pad(acs_BHCL[..., -1], ((0, 0), (0, 0), (1, 0)))
    decay_chunk_BHZC = jnp.exp(segsum(chunk_ends_BHC))
    states_BCHPN = jnp.einsum("bhzc,bchpn->bzhpn", decay_chunk_BHZC, states_BCHPN)[:, :-1]
    # 4. state -> output within each chunk
    y_off = jnp.einsum("bcln,bchpn,bhcl->bclhp", c_BCLN, states_BCHPN, jnp.exp(acs_BHCL))
    return (y_diag + y_off).reshape(bsz, length, heads, p)


def ssd_quadratic(x_BLHP, a_BLH, b_BLN, c_BLN) -> jax.Array:
    """The 'minimal SSD' quadratic form over the whole sequence: the oracle for the chunked path."""
    decay_BHLS = jnp.exp(segsum(a_BLH.transpose(0, 2, 1)))
    return jnp.einsum("bln,bsn,bhls,bshp->blhp", c_BLN, b_BLN, decay_BHLS, x_BLHP)


def ssd_sequential(x_BLHP, a_BLH, b_BLN, c_BLN) -> jax.Array:
    """Token-by-token recurrence: the plainest statement of what SSD computes."""
    bsz, _, heads, p = x_BLHP.shape
    n = b_BLN.shape[-1]

    def step(state_BHPN, inp):
        x_BHP, a_BH, b_BN, c_BN = inp
        state_BHPN = jnp.exp(a_BH)[..., None, None] * state_BHPN + x_BHP[..., None] * b_BN[:, None, None, :]
        return state_BHPN, jnp.einsum("bhpn,bn->bhp", state_BHPN, c_BN)

    xs = (x_BLHP.swapaxes(0, 1), a_BLH.swapaxes(0, 1), b_BLN.swapaxes(0, 1), c_BLN.swapaxes(0, 1))
    _, y_LBHP = jax.lax.scan(step, jnp.zeros((bsz, heads, p, n), x_BLHP.dtype), xs)
    return y_LBHP.swapaxes(0, 1)
