"""FP8 projections with delayed scaling (model.fp8), the recipe Hopper users expect.

One module on purpose: every fp8 product (dense, fused SwiGLU, grouped experts, the LM head with its
cross-entropy, the q/k/v product with RoPE) shares the quantization, scale and amax rules below, and a rule
changed in one place must change for all of them.

A projection y = x @ w runs as x8 @ w8 with fp32 accumulation, where x8 = e4m3(x * s_x), w8 = e4m3(w * s_w)
and the result is divided by s_x * s_w; its backward quantizes the incoming gradient to e5m2(dy * s_g) and
runs dx = g8 @ w8^T, dw = x8^T @ g8 the same way. Every projection has a scale vector s = (s_x, s_w, s_g) in
the "fp8" collection and an amax history (3, H). Delayed scaling: the scales a step uses were computed at the
end of the step before, from the amax histories up to it:

    s = fmax / (max over the history of amax) / 2^margin      (fmax: 448 for e4m3, 57344 for e5m2)

kept unchanged while that amax is 0 or not finite (step 0 runs with s = 1). After the step each history is
shifted by one and takes the step's amax (max |x|, max |w|, max |dy| over every microbatch) in front.

How the step's amaxes leave the model: the projection's custom VJP returns them as the "cotangent" of its scale
vector, so jax.grad of the loss with respect to the fp8 collection gives each projection's amaxes of that
microbatch (a max over the whole array: under jit with shardings the partitioner reduces it with an exact max,
whatever the mesh). The trainer takes the max over microbatches (detjax.step) -- order-free and exact, so the
scales are deterministic like every other leaf; they are checkpointed, digested and checked on restore.

The products themselves are detjax's pinned-tile Pallas matmul with fp8 operands under model.kernels=pallas
(the bits owned on the GPU), or XLA's dot on fp8 operands otherwise (on the CPU: exact fp8 products, fp32
sums -- the same math, emulated, so the tests run in CI). On Hopper, weights of at least
kernel.MOSAIC_FP8_MIN_SIZE elements take the Mosaic GPU kernel's fp8 wgmma (kernel.fp8_nt), which reads both
operands with the reduced dimension contiguous: x, w and dy are quantized by
quantize.quantize_transposed, which writes the transposed copy (and the amax) in the same pass, both
zero-padded to the products' tiles (_mosaic_pads), and the dequantizing scale is applied in the kernel's
epilogue. On one device, an MLP whose two products both take that path runs as fp8_swiglu_mlp: SwiGLU is
computed in float32 inside the kernels that quantize its output h and its gradient dy, so neither is written
in the compute dtype. A product whose result joins the float32 residual stream (a block's last product, the
LM head) can return it widened to float32 (`widen`), so that its backward's quantization kernel rounds the
stream's float32 gradient to the compute dtype itself: the same bits as a cast, without the cast's pass
over memory. In training on that path, the fp8 LM head and its cross-entropy are one operation
(fp8_head_ce): its backward quantizes the loss's gradient for the logits in one kernel, from the bf16
logits, without storing it in float32. Likewise the attention block's q/k/v product and RoPE
(fp8_matmul_rope): RoPE's backward kernel writes the product's quantized incoming gradient. The routed
experts' grouped matmuls (fp8_grouped_matmul) take fp8 wgmma on Hopper too, on rows laid out in groups padded
to whole tiles (detjax.pallas_kernels.gmm.mosaic); elsewhere they multiply the fp8 values exactly in bf16
(Triton gmm / tgmm) or float32 (XLA's ragged_dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from detjax.model.ce import token_ce
from detjax.pallas_kernels.matmul.quantize import amax_of
from detjax.pallas_kernels.matmul.quantize import quantize as _quantize

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FMAX = (float(jnp.finfo(E4M3).max), float(jnp.finfo(E4M3).max), float(jnp.finfo(E5M2).max))  # x, w, dy


def _amax(v: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(v.astype(jnp.float32)))


def dequant_factors(scale_3: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The products' dequantizing factors from a scale set (s_x, s_w, s_g): forward 1 / (s_x s_w), dx
    1 / (s_g s_w), dw 1 / (s_x s_g), float32 scalars. A weight copy (weight_copy, grouped_weight_copy) carries
    them, so a step that makes its copies once before the microbatch loop computes them once too. Otherwise
    each product and microbatch would compute them in a tiny kernel of its own, because the products are
    custom calls and XLA cannot fuse the scalars into them. The same operations on the same values, so the
    same bits."""
    return 1.0 / (scale_3[0] * scale_3[1]), 1.0 / (scale_3[2] * scale_3[1]), 1.0 / (scale_3[0] * scale_3[2])


def _factors(wq, scale_3) -> tuple:
    """A product's dequantizing factors: its weight copy's, else computed here (dequant_factors)."""
    return wq[3] if wq is not None else dequant_factors(scale_3)


def _qdot(a, b, kind: str, kernels: str, inv_scale: jax.Array, out_dtype) -> jax.Array:
    """(fp32 product of fp8 operands: fwd a @ b, dx a @ b^T, dw a^T @ b) * inv_scale, rounded to out_dtype."""
    if kernels == "pallas":
        from detjax.pallas_kernels.backend import interpret_mode
        from detjax.pallas_kernels.matmul.kernel import fp8_product

        return fp8_product(a, b, inv_scale, kind=kind, out_dtype=out_dtype, interpret=interpret_mode())
    dims = {"fwd": ((1,), (0,)), "dx": ((1,), (1,)), "dw": ((0,), (0,))}[kind]
    return (jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32) * inv_scale).astype(
        out_dtype
    )


def _interpret() -> bool:
    from detjax.pallas_kernels.backend import interpret_mode

    return interpret_mode()


def _mosaic_path(w_KN: jax.Array, kernels: str) -> bool:
    """Whether this projection's products run fp8 wgmma (kernel.use_mosaic_fp8: Hopper, a large weight)."""
    if kernels != "pallas":
        return False
    from detjax.pallas_kernels.matmul import kernel

    return kernel.use_mosaic_fp8(E5M2, E4M3, *w_KN.shape, _interpret())


def _mosaic_pads(m: int, k: int, n: int) -> tuple[int, int, int]:
    """The multiples that x (m, k), w (k, n) and dy (m, n) are padded to on the Mosaic path: each dimension
    once, to every tile of kernel.fp8_nt that reads it (the forward's and dx's output tiles and 128-element
    reduction blocks, dw's token chunks), so that the three products read the same padded copies and pad
    nothing more. All are powers of two: the largest is a multiple of the others."""
    from detjax.pallas_kernels.matmul import mosaic
    from detjax.pallas_kernels.matmul.kernel import dw_row_chunk

    cm, cn = mosaic.cta_tile("nt")
    br = mosaic.block_r(E4M3)
    chunk = dw_row_chunk(k, n)
    r_mult = chunk if 0 < chunk < m else br  # dw's reduction over tokens, as fp8_nt takes it
    return max(cm, r_mult, br), max(cm, cn, br), max(cn, br)


def _quantize_padded(
    v: jax.Array, scale_3: jax.Array, i: int, dtype, rows_to: int, cols_to: int, round_to=None, amax_tiles=True
):
    """(q, q^T, amax) in one pass with the scale scale_3[i], q zero-padded to rows_to x cols_to multiples
    (quantize.quantize_transposed: the same q as XLA's quantization, tests/test_matmul.py); `round_to`: v's
    values rounded to that dtype first, in the kernel. The kernel reads scale_3[i] itself (scale_index), so
    no slice of the scale set runs as a copy of its own. The amax comes as the kernel's per-tile amaxes
    (`amax_tiles`), which the product's backward reduces with its other amaxes in one kernel (amax_of)."""
    from detjax.pallas_kernels.matmul.quantize import quantize_transposed

    return quantize_transposed(
        v,
        scale_3,
        dtype=dtype,
        interpret=_interpret(),
        rows_to=rows_to,
        cols_to=cols_to,
        round_to=round_to,
        scale_index=i,
        amax_tiles=amax_tiles,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def fp8_matmul(
    x_MK: jax.Array, w_KN: jax.Array, scale_3: jax.Array, out_dtype, kernels: str, widen: bool = False
) -> jax.Array:
    """x @ w through fp8 with the given scales (s_x, s_w, s_g); see the module docstring. x comes in
    out_dtype (the compute dtype), w is the float32 master. `widen`: the out_dtype result is returned as
    float32 (the same values) and its float32 cotangent is rounded to out_dtype where the backward quantizes
    it -- the bits of `fp8_matmul(...).astype(float32)`, without the cotangent's cast as a pass of its own
    (a residual stream in float32: detjax.model.lm.Block)."""
    return _fwd(x_MK, w_KN, scale_3, out_dtype, kernels, widen)[0]


def weight_copy(w_KN: jax.Array, scale_3: jax.Array, kernels: str) -> tuple:
    """What fp8_matmul's products read of a weight w (k, n) (its float32 master, or the masters fused along n
    as the product fuses them): (w8, w8^T, amax |w|, dequant_factors) on the Mosaic path, w8 and w8^T
    zero-padded to the products' tiles, else (w8, None, amax |w|, dequant_factors). The step makes these once
    per step, before its microbatch loop (detjax.step.Trainer.compute_copies; fp8_matmul_copy reads them): the
    weight and its scale are the same in every microbatch, so they are the same bytes the product would make
    at each use."""
    if _mosaic_path(w_KN, kernels):
        k, n = w_KN.shape
        _, pk, pn = _mosaic_pads(k, k, n)  # the weight's pads do not depend on the token count
        return (*_quantize_padded(w_KN, scale_3, 1, E4M3, pk, pn, amax_tiles=False), dequant_factors(scale_3))
    return _quantize(w_KN, scale_3[1], E4M3), None, _amax(w_KN), dequant_factors(scale_3)


def _check_copy(w_KN, wq, mosaic: bool) -> None:
    if len(wq) != 4:
        raise ValueError(
            f"fp8 weight copy has {len(wq)} parts, not 4 (w8, w8^T, amax, dequant_factors: fp8.weight_copy)"
        )
    if (wq[1] is not None) != mosaic or wq[0].shape[0] < w_KN.shape[0] or wq[0].shape[1] < w_KN.shape[1]:
        raise ValueError(f"fp8 weight copy {wq[0].shape} does not fit the weight {w_KN.shape} (fp8.weight_copy)")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def fp8_matmul_copy(x_MK, w_KN, wq, scale_3, out_dtype, kernels: str, widen: bool = False) -> jax.Array:
    """fp8_matmul reading wq = weight_copy(w, scale_3, kernels), made beforehand: the products never read
    w's values, w only receives dw. The same bytes as fp8_matmul, so the same bits."""
    _check_copy(w_KN, wq, _mosaic_path(w_KN, kernels))
    return _fwd(x_MK, w_KN, scale_3, out_dtype, kernels, widen, wq)[0]


def _copy_fwd(x_MK, w_KN, wq, scale_3, out_dtype, kernels, widen):
    _check_copy(w_KN, wq, _mosaic_path(w_KN, kernels))
    y, res = _fwd(x_MK, w_KN, scale_3, out_dtype, kernels, widen, wq)
    return y, (res, wq)


def _copy_bwd(out_dtype, kernels, widen, res, dy_MN):
    res, wq = res
    dx, dw, amax = _bwd(out_dtype, kernels, widen, res, dy_MN)
    return dx, dw, jax.tree.map(jnp.zeros_like, wq), amax  # the copy is a constant of the step


fp8_matmul_copy.defvjp(_copy_fwd, _copy_bwd)


def _widened(y: jax.Array, widen: bool) -> jax.Array:
    return y.astype(jnp.float32) if widen else y


def _fwd(x_MK, w_KN, scale_3, out_dtype, kernels, widen=False, wq=None):
    inv = _factors(wq, scale_3)
    if _mosaic_path(w_KN, kernels):  # fp8 wgmma: every product as a @ b^T, transposed copies made while quantizing
        from detjax.pallas_kernels.matmul.kernel import fp8_nt

        (m, k), n = x_MK.shape, w_KN.shape[1]
        pm, pk, pn = _mosaic_pads(m, k, n)
        x8, x8_KM, amax_x = _quantize_padded(x_MK, scale_3, 0, E4M3, pm, pk)
        w8, w8_NK, amax_w = wq[:3] if wq is not None else _quantize_padded(w_KN, scale_3, 1, E4M3, pk, pn)
        y = fp8_nt(x8, w8_NK, inv[0], out_dtype=out_dtype, r_chunk=0, interpret=_interpret())
        kn = jnp.zeros((k, n, 0), jnp.int8)  # the weight's unpadded shape, for the backward (no data)
        return _widened(y[:m, :n], widen), (x8_KM, w8, scale_3, amax_x, amax_w, kn, inv)
    x8 = _quantize(x_MK, scale_3[0], E4M3)
    w8, _, amax_w = wq[:3] if wq is not None else (_quantize(w_KN, scale_3[1], E4M3), None, _amax(w_KN))
    y = _qdot(x8, w8, "fwd", kernels, inv[0], out_dtype)
    return _widened(y, widen), (x8, w8, scale_3, _amax(x_MK), amax_w, None, inv)


def _bwd(out_dtype, kernels, widen, res, dy_MN):
    """dx in the compute dtype (x arrives in it, as out_dtype), dw in float32 (the master's dtype). With
    `widen` dy comes in float32 and is rounded to out_dtype first (in the quantization kernel on the Mosaic
    path)."""
    x8, w8, scale_3, amax_x, amax_w, kn, (_, inv_dx, inv_dw) = res
    if kn is not None:  # the Mosaic path: x8 is x8^T (K, M) and w8 (K, N), both padded; kn has (K, N)
        (m, n), k = dy_MN.shape, kn.shape[0]
        pm, _, pn = _mosaic_pads(m, k, n)
        g8, g8_NM, amax_g = _quantize_padded(dy_MN, scale_3, 2, E5M2, pm, pn, out_dtype if widen else None)
        dx, dw = _mosaic_grads(g8, g8_NM, x8, w8, (m, k, n), inv_dx, inv_dw, out_dtype)
        return dx, dw, amax_of(amax_x, amax_w, amax_g)
    if widen:
        dy_MN = dy_MN.astype(out_dtype)
    g8 = _quantize(dy_MN, scale_3[2], E5M2)
    dx = _qdot(g8, w8, "dx", kernels, inv_dx, out_dtype)
    dw = _qdot(x8, g8, "dw", kernels, inv_dw, jnp.float32)
    return dx, dw, jnp.stack([amax_x, amax_w, _amax(dy_MN)])


fp8_matmul.defvjp(_fwd, _bwd)


def _mosaic_grads(g8, g8_NM, x8_KM, w8, mkn: tuple[int, int, int], inv_dx, inv_dw, out_dtype):
    """The Mosaic path's backward products from the quantized gradient (both layouts, padded): dx = g8 @ w8^T
    in out_dtype and dw = x8^T @ g8 in float32 with the dw token chunks, sliced to (m, k) and (k, n)."""
    from detjax.pallas_kernels.matmul.kernel import dw_row_chunk, fp8_nt

    m, k, n = mkn
    dx = fp8_nt(g8, w8, inv_dx, out_dtype=out_dtype, r_chunk=0, interpret=_interpret())
    dw = fp8_nt(x8_KM, g8_NM, inv_dw, out_dtype=jnp.float32, r_chunk=dw_row_chunk(k, n), interpret=_interpret())
    return dx[:m, :k], dw[:k, :n]


# ------------------------------------------------------------------ the LM head fused with its cross-entropy
def fused_head_ce(w_KN: jax.Array, kernels: str) -> bool:
    """Whether an fp8 LM head runs as fp8_head_ce (its products on the Mosaic path)."""
    return _mosaic_path(w_KN, kernels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def fp8_head_ce(x_MK, w_KN, wq, scale_3, targets_M, out_dtype, kernels: str) -> jax.Array:
    """Per-token cross-entropy (float32, (m,)) of the fp8 LM head's logits x @ w for the targets (model.fp8
    with lm_head, on the Mosaic path: fused_head_ce). The forward is fp8_matmul's (logits rounded to
    out_dtype, then widened to float32) followed by detjax.model.ce.token_ce. The backward never stores the
    logits' float32 gradient: one kernel (quantize.ce_grad_quantize_transposed) computes dce * (softmax -
    onehot) from the out_dtype logits and the rows' logsumexp in float32 and writes its e5m2 copies and amax,
    which the dx and dw products read as fp8_matmul's backward reads the quantized dy. `wq`: the weight's
    copy (weight_copy) or None. Against fp8_matmul(widen=True) + ce.token_ce: the same ce; the gradients
    differ only in that the logits' gradient is quantized from float32 directly, where that path rounds it
    to out_dtype first, and in the exp's implementation (XLA's or the kernel's)."""
    return _head_ce_fwd(x_MK, w_KN, wq, scale_3, targets_M, out_dtype, kernels)[0]


def _head_ce_fwd(x_MK, w_KN, wq, scale_3, targets_M, out_dtype, kernels):
    from detjax.pallas_kernels.matmul.kernel import fp8_nt

    if not _mosaic_path(w_KN, kernels):
        raise ValueError("fp8_head_ce needs the Mosaic fp8 path (fp8.fused_head_ce); use fp8_matmul and ce.token_ce")
    (m, k), n = x_MK.shape, w_KN.shape[1]
    pm, pk, pn = _mosaic_pads(m, k, n)
    x8, x8_KM, amax_x = _quantize_padded(x_MK, scale_3, 0, E4M3, pm, pk)
    if wq is not None:
        _check_copy(w_KN, wq, True)
    w8, w8_NK, amax_w = wq[:3] if wq is not None else _quantize_padded(w_KN, scale_3, 1, E4M3, pk, pn)
    inv = _factors(wq, scale_3)
    logits = fp8_nt(x8, w8_NK, inv[0], out_dtype=out_dtype, r_chunk=0, interpret=_interpret())[:m, :n]
    ce, lse = token_ce(logits.astype(jnp.float32), targets_M)
    kn = jnp.zeros((k, n, 0), jnp.int8)  # the weight's unpadded shape, for the backward (no data)
    return ce, (x8_KM, w8, scale_3, amax_x, amax_w, logits, lse, targets_M, kn, wq, inv)


def _head_ce_bwd(out_dtype, kernels, res, dce_M):
    from detjax.pallas_kernels.matmul.quantize import ce_grad_quantize_transposed

    x8_KM, w8, scale_3, amax_x, amax_w, logits, lse, targets_M, kn, wq, (_, inv_dx, inv_dw) = res
    (m, n), k = logits.shape, kn.shape[0]
    pm, _, pn = _mosaic_pads(m, k, n)
    g8, g8_NM, amax_g = ce_grad_quantize_transposed(
        logits,
        lse,
        targets_M,
        dce_M,
        scale_3,
        dtype=E5M2,
        interpret=_interpret(),
        rows_to=pm,
        cols_to=pn,
        scale_index=2,
        amax_tiles=True,
    )
    dx, dw = _mosaic_grads(g8, g8_NM, x8_KM, w8, (m, k, n), inv_dx, inv_dw, out_dtype)
    d_wq = None if wq is None else jax.tree.map(jnp.zeros_like, wq)  # the copy is a constant of the step
    return dx, dw, d_wq, amax_of(amax_x, amax_w, amax_g), None


fp8_head_ce.defvjp(_head_ce_fwd, _head_ce_bwd)


def fused_swiglu(m: int, d: int, f: int, kernels: str) -> bool:
    """Whether an MLP of m tokens, d_model d and ffn_dim f runs as fp8_swiglu_mlp: both products on the Mosaic
    path (kernel.use_mosaic_fp8) with shapes that need no padding (whole tiles of _mosaic_pads and of the
    quantization's 128-element blocks), so no copy of y, h or dy is padded or sliced."""
    from detjax.pallas_kernels.matmul import kernel
    from detjax.pallas_kernels.matmul.quantize import BLOCK

    if kernels != "pallas" or f % BLOCK:
        return False
    interp = _interpret()
    if not (kernel.use_mosaic_fp8(E5M2, E4M3, d, 2 * f, interp) and kernel.use_mosaic_fp8(E5M2, E4M3, f, d, interp)):
        return False
    return _whole_tiles(m, d, f)


def _whole_tiles(m: int, d: int, f: int) -> bool:
    (pm, pd, pn), (pm2, pf, pd2) = _mosaic_pads(m, d, 2 * f), _mosaic_pads(m, f, d)
    return all(a % b == 0 for a, b in ((m, pm), (m, pm2), (d, pd), (d, pd2), (2 * f, pn), (f, pf)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def fp8_swiglu_mlp(x_MK, w_gu_KN, w_down_FK, s_gu_3, s_down_3, copies, out_dtype, widen: bool = False):
    """down(silu(gate) * up) of x through fp8 on the Mosaic path, with w_gu = [w_gate | w_up] (k, 2f): the
    two products of fp8_matmul with h = silu(gate) * up computed in float32 and quantized in one kernel
    (quantize.swiglu_quantize_transposed), and its backward likewise (swiglu_bwd_quantize_transposed), so
    neither h nor dy is written in the compute dtype. The amaxes are those of fp8_matmul (h's in float32).
    Shapes as fused_swiglu admits them. `copies`: None, or (weight_copy of w_gu, of w_down) made beforehand
    (then the weights' values are not read; they receive the gradients). `widen` as in fp8_matmul."""
    return _swiglu_fwd(x_MK, w_gu_KN, w_down_FK, s_gu_3, s_down_3, copies, out_dtype, widen)[0]


def _swiglu_fwd(x_MK, w_gu_KN, w_down_FK, s_gu_3, s_down_3, copies, out_dtype, widen):
    from detjax.pallas_kernels.matmul.kernel import fp8_nt
    from detjax.pallas_kernels.matmul.quantize import swiglu_quantize_transposed

    (m, k), f2 = x_MK.shape, w_gu_KN.shape[1]
    if f2 % 2 or not _whole_tiles(m, k, f2 // 2):
        raise ValueError(f"fp8_swiglu_mlp: x {x_MK.shape}, w_gu {w_gu_KN.shape} are not whole tiles (fused_swiglu)")
    interp = _interpret()
    pm, pk, pn = _mosaic_pads(m, k, f2)
    x8, x8_KM, amax_x = _quantize_padded(x_MK, s_gu_3, 0, E4M3, pm, pk)
    if copies is not None:
        _check_copy(w_gu_KN, copies[0], True)
        _check_copy(w_down_FK, copies[1], True)
    w8, w8_NK, amax_w = copies[0][:3] if copies is not None else _quantize_padded(w_gu_KN, s_gu_3, 1, E4M3, pk, pn)
    inv_gu = _factors(None if copies is None else copies[0], s_gu_3)
    y = fp8_nt(x8, w8_NK, inv_gu[0], out_dtype=out_dtype, r_chunk=0, interpret=interp)
    h8, h8_FM, amax_h = swiglu_quantize_transposed(
        y, s_down_3, dtype=E4M3, interpret=interp, scale_index=0, amax_tiles=True
    )
    _, pf, pd = _mosaic_pads(m, f2 // 2, k)
    wd8, wd8_NK, amax_wd = (
        copies[1][:3] if copies is not None else _quantize_padded(w_down_FK, s_down_3, 1, E4M3, pf, pd)
    )
    inv_dn = _factors(None if copies is None else copies[1], s_down_3)
    out = fp8_nt(h8, wd8_NK, inv_dn[0], out_dtype=out_dtype, r_chunk=0, interpret=interp)
    zero = jax.tree.map(jnp.zeros_like, copies)  # the copies' cotangent: they are constants of the step
    res = (x8_KM, w8, y, h8_FM, wd8, s_gu_3, s_down_3, amax_x, amax_w, amax_h, amax_wd, zero, inv_gu, inv_dn)
    return _widened(out, widen), res


def _swiglu_bwd(out_dtype, widen, res, dout_MK):
    from detjax.pallas_kernels.matmul.kernel import dw_row_chunk, fp8_nt
    from detjax.pallas_kernels.matmul.quantize import swiglu_bwd_quantize_transposed

    x8_KM, w8, y, h8_FM, wd8, s_gu, s_dn, amax_x, amax_w, amax_h, amax_wd, zero, inv_gu, inv_dn = res
    (m, k), f = dout_MK.shape, y.shape[1] // 2
    interp = _interpret()
    pm, _, pd = _mosaic_pads(m, f, k)
    g8, g8_KM, amax_g = _quantize_padded(dout_MK, s_dn, 2, E5M2, pm, pd, out_dtype if widen else None)
    dh = fp8_nt(g8, wd8, inv_dn[1], out_dtype=out_dtype, r_chunk=0, interpret=interp)
    dw_down = fp8_nt(h8_FM, g8_KM, inv_dn[2], out_dtype=jnp.float32, r_chunk=dw_row_chunk(f, k), interpret=interp)
    dy8, dy8_NM, amax_dy = swiglu_bwd_quantize_transposed(
        y, dh, s_gu, dtype=E5M2, interpret=interp, scale_index=2, amax_tiles=True
    )
    dx = fp8_nt(dy8, w8, inv_gu[1], out_dtype=out_dtype, r_chunk=0, interpret=interp)
    dw_gu = fp8_nt(
        x8_KM,
        dy8_NM,
        inv_gu[2],
        out_dtype=jnp.float32,
        r_chunk=dw_row_chunk(k, 2 * f),
        interpret=interp,
    )
    return (
        dx,
        dw_gu,
        dw_down,
        amax_of(amax_x, amax_w, amax_dy),
        amax_of(amax_h, amax_wd, amax_g),
        zero,
    )


fp8_swiglu_mlp.defvjp(_swiglu_fwd, _swiglu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def fp8_grouped_matmul(x_RK: jax.Array, w_EKN: jax.Array, gs_E: jax.Array, scale_3: jax.Array, kernels: str, x_dtype):
    """Rows sorted by expert (in x_dtype, the compute dtype) times their expert's weight through fp8 (one scale
    set for the whole expert stack), float32 out. Under kernels=pallas on Hopper (`_grouped_mosaic`), fp8
    wgmma through the Mosaic GPU kernel on the padded group layout (detjax.pallas_kernels.gmm.mosaic), the
    activations quantized with their transposed copies by quantize.quantize_transposed; kernels="mosaic"
    takes that path anywhere (its interpreter off the GPU: the tests). Otherwise the fp8 values are
    multiplied exactly: as bf16 operands of detjax's Triton gmm / tgmm under kernels=pallas (or "triton",
    which forces it: scripts/gemm_bench.py --grouped), else as float32 operands of XLA's ragged_dot at
    full precision."""
    return _gfwd(x_RK, w_EKN, gs_E, scale_3, kernels, x_dtype)[0]


def _grouped_mosaic(w_EKN: jax.Array, kernels: str) -> bool:
    """Whether the experts' products take fp8 wgmma: kernels="mosaic", or kernels=pallas where each expert's
    product takes the Mosaic kernel (kernel.use_mosaic_fp8, e5m2 x e4m3 included) and whole tiles fit."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    _, k, n = w_EKN.shape
    if kernels == "mosaic":
        return True
    if kernels != "pallas" or not gmosaic.usable(k, n):
        return False
    from detjax.pallas_kernels.matmul import kernel

    return kernel.use_mosaic_fp8(E5M2, E4M3, k, n, _interpret())


def _gmm(a, w, gs, kernels):
    if kernels in ("pallas", "triton"):
        from detjax.pallas_kernels.backend import interpret_mode
        from detjax.pallas_kernels.gmm.kernel import gmm

        return gmm(
            a.astype(jnp.bfloat16), w.astype(jnp.bfloat16), gs, out_dtype=jnp.float32, interpret=interpret_mode()
        )
    f32 = jnp.float32
    return jax.lax.ragged_dot(
        a.astype(f32), w.astype(f32), gs, precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32
    )


def _tgmm(a, b, gs, kernels, n_groups: int):
    if kernels in ("pallas", "triton"):
        from detjax.pallas_kernels.backend import interpret_mode
        from detjax.pallas_kernels.gmm.kernel import tgmm

        return tgmm(
            a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), gs, out_dtype=jnp.float32, interpret=interpret_mode()
        )
    f32 = jnp.float32
    w0 = jnp.zeros((n_groups, a.shape[1], b.shape[1]), f32)
    _, vjp = jax.vjp(
        lambda w: jax.lax.ragged_dot(
            a.astype(f32), w, gs, precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32
        ),
        w0,
    )
    return vjp(b.astype(f32))[0]


def grouped_weight_copy(w_EKN: jax.Array, scale_3: jax.Array, kernels: str) -> tuple:
    """What fp8_grouped_matmul's products read of an expert stack w (E, K, N): (w8, w8 with K and N swapped on
    the Mosaic path else None, amax |w|) -- made once per step by the trainer (Trainer.compute_copies), the
    same bytes the products would make at each use (fp8_grouped_matmul_copy reads them); and, as weight_copy,
    the dequant_factors of the scale set."""
    w8 = _quantize(w_EKN, scale_3[1], E4M3)
    w8_T = jnp.swapaxes(w8, 1, 2) if _grouped_mosaic(w_EKN, kernels) else None
    return w8, w8_T, _amax(w_EKN), dequant_factors(scale_3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def fp8_grouped_matmul_copy(x_RK, w_EKN, gs_E, scale_3, wq, kernels: str, x_dtype):
    """fp8_grouped_matmul reading wq = grouped_weight_copy(w, scale_3, kernels), made beforehand: w's values
    are not read, w only receives dw. The same bytes, so the same bits."""
    _check_grouped_copy(w_EKN, wq, kernels)
    return _gfwd(x_RK, w_EKN, gs_E, scale_3, kernels, x_dtype, wq)[0]


def _check_grouped_copy(w_EKN, wq, kernels: str) -> None:
    if len(wq) != 4:
        raise ValueError(f"fp8 expert weight copy has {len(wq)} parts, not 4 (fp8.grouped_weight_copy)")
    if (wq[1] is not None) != _grouped_mosaic(w_EKN, kernels) or wq[0].shape != w_EKN.shape:
        raise ValueError(f"fp8 expert weight copy {wq[0].shape} does not fit {w_EKN.shape} (grouped_weight_copy)")


def _gcopy_fwd(x_RK, w_EKN, gs_E, scale_3, wq, kernels, x_dtype):
    _check_grouped_copy(w_EKN, wq, kernels)
    y, res = _gfwd(x_RK, w_EKN, gs_E, scale_3, kernels, x_dtype, wq)
    return y, (res, jax.tree.map(jnp.zeros_like, wq))


def _gcopy_bwd(kernels, x_dtype, res, dy_RN):
    res, zero = res
    dx, dw, dgs, amax = _gbwd(kernels, x_dtype, res, dy_RN)
    return dx, dw, dgs, amax, zero  # the copy is a constant of the step


fp8_grouped_matmul_copy.defvjp(_gcopy_fwd, _gcopy_bwd)


def _gfwd(x_RK, w_EKN, gs_E, scale_3, kernels, x_dtype, wq=None):
    if wq is None:
        wq = grouped_weight_copy(w_EKN, scale_3, kernels)
    if _grouped_mosaic(w_EKN, kernels):
        return _gfwd_mosaic(x_RK, wq, gs_E, scale_3)
    x8, (w8, _, amax_w, inv) = _quantize(x_RK, scale_3[0], E4M3), wq
    y = _gmm(x8, w8, gs_E, kernels) * inv[0]
    return y, (x8, w8, gs_E, scale_3, _amax(x_RK), amax_w, inv)


def _gbwd(kernels, x_dtype, res, dy_RN):
    if len(res) == 4:  # the Mosaic path's residuals
        return _gbwd_mosaic(kernels, x_dtype, res, dy_RN)
    x8, w8, gs_E, scale_3, amax_x, amax_w, (_, inv_dx, inv_dw) = res
    g8 = _quantize(dy_RN, scale_3[2], E5M2)
    dx = (_gmm(g8, jnp.swapaxes(w8, 1, 2), gs_E, kernels) * inv_dx).astype(x_dtype)
    dw = _tgmm(x8, g8, gs_E, kernels, w8.shape[0]) * inv_dw
    return dx, dw, None, jnp.stack([amax_x, amax_w, _amax(dy_RN)])


def _gfwd_mosaic(x_RK, wq, gs_E, scale_3):
    """The forward on the padded group layout: x copied in, quantized with its transposed copy (kept for dw),
    each row tile times its expert's w^T copy, the dequantizing scale in the epilogue, the rows copied out."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    w8, w8_ENK, amax_w, inv = wq
    gm = gmosaic.GROUP_ROWS
    lay = gmosaic.padded_layout(gs_E, x_RK.shape[0])
    x8, x8_KP, amax_x = _quantize_padded(gmosaic.to_padded(x_RK, lay), scale_3, 0, E4M3, gm, gm)
    y = gmosaic.grouped_nt(x8, w8_ENK, lay, inv[0], out_dtype=jnp.float32, interpret=_interpret())
    return gmosaic.from_padded(y, lay), (x8_KP, w8, lay, (scale_3, amax_x, amax_w, inv))


def _gbwd_mosaic(kernels, x_dtype, res, dy_RN):
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    x8_KP, w8, lay, (scale_3, amax_x, amax_w, (_, inv_dx, inv_dw)) = res
    gm = gmosaic.GROUP_ROWS
    g8, g8_NP, amax_g = _quantize_padded(gmosaic.to_padded(dy_RN, lay), scale_3, 2, E5M2, gm, gmosaic.BLOCK)
    dx = gmosaic.grouped_nt(g8, w8, lay, inv_dx, out_dtype=x_dtype, interpret=_interpret())
    dw = gmosaic.grouped_tnt(x8_KP, g8_NP, lay, inv_dw, interpret=_interpret())
    return gmosaic.from_padded(dx, lay), dw, None, amax_of(amax_x, amax_w, amax_g)


fp8_grouped_matmul.defvjp(_gfwd, _gbwd)


def fp8_dense_many(
    specs: list[str],
    x: jax.Array,
    ws: list[jax.Array],
    dtype,
    scale_3,
    kernels: str,
    wq=None,
    widen: bool = False,
    rope: tuple | None = None,
):
    """Several projections of one input as one fp8 product over the weights concatenated along N (one
    scale set for the fused weight, as one GEMM), split after (detjax.pallas_kernels.matmul.ops.dense_many).
    `wq`: the fused weight's weight_copy, made beforehand (the step's compute copies), or None. `widen`:
    float32 outputs, as in fp8_matmul. `rope` = (shape, theta), kernels=pallas: q, k, v with RoPE on q and k
    (layers.proj_many), as fp8_matmul_rope where its shapes admit it (fused_rope), else fp8_matmul then
    rope.ops.split_rope."""
    from detjax.pallas_kernels.matmul.ops import dense_many
    from detjax.pallas_kernels.rope.ops import split_rope

    if rope is not None and widen:
        raise ValueError("fp8_dense_many: rope and widen do not combine (q, k, v stay in the compute dtype)")

    def product(x2d, w):
        if rope is not None and fused_rope(x2d.shape[0], *w.shape, kernels):
            return fp8_matmul_rope(x2d, w, wq, scale_3, rope[0], rope[1], dtype, kernels)
        if wq is None:
            y = fp8_matmul(x2d, w, scale_3, dtype, kernels, widen)
        else:
            y = fp8_matmul_copy(x2d, w, wq, scale_3, dtype, kernels, widen)
        return y if rope is None else split_rope(y, *rope)

    return dense_many(specs, x, ws, dtype, product=product, split=None if rope is None else (lambda qkv: qkv))


# ------------------------------------------------------ the q/k/v product fused with RoPE's backward
def fused_rope(m: int, k: int, n: int, kernels: str) -> bool:
    """Whether the attention block's fp8 q/k/v product (m tokens, (k, n) weight) runs as fp8_matmul_rope:
    the Mosaic path with m and n whole multiples of its pads (the kernel writes dy's copies unpadded)."""
    if not _mosaic_path(jax.ShapeDtypeStruct((k, n), jnp.float32), kernels):
        return False
    pm, _, pn = _mosaic_pads(m, k, n)
    return m % pm == 0 and n % pn == 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def fp8_matmul_rope(x_MK, w_KN, wq, scale_3, shape: tuple, theta: float, out_dtype, kernels: str):
    """(rope(q), rope(k), v) of y = [q | k | v] = fp8_matmul(x, w) (rope.ops.split_rope_forward: the same
    forward bits as the product, then the split and RoPE), on the Mosaic path (fused_rope). The backward
    never writes y's cotangent in the compute dtype: one kernel (rope.kernel.rope_grad_quantize_transposed)
    applies RoPE's backward to dq and dk and writes dy's e5m2 copies (both layouts) and amax, which the dx
    and dw products read as fp8_matmul's backward reads its quantized dy. `wq`: the weight's copy
    (weight_copy) or None. Against fp8_matmul + split_rope: the same bytes forward and backward (the same
    kernels' arithmetic; tests/test_fp8.py)."""
    return _rope_fwd(x_MK, w_KN, wq, scale_3, shape, theta, out_dtype, kernels)[0]


def _rope_fwd(x_MK, w_KN, wq, scale_3, shape, theta, out_dtype, kernels):
    from detjax.pallas_kernels.rope.ops import split_rope_forward

    if not fused_rope(x_MK.shape[0], *w_KN.shape, kernels):
        raise ValueError(f"fp8_matmul_rope: x {x_MK.shape}, w {w_KN.shape} are not whole tiles of the Mosaic path")
    if wq is not None:
        _check_copy(w_KN, wq, True)
    y, res = _fwd(x_MK, w_KN, scale_3, out_dtype, kernels, False, wq)
    d_wq = None if wq is None else jax.tree.map(jnp.zeros_like, wq)  # the copy is a constant of the step
    return split_rope_forward(y, shape, theta), (res, d_wq)


def _rope_bwd(shape, theta, out_dtype, kernels, res, cts):
    from detjax.pallas_kernels.rope.ops import rope_cotangent_quantized

    (x8_KM, w8, scale_3, amax_x, amax_w, kn, (_, inv_dx, inv_dw)), d_wq = res
    m, (k, n) = shape[0] * shape[1], kn.shape[:2]
    g8, g8_NM, amax_g = rope_cotangent_quantized(cts, shape, theta, scale_3, E5M2, scale_index=2, amax_tiles=True)
    dx, dw = _mosaic_grads(g8, g8_NM, x8_KM, w8, (m, k, n), inv_dx, inv_dw, out_dtype)
    return dx, dw, d_wq, amax_of(amax_x, amax_w, amax_g)


fp8_matmul_rope.defvjp(_rope_fwd, _rope_bwd)


def scale_var(module, name: str, enabled: bool) -> jax.Array | None:
    """The (s_x, s_w, s_g) scale vector of one projection of `module` (None with fp8 off)."""
    if not enabled:
        return None
    return module.variable("fp8", name, lambda: jnp.ones((3,), jnp.float32)).value


# ------------------------------------------------------------------------------------ delayed scaling state


def init_collection(scales, history_len: int) -> dict:
    """TrainState.collections["fp8"]: the scales the next step uses and the amax histories behind them."""
    return {
        "scale": scales,
        "amax_history": jax.tree.map(lambda s: jnp.zeros((*s.shape, history_len), jnp.float32), scales),
    }


def next_scales(history_3H: jax.Array, old_3: jax.Array, margin: int) -> jax.Array:
    """(..., 3, H) histories -> (..., 3) scales (leading dims: a pipeline's stacked stages)."""
    amax = jnp.max(history_3H, axis=-1)
    new = jnp.broadcast_to(jnp.asarray(FMAX, jnp.float32), amax.shape) / amax / (2.0**margin)
    return jnp.where((amax > 0) & jnp.isfinite(amax), new, old_3)


def update_collection(coll: dict, amax_tree, margin: int) -> dict:
    """The state after a step: each history shifted by one with the step's amaxes in front; new scales.

    All projections at once: their histories, amaxes and scales are packed along one leading axis, so the
    update is one shift and one next_scales on the GPU, not one small kernel of each per projection (gpu_dense's
    fp8 profile had about 130 a step, docs/benchmarks-history.md set 34). Every op is elementwise or a maximum over
    one history, so these are the bytes of the update per projection. The collection is replicated on every
    mesh (Trainer.state_shardings), so packing moves no data between devices."""
    hists, treedef = jax.tree.flatten(coll["amax_history"])
    amaxes, scales = treedef.flatten_up_to(amax_tree), treedef.flatten_up_to(coll["scale"])
    if not hists:
        return coll
    length = hists[0].shape[-1]
    h = jnp.concatenate([x.reshape(-1, 3, length) for x in hists])
    a = jnp.concatenate([x.reshape(-1, 3) for x in amaxes])
    hist = jnp.concatenate([a[..., None], h[..., :-1]], axis=-1)
    scale = next_scales(hist, jnp.concatenate([x.reshape(-1, 3) for x in scales]), margin)
    new_h, new_s, at = [], [], 0
    for x in scales:
        rows = x.size // 3
        new_h.append(hist[at : at + rows].reshape(*x.shape, length))
        new_s.append(scale[at : at + rows].reshape(x.shape))
        at += rows
    return {"scale": treedef.unflatten(new_s), "amax_history": treedef.unflatten(new_h)}
