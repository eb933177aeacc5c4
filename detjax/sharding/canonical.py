"""Canonical numerics (L3): sums whose order is a function of the logical problem, never of the mesh.

Every sum here is a balanced binary tree over its terms in index order, built from elementwise adds of
adjacent pairs: level 1 adds terms (0, 1), (2, 3), ...; level 2 adds those results pairwise; and so on. An
elementwise add of two given float values has one result on any device, so the tree's bits do not depend on
where its adds run: a device that holds a contiguous, aligned block of terms computes that block's subtree,
and the levels above may run wherever XLA moves the operands. A length that is not a power of two is padded
with zeros at the end (a fixed structure, a function of the length only).

Across devices (inside shard_map) the top levels of a tree whose terms are spread over n devices run as a
reduce-scatter and an all-gather, each a pure exchange of values: every device receives all n devices' terms
for its own piece of the elements, adds them by the tree, and the pieces are gathered into the shards the
sum is stored in (`reduce_to_shards`). The adds and their order per
element are the tree's, so the bits are those of summing the stacked terms in one place; each device receives
about twice the bytes of its result, as in a ring all-reduce (XLA's own lowering of a pair tree over a sharded
axis, collective-permutes per tree edge and then all-reduces, moved 15 x the parameters' bytes per device in
a dp8 step: scripts/collective_bytes.py).

`TreeAccumulator` walks the same tree over a sequence of subtree results pushed in order (the step pushes
one sequence's gradient at a time): it keeps one pending partial per tree level (a binary counter), so
pushing aligned power-of-two blocks, of any one size, gives the same tree as summing all leaves at once.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from detjax.pallas_kernels.ordered import pad_to_power_of_two


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# Tree levels per elementwise pass: blocks of 2**LEVELS adjacent terms are reduced by their own pair tree in one
# pass (one fused op on the GPU instead of one per level). The same adds in the same order: any value gives
# the same bits (tests/test_canonical.py compares it with one level per pass).
LEVELS = 4


def pair_sum(x: jax.Array, axis: int = 0) -> jax.Array:
    """Sum over `axis` as a balanced binary tree of adjacent pairs (the axis is removed)."""
    axis = axis % x.ndim
    x = pad_to_power_of_two(x, axis)
    while x.shape[axis] > 1:
        m = x.shape[axis]
        g = 1 << min(LEVELS, m.bit_length() - 1)  # terms per block this pass (m is a power of two)
        blocks = x.reshape(x.shape[:axis] + (m // g, g) + x.shape[axis + 1 :])
        parts = [jax.lax.index_in_dim(blocks, j, axis + 1, keepdims=False) for j in range(g)]
        while len(parts) > 1:  # the block's levels: (0 + 1), (2 + 3), ... then those pairwise
            parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
        x = parts[0]
    return jax.lax.index_in_dim(x, 0, axis, keepdims=False)


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names (None: none; a name; a tuple of names, major first)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def reduce_to_shards(
    xs: list[jax.Array], specs: list, axes: tuple[str, ...], degrees: dict[str, int], terms: int = 1
) -> list:
    """Inside shard_map over the batch `axes` (their `degrees`; device s the linear index, first axis major):
    each x in xs holds this device's `terms` consecutive terms of a pair tree over the S devices (device s's
    are terms s*K .. s*K + K - 1; with K > 1 along a leading axis of x, else x is the term); returns each
    tree's sum as this device stores it: specs[i] names, per dimension of the sum, the batch axes that shard it
    (the parameter's storage sharding; None: whole), and the devices that share a shard get the same values.

    Every device receives all devices' terms for a 1/R piece of its own shard (R devices share each shard: one
    all-to-all for all arrays), adds them by the tree, and the R pieces are gathered (one all-gather per set
    of sharing axes): each device receives about the shard's bytes twice, as in a ring all-reduce."""
    if not xs:
        return []
    n = math.prod(degrees[a] for a in axes)
    stride = {a: math.prod(degrees[b] for b in axes[i + 1 :]) for i, a in enumerate(axes)}
    coord = {a: np.arange(n) // stride[a] % degrees[a] for a in axes}  # device -> its index along axis a
    parts, plans = [], []
    for x, spec in zip(xs, specs, strict=True):
        x = x if terms > 1 else x[None]  # (K, ...)
        ndim = x.ndim - 1
        entries = [spec_axes(e) for e in spec] + [()] * (ndim - len(spec))
        dims = [(d, e) for d, e in enumerate(entries) if e]
        shared = tuple(a for a in axes if not any(a in e for _, e in dims))  # the axes whose devices share a shard
        counts = [math.prod(degrees[a] for a in e) for _, e in dims]
        # device -> its shard: per sharded dimension the linear index over that dimension's axes, then row-major
        block = np.zeros(n, np.int64)
        for (_, e), c in zip(dims, counts, strict=True):
            idx = np.zeros(n, np.int64)
            for a in e:
                idx = idx * degrees[a] + coord[a]
            block = block * c + idx
        piece = np.zeros(n, np.int64)
        for a in shared:
            piece = piece * degrees[a] + coord[a]
        r = math.prod(degrees[a] for a in shared)
        # each term as (shards, shard elements): each sharded dimension split into (count, size / count), the
        # counts first
        split_shape, perm_front, perm_back = [], [], []
        count_of = dict(zip([d for d, _ in dims], counts, strict=True))
        for d in range(ndim):
            c = count_of.get(d)
            if c is None:
                perm_back.append(1 + len(split_shape))
                split_shape.append(x.shape[1 + d])
            else:
                perm_front.append(1 + len(split_shape))
                perm_back.append(2 + len(split_shape))
                split_shape += [c, x.shape[1 + d] // c]
        shard_shape = tuple(split_shape[i - 1] for i in perm_back)
        blocks = x.reshape(terms, *split_shape).transpose([0, *perm_front, *perm_back])
        blocks = blocks.reshape(terms, math.prod(counts), -1)
        size = blocks.shape[2]
        per = -(-size // r)
        blocks = jnp.pad(blocks, ((0, 0), (0, 0), (0, r * per - size))).reshape(terms, -1, r, per)
        parts.append(blocks[:, block, piece].swapaxes(0, 1))  # (S, K, per): device j's piece of its shard
        plans.append((shared, r, per, size, shard_shape))
    cat = jnp.concatenate(parts, axis=2)
    got = jax.lax.all_to_all(cat, axes, 0, 0) if axes else cat  # got[i]: device i's terms of my pieces
    mine = pair_sum(got.reshape(n * terms, -1), 0)  # the terms in tree order i*K + k
    pieces, at = [], 0
    for _, _, per, _, _ in plans:
        pieces.append(mine[at : at + per])
        at += per
    out: list = [None] * len(xs)
    for shared in dict.fromkeys(p[0] for p in plans):  # one all-gather per set of sharing axes
        idx = [i for i, p in enumerate(plans) if p[0] == shared]
        cat = jnp.concatenate([pieces[i] for i in idx])
        whole = jax.lax.all_gather(cat, shared, axis=0, tiled=False) if shared else cat[None]  # (R, sum per)
        at = 0
        for i in idx:
            _, r, per, size, shard_shape = plans[i]
            out[i] = whole[:, at : at + per].reshape(-1)[:size].reshape(shard_shape)
            at += per
    return out


def full_sum(x: jax.Array) -> jax.Array:
    """Sum of every element: pair_sum over each axis, the last axis first."""
    for axis in reversed(range(x.ndim)):
        x = pair_sum(x, axis)
    return x


def tree_pair_sum(tree: Any, axis: int = 0) -> Any:
    return jax.tree.map(lambda x: pair_sum(x, axis), tree)


# Leaves of at most this many bytes that share a shape, a dtype and a key (the parameter's logical sharding) are
# computed stacked, as one array, by the elementwise canonical code (square_sums here, optim.pinned_adamw): the
# same adds and roundings per element, so the same bits, in fewer and larger kernels. None: every leaf alone.
STACK_BYTES: int | None = 256 << 10


def stack_groups(leaves: list[jax.Array], keys: list[Any] | None, stack_bytes: int | None = -1) -> list[list[int]]:
    """Indices of `leaves` in groups that may be stacked, in order of first appearance: leaves of <= stack_bytes
    (-1: STACK_BYTES) with one shape, dtype and key together; every other leaf alone. keys: one hashable per
    leaf that must match for leaves to stack -- the logical partition spec, so that no stack mixes shardings
    (a stacked result has one sharding, and XLA would move the others' shards); None: no stacking."""
    limit = STACK_BYTES if stack_bytes == -1 else stack_bytes
    if keys is not None and len(keys) != len(leaves):
        raise ValueError(f"stack_groups: {len(keys)} keys for {len(leaves)} leaves")
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        small = keys is not None and limit is not None and x.size * jnp.dtype(x.dtype).itemsize <= limit
        groups.setdefault((tuple(x.shape), str(x.dtype), keys[i]) if small else ("alone", i), []).append(i)
    return list(groups.values())


def stacked(idx: list[int], leaves: list[jax.Array]) -> jax.Array:
    """The leaves of one stack_groups group as one array: the leaf itself, or the leaves stacked on a new
    leading axis."""
    return leaves[idx[0]] if len(idx) == 1 else jnp.stack([leaves[i] for i in idx])


def unstacked(idx: list[int], x: jax.Array) -> list[jax.Array]:
    """stacked's inverse: one array per leaf of the group."""
    return [x] if len(idx) == 1 else [x[n] for n in range(len(idx))]


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def unseen_zero() -> jax.Array:
    """A uint32 zero that the compiler cannot see is zero (an optimization barrier around the constant)."""
    return jax.lax.optimization_barrier(jnp.zeros((), jnp.uint32))


def rounded(x: jax.Array, zero: jax.Array) -> jax.Array:
    """x, a product that must reach the following add rounded: its bits pass through an integer xor with
    `zero` (unseen_zero), after which it is no longer a product to any compiler, so the multiply cannot be
    contracted with the add into an FMA. The values and bits are x's, as an optimization barrier between
    product and add would give them, but without the barrier's cost: the barrier writes x to memory and the
    add reads it back, where this keeps both in one elementwise kernel."""
    uint = _UINT[jnp.dtype(x.dtype).itemsize]
    bits = jax.lax.bitcast_convert_type(x, uint) ^ zero.astype(uint)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


def square_sums(tree: Any, keys: list[Any] | None = None) -> list[jax.Array]:
    """Each leaf's sum of squares in float32 by full_sum: the same bits however the leaf is sharded. The
    squares are rounded before the first adds (`rounded`): fused with them, x*x + y*y may be contracted to
    one FMA (one rounding instead of two) in some fusions and not in others, and where a fusion ends
    depends on the sharding (measured on CPU: fsdp 2 x data 4 changed the last bit of the grad norm).
    With `keys` (stack_groups) small leaves are summed stacked (vmapped full_sum: each leaf's own tree)."""

    leaves = jax.tree.leaves(tree)
    out: list[Any] = [None] * len(leaves)
    zero = unseen_zero()
    for idx in stack_groups(leaves, keys):
        sq = rounded(jnp.square(stacked(idx, leaves).astype(jnp.float32)), zero)
        sums = full_sum(sq) if len(idx) == 1 else jax.vmap(full_sum)(sq)
        for i, x in zip(idx, unstacked(idx, sums), strict=True):
            out[i] = x
    return out


def global_norm(tree: Any, squares: list[jax.Array] | None = None) -> jax.Array:
    """sqrt of the leaves' square sums, the leaves combined by the same pair tree in pytree order."""
    squares = square_sums(tree) if squares is None else squares
    return jnp.sqrt(pair_sum(jnp.stack(squares)))


class TreeAccumulator:
    """Accumulate `count` (a power of two) subtree sums s_0, s_1, ... into their balanced pair tree.

    The state is one pending left operand per level; pushing s_m adds it to the pending partials of the levels
    where m's binary digits are 1 (left operand first) and parks the result at the first level where the digit
    is 0. After the last push the result sits in `total`. Works inside lax.scan (m may be traced)."""

    def __init__(self, count: int) -> None:
        if not is_power_of_two(count):
            raise ValueError(f"TreeAccumulator needs a power-of-two count, got {count}")
        self.levels = count.bit_length() - 1

    def init(self, like: Any) -> dict[str, Any]:
        zeros = jax.tree.map(jnp.zeros_like, like)
        return {"pending": [zeros] * self.levels, "total": zeros}

    def push(self, acc: dict[str, Any], x: Any, m: jax.Array) -> dict[str, Any]:
        m = jnp.asarray(m, jnp.int32)
        active = jnp.bool_(True)
        pending = []
        for level, left in enumerate(acc["pending"]):
            one = ((m >> level) & 1) == 1
            park, merge = active & ~one, active & one
            pending.append(jax.tree.map(lambda lft, cur, p=park: jnp.where(p, cur, lft), left, x))
            x = jax.tree.map(lambda lft, cur, g=merge: jnp.where(g, lft + cur, cur), left, x)
            active = merge
        # only the push that completes the tree (every digit 1) reaches the top still active
        total = jax.tree.map(lambda t, cur, a=active: jnp.where(a, cur, t), acc["total"], x)
        return {"pending": pending, "total": total}
