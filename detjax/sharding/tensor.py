"""Canonical tensor parallelism: every sum over a dimension that `tensor` may split is a fixed chunk tree.

Under canonical numerics with `determinism.max_tensor` = M > 1, each dimension that tensor parallelism splits
(attention and Mamba2 heads, the MLP's and the experts' widths, the vocabulary) is cut into M equal contiguous
chunks, whatever the tensor degree t (a divisor of M). Device r of the `tensor` axis holds chunks
[r M/t, (r+1) M/t): the contiguous block that a NamedSharding over `tensor` gives it. Each chunk's work runs
as one loop body (`per_chunk`), the same program for any number of chunks, so a chunk's values do not depend
on how many chunks sit beside it (a vmapped batch of 8 chunks and one of 4 are two programs, and XLA's CPU code
for them measured one ulp apart in a weight gradient). A sum over the split dimension -- a row-parallel
projection's contraction, a column-parallel projection's input gradient, Mamba2's gated-norm mean square and
the gradient of B and C over the heads, the vocabulary's logsumexp and label logit -- takes each chunk's
partial result and adds the M of them by detjax.sharding.canonical.pair_sum's tree: a device adds its own
aligned block of M/t partials (a subtree of that tree), the t subtree results are all-gathered (exact copies,
no arithmetic) and added by the top levels of the same tree. One device runs the same chunks and the same tree
with no collective, so the bits are the same for t = 1, 2, ..., M.

Two operations carry it, each the other's transpose:
- `combine(split, parts)`: the chunk tree over the leading (local chunk) axis; its backward hands every chunk
  the cotangent.
- `fanout(split, x)`: a replicated input copied once per local chunk (float32); its backward is `combine` of
  the chunks' cotangents, so the input gradient of a column-parallel projection is the chunk tree.

Sequence parallelism (`TensorSplit.sequence`) keeps the residual stream between blocks split over `tensor`
along the sequence. A block gathers the pieces (`gather_sequence`), runs the program of the unsplit stream and
keeps its own piece of the result; gathering and taking a piece are copies in either direction, so the bits
are those of the unsplit stream. The mixers whose output is a row-parallel product (attention, the MLP,
Mamba2) end with `combine_piece`, the chunk tree's reduce-scatter: each device adds its own chunks over the
whole sequence (its subtree), the subtree results are exchanged piece by piece (`all_to_all`: device r
receives every device's piece r) and added by the same top levels of the tree, on the piece alone. The adds
and their order are `combine`'s followed by `scatter_sequence`, so the bits are too; the exchange carries 1/t
of the all-gather's bytes. The MoE block (its shared expert's output is added to the routed experts') keeps
`combine` and `scatter_sequence`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from detjax.sharding import canonical


@dataclass(frozen=True)
class TensorSplit:
    """M feature chunks per split dimension over `degree` devices of mesh axis `axis` (None: one device)."""

    chunks: int
    degree: int = 1
    axis: str | None = None
    sequence: bool = False  # sequence parallelism: the residual stream between blocks is split over `axis`

    def __post_init__(self) -> None:
        if not canonical.is_power_of_two(self.chunks) or self.chunks % self.degree:
            raise ValueError(f"TensorSplit: {self.chunks} chunks over {self.degree} devices")
        if (self.degree > 1) != (self.axis is not None):
            raise ValueError("TensorSplit: a mesh axis is named exactly when the degree is above 1")
        if self.sequence and self.degree == 1:
            raise ValueError("TensorSplit: sequence parallelism needs a tensor degree above 1")

    @property
    def local(self) -> int:
        """Chunks this device holds."""
        return self.chunks // self.degree

    def first(self) -> jax.Array | int:
        """Global index of this device's first chunk (inside shard_map when degree > 1)."""
        return jax.lax.axis_index(self.axis) * self.local if self.degree > 1 else 0

    def local_size(self, size: int) -> int:
        """This device's share of a split dimension of global size `size`."""
        return size // self.degree


def _tree(split: TensorSplit, parts: jax.Array) -> jax.Array:
    s = canonical.pair_sum(parts, 0)
    if split.degree > 1:
        s = canonical.pair_sum(jax.lax.all_gather(s, split.axis, axis=0, tiled=False), 0)
    return s


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine(split: TensorSplit, parts: jax.Array) -> jax.Array:
    """Sum of all M chunk partials (this device's `parts` are its local ones, leading axis) by the chunk tree;
    the result is replicated over the tensor axis."""
    return _tree(split, parts)


def _combine_fwd(split, parts):
    return _tree(split, parts), None


def _combine_bwd(split, _, g):
    return (jnp.broadcast_to(g, (split.local, *g.shape)),)


combine.defvjp(_combine_fwd, _combine_bwd)


def _piece_tree(split: TensorSplit, parts: jax.Array) -> jax.Array:
    s = canonical.pair_sum(parts, 0)  # this device's subtree, over the whole sequence (axis 1)
    t, n = split.degree, s.shape[1] // split.degree
    pieces = jnp.moveaxis(s.reshape(s.shape[0], t, n, *s.shape[2:]), 1, 0)  # (t, B, l, ...): piece r at [r]
    got = jax.lax.all_to_all(pieces, split.axis, 0, 0)  # got[j]: device j's subtree, this device's piece
    return canonical.pair_sum(got, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine_piece(split: TensorSplit, parts: jax.Array) -> jax.Array:
    """`combine` under sequence parallelism, for parts (local, B, L, ...) whose sum leaves the block: this
    device's piece of the sequence (axis 1) of the chunk tree's result, by reduce-scatter (module docstring).
    Without sequence parallelism it is `combine`. The backward all-gathers the pieces' cotangents and hands
    every chunk the whole."""
    return _piece_tree(split, parts) if split.sequence else _tree(split, parts)


def _combine_piece_fwd(split, parts):
    return (_piece_tree(split, parts) if split.sequence else _tree(split, parts)), None


def _combine_piece_bwd(split, _, g):
    whole = _all_pieces(split, g) if split.sequence else g
    return (jnp.broadcast_to(whole, (split.local, *whole.shape)),)


combine_piece.defvjp(_combine_piece_fwd, _combine_piece_bwd)


def dropout_piece(split: TensorSplit, rate: float, key: jax.Array, y_BlD: jax.Array) -> jax.Array:
    """Flax's nn.Dropout of the whole-sequence value, applied to this device's piece of it: the mask is drawn
    for the whole sequence with the block's key (the unsplit stream's mask) and the piece's part kept."""
    keep_prob = 1.0 - rate
    whole = (y_BlD.shape[0], y_BlD.shape[1] * split.degree, *y_BlD.shape[2:])
    mask = _own_piece(split, jax.random.bernoulli(key, p=keep_prob, shape=whole))
    return jax.lax.select(mask, y_BlD / keep_prob, jnp.zeros_like(y_BlD))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fanout(split: TensorSplit, x: jax.Array) -> jax.Array:
    """x (replicated) as float32 copies, one per local chunk: (local, *x.shape). The backward adds the chunks'
    cotangents by the chunk tree (then rounds once to x's dtype)."""
    return jnp.broadcast_to(x.astype(jnp.float32), (split.local, *x.shape))


def _fanout_fwd(split, x):
    return fanout(split, x), jnp.zeros((0,), x.dtype)


def _fanout_bwd(split, like, g):
    return (_tree(split, g).astype(like.dtype),)


fanout.defvjp(_fanout_fwd, _fanout_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def expand(w: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """A small parameter broadcast over leading token dimensions `lead` (w.shape: the trailing dims of the
    use). Its gradient -- the sum over the tokens -- is canonical.full_sum's pair tree of the cotangent, put
    behind an optimization barrier first: left to XLA, that reduce is fused with the product that makes the
    cotangent (a weight gradient like sum(g * x)) and may be contracted into FMAs differently in different
    programs, and a tensor-parallel device's program is not the one-device program (measured on CPU: an
    RMSNorm scale gradient one ulp apart between tensor 1 and 2)."""
    return jnp.broadcast_to(w, (*lead, *w.shape))


def _expand_fwd(w, lead):
    return expand(w, lead), None


def _expand_bwd(lead, _, g):
    g = jax.lax.optimization_barrier(g)
    for _ in lead:
        g = canonical.pair_sum(g, 0)
    return (g,)


expand.defvjp(_expand_fwd, _expand_bwd)


def _own_piece(split: TensorSplit, x: jax.Array) -> jax.Array:
    """This device's contiguous piece of the sequence (axis 1) of x, held whole on every tensor device."""
    n = x.shape[1] // split.degree
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(split.axis) * n, n, axis=1)


def _all_pieces(split: TensorSplit, x: jax.Array) -> jax.Array:
    return jax.lax.all_gather(x, split.axis, axis=1, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gather_sequence(split: TensorSplit, x_BlD: jax.Array) -> jax.Array:
    """Sequence parallelism's entry to a block: the residual stream's pieces (axis 1) all-gathered into the
    whole sequence, exact copies. The block then runs the very program of the unsplit stream, so every tensor
    device computes the whole sequence's cotangent with the same bits, and the backward takes this device's
    piece of it (no sum: the transpose of a gather would add t equal copies)."""
    return _all_pieces(split, x_BlD)


gather_sequence.defvjp(lambda split, x: (_all_pieces(split, x), None), lambda split, _, g: (_own_piece(split, g),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def scatter_sequence(split: TensorSplit, x_BLD: jax.Array) -> jax.Array:
    """Sequence parallelism's exit from a block: this device's piece of a whole-sequence value that every
    tensor device holds with the same bits (the chunk tree's result is replicated). The backward all-gathers
    the pieces' cotangents: copies, so the block's backward sees the unsplit stream's cotangent."""
    return _own_piece(split, x_BLD)


scatter_sequence.defvjp(lambda split, x: (_own_piece(split, x), None), lambda split, _, g: (_all_pieces(split, g),))


@jax.custom_vjp
def pin_cotangent(x: jax.Array) -> jax.Array:
    """Identity whose cotangent passes an optimization barrier: the gradient computed behind it is stored
    whole before anything adds to it. A pre-norm block's input gradient is the residual's cotangent plus the
    norm's input gradient, and left to XLA that add is fused with the norm's last products differently when a
    slice sits between them (sequence parallelism; measured on CPU: the embedding gradient apart)."""
    return x


pin_cotangent.defvjp(lambda x: (x, None), lambda _, g: (jax.lax.optimization_barrier(g),))


def per_chunk(fn, *xs, consts: tuple = ()):
    """fn(*chunk, *consts) for each chunk of the leading axis of xs, stacked: the same program per chunk
    whatever the number of chunks. A loop body is its own program; a vmapped batch of 8 chunks and one of 4
    are two programs, and XLA's CPU code for them measured one ulp apart in a weight gradient. The loop's trip
    count is hidden from XLA (it inlines a loop it can count to one trip: a device holding one chunk, whose
    ops then fuse with their neighbours -- measured: tensor 8 against one device, 4 weight gradients one ulp
    apart), so the loop is a while loop with a custom backward, itself such a loop, that recomputes each
    chunk's forward and applies its vjp. `consts`: arrays every chunk reads whole (no gradient flows to
    them: pass only constants of the differentiation, e.g. stop_gradient values or integers)."""
    return _per_chunk(fn, len(xs), *xs, *consts)


def _loop(f, xs: tuple, consts: tuple):
    """Stacked f(*chunk_i, *consts) over i, in a while loop whose trip count XLA cannot count."""
    n = xs[0].shape[0]
    first = jax.tree.map(lambda x: x[0], xs)
    out = jax.tree.map(lambda sh: jnp.zeros((n, *sh.shape), sh.dtype), jax.eval_shape(f, *first, *consts))
    start = jax.lax.optimization_barrier(jnp.zeros((), jnp.int32))

    def body(carry):
        i, acc = carry
        chunk = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), xs)
        # barriers: with one chunk the slice is the whole array, and XLA would fuse what reads it otherwise
        chunk, held = jax.lax.optimization_barrier((chunk, consts))
        y = jax.lax.optimization_barrier(f(*chunk, *held))
        return i + 1, jax.tree.map(lambda o, v: jax.lax.dynamic_update_index_in_dim(o, v, i, 0), acc, y)

    return jax.lax.while_loop(lambda c: c[0] < n, body, (start, out))[1]


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _per_chunk(fn, n_xs: int, *args):
    return _loop(fn, args[:n_xs], args[n_xs:])


def _per_chunk_fwd(fn, n_xs, *args):
    return _loop(fn, args[:n_xs], args[n_xs:]), args


def _per_chunk_bwd(fn, n_xs, args, g):
    xs, consts = args[:n_xs], args[n_xs:]
    diff = [i for i, x in enumerate(xs) if _is_float(x)]

    def chunk_vjp(*a):
        x_c, g_c, cs = a[:n_xs], a[n_xs], a[n_xs + 1 :]

        def f(*d):
            full = list(x_c)
            for i, v in zip(diff, d, strict=True):
                full[i] = v
            return fn(*full, *cs)

        return jax.vjp(f, *(x_c[i] for i in diff))[1](g_c)

    dxs = _loop(chunk_vjp, (*xs, g), consts) if diff else ()
    out: list = [None] * (n_xs + len(consts))
    for i, d in zip(diff, dxs, strict=True):
        out[i] = d
    return tuple(out)


_per_chunk.defvjp(_per_chunk_fwd, _per_chunk_bwd)


def chunked(x: jax.Array, axis: int, n: int) -> jax.Array:
    """Dimension `axis` cut into n equal contiguous chunks, the chunk index moved to the front."""
    axis = axis % x.ndim
    size = x.shape[axis]
    if size % n:
        raise ValueError(f"chunked: dimension {axis} of size {size} does not split into {n} chunks")
    y = x.reshape(*x.shape[:axis], n, size // n, *x.shape[axis + 1 :])
    return jnp.moveaxis(y, axis, 0)


def transposed_specs(spec: str) -> tuple[str, str]:
    """The dx and dw einsum specs of the projection `spec` ('x,w->y' gives 'y,w->x' and 'x,y->w')."""
    ins, y = spec.split("->")
    x, w = ins.split(",")
    return f"{y},{w}->{x}", f"{x},{y}->{w}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def chunk_product(spec: str, dtype, kernels: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """One chunk's einsum with operands in `dtype` and a float32 result (a partial, unrounded). Its backward
    runs both products in `dtype` with float32 results: dx in x's dtype (float32 for a fanout copy: the chunk
    tree then adds unrounded partials), dw in w's (the float32 master). kernels="pallas": the three products
    are detjax's pinned-tile matmul (the spec folded to one 2-D product, as layers.proj does); else XLA's
    einsum."""
    return _product_fwd(spec, dtype, kernels, x, w)[0]


def _fold(spec: str, x: jax.Array) -> tuple[int, int]:
    """(rows, contracted size) of the 2-D form of a '<free x><contracted>,<contracted><free w>' product."""
    from detjax.pallas_kernels.matmul.ops import contracted_dims

    k = math.prod(x.shape[x.ndim - contracted_dims(spec) :])
    return x.size // k, k


def _pallas(kind: str, a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    from detjax.pallas_kernels.backend import interpret_mode
    from detjax.pallas_kernels.matmul.kernel import matmul_kernel

    return matmul_kernel(a, b, kind=kind, out_dtype=out_dtype, interpret=interpret_mode())


def _product_fwd(spec, dtype, kernels, x, w):
    xc, wc = x.astype(dtype), w.astype(dtype)
    res = (xc, wc, jnp.zeros((0,), x.dtype))
    if kernels != "pallas":
        return jnp.einsum(spec, xc, wc, preferred_element_type=jnp.float32), res
    m, k = _fold(spec, x)
    y = _pallas("fwd", xc.reshape(m, k), wc.reshape(k, -1), jnp.float32)
    out_shape = jax.eval_shape(functools.partial(jnp.einsum, spec), xc, wc).shape
    return y.reshape(out_shape), res


def _product_bwd(spec, dtype, kernels, res, g):
    xc, wc, like = res
    gc = g.astype(dtype)
    if kernels == "pallas":
        m, k = _fold(spec, xc)
        g2 = gc.reshape(m, -1)
        dx = _pallas("dx", g2, wc.reshape(k, -1), like.dtype).reshape(xc.shape)
        return dx, _pallas("dw", xc.reshape(m, k), g2, jnp.float32).reshape(wc.shape)
    dx_spec, dw_spec = transposed_specs(spec)
    dx = jnp.einsum(dx_spec, gc, wc, preferred_element_type=jnp.float32).astype(like.dtype)
    dw = jnp.einsum(dw_spec, xc, gc, preferred_element_type=jnp.float32)
    return dx, dw


chunk_product.defvjp(_product_fwd, _product_bwd)


def max_over(split: TensorSplit, x: jax.Array) -> jax.Array:
    """Elementwise maximum of x over the tensor axis (exact in any order)."""
    if split.degree == 1:
        return x
    return jnp.max(jax.lax.all_gather(x, split.axis, axis=0, tiled=False), axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 2))
def max_copies(split: TensorSplit, scale: jax.Array, count: int) -> jax.Array:
    """`count` copies of an fp8 scale vector (detjax.model.fp8), one per use: a projection's scale set must
    leave the model with the maximum of its uses' amaxes (its "gradient"), and the transpose of a broadcast
    would add them. The backward takes the elementwise maximum over the copies and then over the tensor
    devices: exact in any order, the global amax whatever the tensor degree."""
    return jnp.broadcast_to(scale, (count, *scale.shape))


def _max_copies_bwd(split, count, _, g):
    return (max_over(split, jnp.max(g, axis=0)),)


max_copies.defvjp(lambda split, scale, count: (max_copies(split, scale, count), None), _max_copies_bwd)


def _ce_chunk(logits_BLV, first, m_BL, targets_BL):
    """One vocabulary chunk's sum of exponentials and label logit (a masked sum: one term at most)."""
    s_BL = jnp.sum(jnp.exp(logits_BLV - m_BL[..., None]), axis=-1)
    ids_11V = first + jnp.arange(logits_BLV.shape[-1])[None, None, :]
    return s_BL, jnp.sum(jnp.where(ids_11V == targets_BL[..., None], logits_BLV, 0.0), axis=-1)


def ce_sum(split: TensorSplit, logits_cBLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Sum of token cross-entropies from vocabulary-chunked logits (this device's chunks, leading axis): the
    maximum over the vocabulary exact, the sum of exponentials and the label logit each a per-chunk sum added
    by the chunk tree, the token sum canonical.full_sum."""
    n, vc = logits_cBLV.shape[0], logits_cBLV.shape[-1]
    m_BL = jax.lax.stop_gradient(max_over(split, jnp.max(logits_cBLV, axis=(0, -1))))  # exact in any order
    first_c = (split.first() + jnp.arange(n)) * vc

    s_cBL, label_cBL = per_chunk(_ce_chunk, logits_cBLV, first_c, consts=(m_BL, targets_BL))
    logz_BL = m_BL + jnp.log(combine(split, s_cBL))
    return canonical.full_sum(logz_BL - combine(split, label_cBL))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def embed_lookup(split: TensorSplit, table_VD: jax.Array, ids_BL: jax.Array) -> jax.Array:
    """table[ids] from this device's contiguous block of vocabulary rows: each device looks up the rows it
    holds, the lookups are all-gathered and each token takes its owner's (a selection, exact). The table
    gradient is a one-hot contraction per vocabulary chunk of the local rows (no scatter-add)."""
    rows = table_VD.shape[0]
    local_BL = ids_BL - split.first() * (rows // split.local)
    e_BLD = jnp.take(table_VD, jnp.clip(local_BL, 0, rows - 1), axis=0)
    if split.degree == 1:
        return e_BLD
    all_tBLD = jax.lax.all_gather(e_BLD, split.axis, axis=0, tiled=False)
    owner_BL = ids_BL // rows
    return jnp.take_along_axis(all_tBLD, owner_BL[None, ..., None], axis=0)[0]


def _embed_fwd(split, table_VD, ids_BL):
    return embed_lookup(split, table_VD, ids_BL), (ids_BL, jnp.zeros((0,) + table_VD.shape, table_VD.dtype))


def _embed_bwd(split, res, g_BLD):
    ids_BL, like = res
    rows = like.shape[1]
    per = rows // split.local
    local_BL = ids_BL - split.first() * per

    def one(c, local_BL, g_BLD):
        onehot_BLV = jax.nn.one_hot(local_BL - c * per, per, dtype=g_BLD.dtype)
        return jnp.einsum("blv,bld->vd", onehot_BLV, g_BLD, preferred_element_type=jnp.float32)

    sums = per_chunk(one, jnp.arange(split.local), consts=(local_BL, g_BLD))
    return sums.reshape(rows, -1).astype(like.dtype), None


embed_lookup.defvjp(_embed_fwd, _embed_bwd)
