"""The per-step fingerprint's lane sums (detjax.fingerprint) of one large tensor, in one Pallas pass.

A digest is a pair of uint32 sums of per-element hashes, and integer addition is associative: any kernel that
hashes every element at its flat position and adds the hashes gives the digest's exact bits, whatever its
blocking. This one views the tensor as rows of WIDTH elements (a free reshape of a row-major array); a
program owns `rows` consecutive rows and walks them in sub-blocks of `block_rows`, hashing each element with
the fingerprint's element hash at its flat position (mod 2^32, as fingerprint.positions counts) and adding the
hashes and the non-finite flags (read from the exponent bits) into three uint32 sums of its own. XLA adds
the programs' sums and the rows past the last whole program (hashed by the same function), so the result is
fingerprint._lane_sums' to the bit: tests/test_fingerprint.py checks it on the interpreter.

Why it was written: the digests' scope took 22 ms of a 462 ms step of 1.3 B parameters on an H100
(`scripts/profile_step.py`, 2026-12-05). Timed alone the XLA reductions turned out to run at 2.3 TB/s (8.66 ms
for the state's 19 GiB) and this kernel at the same rate (8.52 ms), so it is off by default
(fingerprint.DIGEST_KERNEL; docs/BENCHMARKS.md "The d 4096 dense cell"). `scripts/digest_bench.py --kernel`
times both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

WIDTH = 1024
TILES = {"rows": 64, "block_rows": 4, "num_warps": 8, "num_stages": 2}
# the exponent field of each float dtype the kernel reads, in its bits widened to uint32: all ones is inf/NaN
EXPONENT = {
    jnp.dtype(jnp.float32): np.uint32(0x7F800000),
    jnp.dtype(jnp.bfloat16): np.uint32(0x7F80),
    jnp.dtype(jnp.float16): np.uint32(0x7C00),
}
INTEGERS = (jnp.dtype(jnp.int32), jnp.dtype(jnp.uint32))


def takes(x: jax.ShapeDtypeStruct | jax.Array, min_programs: int = 1) -> bool:
    """Whether the kernel digests x: a dtype it reads (float32, bfloat16, float16, int32, uint32), a size that
    is a whole number of rows, and at least `min_programs` programs' worth of them."""
    dt = jnp.dtype(x.dtype)
    if dt not in EXPONENT and dt not in INTEGERS:
        return False
    return x.size % WIDTH == 0 and x.size // WIDTH >= min_programs * TILES["rows"]


def _nonfinite(bits: jax.Array, exponent) -> jax.Array:
    """1 (uint32) where the exponent field of `bits` is all ones (inf or NaN), else 0."""
    return ((bits & exponent) == exponent).astype(jnp.uint32)


def _kernel(x_ref, h1_ref, h2_ref, bad_ref, *, bits_of, hashes, salt, version: int, br: int, nsub: int, exponent):
    span = np.uint32(br * nsub * WIDTH)  # elements a program owns (wraps as positions do)
    base = pl.program_id(0).astype(jnp.uint32) * span
    within = jax.lax.broadcasted_iota(jnp.uint32, (br, WIDTH), 0) * np.uint32(WIDTH)
    within = within + jax.lax.broadcasted_iota(jnp.uint32, (br, WIDTH), 1)

    def body(s, acc):
        rows = pl.ds(pl.multiple_of(s * br, br), br)
        bits = bits_of(x_ref[rows, :])
        pos = base + s.astype(jnp.uint32) * np.uint32(br * WIDTH) + within
        h1, h2 = hashes(bits, salt, version, pos=pos)
        parts = (h1, h2, jnp.zeros_like(bits) if exponent is None else _nonfinite(bits, exponent))
        return tuple(a + jnp.sum(v, axis=0, keepdims=True, dtype=jnp.uint32) for a, v in zip(acc, parts, strict=True))

    zero = tuple(jnp.zeros((1, WIDTH), jnp.uint32) for _ in range(3))
    for ref, a in zip((h1_ref, h2_ref, bad_ref), jax.lax.fori_loop(0, nsub, body, zero), strict=True):
        ref[...] = jnp.sum(a, axis=1, keepdims=True, dtype=jnp.uint32)


_STATIC = ("bits_of", "hashes", "positions", "salt", "version", "count_nonfinite", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def lane_sums(
    x: jax.Array,
    *,
    bits_of: Callable,
    hashes: Callable,
    positions: Callable,
    salt: int,
    version: int,
    count_nonfinite: bool,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum of lane-1 hashes, sum of lane-2 hashes, non-finite count or 0) of x, uint32: the bits of
    fingerprint._lane_sums(x, count_nonfinite, version) when given fingerprint's as_u32, element_hashes and
    positions, and salt = fingerprint.meta_salt(x) (passed in: this module does not import the fingerprint
    module, which imports it). x must pass `takes`."""
    if not takes(x):
        raise ValueError(f"digest kernel: {x.shape} {x.dtype} is not a whole number of {WIDTH}-wide rows")
    dt = jnp.dtype(x.dtype)
    exponent = EXPONENT.get(dt) if count_nonfinite else None
    r, br = TILES["rows"], TILES["block_rows"]
    rows = x.size // WIDTH
    g = rows // r
    x2 = x.reshape(rows, WIDTH)
    part = jax.ShapeDtypeStruct((g, 1), jnp.uint32)
    one = pl.BlockSpec((1, 1), lambda i: (i, 0))
    h1p, h2p, badp = pl.pallas_call(
        functools.partial(
            _kernel,
            bits_of=bits_of,
            hashes=hashes,
            salt=np.uint32(salt),
            version=version,
            br=br,
            nsub=r // br,
            exponent=exponent,
        ),
        grid=(g,),
        in_specs=[pl.BlockSpec((r, WIDTH), lambda i: (i, 0))],
        out_specs=[one, one, one],
        out_shape=[part, part, part],
        name="digest",
        interpret=interpret,
        compiler_params=triton_params(TILES["num_warps"], TILES["num_stages"], interpret),
    )(x2)
    sums = [jnp.sum(p, dtype=jnp.uint32) for p in (h1p, h2p, badp)]
    if g * r < rows:  # the rows past the last whole program
        tail = bits_of(x2[g * r :])
        pos = positions(tail.shape) + np.uint32((g * r * WIDTH) % 2**32)
        t1, t2 = hashes(tail, np.uint32(salt), version, pos=pos)
        sums[0] = sums[0] + jnp.sum(t1, dtype=jnp.uint32)
        sums[1] = sums[1] + jnp.sum(t2, dtype=jnp.uint32)
        if exponent is not None:
            sums[2] = sums[2] + jnp.sum(_nonfinite(tail, exponent), dtype=jnp.uint32)
    return sums[0], sums[1], sums[2]
