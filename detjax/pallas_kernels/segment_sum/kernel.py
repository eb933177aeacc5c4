"""Segment sum (the embedding gradient) in Pallas without atomics, in work proportional to tokens x d.

The tokens are first put in a stable order by id (XLA's stable sort; ties keep their token order) and the
rows of g gathered in that order, so the tokens of each block of BLOCK_V ids form one contiguous run
[start, end). Each program owns a (BLOCK_V x BLOCK_D) output tile and walks only its run, in ascending blocks
of BLOCK_T sorted tokens aligned to multiples of BLOCK_T, adding one_hot(ids_block)^T @ g_block (products
with 0/1 are exact; float32 as IEEE float32). Every output element has one writer, and its tokens are added
in ascending token order in the same aligned blocks on every call with the same ids: a fixed order, and
work ~ tokens x d (plus one block per id tile) instead of tokens x vocab x d. Tiles are pinned in TILES.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

TILES = {"block_v": 16, "block_d": 128, "block_t": 64, "num_warps": 4, "num_stages": 2}


def _kernel(bounds_ref, ids_ref, g_ref, out_ref, *, bt: int, bv: int):
    b = pl.program_id(0)
    v0 = b * bv
    start, end = bounds_ref[0, b], bounds_ref[1, b]
    rows = jax.lax.broadcasted_iota(jnp.int32, (bv, bt), 0) + v0

    def body(i, acc):
        blk = pl.ds(pl.multiple_of(i * bt, bt), bt)
        ids = ids_ref[:, blk]  # (1, bt), ascending
        g = g_ref[blk, :]  # (bt, bd)
        onehot = (ids == rows).astype(g.dtype)  # (bv, bt): tokens outside this id block match no row
        prec = jax.lax.Precision.HIGHEST if g.dtype == jnp.float32 else None
        return acc + jnp.dot(onehot, g, precision=prec, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(start // bt, (end + bt - 1) // bt, body, jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = acc


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.partial(jax.jit, static_argnames=("n_segments", "interpret"))
def segment_sum(ids_T: jax.Array, g_TD: jax.Array, *, n_segments: int, interpret: bool) -> jax.Array:
    """out[v] = sum of g[t] over the tokens t with ids[t] == v (ids outside [0, n_segments) are dropped)."""
    bv, bd, bt = TILES["block_v"], TILES["block_d"], TILES["block_t"]
    t, d = g_TD.shape
    while bd > 16 and d % bd:
        bd //= 2  # the widest feature tile (128 .. 16) that divides d
    if d % bd:
        raise ValueError(f"segment_sum kernel needs the feature dim divisible by 16; got {d}")
    nvb = -(-n_segments // bv)
    tp = -(-t // bt) * bt
    ids = ids_T.astype(jnp.int32)
    ids = jnp.where((ids >= 0) & (ids < n_segments), ids, n_segments + bv)  # out of range: after every block
    order = jnp.argsort(ids, stable=True)
    ids_sorted = jnp.pad(ids[order], (0, tp - t), constant_values=n_segments + bv)
    g_sorted = jnp.pad(jnp.take(g_TD, order, axis=0), ((0, tp - t), (0, 0)))
    edges = jnp.arange(nvb + 1, dtype=jnp.int32) * bv
    pos = jnp.searchsorted(ids_sorted, edges, side="left").astype(jnp.int32)
    bounds = jnp.stack([pos[:-1], pos[1:]])  # (2, nvb): each id block's run of sorted tokens
    bounds = jnp.pad(bounds, ((0, 0), (0, _pow2(nvb) - nvb)))
    out = pl.pallas_call(
        functools.partial(_kernel, bt=bt, bv=bv),
        grid=(nvb, d // bd),
        in_specs=[
            pl.BlockSpec(bounds.shape, lambda i, j: (0, 0)),
            pl.BlockSpec((1, tp), lambda i, j: (0, 0)),
            pl.BlockSpec((tp, bd), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bv, bd), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((nvb * bv, d), jnp.float32),
        name="segment_sum",
        interpret=interpret,
        compiler_params=triton_params(TILES["num_warps"], TILES["num_stages"], interpret),
    )(bounds, ids_sorted.reshape(1, tp), g_sorted)
    return out[:n_segments]
