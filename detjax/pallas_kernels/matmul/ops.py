"""matmul(x, w): x @ w with the operands in x's dtype and float32 accumulation, through the pinned-tile
Pallas kernel forward and backward. w is the float32 master (cast to x's dtype at use), so the weight
gradient leaves the kernel in float32 without a low-precision rounding; dx has x's dtype.

`dense(spec, x, w)` is the einsum-shaped front end the model's projections use: it folds the contracted
trailing dims of x and the leading dims of w into one 2-D product; `dense_many` runs several projections
of one input as one product. Both take an optional compute copy of the weights (`compute_copy`: cast and
fused once per step by the trainer) instead of casting and concatenating the masters at every use.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.matmul.kernel import matmul_kernel


def matmul(
    x_MK: jax.Array,
    w_KN: jax.Array,
    out_dtype=None,
    w_c_KN: jax.Array | None = None,
    acc_KN: jax.Array | None = None,
) -> jax.Array:
    """x @ w in x's dtype with float32 accumulation; the weight gradient in w's dtype (the float32 master).

    `w_c_KN`: w already in x's dtype (a compute copy the trainer makes once per step, outside the microbatch
    loop: detjax.step.Trainer.compute_copies). The products then read it and never w's values; w only receives
    the gradient. Without it w is cast here, in the forward and again in the backward. The same cast either
    way, so the same bits.

    `acc_KN` (with w_c_KN; float32, w's shape): the gradient accumulation fusion. The weight gradient is then
    not w's: w gets none, and the cotangent of acc_KN is acc_KN + the weight gradient, added by the dw
    kernel (matmul_kernel's `acc`). detjax.step differentiates with respect to the microbatch loop's running
    sum passed here, so the gradient it gets back is the new running sum: the bits of adding the microbatch's
    gradient to it, without a pass of its own. acc_KN must reach one product only."""
    out_dtype = jnp.dtype(out_dtype or x_MK.dtype)
    if w_c_KN is None:
        if acc_KN is not None:
            raise ValueError("matmul: acc_KN needs the compute copy w_c_KN")
        return _matmul_cast(x_MK, w_KN, out_dtype)
    if w_c_KN.shape != w_KN.shape or w_c_KN.dtype != x_MK.dtype:
        raise ValueError(f"compute copy {w_c_KN.shape} {w_c_KN.dtype} does not match w {w_KN.shape} in {x_MK.dtype}")
    if acc_KN is not None:
        if acc_KN.shape != w_KN.shape or acc_KN.dtype != jnp.float32:
            raise ValueError(f"accumulator {acc_KN.shape} {acc_KN.dtype} does not match w {w_KN.shape} in float32")
        return _matmul_acc(x_MK, w_c_KN, acc_KN, out_dtype)
    return _matmul_copy(x_MK, w_KN, w_c_KN, out_dtype, jnp.dtype(w_KN.dtype))


def _products(x_MK, w, dy_MN, w_dtype):
    """dx, dw from the compute-dtype weight `w`: operands in the compute dtype, float32 accumulation."""
    dy = dy_MN.astype(x_MK.dtype)
    dx = matmul_kernel(dy, w, kind="dx", out_dtype=x_MK.dtype, interpret=interpret_mode())
    dw = matmul_kernel(x_MK, dy, kind="dw", out_dtype=w_dtype, interpret=interpret_mode())
    return dx, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_cast(x_MK: jax.Array, w_KN: jax.Array, out_dtype) -> jax.Array:
    return matmul_kernel(x_MK, w_KN.astype(x_MK.dtype), kind="fwd", out_dtype=out_dtype, interpret=interpret_mode())


def _cast_fwd(x_MK, w_KN, out_dtype):
    return _matmul_cast(x_MK, w_KN, out_dtype), (x_MK, w_KN)


def _cast_bwd(out_dtype, res, dy_MN):
    x_MK, w_KN = res
    return _products(x_MK, w_KN.astype(x_MK.dtype), dy_MN, w_KN.dtype)


_matmul_cast.defvjp(_cast_fwd, _cast_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul_copy(x_MK: jax.Array, w_KN: jax.Array, w_c_KN: jax.Array, out_dtype, w_dtype) -> jax.Array:
    return matmul_kernel(x_MK, w_c_KN, kind="fwd", out_dtype=out_dtype, interpret=interpret_mode())


def _copy_fwd(x_MK, w_KN, w_c_KN, out_dtype, w_dtype):
    # the residuals are the compute-dtype operands: w's values are never read (XLA drops what made them)
    return _matmul_copy(x_MK, w_KN, w_c_KN, out_dtype, w_dtype), (x_MK, w_c_KN)


def _copy_bwd(out_dtype, w_dtype, res, dy_MN):
    x_MK, w_c_KN = res
    dx, dw = _products(x_MK, w_c_KN, dy_MN, w_dtype)
    return dx, dw, None  # the copy is a constant of the step: no gradient flows into it


_matmul_copy.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul_acc(x_MK: jax.Array, w_c_KN: jax.Array, acc_KN: jax.Array, out_dtype) -> jax.Array:
    return matmul_kernel(x_MK, w_c_KN, kind="fwd", out_dtype=out_dtype, interpret=interpret_mode())


def _acc_fwd(x_MK, w_c_KN, acc_KN, out_dtype):
    return _matmul_acc(x_MK, w_c_KN, acc_KN, out_dtype), (x_MK, w_c_KN, acc_KN)


def _acc_bwd(out_dtype, res, dy_MN):
    x_MK, w_c_KN, acc_KN = res
    dy = dy_MN.astype(x_MK.dtype)
    dx = matmul_kernel(dy, w_c_KN, kind="dx", out_dtype=x_MK.dtype, interpret=interpret_mode())
    acc = matmul_kernel(x_MK, dy, kind="dw", out_dtype=jnp.float32, interpret=interpret_mode(), acc=acc_KN)
    return dx, None, acc  # the copy is a constant of the step; the running sum's cotangent is the new sum


_matmul_acc.defvjp(_acc_fwd, _acc_bwd)


# Fused weights are padded with zero columns to a whole number of the widest output tile (no effect on the
# other columns' bits: the kernel is column-invariant).
FUSED_COLUMN_MULTIPLE = 256


def contracted_dims(spec: str) -> int:
    """Number of contracted dims of a '<free x><contracted>,<contracted><free w>-><free x><free w>' spec."""
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    c = len([ch for ch in xs if ch in ws])
    if xs[len(xs) - c :] != ws[:c] or out != xs[: len(xs) - c] + ws[c:]:
        raise ValueError(f"dense() needs '<free><contracted>,<contracted><free>->...' specs, got {spec!r}")
    return c


def fuse(ws_KN: list[jax.Array], padded: bool = True) -> jax.Array:
    """The 2-D weights side by side along N (one weight: itself), with `padded` zero columns up to a whole
    multiple of FUSED_COLUMN_MULTIPLE."""
    if len(ws_KN) == 1:
        return ws_KN[0]
    k = ws_KN[0].shape[0]
    pad = -sum(w.shape[1] for w in ws_KN) % FUSED_COLUMN_MULTIPLE if padded else 0
    # zero columns inside the concatenation (a copy anyway) spare the kernel a padded copy of the activations
    return jnp.concatenate(ws_KN + [jnp.zeros((k, pad), ws_KN[0].dtype)] * bool(pad), axis=1)


def compute_copy(ws: list[jax.Array], contracted: int, dtype) -> jax.Array:
    """What dense_many's product reads for weights `ws` whose first `contracted` dims are contracted: the
    weights as 2-D, cast to `dtype` and fused (detjax.step.Trainer.compute_copies makes these once per step)."""
    k = math.prod(ws[0].shape[:contracted])
    return fuse([w.reshape(k, -1).astype(dtype) for w in ws])


def dense(
    spec: str,
    x: jax.Array,
    w: jax.Array,
    dtype,
    out_dtype=None,
    w_c: jax.Array | None = None,
    acc: jax.Array | None = None,
) -> jax.Array:
    """einsum(spec, x, w) for specs of the form '<free x><contracted>,<contracted><free w>-><free x><free w>'
    (every projection in the model), as one 2-D Pallas matmul in `dtype` with float32 accumulation. `w_c`:
    compute_copy([w], ...), made beforehand (else w is cast at use); `acc`: as dense_many's."""
    return dense_many([spec], x, [w], dtype, out_dtype, w_cat_c=w_c, acc=acc)[0]


def dense_many(
    specs: list[str],
    x: jax.Array,
    ws: list[jax.Array],
    dtype,
    out_dtype=None,
    product: Callable | None = None,
    w_cat_c: jax.Array | None = None,
    split: Callable | None = None,
    acc: jax.Array | None = None,
) -> list[jax.Array]:
    """Several projections of one input as ONE matmul over the weights concatenated along N, split after.

    Bit-identical to separate products: an output column's reduction does not depend on the columns
    beside it (the kernel's batch invariance), so fusing changes speed only. `product(x2d, w_cat)` replaces
    the Pallas matmul (detjax.model.fp8: the fp8 product; no tile padding then). `w_cat_c`: compute_copy of
    ws, made beforehand; the product reads it, and the float32 concatenation only carries the gradient back
    to the masters (nothing computes it in the forward). `split(y)`: the outputs from the product's result
    instead of its column blocks reshaped (the attention block's q, k, v with RoPE: detjax.model.layers.proj_many).
    `acc` (with w_cat_c): the running gradient sum of the fused weights, shaped like w_cat_c in float32
    (matmul's acc_KN); the weights in `ws` then get no gradient from this product."""
    cs = {contracted_dims(s) for s in specs}
    if len(cs) != 1:
        raise ValueError(f"dense_many() needs specs contracting the same dims of x, got {specs}")
    c = cs.pop()
    lead = x.shape[: x.ndim - c]
    k = math.prod(x.shape[x.ndim - c :])
    w2 = [w.reshape(k, -1) for w in ws]
    w_cat = fuse(w2, padded=product is None)
    x2d = x.astype(dtype).reshape(-1, k)
    if acc is not None and product is not None:
        raise ValueError("dense_many: acc is for the Pallas matmul, not a replacement product")
    y = matmul(x2d, w_cat, out_dtype or dtype, w_cat_c, acc) if product is None else product(x2d, w_cat)
    if split is not None:
        return list(split(y))
    outs, start = [], 0
    for w, w2d in zip(ws, w2, strict=True):
        outs.append(y[:, start : start + w2d.shape[1]].reshape(*lead, *w.shape[c:]))
        start += w2d.shape[1]
    return outs
