"""grouped_matmul(x, w, group_sizes): rows sorted by expert times their expert's weight, float32 out; the
backward is a gmm against the transposed weights (dx) and a tgmm (dw), all fixed-order Pallas kernels.

Two kernels, one rule: the Triton gmm / tgmm (gmm/kernel.py, every GPU and the CPU's interpreter) and, for
bf16 operands on Hopper, bf16 wgmma through the Mosaic GPU kernel on the padded group layout (gmm/mosaic.py,
`use_mosaic`, where MOSAIC_BF16 is on: the default). Both reduce each output element in one ascending loop
into one float32 accumulator: over K (or N) for the forward and dx, and for dw over the group's own rows in
blocks aligned to its first row, the rows past its end zero. grouped_swiglu_padded runs the experts' whole
SwiGLU on the Mosaic path with the rows kept in the padded layout between the three products."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.gmm.kernel import gmm, tgmm

# Whether "auto" takes the Mosaic path for bf16 experts (and dispatch.expert_ffn their whole SwiGLU on the padded
# layout, grouped_swiglu_padded). Both paths give the same bytes. On since 2026-12-06: with the padded layout's
# lookups as compare-and-count and dw read as stored (DW_AS_STORED), the whole SwiGLU took 1.173 ms against
# Triton's 1.346 on an H100 (`scripts/gemm_bench.py --swiglu`), and the gpu_medium step 130.19 against 134.78 ms
# pipelined, ending on the same parameter digest (docs/BENCHMARKS.md, "The experts on the Mosaic path").
MOSAIC_BF16 = True
# Whether grouped_swiglu_padded's down product writes its caller's out_dtype (the compute dtype, where the MoE
# block casts the experts' output to it next) from the kernel, so the rows copied out of the padded layout, and
# their cotangents copied in, are bf16 instead of float32: the same bytes (the kernel rounds its float32 sums to
# the nearest even bf16, as XLA's cast does), half the bytes moved. With dispatch.COMPOSED_GATHERS, the gpu_medium
# step 1.4 % faster pipelined on an H100, on the same parameter digest (docs/BENCHMARKS.md, "The experts' row
# copies and weight-gradient sums").
DOWN_WRITES_OUT_DTYPE = True
# Whether the experts' gate and up products under model.kernels=pallas (bf16, no fp8) are rounded to the compute
# dtype before the SwiGLU, as the dense MLP's products are (its proj returns the compute dtype): on the padded
# layout the two products' kernels write bf16, so the SwiGLU reads, and its backward reads, two bf16 (P, F) arrays
# instead of two float32 ones, and the sums are stored for the backward in half the bytes. dispatch's Triton path
# rounds the float32 sums the same way (the padded layout's bytes under the interpreter). XLA's ragged_dot
# (model.kernels=reference) keeps the float32 sums.
# Off: not yet timed on a GPU (docs/BENCHMARKS.md, "Where gpu_medium's step goes at `3bad40e`").
GATE_UP_IN_DTYPE = False
# Whether the Mosaic path's bf16 dw reads x and dy as stored (gmm/mosaic.py grouped_dw, a transposed
# shared-memory view) instead of from transposed copies (grouped_tnt): the same reduction order, two fewer
# passes over the rows a product.
DW_AS_STORED = True


def use_mosaic(x_dtype, w_dtype, k: int, n: int) -> bool:
    """Whether the Mosaic GPU kernel can take the experts' bf16 products of an (E, k, n) weight stack: bf16
    operands on a Hopper GPU, compiled (not the interpreter) and whole tiles (gmm/mosaic.py `usable`). A
    function of dtypes, shapes and the device, never of a measurement."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic
    from detjax.pallas_kernels.matmul import mosaic

    bf16 = jnp.dtype(x_dtype) == jnp.dtype(w_dtype) == jnp.bfloat16
    return bf16 and not interpret_mode() and gmosaic.usable(k, n) and mosaic.available()


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x_RK: jax.Array, w_EKN: jax.Array, group_sizes_E: jax.Array, impl: str = "auto") -> jax.Array:
    """`impl`: "auto" (the Mosaic kernel where MOSAIC_BF16 is on and use_mosaic says so, else Triton),
    "triton" or "mosaic" (forced; off the GPU under its interpreter: the tests)."""
    return _fwd(x_RK, w_EKN, group_sizes_E, impl)[0]


def grouped_compute_copy(w_EKN: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """What the grouped products read of a float32 expert stack w (E, K, N) in the compute dtype: (w, w with K
    and N swapped), cast. The trainer makes it once per step (Trainer.compute_copies); without it each
    microbatch casts the stack for the forward and casts and transposes it again for the backward."""
    w_c = w_EKN.astype(dtype)
    return w_c, jnp.swapaxes(w_c, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def grouped_matmul_copy(x_RK, w_EKN, group_sizes_E, w_c: tuple, impl: str = "auto") -> jax.Array:
    """grouped_matmul(x, w.astype(x.dtype), group_sizes, impl) reading w_c = grouped_compute_copy(w, x.dtype),
    made beforehand: w's values are not read, w only receives dw, rounded to the compute dtype first as the
    cast at use rounds it. The same bytes, so the same bits."""
    _check_copy(x_RK, w_EKN, w_c)
    return _fwd(x_RK, w_c[0], group_sizes_E, impl, w_c[1])[0]


def _check_copy(x_RK, w_EKN, w_c) -> None:
    if len(w_c) != 2 or w_c[0].shape != w_EKN.shape or w_c[0].dtype != x_RK.dtype:
        raise ValueError(
            f"expert weight copy does not fit w {w_EKN.shape} in {x_RK.dtype} (gmm.ops.grouped_compute_copy)"
        )


def _copy_fwd(x_RK, w_EKN, group_sizes_E, w_c, impl):
    _check_copy(x_RK, w_EKN, w_c)
    y, res = _fwd(x_RK, w_c[0], group_sizes_E, impl, w_c[1])
    return y, (res, jnp.zeros((0,), w_EKN.dtype))  # w's dtype, for dw (no data)


def _copy_bwd(impl, res, dy_RN):
    res, w_dtype = res
    dx, dw, _ = _bwd(impl, res, dy_RN)
    return dx, dw.astype(w_dtype.dtype), None, None  # the copy is a constant of the step: no gradient into it


grouped_matmul_copy.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def grouped_matmul_acc(x_RK, acc_EKN, group_sizes_E, w_c: tuple, impl: str = "auto") -> jax.Array:
    """grouped_matmul_copy for the gradient accumulation fusion (detjax.step): the same product, but the weight
    gradient goes to acc_EKN, the microbatch loop's float32 running sum of it, whose cotangent is the new sum,
    acc + dw rounded to the compute dtype (the bits of the separate sum of grouped_matmul_copy's gradient).
    The Triton path adds it here; the padded layout's Mosaic dw adds it in its epilogue (_padded_product_acc)."""
    _check_copy(x_RK, acc_EKN, w_c)
    return _fwd(x_RK, w_c[0], group_sizes_E, impl, w_c[1])[0]


def _gacc_fwd(x_RK, acc_EKN, group_sizes_E, w_c, impl):
    _check_copy(x_RK, acc_EKN, w_c)
    y, res = _fwd(x_RK, w_c[0], group_sizes_E, impl, w_c[1])
    return y, (res, acc_EKN)


def _gacc_bwd(impl, res, dy_RN):
    res, acc = res
    dx, dw, _ = _bwd(impl, res, dy_RN)
    return dx, acc + dw.astype(res[1].dtype).astype(acc.dtype), None, None


grouped_matmul_acc.defvjp(_gacc_fwd, _gacc_bwd)


def _mosaic(x_RK, w_EKN, impl: str) -> bool:
    if impl == "auto":
        return MOSAIC_BF16 and use_mosaic(x_RK.dtype, w_EKN.dtype, *w_EKN.shape[1:])
    if impl not in ("triton", "mosaic"):
        raise ValueError(f"grouped_matmul impl {impl!r}: use auto, triton or mosaic")
    return impl == "mosaic"


def _fwd(x_RK, w_EKN, group_sizes_E, impl, w_ENK=None):
    """`w_ENK`: w with K and N swapped, where the caller has it (a compute copy); else made where needed."""
    if _mosaic(x_RK, w_EKN, impl):
        return _fwd_mosaic(x_RK, w_EKN, group_sizes_E, w_ENK)
    y = gmm(x_RK, w_EKN, group_sizes_E, out_dtype=jnp.float32, interpret=interpret_mode())
    return y, (x_RK, w_EKN, group_sizes_E, w_ENK)


def _bwd(impl, res, dy_RN):
    if _mosaic(res[0], res[1], impl):  # the residuals keep x's dtype and w
        return _bwd_mosaic(res, dy_RN)
    x_RK, w_EKN, gs_E, w_ENK = res
    dy = dy_RN.astype(x_RK.dtype)  # low-precision operands, float32 accumulation (as in the forward)
    w_ENK = jnp.swapaxes(w_EKN, 1, 2) if w_ENK is None else w_ENK
    dx = gmm(dy, w_ENK, gs_E, out_dtype=x_RK.dtype, interpret=interpret_mode())
    dw = tgmm(x_RK, dy, gs_E, out_dtype=w_EKN.dtype, interpret=interpret_mode())
    return dx, dw, None


def _materialized(v_PK: jax.Array) -> jax.Array:
    """An array written once, before anything reads it (XLA fuses nothing across it). For a padded-layout copy:
    the products read it and dw reads its plain transpose, where XLA could otherwise fuse the row gather into
    that transpose (a gather whose writes are strided; the bf16 path's select-and-transpose fusions,
    docs/BENCHMARKS.md "GEMMs")."""
    return jax.lax.optimization_barrier(v_PK)


def _fwd_mosaic(x_RK, w_EKN, gs_E, w_ENK=None):
    """The rows copied into the padded group layout, each row tile times its expert's w^T copy (K contiguous,
    as the "nt" product reads it), the rows copied back out."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic
    from detjax.pallas_kernels.matmul import mosaic

    lay = gmosaic.padded_layout(gs_E, x_RK.shape[0], mosaic.block_r(x_RK.dtype))
    x_PK = _materialized(gmosaic.to_padded(x_RK, lay))
    w_ENK = jnp.swapaxes(w_EKN, 1, 2) if w_ENK is None else w_ENK
    y = gmosaic.grouped_nt(x_PK, w_ENK, lay, out_dtype=jnp.float32, interpret=interpret_mode())
    return gmosaic.from_padded(y, lay), (x_PK, w_EKN, lay)


def _bwd_mosaic(res, dy_RN):
    """dy rounded to x's dtype and written once (_materialized), copied into the padded layout, its products
    there (_padded_grads), dx copied back out. Written once so that the math that made dy (the SwiGLU's
    backward) is not fused into the row gather, as grouped_swiglu_padded (which computes it on the padded rows)
    does not fuse it: with that fusion, XLA's CPU backend of jax 0.12.0.1 gave one element of dw_gate one bf16
    ulp apart from grouped_swiglu_padded's."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    x_PK, w_EKN, lay = res
    dx, dw = _padded_grads(x_PK, w_EKN, gmosaic.to_padded(_materialized(dy_RN.astype(x_PK.dtype)), lay), lay)
    return gmosaic.from_padded(dx, lay), dw.astype(w_EKN.dtype), None


def _padded_grads(x_PK, w_EKN, dy_PN, lay, acc=None) -> tuple[jax.Array, jax.Array]:
    """(dx, float32 dw) of x @ w[expert] on the padded layout: dx = dy w[e]^T per row tile (w as stored, N
    contiguous), dw[e] from x and dy as stored (DW_AS_STORED, where grouped_dw takes the shape) or from their
    transposed copies, each group's padded rows in ascending blocks either way.
    dy is rounded to x's dtype and written once before either product reads it (_materialized).
    `acc` (float32, w's shape): return acc + dw rounded to x's dtype in place of dw (grouped_dw adds it in
    its epilogue)."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    dy_PN = _materialized(dy_PN.astype(x_PK.dtype))
    dx = gmosaic.grouped_nt(dy_PN, w_EKN, lay, out_dtype=x_PK.dtype, interpret=interpret_mode())
    if DW_AS_STORED and gmosaic.dw_usable(x_PK.shape[1], dy_PN.shape[1], x_PK.dtype):
        return dx, gmosaic.grouped_dw(x_PK, dy_PN, lay, interpret=interpret_mode(), acc=acc)
    dw = gmosaic.grouped_tnt(x_PK.T, dy_PN.T, lay, interpret=interpret_mode())
    return dx, dw if acc is None else acc + dw.astype(x_PK.dtype).astype(acc.dtype)


grouped_matmul.defvjp(_fwd, _bwd)


# ------------------------------------------------------------------ the experts' SwiGLU on the padded layout
def swiglu_on_padded_layout(dtype, d: int, f: int) -> bool:
    """Whether the experts' SwiGLU (d_model d, expert width f) runs as grouped_swiglu_padded: where "auto"
    takes the Mosaic path for all three products (MOSAIC_BF16 and use_mosaic of (d, f) and (f, d))."""
    return MOSAIC_BF16 and use_mosaic(dtype, dtype, d, f) and use_mosaic(dtype, dtype, f, d)


def grouped_swiglu_padded(
    xs_RD,
    gs_E,
    weights: tuple,
    dtype,
    copies: tuple | None = None,
    out_dtype=jnp.float32,
    accs: tuple | None = None,
    rows: tuple | None = None,
) -> jax.Array:
    """silu(x w_gate[e]) * (x w_up[e]), times w_down[e], per expert over rows sorted by expert (group sizes
    gs_E), (R, D) in out_dtype (the float32 sums rounded once; the down product's kernel writes out_dtype where
    DOWN_WRITES_OUT_DTYPE): the three products on the Mosaic kernel with the rows kept in the padded group
    layout from the first product to the last. The rows are copied in once and out once (and their
    cotangents once each way), where three grouped_matmul calls copy in and out around every product.

    The same bytes as three grouped_matmul(..., impl="mosaic") calls around the same SwiGLU, so the Triton
    gmm / tgmm's (tests): the products see the same rows, the padding rows are zeros (silu(0) * 0 = 0, and
    their cotangents are zeros), the two cotangents of x are added on the padded rows as they were on the
    sorted ones, and each dw reaches its weight rounded to the compute dtype. `weights`: the (gate, up, down)
    stacks (E, D, F), (E, D, F), (E, F, D) as stored; `copies`: their grouped_compute_copy made once per
    step, or None (cast here). `accs` (with copies): the gradient accumulation fusion's float32 running sums
    of the three stacks, which then receive the weight gradients (_padded_product_acc) and the stacks none.
    `rows` (order_R, inv_R): xs_RD is not yet sorted by expert (sorted row i is xs_RD[order_R[i]]; inv_R the
    inverse), and the result comes back in xs_RD's order: the sort is composed with the copies into and out of
    the padded layout, one row gather each way instead of two (data movement only: the same bytes)."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic
    from detjax.pallas_kernels.matmul import mosaic

    lay = gmosaic.padded_layout(gs_E, xs_RD.shape[0], mosaic.block_r(dtype))
    if rows is not None:  # the padded rows read and write the unsorted rows directly
        order_R, inv_R = rows
        lay = lay._replace(pos_R=lay.pos_R[inv_R], src_P=order_R[lay.src_P])
    if accs is not None and copies is None:
        raise ValueError("grouped_swiglu_padded: running sums (accs) need the step's weight copies")
    cs = copies if copies is not None else tuple(grouped_compute_copy(w, dtype) for w in weights)

    def product(i, x_PK, out=jnp.float32):
        if accs is not None:
            return _padded_product_acc(x_PK, accs[i], *cs[i], lay, out)
        return _padded_product(x_PK, weights[i], *cs[i], lay, out)

    x_PD = _padded_in(xs_RD.astype(dtype), lay)
    gate_up = dtype if GATE_UP_IN_DTYPE else jnp.float32
    g_PF, u_PF = (product(i, x_PD, gate_up).astype(jnp.float32) for i in (0, 1))
    h_PF = (jax.nn.silu(g_PF) * u_PF).astype(dtype)
    y_PD = product(2, h_PF, out_dtype if DOWN_WRITES_OUT_DTYPE else jnp.float32)
    return _padded_out(y_PD, lay).astype(out_dtype)


@jax.custom_vjp
def _padded_in(x_RK: jax.Array, lay) -> jax.Array:
    """Sorted rows into the padded layout (gmm/mosaic.py to_padded); the cotangent goes back by the inverse
    row gather (from_padded): each sorted row has one padded row, the padding rows come from no row."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    return _materialized(gmosaic.to_padded(x_RK, lay))


def _padded_in_fwd(x_RK, lay):
    return _padded_in(x_RK, lay), lay


def _padded_in_bwd(lay, ct_PK):
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    return gmosaic.from_padded(ct_PK, lay), None


_padded_in.defvjp(_padded_in_fwd, _padded_in_bwd)


@jax.custom_vjp
def _padded_out(y_PN: jax.Array, lay) -> jax.Array:
    """The padded rows that hold sorted rows, in sorted order (from_padded); the cotangent goes back into the
    padded layout (to_padded: zeros on the padding rows)."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    return gmosaic.from_padded(y_PN, lay)


def _padded_out_fwd(y_PN, lay):
    return _padded_out(y_PN, lay), lay


def _padded_out_bwd(lay, ct_RN):
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    return _materialized(gmosaic.to_padded(ct_RN, lay)), None


_padded_out.defvjp(_padded_out_fwd, _padded_out_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _padded_product(x_PK, w_EKN, w_c_EKN, w_c_ENK, lay, out_dtype=jnp.float32) -> jax.Array:
    """x @ w[expert] per padded row tile, (P, N) float32 sums written in out_dtype, reading the compute copy w_c
    (and w_c with K and N swapped, for the forward); w (the stored stack) only receives dw, rounded to the
    copy's dtype first."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    return gmosaic.grouped_nt(x_PK, w_c_ENK, lay, out_dtype=out_dtype, interpret=interpret_mode())


def _padded_product_fwd(x_PK, w_EKN, w_c_EKN, w_c_ENK, lay, out_dtype):
    like = jnp.zeros((0,), w_EKN.dtype)  # the stored stack's dtype, for dw (no data)
    return _padded_product(x_PK, w_EKN, w_c_EKN, w_c_ENK, lay, out_dtype), (x_PK, w_c_EKN, lay, like)


def _padded_product_bwd(out_dtype, res, dy_PN):
    x_PK, w_c_EKN, lay, like = res
    dx, dw = _padded_grads(x_PK, w_c_EKN, dy_PN, lay)
    return dx, dw.astype(w_c_EKN.dtype).astype(like.dtype), None, None, None


_padded_product.defvjp(_padded_product_fwd, _padded_product_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _padded_product_acc(x_PK, acc_EKN, w_c_EKN, w_c_ENK, lay, out_dtype=jnp.float32) -> jax.Array:
    """_padded_product whose weight gradient goes to the running sum acc (float32, the stack's shape): its
    cotangent is acc + dw rounded to the copy's dtype, added in grouped_dw's epilogue where it takes the
    shape (else here): the bits of _padded_product's gradient added to acc apart."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    return gmosaic.grouped_nt(x_PK, w_c_ENK, lay, out_dtype=out_dtype, interpret=interpret_mode())


def _padded_acc_fwd(x_PK, acc_EKN, w_c_EKN, w_c_ENK, lay, out_dtype):
    return _padded_product_acc(x_PK, acc_EKN, w_c_EKN, w_c_ENK, lay, out_dtype), (x_PK, w_c_EKN, lay, acc_EKN)


def _padded_acc_bwd(out_dtype, res, dy_PN):
    x_PK, w_c_EKN, lay, acc = res
    return *_padded_grads(x_PK, w_c_EKN, dy_PN, lay, acc), None, None, None


_padded_product_acc.defvjp(_padded_acc_fwd, _padded_acc_bwd)
