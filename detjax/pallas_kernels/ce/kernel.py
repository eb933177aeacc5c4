"""The cross-entropy forward in one pass over the logits: each row's logsumexp and label logit, fixed order.

A program owns TILES["block_rows"] rows (tokens) and walks the vocabulary in ascending blocks of
TILES["block_vocab"] columns, carrying per row the running maximum m, the running sum s of exp(logit - m)
(rescaled by exp(m_old - m_new) when m grows) and the label logit (a masked sum: the one column equal to the
target adds its logit, every other adds +0, so it is that logit exactly). Then lse = m + log(s) and
ce = lse - label, in float32 from logits of any float dtype. Every row is one program's, its blocks are
added in ascending order and each block's row sums are one reduction of a pinned shape: a fixed order,
whatever the number of rows. XLA's logsumexp instead reads the logits once for the maximum and again for the
sum, and the label sum a third time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

TILES = {"block_rows": 16, "block_vocab": 1024, "num_warps": 4, "num_stages": 2}


def usable(rows: int, vocab: int) -> bool:
    """Whether the kernel takes (rows, vocab) logits: whole row blocks and whole vocabulary blocks."""
    return rows % TILES["block_rows"] == 0 and vocab % TILES["block_vocab"] == 0


def _kernel(l_ref, t_ref, ce_ref, lse_ref, *, bv: int, nv: int):
    br = l_ref.shape[0]
    target = t_ref[...]  # (br, 1)

    def body(j, carry):
        m, s, label = carry
        blk = l_ref[:, pl.ds(pl.multiple_of(j * bv, bv), bv)].astype(jnp.float32)  # (br, bv)
        m_new = jnp.maximum(m, jnp.max(blk, axis=1, keepdims=True))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(blk - m_new), axis=1, keepdims=True)
        cols = j * bv + jax.lax.broadcasted_iota(jnp.int32, (br, bv), 1)
        label = label + jnp.sum(jnp.where(cols == target, blk, 0.0), axis=1, keepdims=True)
        return m_new, s, label

    zeros = jnp.zeros((br, 1), jnp.float32)
    m, s, label = jax.lax.fori_loop(0, nv, body, (jnp.full((br, 1), -jnp.inf, jnp.float32), zeros, zeros))
    lse = m + jnp.log(s)
    ce_ref[...] = lse - label
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("interpret",))
def ce_fwd(logits_MV: jax.Array, targets_M: jax.Array, *, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """(ce, lse) of each row of logits (M, V), float32 (M,): lse = logsumexp(logits), ce = lse - logits[target]."""
    m, v = logits_MV.shape
    br, bv = TILES["block_rows"], TILES["block_vocab"]
    if not usable(m, v):
        raise ValueError(f"ce_fwd takes rows in blocks of {br} and a vocabulary in blocks of {bv}; got ({m}, {v})")
    col = pl.BlockSpec((br, 1), lambda i: (i, 0))
    ce, lse = pl.pallas_call(
        functools.partial(_kernel, bv=bv, nv=v // bv),
        grid=(m // br,),
        in_specs=[pl.BlockSpec((br, v), lambda i: (i, 0)), col],
        out_specs=[col, col],
        out_shape=[jax.ShapeDtypeStruct((m, 1), jnp.float32)] * 2,
        name="ce_fwd",
        interpret=interpret,
        compiler_params=triton_params(TILES["num_warps"], TILES["num_stages"], interpret),
    )(logits_MV, targets_M.astype(jnp.int32).reshape(m, 1))
    return ce[:, 0], lse[:, 0]
