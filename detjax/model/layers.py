"""Small shared pieces: parameter helpers, RMSNorm, projections and the scatter-free gathers."""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from detjax.model.fp8 import (
    fp8_dense_many,
    fp8_swiglu_mlp,
    fused_swiglu,
    grouped_weight_copy,
    scale_var,
    weight_copy,
)
from detjax.pallas_kernels.gmm.ops import grouped_compute_copy
from detjax.pallas_kernels.matmul.ops import compute_copy, dense, dense_many, fuse
from detjax.pallas_kernels.ordered import pinned_normalize, pinned_softmax, tree_sum_last  # noqa: F401 (the model's names)
from detjax.pallas_kernels.rmsnorm.kernel import fits as rmsnorm_fits
from detjax.pallas_kernels.rmsnorm.ops import rmsnorm, rmsnorm_stream
from detjax.pallas_kernels.rope.ops import split_rope
from detjax.pallas_kernels.segment_sum.ops import segment_sum
from detjax.sharding import rules as ax
from detjax.sharding import tensor as tp_ops
from detjax.sharding.rules import constrain
from detjax.sharding.tensor import TensorSplit

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def normal_init(std: float) -> nn.initializers.Initializer:
    return nn.initializers.normal(stddev=std)


def param(
    module: nn.Module,
    name: str,
    init: nn.initializers.Initializer,
    shape: tuple[int, ...],
    axes: tuple,
    tp: TensorSplit | None = None,
):
    """An fp32 master parameter whose dimensions carry logical axis names (the sharding words). `tp`: the
    model runs as one device of canonical tensor parallelism, holding its share of every dimension that
    tensor parallelism splits (rules.TENSOR_PARAM_AXES)."""
    assert len(axes) == len(shape), (name, shape, axes)
    if tp is not None:
        shape = tuple(tp.local_size(s) if a in ax.TENSOR_PARAM_AXES else s for s, a in zip(shape, axes, strict=True))
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


# The weights the trainer casts (and fuses) once per step, outside the microbatch loop, into the model's
# "compute" collection (detjax.step.Trainer.compute_copies): under each module's path, the key joins the
# parameter names in the order the module multiplies them; the value gives how many leading dims the product
# contracts and the first weight's rank (which tells the MLP's 2-D gate/up from the MoE's stacked experts). A
# projection called with copy=(module, names) reads its copy from there when the trainer made one
# (model.kernels=pallas); a module that has copies but not the one named is an error. With model.fp8 the
# groups of FP8_SCALES are copied as the fp8 product reads them (detjax.model.fp8.weight_copy, quantized with
# the module's scale set of that name), the routed experts' stacks likewise (fp8.grouped_weight_copy, under
# their own names), the others (the LM head unless model.fp8.lm_head) in the compute dtype.
COMPUTE_COPIES: dict[tuple[str, ...], tuple[int, int]] = {
    ("w_q", "w_k", "w_v"): (1, 3),
    ("w_o",): (2, 3),
    ("w_gate", "w_up"): (1, 2),  # the MLP's (MoE's stacked experts, 3-D, take the gmm)
    ("w_down",): (1, 2),
    ("w_in_z", "w_in_x", "w_in_bc", "w_in_dt"): (1, 3),
    ("w_out",): (2, 3),
    ("w_head",): (1, 2),
}


FP8_SCALES: dict[tuple[str, ...], str] = {
    ("w_q", "w_k", "w_v"): "qkv",
    ("w_o",): "o",
    ("w_gate", "w_up"): "gate_up",
    ("w_down",): "down",
    ("w_in_z", "w_in_x", "w_in_bc", "w_in_dt"): "in_proj",
    ("w_out",): "out_proj",
    ("w_head",): "head",  # with model.fp8.lm_head
}


def copy_key(names: tuple[str, ...]) -> str:
    return "+".join(names)


def module_copies(tree: dict, dtype, fp8_scales: dict | None = None, experts: bool = True) -> dict:
    """The compute copies of one module's parameter dict (COMPUTE_COPIES), {copy_key: weight}. fp8_scales:
    the module's fp8 scale sets (model.fp8 on): FP8_SCALES groups become fp8 weight copies. The routed
    experts' stacks (3-D w_gate, w_up, w_down), where `experts` says the experts run on this device's whole
    stacks (no expert dispatch, which reads the weights itself): fp8.grouped_weight_copy with fp8 scales,
    else gmm.ops.grouped_compute_copy, under their own names."""
    out = {}
    for names, (contracted, ndim) in COMPUTE_COPIES.items():
        ws = [tree.get(n) for n in names]
        if not (all(isinstance(w, jax.Array) and w.dtype == jnp.float32 for w in ws) and ws[0].ndim == ndim):
            continue
        if fp8_scales is not None and FP8_SCALES.get(names) in fp8_scales:  # fused as fp8_dense_many fuses them
            k = math.prod(ws[0].shape[:contracted])
            fused = fuse([w.reshape(k, -1) for w in ws], padded=False)  # side by side, no padding
            out[copy_key(names)] = weight_copy(fused, fp8_scales[FP8_SCALES[names]], "pallas")
        else:
            out[copy_key(names)] = compute_copy(ws, contracted, dtype)
    names = ("w_gate", "w_up", "w_down")
    stacks = [tree.get(n) for n in names]
    if not all(isinstance(w, jax.Array) and w.ndim == 3 and w.dtype == jnp.float32 for w in stacks):
        return out
    for n, w in zip(names, stacks, strict=True):  # the routed experts' stacks
        if fp8_scales is not None:
            out[n] = grouped_weight_copy(w, fp8_scales[n[2:]], "pallas")
        elif experts:
            out[n] = grouped_compute_copy(w, dtype)
    return out


# Whether the routed experts' stacks join the gradient accumulation fusion (module_accumulators' `experts`):
# their grouped products' dw then add to the running sums (on the padded layout's Mosaic path, in grouped_dw's
# epilogue), with the bits of the separate sums. On: the gpu_medium step 0.6 % faster pipelined (1.1 % synced) on
# an H100, on the same parameter digest (docs/BENCHMARKS.md, "The experts' row copies and weight-gradient sums").
EXPERT_ACCUMULATORS = True
EXPERT_STACKS = ("w_gate", "w_up", "w_down")


def module_accumulators(tree: dict, exclude: tuple[tuple[str, ...], ...] = (), experts: bool = False) -> dict:
    """The gradient accumulation fusion's running sums of one module's parameter dict, {copy_key: zeros}:
    one float32 array shaped like each of module_copies' 2-D compute copies (the fused, padded layout the
    products' weight gradient has), except the COMPUTE_COPIES groups named in `exclude`; with `experts` (the
    routed experts on the Pallas grouped products, EXPERT_ACCUMULATORS on) one shaped like each 3-D float32
    expert stack (EXPERT_STACKS)."""
    out = {}
    stacks = [tree.get(n) for n in EXPERT_STACKS]
    if (
        experts
        and EXPERT_ACCUMULATORS
        and all(isinstance(w, jax.Array) and w.ndim == 3 and w.dtype == jnp.float32 for w in stacks)
    ):
        out.update({n: jnp.zeros(w.shape, jnp.float32) for n, w in zip(EXPERT_STACKS, stacks, strict=True)})
    for names, (contracted, ndim) in COMPUTE_COPIES.items():
        ws = [tree.get(n) for n in names]
        if names in exclude or not (
            all(isinstance(w, jax.Array) and w.dtype == jnp.float32 for w in ws) and ws[0].ndim == ndim
        ):
            continue
        shape = jax.eval_shape(lambda ws=ws, c=contracted: compute_copy(ws, c, jnp.float32))
        out[copy_key(names)] = jnp.zeros(shape.shape, jnp.float32)
    return out


def accumulated_grads(tree: dict, sums: dict) -> dict:
    """{parameter name: gradient} of one module's weights from its running sums (module_accumulators' keys):
    each weight's columns of its group's sum, zero padding dropped, in the weight's shape."""
    out = {}
    for key, acc in sums.items():
        if key in EXPERT_STACKS and tree[key].ndim == 3:  # a routed experts' stack (not the MLP's w_down): its shape
            out[key] = acc
            continue
        names = tuple(key.split("+"))
        contracted = COMPUTE_COPIES[names][0]
        start = 0
        for n in names:
            w = tree[n]
            width = math.prod(w.shape[contracted:])
            out[n] = acc[:, start : start + width].reshape(w.shape)
            start += width
    return out


_ACC_USES: list[Counter] = []


@contextlib.contextmanager
def accumulator_uses():
    """Counts, while tracing, how often each running sum (module path, copy key) reaches a product: the
    trainer checks each reached exactly one (a weight used twice, or one a product never passes to the
    Pallas matmul, would get a wrong gradient)."""
    uses: Counter = Counter()
    _ACC_USES.append(uses)
    try:
        yield uses
    finally:
        _ACC_USES.pop()


def acc_of(copy: tuple[nn.Module, tuple[str, ...]] | None) -> jax.Array | None:
    """The running gradient sum of `copy`'s weights from the "grad_acc" collection (the trainer's gradient
    accumulation fusion), or None."""
    if copy is None:
        return None
    module, names = copy
    if not module.has_variable("grad_acc", copy_key(names)):
        return None
    if _ACC_USES:
        _ACC_USES[-1][(*module.scope.path, copy_key(names))] += 1
    return module.get_variable("grad_acc", copy_key(names))


def copy_of(copy: tuple[nn.Module, tuple[str, ...]] | None) -> jax.Array | None:
    if copy is None:
        return None
    module, names = copy
    if not module.has_variable("compute", copy_key(names)):
        if "compute" in module.variables:
            raise ValueError(f"no compute copy of {names} in {module.name}: add them to layers.COMPUTE_COPIES")
        return None
    return module.get_variable("compute", copy_key(names))


def proj(
    spec: str,
    x: jax.Array,
    w: jax.Array,
    dtype: jnp.dtype,
    kernels: str = "reference",
    fp8_scale=None,
    copy: tuple[nn.Module, tuple[str, ...]] | None = None,
    out_f32: bool = False,
) -> jax.Array:
    """Einsum in the compute dtype with fp32 accumulation; fp32 masters are cast at use. With
    kernels=pallas it is detjax's pinned-tile Pallas matmul (forward and both backward products), reading
    the trainer's compute copy of the weight when `copy` = (module, (name,)) finds one (COMPUTE_COPIES). With
    an fp8 scale vector (model.fp8, detjax.model.fp8.scale_var) it runs in fp8 with delayed scaling.
    `out_f32`: the compute-dtype result widened to float32 (the same values and gradient bits); in fp8 the
    widening is inside the product, whose quantization kernel then rounds the float32 cotangent itself
    (fp8.fp8_matmul's `widen`: no separate cast of the cotangent)."""
    if fp8_scale is not None:  # (the trainer's fp8 copies are made for kernels=pallas)
        wq = copy_of(copy if kernels == "pallas" else None)
        return fp8_dense_many([spec], x, [w], dtype, fp8_scale, kernels, wq, widen=out_f32)[0]
    if kernels == "pallas":
        y = dense(spec, x, w, dtype, w_c=copy_of(copy), acc=acc_of(copy))
    else:
        y = _xla_dense(spec, jnp.dtype(dtype), x.dtype, w.dtype, x, w)
    return y.astype(jnp.float32) if out_f32 else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _xla_dense(spec: str, dtype: jnp.dtype, x_dtype, w_dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    """XLA's einsum in `dtype` with float32 accumulation (model.kernels=xla). Its own backward keeps both
    backward products in `dtype` with float32 accumulation, as the Pallas matmul's does: JAX's transpose of a
    dtype x dtype -> float32 dot multiplies the float32 cotangent with the other operand, which XLA runs as
    float32 (TF32) GEMMs on the GPU at about half the bf16 rate (docs/benchmarks-history.md set 11). The weight
    gradient is returned in the weight's dtype (the float32 master) without a round trip through `dtype`."""
    return _xla_dense_fwd(spec, dtype, x_dtype, w_dtype, x, w)[0]


def _xla_dense_fwd(spec, dtype, x_dtype, w_dtype, x, w):
    xc, wc = x.astype(dtype), w.astype(dtype)
    return jnp.einsum(spec, xc, wc, preferred_element_type=jnp.float32).astype(dtype), (xc, wc)


def _xla_dense_bwd(spec, dtype, x_dtype, w_dtype, res, dy):
    xc, wc = res
    dx_spec, dw_spec = tp_ops.transposed_specs(spec)
    dy = dy.astype(dtype)
    dx = jnp.einsum(dx_spec, dy, wc, preferred_element_type=jnp.float32).astype(dtype).astype(x_dtype)
    dw = jnp.einsum(dw_spec, xc, dy, preferred_element_type=jnp.float32).astype(w_dtype)
    return dx, dw


_xla_dense.defvjp(_xla_dense_fwd, _xla_dense_bwd)


def proj_many(
    specs: list[str],
    x: jax.Array,
    ws: list[jax.Array],
    dtype: jnp.dtype,
    kernels: str,
    fp8_scale=None,
    copy: tuple[nn.Module, tuple[str, ...]] | None = None,
    rope: tuple[tuple[int, int, int, int, int], float] | None = None,
    whole: bool = False,
) -> list[jax.Array]:
    """Several projections of one input (q/k/v, Mamba2's in-projections, SwiGLU gate/up). With
    kernels=pallas they are one matmul over the concatenated weights, bit-identical to separate ones (and
    `copy` as in proj: the fused compute copy); in fp8 one product with one scale set (either kernels
    setting). `rope` = ((batch, length, heads, kv_heads, head_dim), theta), kernels=pallas only: the three
    projections are q, k, v, returned with RoPE on q and k, whose backward is the Pallas kernel's
    (detjax.pallas_kernels.rope; the caller checks rope.ops.fits). `whole` (kernels=pallas, no fp8): the one
    product's (tokens, N) output as a list of one, each projection's columns after the previous one's (N may
    hold zero columns at the end), for kernels that read their columns in place."""
    if whole and (fp8_scale is not None or kernels != "pallas" or rope is not None):
        raise ValueError("proj_many: whole needs kernels=pallas, no fp8 and no rope")
    if fp8_scale is not None:  # (the trainer's fp8 copies are made for kernels=pallas)
        wq = copy_of(copy if kernels == "pallas" else None)
        return fp8_dense_many(specs, x, ws, dtype, fp8_scale, kernels, wq, rope=rope)
    if kernels == "pallas":
        if whole:
            return dense_many(specs, x, ws, dtype, w_cat_c=copy_of(copy), split=lambda y: [y], acc=acc_of(copy))
        if rope is None:
            return dense_many(specs, x, ws, dtype, w_cat_c=copy_of(copy), acc=acc_of(copy))
        width = sum(math.prod(w.shape[1:]) for w in ws)  # (the fused weight's zero columns are sliced off)
        split = lambda y: split_rope(y[:, :width] if y.shape[1] > width else y, *rope)  # noqa: E731
        return dense_many(specs, x, ws, dtype, w_cat_c=copy_of(copy), split=split, acc=acc_of(copy))
    if rope is not None:
        raise ValueError("proj_many: rope needs kernels=pallas")
    return [proj(s, x, w, dtype) for s, w in zip(specs, ws, strict=True)]


def chunk_products(specs: list[str], dtype, kernels: str, x: jax.Array, ws: list, scale=None) -> list[jax.Array]:
    """One chunk's projections of x by ws (float32 partials): tensor.chunk_product each, or with an fp8 scale
    vector (one of max_copies') ONE fp8 product over the weights side by side with that scale set, as the unchunked
    model fuses them (detjax.model.fp8.fp8_dense_many; dx and the partials in float32)."""
    if scale is None:
        return [tp_ops.chunk_product(spec, dtype, kernels, x, w) for spec, w in zip(specs, ws, strict=True)]
    return fp8_dense_many(specs, x, ws, jnp.float32, scale, kernels)


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * scale, computed in float32 and returned in `out_dtype` (float32 by
    default; a block's norm returns the compute dtype its projections take, which the Pallas kernel then
    writes directly)."""

    eps: float = 1e-5
    kernels: str = "reference"
    out_dtype: Any = jnp.float32
    pinned: bool = False  # canonical tensor parallelism: the scale's gradient by tensor.expand's pinned token tree,
    # the input's behind tensor.pin_cotangent

    @nn.compact
    def __call__(self, x: jax.Array, stream: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
        """The normed x; with `stream` (a float32 residual stream x) the pair (x, normed x): on the Pallas path
        the norm's backward then adds x's other cotangent, the residual add's, in its kernel
        (rmsnorm_stream); elsewhere the pair is just x beside its norm."""
        w_D = param(self, "scale", nn.initializers.ones, (x.shape[-1],), (ax.NORM,))
        if self.kernels == "pallas" and rmsnorm_fits(x.size // x.shape[-1]):
            d = x.shape[-1]
            out_dtype = jnp.dtype(self.out_dtype)
            x_ND = x.astype(jnp.float32).reshape(-1, d)
            if stream and x.dtype == jnp.float32:
                x_ND, y_ND = rmsnorm_stream(x_ND, w_D, self.eps, out_dtype)
                return x_ND.reshape(x.shape), y_ND.reshape(x.shape)
            y = rmsnorm(x_ND, w_D, self.eps, out_dtype).reshape(x.shape)
            return (x, y) if stream else y
        x32 = tp_ops.pin_cotangent(x.astype(jnp.float32)) if self.pinned else x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = tp_ops.expand(w_D, y.shape[:-1]) if self.pinned else w_D.reshape((1,) * (y.ndim - 1) + (-1,))
        y = (y * w).astype(self.out_dtype)
        return (x, y) if stream else y


# --------------------------------------------------------------------------- gathers without scatter-add
# The transpose of a gather is a scatter-add, whose GPU result depends on atomic arrival order. The
# embedding gather therefore carries its own backward, a one-hot contraction (row permutations, with the
# inverse permutation as backward, are in detjax.model.dispatch).


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _embed_lookup(table_VD: jax.Array, ids_BL: jax.Array, vocab: int, kernels: str) -> jax.Array:
    return jnp.take(table_VD, ids_BL, axis=0)


def _embed_fwd(table_VD, ids_BL, vocab, kernels):
    return _embed_lookup(table_VD, ids_BL, vocab, kernels), ids_BL


def _embed_bwd(vocab, kernels, ids_BL, g_BLD):
    if kernels == "pallas":
        d = g_BLD.shape[-1]
        return segment_sum(ids_BL.reshape(-1), g_BLD.reshape(-1, d), vocab), None
    onehot_BLV = jax.nn.one_hot(ids_BL, vocab, dtype=g_BLD.dtype)
    return jnp.einsum("blv,bld->vd", onehot_BLV, g_BLD, preferred_element_type=jnp.float32), None


_embed_lookup.defvjp(_embed_fwd, _embed_bwd)


def embed_lookup(table_VD: jax.Array, ids_BL: jax.Array, kernels: str = "reference") -> jax.Array:
    """table[ids]; the table gradient is a one-hot contraction (or the Pallas segment sum), not a scatter-add."""
    return _embed_lookup(table_VD, ids_BL, table_VD.shape[0], kernels)


class Embed(nn.Module):
    vocab_size: int
    d_model: int
    init_std: float
    kernels: str = "reference"
    layout: ax.Layout | None = None
    grad: str = "fixed"  # "scatter_add": the gather's own transpose (the nondeterministic baseline)
    tp: TensorSplit | None = None  # canonical tensor parallelism: vocabulary-parallel lookup

    @nn.compact
    def __call__(self, ids_BL: jax.Array) -> jax.Array:
        table_VD = param(
            self, "table", normal_init(self.init_std), (self.vocab_size, self.d_model), (ax.VOCAB, ax.EMBED), self.tp
        )
        if self.tp is not None:
            return tp_ops.embed_lookup(self.tp, table_VD, ids_BL)
        if self.grad == "scatter_add":
            h_BLD = jnp.take(table_VD, ids_BL, axis=0)
        else:
            h_BLD = embed_lookup(table_VD, ids_BL, self.kernels)
        return constrain(h_BLD, self.layout, (ax.BATCH, ax.SEQ, ax.ACT_EMBED), "embed_out")


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    d_model: int
    ffn_dim: int
    init_std: float
    dtype: jnp.dtype
    layout: ax.Layout | None = None
    kernels: str = "reference"
    fp8: bool = False  # model.fp8.enabled: both products in fp8 with delayed scaling
    tp: TensorSplit | None = None  # canonical tensor parallelism: gate/up column-, down row-parallel in chunks
    out_f32: bool = False  # may return the result widened to float32 (proj's out_f32; the same values)

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        init = normal_init(self.init_std)
        d, f, kern, tp = self.d_model, self.ffn_dim, self.kernels, self.tp
        w_gate_DF = param(self, "w_gate", init, (d, f), (ax.EMBED, ax.MLP), tp)
        w_up_DF = param(self, "w_up", init, (d, f), (ax.EMBED, ax.MLP), tp)
        w_down_FD = param(self, "w_down", init, (f, d), (ax.MLP, ax.EMBED), tp)
        if tp is not None:  # one loop body per width chunk, its down-product partials added by the chunk tree
            dtype, n = self.dtype, tp.local
            # fp8: each chunk its copy of the scale sets (their amaxes leave as the maximum over the copies)
            scales = [tp_ops.max_copies(tp, scale_var(self, nm, True), n) for nm in ("gate_up", "down") if self.fp8]

            def chunk(x_BLD, w_gate_DF, w_up_DF, w_down_FD, *s):
                s_gate_up, s_down = s or (None, None)
                gate_BLF, up_BLF = (
                    y.astype(dtype)
                    for y in chunk_products(["bld,df->blf"] * 2, dtype, kern, x_BLD, [w_gate_DF, w_up_DF], s_gate_up)
                )
                h_BLF = nn.silu(gate_BLF) * up_BLF
                return chunk_products(["blf,fd->bld"], dtype, kern, h_BLF, [w_down_FD], s_down)[0]

            w_c = (tp_ops.chunked(w_gate_DF, 1, n), tp_ops.chunked(w_up_DF, 1, n), tp_ops.chunked(w_down_FD, 0, n))
            parts = tp_ops.per_chunk(chunk, tp_ops.fanout(tp, x_BLD), *w_c, *scales)
            return tp_ops.combine_piece(tp, parts).astype(dtype)
        m = x_BLD.shape[0] * x_BLD.shape[1]
        if self.fp8 and (self.layout is None or self.layout.trivial) and fused_swiglu(m, d, f, kern):
            # one device, the Mosaic fp8 path: h and dy go straight to fp8 (detjax.model.fp8.fp8_swiglu_mlp)
            copies = copy_of((self, ("w_gate", "w_up"))), copy_of((self, ("w_down",)))
            out = fp8_swiglu_mlp(
                x_BLD.astype(self.dtype).reshape(m, d),
                jnp.concatenate([w_gate_DF, w_up_DF], axis=1),  # with copies: only carries dw to the masters
                w_down_FD,
                scale_var(self, "gate_up", True),
                scale_var(self, "down", True),
                None if copies[0] is None else copies,
                self.dtype,
                self.out_f32,
            )
            return out.reshape(x_BLD.shape)
        names = (ax.BATCH, ax.LENGTH, ax.ACT_MLP)
        gate_BLF, up_BLF = proj_many(
            ["bld,df->blf"] * 2,
            x_BLD,
            [w_gate_DF, w_up_DF],
            self.dtype,
            kern,
            scale_var(self, "gate_up", self.fp8),
            (self, ("w_gate", "w_up")),
        )
        gate_BLF = constrain(gate_BLF, self.layout, names, "mlp_hidden")
        up_BLF = constrain(up_BLF, self.layout, names)
        h_BLF = nn.silu(gate_BLF) * up_BLF
        down_fp8 = scale_var(self, "down", self.fp8)
        return proj("blf,fd->bld", h_BLF, w_down_FD, self.dtype, kern, down_fp8, (self, ("w_down",)), self.out_f32)
