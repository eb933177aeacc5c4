"""Fused RMSNorm forward and backward in Pallas, for any feature width that is a power of two or a multiple
of 128.

Tiles (pinned per width class in TILES; no autotuning): a program owns `rows` consecutive rows and walks them
in sub-blocks of `block_rows` rows, in ascending order. A sub-block spans the whole feature dim, loaded as
column chunks of a power-of-two width (Triton's tensors are powers of two): one chunk when the width is a
power of two, else the widest power-of-two chunk that divides it (1536 = 3 x 512). A row's own sums (its mean
square, and the backward's mean of dxhat * xhat) are reduced inside each chunk and the chunks' sums added in
ascending order, so their order depends on the width and the pinned tile only. Row counts that are not a whole
number of `rows` are padded with zero rows, which add exact zeros to the weight gradient.

The weight gradient's sum over tokens has no atomics -- "separate writers in space, then order once": each
program adds its sub-blocks' column sums in ascending order into one private slot (a fixed chunk of `rows`
tokens), and the slots are combined by a fixed pairwise tree (ordered.tree_sum), not a serial walk.

Speed (H200, 2026-12-04, `python3 scripts/tile_sweep.py --kernels rmsnorm`, 8192 tokens): 3.5-3.8 TB/s forward
and 3.0-3.5 TB/s backward with the stream's add at widths 1024, 1536, 2048 and 4096; forward and backward
together 1.01-1.09 x as fast as XLA's fused jnp norm (docs/BENCHMARKS.md, "RMSNorm").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params
from detjax.pallas_kernels.ordered import tree_sum
from detjax.pallas_kernels.rmsnorm import WIDEST

# Per width class (the feature dim rounded up to a power of two). Classes 1024, 2048 and 4096 are the fastest
# of scripts/tile_sweep.py --kernels rmsnorm on the H200 (docs/BENCHMARKS.md); the others keep a sub-block near
# 4096 elements (about 16 of each operand a thread) and are not swept. A change here changes bits (the row
# sums' and the weight gradient's reduction order): it is a new trajectory.
TILES = {
    "fwd": {
        128: {"rows": 32, "block_rows": 32, "num_warps": 8, "num_stages": 2},
        256: {"rows": 16, "block_rows": 16, "num_warps": 8, "num_stages": 2},
        512: {"rows": 8, "block_rows": 8, "num_warps": 8, "num_stages": 2},
        1024: {"rows": 8, "block_rows": 2, "num_warps": 4, "num_stages": 2},
        2048: {"rows": 4, "block_rows": 1, "num_warps": 8, "num_stages": 2},
        4096: {"rows": 4, "block_rows": 1, "num_warps": 8, "num_stages": 2},
        8192: {"rows": 4, "block_rows": 1, "num_warps": 16, "num_stages": 2},
        16384: {"rows": 4, "block_rows": 1, "num_warps": 16, "num_stages": 2},
    },
    "bwd": {
        128: {"rows": 128, "block_rows": 32, "num_warps": 8, "num_stages": 2},
        256: {"rows": 64, "block_rows": 16, "num_warps": 8, "num_stages": 2},
        512: {"rows": 64, "block_rows": 8, "num_warps": 8, "num_stages": 2},
        1024: {"rows": 32, "block_rows": 4, "num_warps": 8, "num_stages": 2},
        2048: {"rows": 16, "block_rows": 1, "num_warps": 4, "num_stages": 2},
        4096: {"rows": 16, "block_rows": 1, "num_warps": 8, "num_stages": 2},
        8192: {"rows": 16, "block_rows": 1, "num_warps": 16, "num_stages": 2},
        16384: {"rows": 8, "block_rows": 1, "num_warps": 16, "num_stages": 2},
    },
}
MIN_ROWS = 8  # the layers use the kernel for row counts that are multiples of this (see `fits`)


def width_class(d: int) -> int:
    """The tile class of feature dim d: d rounded up to a power of two, at least 128."""
    return max(128, 1 << max(d - 1, 0).bit_length())


def chunk_width(d: int) -> int:
    """The column chunk a row is loaded in: d itself when it is a power of two, else the widest power of two
    dividing it (at least 128: the width must be a multiple of 128)."""
    if d & (d - 1) == 0:
        return d
    c = d & -d
    if c < 128:
        raise ValueError(f"rmsnorm kernel: feature dim {d} is neither a power of two nor a multiple of 128")
    return c


def fits(rows: int) -> bool:
    """Whether the layers take the kernel for `rows` rows (other row counts take the jnp path)."""
    return rows % MIN_ROWS == 0


def _tiles(which: str, d: int) -> tuple[int, dict]:
    t = TILES[which].get(width_class(d))
    if t is None:
        raise ValueError(f"rmsnorm kernel: feature dim {d} is wider than the widest pinned tile ({WIDEST})")
    if t["rows"] % t["block_rows"]:
        raise ValueError(f"rmsnorm kernel: rows % block_rows must be 0 in {which} tile {t}")
    return t["rows"], t


def _cols(c: int, nc: int) -> list:
    """The column indexers of a row's chunks of width c, in ascending order (the whole row when nc == 1)."""
    return [slice(None)] if nc == 1 else [pl.ds(j * c, c) for j in range(nc)]


def _chunks(ref, rows, c: int, nc: int) -> list:
    """The sub-block `rows` of ref as float32 column chunks of width c, in ascending order."""
    return [ref[rows, col].astype(jnp.float32) for col in _cols(c, nc)]


def _store_chunks(ref, rows, c: int, vals: list) -> None:
    for col, v in zip(_cols(c, len(vals)), vals, strict=True):
        ref[rows, col] = v.astype(ref.dtype)


def _row_sum(parts: list, d: int):
    """sum over the row of each chunk's values, the chunks' sums added in ascending order, divided by d."""
    total = jnp.sum(parts[0], axis=1, keepdims=True)
    for p in parts[1:]:
        total = total + jnp.sum(p, axis=1, keepdims=True)
    return total / d


def _fwd_kernel(x_ref, w_ref, y_ref, rstd_ref, *, eps: float, br: int, nsub: int, c: int, nc: int):
    ws = _chunks(w_ref, slice(None), c, nc)
    d = c * nc

    def body(s, carry):
        rows = pl.ds(pl.multiple_of(s * br, br), br)
        xs = _chunks(x_ref, rows, c, nc)
        rstd = jax.lax.rsqrt(_row_sum([x * x for x in xs], d) + eps)
        _store_chunks(y_ref, rows, c, [x * rstd * w for x, w in zip(xs, ws, strict=True)])
        rstd_ref[rows, :] = rstd
        return carry

    jax.lax.fori_loop(0, nsub, body, 0)


def _bwd_kernel(x_ref, w_ref, rstd_ref, dy_ref, *refs, br: int, nsub: int, c: int, nc: int, stream: bool):
    g_ref, dx_ref, dw_part_ref = refs if stream else (None, *refs)
    ws = _chunks(w_ref, slice(None), c, nc)
    d = c * nc

    def body(s, acc):
        rows = pl.ds(pl.multiple_of(s * br, br), br)
        rstd = rstd_ref[rows, :]
        xhat = [x * rstd for x in _chunks(x_ref, rows, c, nc)]
        dys = _chunks(dy_ref, rows, c, nc)
        dxhat = [dy * w for dy, w in zip(dys, ws, strict=True)]
        mean = _row_sum([a * b for a, b in zip(dxhat, xhat, strict=True)], d)
        dx = [(rstd * (a - b * mean)).astype(dx_ref.dtype) for a, b in zip(dxhat, xhat, strict=True)]
        if stream:  # the stream's own cotangent, added as the residual add's transpose would add it
            gs = [g_ref[rows, col] for col in _cols(c, nc)]
            dx = [a + g for a, g in zip(dx, gs, strict=True)]
        _store_chunks(dx_ref, rows, c, dx)
        return tuple(a + jnp.sum(dy * xh, axis=0, keepdims=True) for a, dy, xh in zip(acc, dys, xhat, strict=True))

    # this program's private slot: its sub-blocks' column sums in ascending order, from +0
    zero = tuple(jnp.zeros((1, c), jnp.float32) for _ in range(nc))
    _store_chunks(dw_part_ref, slice(None), c, list(jax.lax.fori_loop(0, nsub, body, zero)))


def _pad_rows(x: jax.Array, mult: int) -> jax.Array:
    extra = -x.shape[0] % mult
    return jnp.pad(x, ((0, extra), (0, 0))) if extra else x


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "out_dtype"))
def rmsnorm_fwd(x_ND, w_D, *, eps: float, interpret: bool, out_dtype=None):
    """y = x * rsqrt(mean(x^2) + eps) * w (in `out_dtype`, default x's) and the row rstd (float32)."""
    n, d = x_ND.shape
    r, t = _tiles("fwd", d)
    c = chunk_width(d)
    xp = _pad_rows(x_ND, r)
    np_ = xp.shape[0]
    y, rstd = pl.pallas_call(
        functools.partial(_fwd_kernel, eps=eps, br=t["block_rows"], nsub=r // t["block_rows"], c=c, nc=d // c),
        grid=(np_ // r,),
        in_specs=[pl.BlockSpec((r, d), lambda i: (i, 0)), pl.BlockSpec((1, d), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((r, d), lambda i: (i, 0)), pl.BlockSpec((r, 1), lambda i: (i, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((np_, d), out_dtype or x_ND.dtype),
            jax.ShapeDtypeStruct((np_, 1), jnp.float32),
        ],
        name="rmsnorm_fwd",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(xp, w_D.reshape(1, d))
    return (y, rstd) if np_ == n else (y[:n], rstd[:n])


@functools.partial(jax.jit, static_argnames=("interpret",))
def rmsnorm_bwd(x_ND, w_D, rstd_N1, dy_ND, g_ND=None, *, interpret: bool):
    """dx (x's dtype) and dw (float32) of the forward above, for the incoming gradient dy. `g_ND` (x's shape
    and dtype): a cotangent x also receives from elsewhere -- the residual stream's, when x is the stream
    (ops.rmsnorm_stream) -- added to dx in the kernel, without a pass of its own: dx + g, the bytes of adding
    it afterwards where the compiler keeps dx's last product and the add apart (the H200's Triton does; the
    CPU's interpreted kernel may fuse them into an fma)."""
    n, d = x_ND.shape
    r, t = _tiles("bwd", d)
    c = chunk_width(d)
    if g_ND is not None and (g_ND.shape != x_ND.shape or g_ND.dtype != x_ND.dtype):
        got, want = f"{g_ND.shape} {g_ND.dtype}", f"{x_ND.shape} {x_ND.dtype}"
        raise ValueError(f"rmsnorm_bwd: g {got} must have x's shape and dtype {want}")
    xp, rp, dyp = _pad_rows(x_ND, r), _pad_rows(rstd_N1, r), _pad_rows(dy_ND, r)
    nb = xp.shape[0] // r
    rows = pl.BlockSpec((r, d), lambda i: (i, 0))
    stream = () if g_ND is None else (_pad_rows(g_ND, r),)
    br = t["block_rows"]
    dx, parts = pl.pallas_call(
        functools.partial(_bwd_kernel, br=br, nsub=r // br, c=c, nc=d // c, stream=g_ND is not None),
        grid=(nb,),
        in_specs=[rows, pl.BlockSpec((1, d), lambda i: (0, 0)), pl.BlockSpec((r, 1), lambda i: (i, 0)), rows]
        + [rows] * len(stream),
        out_specs=[rows, pl.BlockSpec((1, d), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(xp.shape, x_ND.dtype), jax.ShapeDtypeStruct((nb, d), jnp.float32)],
        name="rmsnorm_bwd",
        interpret=interpret,
        compiler_params=triton_params(t["num_warps"], t["num_stages"], interpret),
    )(xp, w_D.reshape(1, d), rp, dyp, *stream)
    return (dx if nb * r == n else dx[:n]), tree_sum(parts, 0).reshape(d)
