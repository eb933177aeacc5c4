"""On-device tensor digests and per-step fingerprint records.

A digest is a pair of uint32 sums of per-element hashes. Integer addition is associative, so the digest is
the same whatever order the reduction runs in (the digest itself is deterministic); each element hash mixes
the element's bits with its position, so permutations change the digest (a plain XOR would not). Shape and
dtype are folded in. `row_digest` keeps the leading axis, for routing maps and dispatch orders.

Versions (`DIGEST_VERSION`, written into every fingerprint record and checkpoint, so digests of different
versions are never compared with each other):
- 1: each lane hashes the element with a murmur3-finalised hash of its position (four finalisers per
  element). On the H200 the per-step digests cost 8.0 ms of a 181 ms gpu_dense step (6.9 ms with version
  2: the hash arithmetic is the smaller part of that cost; docs/benchmarks-history.md set 12).
- 2 (current): the position enters through one multiply-add; lane 1 is the murmur3 finaliser of the bits
  xor that, lane 2 a one-round xorshift-multiply of the bits plus it. Both per-element maps are bijections of
  the bits at a fixed position, so a change of any one element changes both sums.
A third version with one multiply and one xorshift per lane (fewer integer operations) was measured and
dropped: the step's digests of gpu_dense, timed alone, took 4.60 ms with it against 4.31 with version 2
(`scripts/digest_bench.py`, docs/benchmarks-history.md set 18), so the arithmetic is not what they wait on.

Cost: a tree's leaves of one role in different layers are digested by one stacked reduction (`grouped`, the
same bits as one reduction per leaf): gpu_dense's digests went from 6.9 to 3.1 ms per step
(docs/benchmarks-history.md set 14) -- the per-leaf reductions (about 590 of them) were bound by their count,
not by bytes. Digesting
the large leaves alone instead (ALONE_BYTES) was slower again (2026-12-02: 5.6 against 3.2 ms in the step), so
every leaf may be stacked. In the step three fusions of 0.5-0.65 ms make about half of the 3.2 ms while every other
digest fusion takes under 0.1 ms per call; with the parameters' non-finite count moved out of the digest (a
reduction of its own) they stayed, two of them then named as concatenate-reduce fusions (2026-12-02). Writing
each stack out before its reduction (an optimization barrier) was slower still: 8.7 against 4.5 ms alone, 6.8
against 3.2 ms in the step (2026-12-02), so XLA's fused concatenate-reduce is the cheaper form.
On one device a small tree (at most FLAT_WORDS 32-bit words) is digested in one pass over its leaves'
concatenated bits instead (`flat`, `_flat_sums`): an element's position in its leaf is its position in the
concatenation less the leaf's start, folded into a per-leaf constant, and each leaf's sums are differences
of one cumulative sum of chunk sums (exact mod 2^32), so the bits are the grouped form's (tested). It is a
compile-time form: one hash pipeline per tree instead of one per group, so a smaller program for XLA to
compile (the suite's many CPU step compiles gain most). The concatenation copies the tree, so
large trees keep the grouped form, and so do sharded ones: their concatenation gathers them, and XLA's
sharding propagation carries its layout back into the ops that produce them (forced onto a data 2 x fsdp 4
CPU mesh, it changed the gradients' bits, while the same gradients digested either way gave equal digests).
The Pallas kernel of pallas_kernels/digest gives the same bits (integer sums) in one pass per large leaf. It is
off by default (DIGEST_KERNEL): on an H100 (2026-12-05, docs/BENCHMARKS.md "The d 4096 dense cell") it digested
a 1.3 B-parameter state's 19 GiB in 8.52 ms against the XLA reductions' 8.66, and in the step the time moved
between scopes rather than clearly going away.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_C1, _C2 = np.uint32(0x9E3779B9), np.uint32(0x85EBCA6B)
DIGEST_VERSION = 2
DIGEST_VERSIONS = (1, 2)


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3 32-bit finaliser: a bijection with good avalanche."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def as_u32(x: jax.Array) -> jax.Array:
    """The exact bits of `x` as uint32 values (one per element; 8-byte dtypes give two)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def meta_salt(x: jax.Array) -> np.uint32:
    meta = f"{tuple(x.shape)}|{x.dtype}".encode()
    return np.uint32(int.from_bytes(hashlib.blake2s(meta, digest_size=4).digest(), "little"))


def positions(shape: tuple[int, ...]) -> jax.Array:
    """Row-major flat index of every element, built from per-dimension iotas (mod 2^32). No reshape of the
    data is needed, so a sharded array is digested shard by shard and only the two sums are reduced."""
    pos = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(stride % 2**32)
        stride *= shape[d]
    return pos


def element_hashes(
    bits: jax.Array, salt: np.uint32, version: int = DIGEST_VERSION, pos: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The two lanes' hashes of every element of `bits` (uint32), at flat positions `pos` (uint32, mod 2^32;
    default: `bits`'s own row-major positions). Elementwise: a kernel that holds a block of a tensor passes
    the block's positions in the whole tensor and gets the same hashes."""
    pos = positions(bits.shape) if pos is None else pos
    if version == 1:
        p1 = _fmix(pos * _C1 + salt)
        p2 = _fmix(pos * _C2 + (salt ^ np.uint32(0x5BD1E995)))
        return _fmix(bits ^ p1), _fmix((bits + p2) * _C1)
    if version != 2:
        raise ValueError(f"unknown digest version {version} (this detjax knows {DIGEST_VERSIONS})")
    p = pos * _C1 + salt
    h2 = bits + (p ^ np.uint32(0x5BD1E995))
    h2 = (h2 ^ (h2 >> 15)) * _C2
    return _fmix(bits ^ p), h2 ^ (h2 >> 13)


def _lane_sums(
    x: jax.Array, count_nonfinite: bool = False, version: int = DIGEST_VERSION
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sum of lane-1 hashes, sum of lane-2 hashes, count of non-finite elements or 0), uint32. Reductions of
    one elementwise producer: XLA fuses them into one kernel that reads the tensor once (stacking the lanes
    first materialised a 2x copy: 9.6 ms/step of digests on gpu_medium, docs/BENCHMARKS.md)."""
    bits = as_u32(x)  # element shape kept (8-byte dtypes add a trailing 2): positions as if flattened
    h1, h2 = element_hashes(bits, meta_salt(x), version)
    bad = nonfinite_count(x) if count_nonfinite else jnp.zeros((), jnp.uint32)
    return jnp.sum(h1, dtype=jnp.uint32), jnp.sum(h2, dtype=jnp.uint32), bad


def nonfinite_count(x: jax.Array) -> jax.Array:
    """How many elements of `x` are inf or NaN (uint32; 0 for non-float dtypes). An integer sum: the same
    bits in any reduction order."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros((), jnp.uint32)
    return jnp.sum((~jnp.isfinite(x)).astype(jnp.uint32), dtype=jnp.uint32)


def tensor_digest(x: jax.Array, version: int = DIGEST_VERSION) -> jax.Array:
    """uint32[2] digest of the whole tensor (bits, positions, shape, dtype)."""
    h1, h2, _ = _lane_sums(x, version=version)
    return jnp.stack([h1, h2])


def row_digest(x: jax.Array) -> jax.Array:
    """uint32[rows, 2]: one digest per slice along axis 0, positions counted within the row."""
    bits = as_u32(x).reshape(x.shape[0], -1)
    h1, h2 = jax.vmap(lambda r: element_hashes(r, meta_salt(x)))(bits)
    return jnp.sum(jnp.stack([h1, h2], axis=-1), axis=1, dtype=jnp.uint32)


def tree_digest(tree: Any, flat: bool = False) -> jax.Array:
    """uint32[2] over a pytree: leaf digests mixed with each leaf's path, so moved leaves are caught. `flat`:
    the leaves are on one device (`tree_digest_and_finite`)."""
    return tree_digest_and_finite(tree, count_nonfinite=False, flat=flat)[0]


# A stacked group's bytes are capped: where a backend does not fuse the stack into the reduction, the copy it
# makes stays small (gpu_dense's largest role, 16 MLP weights of 16 MiB, fits whole).
GROUP_BYTES = 256 << 20
# Leaves of at least this many bytes are digested alone, never stacked (None: every leaf may be stacked).
# Stacking saves a reduction per leaf but may copy the leaf; scripts/digest_bench.py --alone-bytes times both.
ALONE_BYTES: int | None = None


def _bounded(groups: Any, leaves: list) -> list[list[int]]:
    """Each group split, in order, into runs of at most GROUP_BYTES (at least one leaf each)."""
    out = []
    for idx in groups:
        if len(idx) == 1:  # also every PRNG key leaf
            out.append(idx)
            continue
        run, size = [], 0
        for i in idx:
            nbytes = leaves[i][1].size * jnp.dtype(leaves[i][1].dtype).itemsize
            if run and size + nbytes > GROUP_BYTES:
                out.append(run)
                run, size = [], 0
            run.append(i)
            size += nbytes
        out.append(run)
    return out


# The most 32-bit words a tree may hold for the flat form (`tree_digest_and_finite(..., flat=True)`): its
# concatenated bits, per-leaf constants, hash lanes and non-finite flags are uint32 arrays of the tree's
# length (up to 64 MiB each at this bound) where XLA does not fuse them.
FLAT_WORDS = 1 << 24


def _words(x: jax.Array) -> int:
    """How many uint32 words `as_u32` makes of `x`."""
    return int(np.prod(jax.eval_shape(as_u32, jax.ShapeDtypeStruct(x.shape, x.dtype)).shape))


# The flat form pads each leaf to whole chunks of this many words, so one reshape gives every chunk's sums
FLAT_CHUNK = 128


def _flat_sums(leaves: list, count_nonfinite: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(lane-1 sums, lane-2 sums, non-finite counts), uint32[leaves] each, from one hash pass over all leaves'
    bits concatenated: the bits of one `_lane_sums` per leaf (version 2). Each leaf is padded with zero bits to
    whole FLAT_CHUNKs, the lanes are summed per chunk by one reshape, and a leaf's sums are the differences of
    the chunk sums' cumulative sum at its first and last chunk (exact mod 2^32), less its padding's hashes
    (known before the step: zero bits at known positions)."""
    bits, consts, bads, bounds, pad_sums = [], [], [], [0], []
    for _, x in leaves:
        b = as_u32(x).reshape(-1)
        n, pad, start = b.size, -b.size % FLAT_CHUNK, bounds[-1] * FLAT_CHUNK
        salt = meta_salt(x)
        # element i of this leaf sits at start + i: p = (start + i) * C1 + (salt - start * C1) mod 2^32
        consts.append(jnp.full((n + pad,), np.uint32((int(salt) - start * int(_C1)) % 2**32)))
        bits.append(jnp.pad(b, (0, pad)))
        pads = element_hashes(np.zeros(pad, np.uint32), salt, 2, np.arange(n, n + pad, dtype=np.uint32))
        pad_sums.append([int(np.sum(h, dtype=np.uint32)) for h in pads])
        if count_nonfinite:
            bad = jnp.zeros((n,), jnp.uint32)
            if jnp.issubdtype(x.dtype, jnp.floating):  # (8-byte floats do not occur under x32 jax)
                bad = (~jnp.isfinite(x)).astype(jnp.uint32).reshape(-1)
            bads.append(jnp.pad(bad, (0, pad)))
        bounds.append(bounds[-1] + (n + pad) // FLAT_CHUNK)
    total = bounds[-1] * FLAT_CHUNK
    lanes = list(element_hashes(jnp.concatenate(bits), jnp.concatenate(consts), 2, jax.lax.iota(jnp.uint32, total)))
    if count_nonfinite:
        lanes.append(jnp.concatenate(bads))
    chunks = jnp.sum(jnp.stack(lanes).reshape(len(lanes), -1, FLAT_CHUNK), axis=2, dtype=jnp.uint32)
    run = jnp.concatenate([jnp.zeros((len(lanes), 1), jnp.uint32), jnp.cumsum(chunks, axis=1, dtype=jnp.uint32)], 1)
    ends = np.array(bounds)
    sums = run[:, ends[1:]] - run[:, ends[:-1]]
    pad_sums = np.array(pad_sums, np.uint32).T  # (2, leaves)
    bad = sums[2] if count_nonfinite else jnp.zeros((len(leaves),), jnp.uint32)
    return sums[0] - pad_sums[0], sums[1] - pad_sums[1], bad


# Whether the step's digests take the Pallas kernel (pallas_kernels/digest) where it can run (`kernel_here`).
# Off: not shown faster in the step (module docstring); `scripts/digest_bench.py --kernel` times both.
DIGEST_KERNEL = False
# Leaves of at least this many of the digest kernel's programs take the kernel where it runs
KERNEL_MIN_PROGRAMS = 64


def kernel_here() -> bool:
    """Whether the digests take the Pallas kernel for large leaves: with DIGEST_KERNEL on, on a GPU, with one
    device (a pallas_call is not split over a sharded leaf; XLA's reductions are, shard by shard)."""
    return DIGEST_KERNEL and jax.default_backend() == "gpu" and jax.device_count() == 1


def tree_digest_and_finite(
    tree: Any,
    count_nonfinite: bool = True,
    grouped: bool = True,
    version: int = DIGEST_VERSION,
    alone_bytes: int | None = -1,
    kernel: bool | None = None,
    flat: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(tree_digest, bool[leaves]: each leaf has no inf/NaN), from one pass over each leaf (the non-finite
    guard rides on the digest's reads).

    `grouped`: leaves of one role in different layers (the same path once layer numbers are dropped, the same
    shape and dtype) are stacked and digested by one vmapped reduction instead of one reduction per leaf — a
    few dozen reductions for a tree of hundreds of leaves. Integer sums: the same bits either way (tested).
    `alone_bytes`: leaves of at least this many bytes are not stacked (-1: the module's ALONE_BYTES).
    `kernel`: leaves of at least KERNEL_MIN_PROGRAMS of its programs are digested by the Pallas kernel, one
    pass each (None: where `kernel_here`; the same bits either way).
    `flat`: the caller's leaves are on one device; a tree of at most FLAT_WORDS words (version 2, no kernel)
    is then digested by one hash pass over its concatenated bits (module docstring; the same bits)."""
    from detjax.pallas_kernels.backend import interpret_mode
    from detjax.pallas_kernels.digest import kernel as digest

    if alone_bytes == -1:
        alone_bytes = ALONE_BYTES
    if kernel is None:
        kernel = kernel_here()

    def lane_sums(x):
        return _lane_sums(x, count_nonfinite, version)

    def by_kernel(x):
        salt = int(meta_salt(x))
        return digest.lane_sums(
            x,
            bits_of=as_u32,
            hashes=element_hashes,
            positions=positions,
            salt=salt,
            version=version,
            count_nonfinite=count_nonfinite,
            interpret=interpret_mode(),
        )

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        return jnp.zeros((2,), jnp.uint32), jnp.ones((0,), bool)
    if flat and version == 2 and not kernel and sum(_words(x) for _, x in leaves) <= FLAT_WORDS:
        return _mixed(leaves, *_flat_sums(leaves, count_nonfinite))
    sums: list[Any] = [None] * len(leaves)
    groups: dict[Any, list[int]] = {}
    for i, (path, leaf) in enumerate(leaves):
        key = jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        big = not key and alone_bytes is not None and leaf.size * jnp.dtype(leaf.dtype).itemsize >= alone_bytes
        if kernel and not key and digest.takes(leaf, KERNEL_MIN_PROGRAMS):
            sums[i] = by_kernel(leaf)
        elif grouped and not key and not big:
            role = re.sub(r"\d+", "#", jax.tree_util.keystr(path))
            groups.setdefault((role, tuple(leaf.shape), str(leaf.dtype)), []).append(i)
        else:
            groups[("leaf", i)] = [i]
    for idx in _bounded(groups.values(), leaves):
        if len(idx) == 1:
            sums[idx[0]] = lane_sums(leaves[idx[0]][1])
            continue
        stacked = jnp.stack([leaves[i][1] for i in idx])
        h1, h2, bad = jax.vmap(lane_sums)(stacked)
        for n, i in enumerate(idx):
            sums[i] = (h1[n], h2[n], bad[n])
    h1s, h2s, bads = (jnp.stack([s[lane] for s in sums]) for lane in range(3))
    return _mixed(leaves, h1s, h2s, bads)


def _mixed(leaves: list, h1: jax.Array, h2: jax.Array, bad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tree digest, bool[leaves] finite) from the leaves' lane sums and non-finite counts (uint32[leaves]):
    each leaf's pair mixed with its path's salt, all leaves in one vector op and one integer sum (the bits of
    adding them one leaf at a time, without an op per leaf)."""
    salts = [
        int.from_bytes(hashlib.blake2s(jax.tree_util.keystr(p).encode(), digest_size=4).digest(), "little")
        for p, _ in leaves
    ]
    mixed = _fmix(jnp.stack([h1, h2], axis=1) ^ np.array(salts, np.uint32)[:, None]) * np.array([[1, 3]], np.uint32)
    return jnp.sum(mixed, axis=0, dtype=jnp.uint32), bad == 0


def digest_hex(d: Any) -> str:
    d = np.asarray(d, dtype=np.uint32).reshape(-1)
    return "".join(f"{int(v):08x}" for v in d)


def exact(value: Any) -> dict[str, Any]:
    """A float stored exactly (hex of its binary value) beside a readable one."""
    v = float(np.asarray(value))
    return {"hex": v.hex(), "value": v}


FLOAT_FIELDS = ("lm_loss", "aux_loss", "mtp_loss", "grad_norm", "lr")
DIGEST_FIELDS = ("params", "grads", "opt_state", "batch", "rng")


def record(step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """One fingerprint line from the metrics the train step returned (already on host)."""
    rec: dict[str, Any] = {"step": step, "digest_version": DIGEST_VERSION}
    for k in FLOAT_FIELDS:
        rec[k] = exact(metrics[k])
    rec["digest"] = {k: digest_hex(metrics["digest"][k]) for k in DIGEST_FIELDS}
    if "collections" in metrics["digest"]:  # model.fp8 only (scales and amax histories): default records unchanged
        rec["digest"]["collections"] = digest_hex(metrics["digest"]["collections"])
    if "skipped" in metrics:  # train.on_nonfinite=skip_step only: the default record is unchanged
        rec["skipped"] = bool(metrics["skipped"])
    if "eval" in metrics:  # steps that ran the held-out evaluation (eval.every) only
        loss, digest = eval_summary(metrics["eval"])
        rec["eval"] = {"loss": exact(loss), "digest": digest}
    return rec


def eval_summary(ev: dict[str, Any]) -> tuple[float, str]:
    """ev = {"sums": each held-out batch's float32 cross-entropy sum, "tokens": the tokens they cover} ->
    (the held-out loss: the sums added in order in float64, over the tokens; a digest of the sums' bits)."""
    arr = np.asarray(ev["sums"], dtype=np.float32).reshape(-1)
    digest = hashlib.blake2s(arr.tobytes(), digest_size=8).hexdigest()
    return float(np.sum(arr.astype(np.float64)) / int(ev["tokens"])), digest


def dumps(rec: dict[str, Any]) -> str:
    return json.dumps(rec, sort_keys=True)
