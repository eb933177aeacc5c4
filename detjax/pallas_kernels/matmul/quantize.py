"""fp8 quantization with a transposed copy and the amax, in one pass (model.fp8 on the Mosaic GPU path).

Hopper's fp8 wgmma reads both operands with the reduced dimension contiguous, so the weight gradient
dw = x^T @ dy needs x and dy transposed, and the forward needs the weight transposed (kernel.fp8_nt). XLA's
transposes of one-byte arrays ran at about a quarter of the H200's memory bandwidth and took a quarter of
gpu_dense's fp8 step (docs/benchmarks-history.md set 22). This kernel reads v once and writes
q = fp8(clip(v * scale)) in both layouts, zero-padded to the product's tiles (so no pad copy follows), plus the
largest |v| of each tile.

Bits: the quantization is elementwise -- a float32 product, a clip, one round-to-nearest-even conversion --
the same function (`quantize`) as detjax.model.fp8's XLA path, so q does not depend on the tile (tests/test_matmul.py
checks it against the XLA quantization on the GPU). The padding is zeros, which add nothing to a product's
float32 sums. The amax is a maximum: exact in any order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from detjax.pallas_kernels.backend import triton_params

BLOCK = 128  # the padding unit of quantize_transposed's copies (the Mosaic fp8 product's tile)
NUM_WARPS = 8
# A program's tile: speed only, since every value is elementwise and the amax a maximum, so no tile changes
# a bit (`python3 scripts/tile_sweep.py --kernels quantize,swiglu` on the GPU chose them). "transposed":
# quantize_transposed, whose tile must divide BLOCK; "transposed_f32" the same for a float32 v (model.fp8's
# float32 cotangents of the residual stream). "t32": the transposed copy is quantized from the float32 tile's
# transpose (_write_tile). "pair": the SwiGLU backward's program computes both
# halves of its tile, reading y's and dh's tiles once; else two programs, one per half, each read them.
TILES = {
    "transposed": {"block_m": 128, "block_n": 128, "num_warps": 8},
    "transposed_f32": {"block_m": 64, "block_n": 64, "num_warps": 2},
    "swiglu_fwd": {"block_m": 32, "block_n": 256, "num_warps": 4},
    "swiglu_bwd": {"block_m": 32, "block_n": 128, "num_warps": 4, "pair": True},
    "ce_grad": {"block_m": 128, "block_n": 128, "num_warps": 8},  # must divide BLOCK, as "transposed"
}


def padded(size: int, multiple: int) -> int:
    """size rounded up to a multiple of `multiple`."""
    return -(-size // multiple) * multiple


def scale_input(scale: jax.Array, scale_index: int | None) -> tuple[jax.Array, pl.BlockSpec]:
    """A quantization kernel's scale operand and its BlockSpec, for any grid. A scalar scale (scale_index None)
    goes in as a (1,) array. With scale_index, `scale` is a 1-D scale set (a projection's (s_x, s_w, s_g)) and
    the kernel reads element scale_index through the BlockSpec. Slicing the set outside the kernel instead costs a
    device-to-device copy per call on the GPU, since XLA emits a contiguous slice as a memcpy: 512 a step in
    gpu_dense's fp8 profile (docs/benchmarks-history.md set 35). The kernel reads the same float either way."""
    if scale_index is None:
        return jnp.asarray(scale, jnp.float32).reshape(1), pl.BlockSpec((1,), lambda *_: (0,))
    s = jnp.asarray(scale, jnp.float32)
    if s.ndim != 1 or not 0 <= scale_index < s.shape[0]:
        raise ValueError(f"quantization scale_index={scale_index} needs a 1-D scale set, not shape {s.shape}")
    return s, pl.BlockSpec((1,), lambda *_: (scale_index,))


def amax_of(*parts: jax.Array) -> jax.Array:
    """(len(parts),) float32: the maximum of each part -- an amax, or the per-tile amaxes a quantization kernel
    returns with amax_tiles=True -- in one reduction: the parts are zero-padded to one length, stacked and
    reduced along the rows. On the GPU each jnp.max of a kernel's tiles is a kernel launch of its own (about
    1 us; gpu_dense's fp8 step had about 500 a step, docs/benchmarks-history.md set 35), so model.fp8's products
    keep the tiles and reduce a product's three amaxes together in its backward. Every amax is >= 0 or NaN
    (a maximum of |v|), so the zeros change no maximum: the bytes of each part's own jnp.max."""
    flat = [jnp.ravel(p).astype(jnp.float32) for p in parts]
    n = max(f.shape[0] for f in flat)
    return jnp.max(jnp.stack([jnp.pad(f, (0, n - f.shape[0])) for f in flat]), axis=1)


def quantize(v: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """dtype(clip(v * scale, -fmax, fmax)) in float32: model.fp8's quantization, here and in XLA alike."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(v.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)


def _inside(v: jax.Array, m: int, n: int) -> jax.Array:
    """This program's (block_m, block_n) tile of an (m, n) array, with 0 where the tile lies outside it."""
    bm, bn = v.shape
    rows = pl.program_id(0) * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
    cols = pl.program_id(1) * bn + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
    return jnp.where((rows < m) & (cols < n), v, 0.0)


def _transposed(v: jax.Array, q: jax.Array, scale, t32: bool) -> jax.Array:
    """q^T for q = quantize(v, scale): q's transpose, or with t32 v's float32 transpose quantized again (the
    same bytes, since the quantization is elementwise; another shared-memory shuffle)."""
    return quantize(v.T, scale, q.dtype) if t32 else q.T


def _write_tile(v: jax.Array, s_ref, q_ref, qt_ref, amax_ref, t32: bool = False) -> None:
    """A tile's outputs: v quantized with the scale, its transpose (`_transposed`), and the tile's max |v|."""
    q = quantize(v, s_ref[0], q_ref.dtype)
    q_ref[...] = q
    qt_ref[...] = _transposed(v, q, s_ref[0], t32)
    amax_ref[...] = jnp.broadcast_to(jnp.max(jnp.abs(v)), (1, 1))


def _kernel(v_ref, s_ref, q_ref, qt_ref, amax_ref, *, m: int, n: int, padding: bool, round_to, t32: bool):
    v = v_ref[...]
    if round_to is not None:  # v's values rounded to round_to first: the bits of quantizing v.astype(round_to)
        v = v.astype(round_to)
    v = v.astype(jnp.float32)
    if padding:  # a tile over v's edge or past it (it loaded v's last tile): what lies outside v becomes 0
        v = _inside(v, m, n)
    _write_tile(v, s_ref, q_ref, qt_ref, amax_ref, t32)


@functools.partial(
    jax.jit, static_argnames=("dtype", "interpret", "rows_to", "cols_to", "round_to", "scale_index", "amax_tiles")
)
def quantize_transposed(
    v: jax.Array,
    scale: jax.Array,
    *,
    dtype,
    interpret: bool,
    rows_to: int = BLOCK,
    cols_to: int = BLOCK,
    round_to=None,
    scale_index: int | None = None,
    amax_tiles: bool = False,
):
    """(q, q^T, amax) of a 2-D v: q = dtype(clip(v * scale, -fmax, fmax)), zero-padded to rows_to x
    cols_to multiples (multiples of BLOCK: the padding the Mosaic fp8 product needs, written here instead
    of by a copy), its transpose, and max |v| (float32, over v alone). `round_to` (a dtype): v is rounded to
    it first, so a float32 v gives the bytes of quantize_transposed(v.astype(round_to)) without that cast's
    pass over memory (model.fp8's float32 cotangents, detjax.model.fp8). `scale_index`: scale is a scale set
    and the kernel reads this element of it (scale_input). `amax_tiles`: the amax unreduced, one per tile
    (amax_of reduces it)."""
    m, n = v.shape
    key = "transposed_f32" if v.dtype == jnp.float32 else "transposed"
    shape, tile, spec, _ = _padded_tiles("quantize_transposed", key, m, n, rows_to, cols_to)
    t32 = TILES[key].get("t32", False)
    kernel = functools.partial(_kernel, m=m, n=n, padding=shape != (m, n), round_to=round_to, t32=t32)
    args = (kernel, "fp8_quantize_transposed", [spec], shape, tile, dtype, interpret, v)
    return _tiles_call(*args, scale=scale, scale_index=scale_index, amax_tiles=amax_tiles)


def _padded_tiles(name: str, key: str, m: int, n: int, rows_to: int, cols_to: int):
    """The grid of a kernel that reads an (m, n) array and writes copies padded to rows_to x cols_to
    multiples, in TILES[key]'s tiles: (padded shape, tile, the array's BlockSpec, a row vector's BlockSpec).
    A tile past the array's edge loads its last tile (the kernel masks it, `_inside`)."""
    if rows_to % BLOCK or cols_to % BLOCK:
        raise ValueError(f"{name}: rows_to={rows_to}, cols_to={cols_to} must be multiples of {BLOCK}")
    t = TILES[key]
    bm, bn = t["block_m"], t["block_n"]
    if BLOCK % bm or BLOCK % bn:
        raise ValueError(f"{name}: TILES['{key}'] {bm} x {bn} must divide {BLOCK}")
    last_i, last_j = -(-m // bm) - 1, -(-n // bn) - 1
    spec = pl.BlockSpec((bm, bn), lambda i, j: (jnp.minimum(i, last_i), jnp.minimum(j, last_j)))
    row = pl.BlockSpec((bm,), lambda i, j: (jnp.minimum(i, last_i),))
    return (padded(m, rows_to), padded(n, cols_to)), (bm, bn, t["num_warps"]), spec, row


def _tiles_call(
    kernel, name: str, in_specs: list, shape, tile, dtype, interpret: bool, *args, scale, scale_index, amax_tiles=False
):
    """The pallas_call of a kernel over the (block_m x block_n) tiles of a (rows, cols) result (tile =
    (block_m, block_n, num_warps)): in_specs for args, then the scale (scale_input); out q (rows, cols), q^T
    and each tile's amax. Returns (q, q^T, the max of the amaxes), or with amax_tiles the tiles' amaxes
    unreduced (see `amax_of`)."""
    scale_arg, scale_spec = scale_input(scale, scale_index)
    rows, cols = shape
    bm, bn, warps = tile
    gm, gn = rows // bm, cols // bn
    q, qt, amax = pl.pallas_call(
        kernel,
        grid=(gm, gn),
        in_specs=[*in_specs, scale_spec],
        out_specs=[
            pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
            pl.BlockSpec((bn, bm), lambda i, j: (j, i)),
            pl.BlockSpec((1, 1), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, cols), dtype),
            jax.ShapeDtypeStruct((cols, rows), dtype),
            jax.ShapeDtypeStruct((gm, gn), jnp.float32),
        ],
        name=name,
        interpret=interpret,
        compiler_params=triton_params(warps, 1, interpret),
    )(*args, scale_arg)
    return q, qt, amax if amax_tiles else jnp.max(amax)


# ------------------------------------------------------------------ SwiGLU fused with the quantization
# model.fp8's MLP on the Mosaic path (detjax.model.fp8.fp8_swiglu_mlp): the down projection's input
# h = silu(gate) * up is never stored in bf16. The forward kernel reads the gate+up product y = [gate | up]
# and writes h's fp8 copies; the backward kernel reads y and dh (the down product's dx) and writes the fp8
# copies of dy = [dgate | dup], the gate+up product's incoming gradient. Both compute in float32 with the
# formulas of `swiglu` / `swiglu_grads`, which the XLA reference path (CPU) uses too.


def _sigmoid(g: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-g))


def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    """silu(g) * u in float32, sigmoid as 1 / (1 + exp(-g))."""
    return g * _sigmoid(g) * u


def swiglu_grads(g: jax.Array, u: jax.Array, dh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(dgate, dup) of h = swiglu(g, u) for the cotangent dh, in float32."""
    sig = _sigmoid(g)
    return dh * u * (sig * (1.0 + g * (1.0 - sig))), dh * g * sig


def _swiglu_tile(key: str, m: int, f: int) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) of TILES[key], or 128 x 128 where the tile does not divide (m, f)."""
    t = TILES[key]
    if m % t["block_m"] or f % t["block_n"]:
        return BLOCK, BLOCK, NUM_WARPS
    return t["block_m"], t["block_n"], t["num_warps"]


def _swiglu_kernel(g_ref, u_ref, s_ref, q_ref, qt_ref, amax_ref, *, t32: bool):
    h = swiglu(g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32))
    _write_tile(h, s_ref, q_ref, qt_ref, amax_ref, t32)


def _swiglu_bwd_half_kernel(g_ref, u_ref, dh_ref, s_ref, q_ref, qt_ref, amax_ref, *, t32: bool):
    dgate, dup = swiglu_grads(
        g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32), dh_ref[...].astype(jnp.float32)
    )
    d = jnp.where(pl.program_id(0) == 0, dgate, dup)  # this program's half of dy: the gate's or the up's
    _write_tile(d, s_ref, q_ref, qt_ref, amax_ref, t32)


def _swiglu_bwd_pair_kernel(g_ref, u_ref, dh_ref, s_ref, q_ref, qt_ref, amax_ref, *, t32: bool):
    """Both halves of a tile: q_ref is the (block_m, 2, block_n) block of dy8 seen as (m, 2, f), qt_ref the
    (2, block_n, block_m) block of dy8^T seen as (2, f, m)."""
    dgate, dup = swiglu_grads(
        g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32), dh_ref[...].astype(jnp.float32)
    )
    qg, qu = quantize(dgate, s_ref[0], q_ref.dtype), quantize(dup, s_ref[0], q_ref.dtype)
    q_ref[:, 0, :] = qg
    q_ref[:, 1, :] = qu
    qt_ref[0, :, :] = _transposed(dgate, qg, s_ref[0], t32)
    qt_ref[1, :, :] = _transposed(dup, qu, s_ref[0], t32)
    amax_ref[...] = jnp.broadcast_to(jnp.maximum(jnp.max(jnp.abs(dgate)), jnp.max(jnp.abs(dup))), (1, 1))


def _check_swiglu(y: jax.Array) -> tuple[int, int]:
    m, f2 = y.shape
    if m % BLOCK or f2 % (2 * BLOCK):
        raise ValueError(f"swiglu quantization: y {y.shape} must have rows and halves in whole {BLOCK}-tiles")
    return m, f2 // 2


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "scale_index", "amax_tiles"))
def swiglu_quantize_transposed(
    y: jax.Array, scale: jax.Array, *, dtype, interpret: bool, scale_index: int | None = None, amax_tiles=False
):
    """(q, q^T, amax) of h = swiglu(gate, up) for y = [gate | up] (m, 2f): q = dtype(clip(h * scale)) (m, f),
    its transpose, and max |h| (float32). `scale_index`, `amax_tiles` as in quantize_transposed."""
    m, f = _check_swiglu(y)
    bm, bn, warps = _swiglu_tile("swiglu_fwd", m, f)
    nf = f // bn
    in_specs = [pl.BlockSpec((bm, bn), lambda i, j: (i, j)), pl.BlockSpec((bm, bn), lambda i, j: (i, nf + j))]
    tile = (bm, bn, warps)
    kernel = functools.partial(_swiglu_kernel, t32=TILES["swiglu_fwd"].get("t32", False))
    args = (kernel, "fp8_swiglu_quantize", in_specs, (m, f), tile, dtype, interpret, y, y)
    return _tiles_call(*args, scale=scale, scale_index=scale_index, amax_tiles=amax_tiles)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "scale_index", "amax_tiles"))
def swiglu_bwd_quantize_transposed(
    y: jax.Array,
    dh: jax.Array,
    scale: jax.Array,
    *,
    dtype,
    interpret: bool,
    scale_index: int | None = None,
    amax_tiles: bool = False,
):
    """(q, q^T, amax) of dy = [dgate | dup] (m, 2f), the gradient of y = [gate | up] through h = swiglu(gate,
    up) for the cotangent dh (m, f): q = dtype(clip(dy * scale)), its transpose and max |dy| (float32).
    With TILES["swiglu_bwd"]["pair"], one program per tile writes both halves (y's and dh's tiles read
    once); else grid (half, row tile, column tile), whose two programs of a tile are neighbours in launch
    order. `scale_index`, `amax_tiles` as in quantize_transposed."""
    m, f = _check_swiglu(y)
    if dh.shape != (m, f):
        raise ValueError(f"swiglu backward: dh {dh.shape} does not match y {y.shape}")
    bm, bn, warps = _swiglu_tile("swiglu_bwd", m, f)
    gm, nf = m // bm, f // bn
    s, s_spec = scale_input(scale, scale_index)
    t32 = TILES["swiglu_bwd"].get("t32", False)
    if TILES["swiglu_bwd"].get("pair", False):
        q, qt, amax = pl.pallas_call(
            functools.partial(_swiglu_bwd_pair_kernel, t32=t32),
            grid=(gm, nf),
            in_specs=[
                pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                pl.BlockSpec((bm, bn), lambda i, j: (i, nf + j)),
                pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                s_spec,
            ],
            out_specs=[
                pl.BlockSpec((bm, 2, bn), lambda i, j: (i, 0, j)),
                pl.BlockSpec((2, bn, bm), lambda i, j: (0, j, i)),
                pl.BlockSpec((1, 1), lambda i, j: (i, j)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((m, 2, f), dtype),
                jax.ShapeDtypeStruct((2, f, m), dtype),
                jax.ShapeDtypeStruct((gm, nf), jnp.float32),
            ],
            name="fp8_swiglu_bwd_quantize",
            interpret=interpret,
            compiler_params=triton_params(warps, 1, interpret),
        )(y, y, dh, s)
        return q.reshape(m, 2 * f), qt.reshape(2 * f, m), amax if amax_tiles else jnp.max(amax)
    q, qt, amax = pl.pallas_call(
        functools.partial(_swiglu_bwd_half_kernel, t32=t32),
        grid=(2, gm, nf),
        in_specs=[
            pl.BlockSpec((bm, bn), lambda c, i, j: (i, j)),
            pl.BlockSpec((bm, bn), lambda c, i, j: (i, nf + j)),
            pl.BlockSpec((bm, bn), lambda c, i, j: (i, j)),
            s_spec,
        ],
        out_specs=[
            pl.BlockSpec((bm, bn), lambda c, i, j: (i, c * nf + j)),
            pl.BlockSpec((bn, bm), lambda c, i, j: (c * nf + j, i)),
            pl.BlockSpec((1, 1), lambda c, i, j: (i, c * nf + j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((m, 2 * f), dtype),
            jax.ShapeDtypeStruct((2 * f, m), dtype),
            jax.ShapeDtypeStruct((gm, 2 * nf), jnp.float32),
        ],
        name="fp8_swiglu_bwd_quantize",
        interpret=interpret,
        compiler_params=triton_params(warps, 1, interpret),
    )(y, y, dh, s)
    return q, qt, amax if amax_tiles else jnp.max(amax)


# ------------------------------------------------------------ the cross-entropy's gradient, quantized
# model.fp8.lm_head on the Mosaic path (detjax.model.fp8.fp8_head_ce): the LM head's logits go straight into
# the token cross-entropy, whose gradient for the logits is dce * (softmax - onehot). This kernel computes it
# from the bf16 logits and the rows' logsumexp and writes its e5m2 copies (both layouts) and its amax, so the
# gradient is never stored in float32 nor read back to be quantized.


def ce_grad(logits: jax.Array, lse: jax.Array, targets: jax.Array, dce: jax.Array, col0=0) -> jax.Array:
    """d ce / d logits for ce = logsumexp(logits) - logits[target] per row, times the rows' cotangents dce:
    dce * (exp(logits - lse) - onehot(target)), in float32 (logits (m, n); lse, targets, dce (m,); col0: the
    vocabulary index of logits' first column). The formula of both the kernel and the reference path."""
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    p = jnp.exp(logits.astype(jnp.float32) - lse[:, None])
    return (p - jnp.where(cols == targets[:, None], 1.0, 0.0)) * dce[:, None]


def _ce_kernel(l_ref, lse_ref, t_ref, dce_ref, s_ref, q_ref, qt_ref, amax_ref, *, m: int, n: int, padding: bool):
    d = ce_grad(l_ref[...], lse_ref[...], t_ref[...], dce_ref[...], pl.program_id(1) * l_ref.shape[1])
    if padding:  # as in quantize_transposed: what lies outside the logits becomes 0
        d = _inside(d, m, n)
    _write_tile(d, s_ref, q_ref, qt_ref, amax_ref)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "rows_to", "cols_to", "scale_index", "amax_tiles"))
def ce_grad_quantize_transposed(
    logits: jax.Array,
    lse: jax.Array,
    targets: jax.Array,
    dce: jax.Array,
    scale: jax.Array,
    *,
    dtype,
    interpret: bool,
    rows_to: int = BLOCK,
    cols_to: int = BLOCK,
    scale_index: int | None = None,
    amax_tiles: bool = False,
):
    """(q, q^T, amax) of d = ce_grad(logits, lse, targets, dce) (m, n): q = dtype(clip(d * scale)), zero-padded
    to rows_to x cols_to multiples as in quantize_transposed, its transpose, and max |d| (float32).
    `scale_index`, `amax_tiles` as in quantize_transposed."""
    m, n = logits.shape
    if lse.shape != (m,) or targets.shape != (m,) or dce.shape != (m,):
        raise ValueError(f"ce_grad_quantize_transposed: lse, targets, dce must be ({m},) for logits {logits.shape}")
    shape, tile, spec, row = _padded_tiles("ce_grad_quantize_transposed", "ce_grad", m, n, rows_to, cols_to)
    kernel = functools.partial(_ce_kernel, m=m, n=n, padding=shape != (m, n))
    args = (logits, lse.astype(jnp.float32), targets.astype(jnp.int32), dce.astype(jnp.float32))
    in_specs = [spec, row, row, row]
    head = (kernel, "fp8_ce_grad_quantize", in_specs, shape, tile, dtype, interpret)
    return _tiles_call(*head, *args, scale=scale, scale_index=scale_index, amax_tiles=amax_tiles)
