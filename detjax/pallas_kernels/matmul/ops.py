"""matmul(x, w): x @ w with the operands in x's dtype and float32 accumulation, through the pinned-tile
Pallas kernel forward and backward. w is the float32 master (cast to x's dtype at use), so the weight
gradient leaves the kernel in float32 without a low-precision rounding; dx has x's dtype.

`dense(spec, x, w)` is the einsum-shaped front end the model's projections use: it folds the contracted
trailing dims of x and the leading dims of w into one 2-D product; `dense_many` runs several projections
of one input as one product.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from detjax.pallas_kernels.backend import interpret_mode
from detjax.pallas_kernels.matmul.kernel import matmul_kernel


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x_MK: jax.Array, w_KN: jax.Array, out_dtype=None) -> jax.Array:
    out_dtype = out_dtype or x_MK.dtype
    return matmul_kernel(x_MK, w_KN.astype(x_MK.dtype), kind="fwd", out_dtype=out_dtype, interpret=interpret_mode())


def _fwd(x_MK, w_KN, out_dtype):
    return matmul(x_MK, w_KN, out_dtype), (x_MK, w_KN)


def _bwd(out_dtype, res, dy_MN):
    x_MK, w_KN = res
    dy = dy_MN.astype(x_MK.dtype)  # operands in the compute dtype, float32 accumulation (as in the forward)
    w = w_KN.astype(x_MK.dtype)
    dx = matmul_kernel(dy, w, kind="dx", out_dtype=x_MK.dtype, interpret=interpret_mode())
    dw = matmul_kernel(x_MK, dy, kind="dw", out_dtype=w_KN.dtype, interpret=interpret_mode())
    return dx, dw


matmul.defvjp(_fwd, _bwd)


# Fused weights are padded with zero columns to a whole number of the widest output tile (no effect on the
# other columns' bits: the kernel is column-invariant).
FUSED_COLUMN_MULTIPLE = 256


def _fold(spec: str) -> int:
    """Number of contracted dims of a '<free x><contracted>,<contracted><free w>-><free x><free w>' spec."""
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    c = len([ch for ch in xs if ch in ws])
    if xs[len(xs) - c :] != ws[:c] or out != xs[: len(xs) - c] + ws[c:]:
        raise ValueError(f"dense() needs '<free><contracted>,<contracted><free>->...' specs, got {spec!r}")
    return c


def dense(spec: str, x: jax.Array, w: jax.Array, dtype, out_dtype=None) -> jax.Array:
    """einsum(spec, x, w) for specs of the form '<free x><contracted>,<contracted><free w>-><free x><free w>'
    (every projection in the model), as one 2-D Pallas matmul in `dtype` with float32 accumulation."""
    return dense_many([spec], x, [w], dtype, out_dtype)[0]


def dense_many(
    specs: list[str], x: jax.Array, ws: list[jax.Array], dtype, out_dtype=None, product: Callable | None = None
) -> list[jax.Array]:
    """Several projections of one input as ONE matmul over the weights concatenated along N, split after.

    Bit-identical to separate products: an output column's reduction does not depend on the columns
    beside it (the kernel's batch invariance), so fusing changes speed only. `product(x2d, w_cat)` replaces
    the Pallas matmul (detjax.model.fp8: the fp8 product; no tile padding then)."""
    cs = {_fold(s) for s in specs}
    if len(cs) != 1:
        raise ValueError(f"dense_many() needs specs contracting the same dims of x, got {specs}")
    c = cs.pop()
    lead = x.shape[: x.ndim - c]
    k = math.prod(x.shape[x.ndim - c :])
    w2 = [w.reshape(k, -1) for w in ws]
    pad = -sum(w.shape[1] for w in w2) % FUSED_COLUMN_MULTIPLE if len(w2) > 1 and product is None else 0
    # zero columns inside the concatenation (a copy anyway) spare the kernel a padded copy of the activations
    w_cat = w2[0] if len(w2) == 1 else jnp.concatenate(w2 + [jnp.zeros((k, pad), w2[0].dtype)] * bool(pad), axis=1)
    x2d = x.astype(dtype).reshape(-1, k)
    y = matmul(x2d, w_cat, out_dtype or dtype) if product is None else product(x2d, w_cat)
    outs, start = [], 0
    for w, w2d in zip(ws, w2, strict=True):
        outs.append(y[:, start : start + w2d.shape[1]].reshape(*lead, *w.shape[c:]))
        start += w2d.shape[1]
    return outs
