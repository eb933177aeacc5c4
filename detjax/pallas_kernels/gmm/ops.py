"""grouped_matmul(x, w, group_sizes): rows sorted by expert times their expert's weight, float32 out; the
backward is a gmm against the transposed weights (dx) and a tgmm (dw), all fixed-order Pallas kernels.

Two kernels, one rule: the Triton gmm / tgmm (gmm/kernel.py, every GPU and the CPU's interpreter) and, for
bf16 operands on Hopper, bf16 wgmma through the Mosaic GPU kernel on the padded group layout (gmm/mosaic.py,
`use_mosaic`; slower, so not the default: MOSAIC_BF16). Both reduce each output element in one ascending loop
into one float32 accumulator: over K (or N) for the forward and dx, and for dw over the group's own rows in
blocks aligned to its first row, the rows past its end zero."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.gmm.kernel import gmm, tgmm

# Whether "auto" takes the Mosaic path for bf16 experts. Off: it gives the Triton kernels' bytes, but took 0.82 ms
# against Triton's 0.51 for gpu_medium's expert product, forward and backward, on an H200 (16384 rows x 1024 x
# 1024 over 8 experts; `scripts/gemm_bench.py --grouped --breakdown 12`, docs/BENCHMARKS.md "GEMMs"): its
# kernels took 0.18 ms against Triton's 0.34, its layout copies 0.52. Not yet timed with _materialized below.
MOSAIC_BF16 = False


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
    """A padded-layout copy written once, before anything reads it: the products read it and dw reads its plain
    transpose, where XLA could otherwise fuse the row gather into that transpose (a gather whose writes are
    strided; the bf16 path's select-and-transpose fusions, docs/BENCHMARKS.md "GEMMs"). Data movement only: the
    bytes are the same either way."""
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
    """dx = dy w[e]^T per row tile (w as stored: N contiguous); dw[e] over the transposed copies of x and dy,
    each group's padded rows in ascending blocks."""
    from detjax.pallas_kernels.gmm import mosaic as gmosaic

    x_PK, w_EKN, lay = res
    dy_PN = _materialized(gmosaic.to_padded(dy_RN.astype(x_PK.dtype), lay))
    dx = gmosaic.grouped_nt(dy_PN, w_EKN, lay, out_dtype=x_PK.dtype, interpret=interpret_mode())
    dw = gmosaic.grouped_tnt(x_PK.T, dy_PN.T, lay, interpret=interpret_mode())
    return gmosaic.from_padded(dx, lay), dw.astype(w_EKN.dtype), None


grouped_matmul.defvjp(_fwd, _bwd)
