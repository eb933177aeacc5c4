"""Segment sum (the embedding gradient) in Pallas without atomics.

Each program owns a (BLOCK_V x BLOCK_D) tile of the output and walks the tokens in ascending blocks of
BLOCK_T, adding one_hot(ids_block)^T @ g_block: every output element has one writer and a fixed
accumulation order that does not depend on which ids repeat or how often. Tiles are pinned in TILES.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TILES = {"block_v": 16, "block_d": 32, "block_t": 32}


def _kernel(ids_ref, g_ref, out_ref, *, n_tblocks: int, bt: int, bv: int):
    v0 = pl.program_id(0) * bv
    rows = jax.lax.broadcasted_iota(jnp.int32, (bv, bt), 0) + v0

    def body(i, acc):
        ids = ids_ref[:, pl.ds(i * bt, bt)]  # (1, bt)
        g = g_ref[pl.ds(i * bt, bt), :].astype(jnp.float32)  # (bt, bd)
        onehot = (ids == rows).astype(jnp.float32)  # (bv, bt)
        return acc + jnp.dot(onehot, g, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, n_tblocks, body, jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("n_segments", "interpret"))
def segment_sum(ids_T: jax.Array, g_TD: jax.Array, *, n_segments: int, interpret: bool) -> jax.Array:
    bv, bd, bt = TILES["block_v"], TILES["block_d"], TILES["block_t"]
    t, d = g_TD.shape
    if d % bd:
        raise ValueError(f"segment_sum kernel needs the feature dim divisible by {bd}; got {d}")
    tp, vp = -(-t // bt) * bt, -(-n_segments // bv) * bv
    ids = jnp.pad(ids_T.astype(jnp.int32), (0, tp - t), constant_values=-1).reshape(1, tp)
    g = jnp.pad(g_TD, ((0, tp - t), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, n_tblocks=tp // bt, bt=bt, bv=bv),
        grid=(vp // bv, d // bd),
        in_specs=[pl.BlockSpec((1, tp), lambda i, j: (0, 0)), pl.BlockSpec((tp, bd), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bv, bd), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((vp, d), jnp.float32),
        name="segment_sum",
        interpret=interpret,
    )(ids, g)
    return out[:n_segments]
