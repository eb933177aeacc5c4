"""Digests: deterministic, sensitive to one bit, to permutation, to dtype and shape; row-wise mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import detjax.fingerprint as fp
from detjax.fingerprint import digest_hex, row_digest, tensor_digest, tree_digest, tree_digest_and_finite


def _xor_digest(x):
    """What a whole-tensor XOR fold sees: the negative control for permutations."""
    return int(np.bitwise_xor.reduce(np.asarray(x).view(np.uint32).ravel()))


def test_one_bit_changes_digest():
    x = jax.random.normal(jax.random.key(0), (64, 32))
    bits = np.asarray(x).view(np.uint32).copy()
    bits[17, 5] ^= 1
    y = jnp.asarray(bits.view(np.float32))
    assert digest_hex(tensor_digest(x)) != digest_hex(tensor_digest(y))
    assert digest_hex(tensor_digest(x)) == digest_hex(tensor_digest(jnp.array(x)))


def test_signed_zero_and_dtype_and_shape():
    z = jnp.zeros((4,))
    assert digest_hex(tensor_digest(z)) != digest_hex(tensor_digest(-z))
    assert digest_hex(tensor_digest(z)) != digest_hex(tensor_digest(z.astype(jnp.bfloat16)))
    assert digest_hex(tensor_digest(z)) != digest_hex(tensor_digest(z.reshape(2, 2)))


def test_row_permutation_caught_by_row_digest_not_by_xor():
    routing = jnp.array(np.random.default_rng(0).integers(0, 8, (6, 2)), dtype=jnp.int32)
    permuted = routing[jnp.array([1, 0, 2, 3, 4, 5])]
    assert _xor_digest(routing) == _xor_digest(permuted)  # XOR is blind to the swap
    ra, rb = np.asarray(row_digest(routing)), np.asarray(row_digest(permuted))
    assert not np.array_equal(ra, rb)
    assert np.array_equal(ra[2:], rb[2:]) and np.array_equal(ra[0], rb[1])  # names the moved rows
    assert digest_hex(tensor_digest(routing)) != digest_hex(tensor_digest(permuted))


def test_tree_digest_sees_moved_leaves():
    a, b = jnp.ones(3), jnp.zeros(3)
    assert digest_hex(tree_digest({"x": a, "y": b})) != digest_hex(tree_digest({"x": b, "y": a}))
    assert digest_hex(tree_digest({"k": jax.random.key(1)})) != digest_hex(tree_digest({"k": jax.random.key(2)}))


def test_grouped_tree_digest_equals_the_per_leaf_one(monkeypatch):
    """Same-role leaves of different layers are digested by one stacked reduction: the same bits and per-leaf
    finite flags as one reduction per leaf; swapping two layers' leaves still changes the digest."""
    ks = jax.random.split(jax.random.key(0), 8)
    tree = {f"layer_{i}": {"w": jax.random.normal(ks[i], (6, 5)), "s": jnp.full((5,), float(i))} for i in range(4)}
    tree["head"] = jax.random.normal(ks[7], (5, 3)).astype(jnp.bfloat16)
    tree["layer_2"]["w"] = tree["layer_2"]["w"].at[3, 1].set(jnp.nan)
    grouped, ok_g = jax.jit(lambda t: tree_digest_and_finite(t, grouped=True))(tree)
    single, ok_s = jax.jit(lambda t: tree_digest_and_finite(t, grouped=False))(tree)
    assert np.array_equal(np.asarray(grouped), np.asarray(single))
    assert np.asarray(ok_g).tolist() == np.asarray(ok_s).tolist()
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [p for p, ok in zip(paths, np.asarray(ok_g), strict=True) if not ok] == ["['layer_2']['w']"]
    swapped = {**tree, "layer_0": tree["layer_1"], "layer_1": tree["layer_0"]}
    assert digest_hex(tree_digest(swapped)) != digest_hex(grouped)  # negative control
    monkeypatch.setattr(fp, "GROUP_BYTES", 2 * 6 * 5 * 4)  # two w leaves per stacked run: still the same bits
    assert np.array_equal(np.asarray(jax.jit(lambda t: tree_digest_and_finite(t))(tree)[0]), np.asarray(single))
    # the w leaves (120 bytes) alone, the s leaves (20 bytes) stacked: still the same bits and flags
    mixed, ok_m = jax.jit(lambda t: tree_digest_and_finite(t, alone_bytes=100))(tree)
    assert np.array_equal(np.asarray(mixed), np.asarray(single))
    assert np.asarray(ok_m).tolist() == np.asarray(ok_s).tolist()


def _count_flat_sums(monkeypatch) -> list:
    """fingerprint._flat_sums wrapped to append to the returned list on every call (the flat form ran)."""
    calls: list = []
    flat_sums = fp._flat_sums
    monkeypatch.setattr(fp, "_flat_sums", lambda *a, **k: calls.append(1) or flat_sums(*a, **k))
    return calls


def test_flat_tree_digest_equals_the_grouped_one(monkeypatch):
    """The flat form (one hash pass over the concatenated bits, per-leaf sums from a cumulative sum) gives the
    grouped form's digest and per-leaf finite flags: float32, bf16, int and PRNG-key leaves, a NaN and an inf
    in two leaves, with and without the finite count. Negative controls: the flat digest of a tree with two
    equal-shaped leaves swapped differs, and so does one with a leaf's first two elements swapped (positions
    within a leaf count). Above FLAT_WORDS the grouped form runs (the same bits)."""
    ks = jax.random.split(jax.random.key(1), 4)
    tree = {
        "a": jax.random.normal(ks[0], (7, 3)),
        "b": jax.random.normal(ks[1], (7, 3)).astype(jnp.bfloat16),
        "c": jnp.arange(5, dtype=jnp.int32),
        "key": ks[2],
        "d": jax.random.normal(ks[3], (7, 3)),
    }
    tree["a"] = tree["a"].at[2, 1].set(jnp.nan)
    tree["b"] = tree["b"].at[0, 0].set(jnp.inf)
    flags = {}
    for count in (True, False):
        want, ok_want = jax.jit(lambda t, c=count: tree_digest_and_finite(t, count_nonfinite=c))(tree)
        got, ok_got = jax.jit(lambda t, c=count: tree_digest_and_finite(t, count_nonfinite=c, flat=True))(tree)
        assert np.array_equal(np.asarray(got), np.asarray(want))
        assert np.asarray(ok_got).tolist() == np.asarray(ok_want).tolist()
        flags[count] = np.asarray(ok_got).tolist()
    assert flags == {True: [False, False, True, True, True], False: [True] * 5}  # leaves a, b, c, d, key
    flat = jax.jit(lambda t: tree_digest(t, flat=True))
    assert digest_hex(flat(tree)) == digest_hex(tree_digest(tree))
    assert digest_hex(flat({**tree, "a": tree["d"], "d": tree["a"]})) != digest_hex(flat(tree))
    moved = tree["d"].at[0, 0].set(tree["d"][0, 1]).at[0, 1].set(tree["d"][0, 0])
    assert digest_hex(flat({**tree, "d": moved})) != digest_hex(flat(tree))
    calls = _count_flat_sums(monkeypatch)
    jax.jit(lambda t: tree_digest(t, flat=True)).trace(tree)
    assert calls == [1]  # the flat form ran at this size (the control for the next check)
    monkeypatch.setattr(fp, "FLAT_WORDS", 8)
    assert digest_hex(jax.jit(lambda t: tree_digest(t, flat=True))(tree)) == digest_hex(tree_digest(tree))
    assert calls == [1]  # above FLAT_WORDS it did not: the grouped form gave these bits


def test_the_step_takes_the_flat_digest_on_one_device_only(tiny_path, monkeypatch):
    """The train step's digests take the flat form on a one-device layout and the grouped form on a mesh (where
    the concatenation would gather the leaves and reshard the ops that make them). Traced, not compiled."""
    from detjax.config import load_config
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer

    calls = _count_flat_sums(monkeypatch)
    for over, devices, want in (([], 1, 3), (["mesh.data=2"], 2, 0)):
        cfg = load_config(tiny_path, ["run.tensorboard=false", *over])
        tr = Trainer(cfg, build_layout(cfg, jax.devices()[:devices]))
        batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), jnp.int32)
        calls.clear()
        step = jax.jit(tr.train_step, in_shardings=(tr.state_shardings(), tr.batch_sharding()))
        step.trace(tr.abstract_state(), batch)
        assert len(calls) == want, over  # params, grads, optimizer state (no fp8 collections)


def test_digest_values_are_pinned():
    """The digest is a file format (fingerprints.jsonl, checkpoint meta): each version's values are pinned.
    Version 1's were produced by the first implementation (two separate reductions) and must stay, so that
    checkpoints written with it still verify; version 2 is the current one. Sharded or not, the same bits.
    The float32 input is built by numpy from its exact bits (i / 7 as i times float32(1/7), which jax up to
    0.12.0.1 computed for jnp's `/ 7`; jax 0.12.1 rounds the quotient itself), so the pins hold whatever
    jax's division does."""
    f32 = jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(1 / 7))
    bf16 = (jnp.arange(10, dtype=jnp.float32) - 5).astype(jnp.bfloat16)
    i32 = jnp.arange(6, dtype=jnp.int32).reshape(2, 3, 1)
    assert digest_hex(tensor_digest(f32, 1)) == "e236fcd004494196"
    assert digest_hex(tensor_digest(bf16, 1)) == "6d36d1ba419cbb94"
    assert digest_hex(tensor_digest(i32, 1)) == "a59fe698a1a15f22"
    assert digest_hex(tensor_digest(f32)) == "877f6ebd58e8178c"
    assert digest_hex(row_digest(f32)) == "c441a4418de72390d5140190a0a3c2eb58183bacab3c7560"
    assert digest_hex(tensor_digest(bf16)) == "2c53affcd191876e"
    assert digest_hex(tensor_digest(i32)) == "f88463199e7b9a72"
    assert digest_hex(row_digest(i32)) == "796a1778081f4367e3c17370dc63387e"
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if len(jax.devices()) < 4:  # a one-GPU run (DETJAX_TEST_GPU=1) checks the values above only
        return
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    big = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) / 3
    split = jax.device_put(big, NamedSharding(mesh, PartitionSpec("a", "b")))
    assert digest_hex(jax.jit(tensor_digest)(split)) == digest_hex(tensor_digest(big))


def test_both_digest_versions_see_every_single_bit_and_swaps_and_differ_from_each_other():
    """Version 2 (one position hash per element) keeps version 1's sensitivity: every single-bit flip of every
    element changes both lanes, and swapping two elements changes the digest.
    Checkpoints written with version 1 are verified with version 1 (tests/test_ckpt.py)."""
    x = jax.random.normal(jax.random.key(3), (8, 16))
    bits = np.asarray(x).view(np.uint32)
    flips = np.zeros((32 * x.size,) + x.shape, np.uint32)
    for e in range(x.size):
        for b in range(32):
            flips[e * 32 + b].reshape(-1)[e] = np.uint32(1) << np.uint32(b)
    variants = jnp.asarray((bits[None] ^ flips).view(np.float32))
    swapped = bits.copy()
    swapped[0, 0], swapped[5, 9] = bits[5, 9], bits[0, 0]
    for v in (1, 2):
        base = np.asarray(tensor_digest(x, v))
        each = np.asarray(jax.vmap(lambda t, v=v: tensor_digest(t, v))(variants))
        assert (each != base).all(), f"version {v}: a bit flip left a lane unchanged"
        assert not np.array_equal(np.asarray(tensor_digest(jnp.asarray(swapped.view(np.float32)), v)), base)
    assert digest_hex(tensor_digest(x, 1)) != digest_hex(tensor_digest(x, 2))


# the fingerprint's hash functions, as tree_digest_and_finite hands them to the digest kernel (interpreted)
_HOW = {"bits_of": fp.as_u32, "hashes": fp.element_hashes, "positions": fp.positions, "interpret": True}


def _small_digest_tiles(monkeypatch):
    """The digest kernel at 128-wide rows, programs of 8 rows in 4-row sub-blocks (tiny tensors, several
    programs and a tail of rows on the interpreter)."""
    from detjax.pallas_kernels.digest import kernel as dk

    monkeypatch.setattr(dk, "WIDTH", 128)
    monkeypatch.setattr(dk, "TILES", {"rows": 8, "block_rows": 4, "num_warps": 4, "num_stages": 1})
    jax.clear_caches()
    return dk


def test_digest_kernel_gives_the_reductions_bits(monkeypatch):
    """The Pallas digest (interpreted) gives _lane_sums' exact bits: float32 with a tail of rows past the last
    whole program and non-finite elements, bfloat16, int32, both digest versions; and a tree digested with the
    kernel for its large leaves equals the XLA reductions'. Negative controls: swapping two elements, or one
    ulp in one element, changes the kernel's sums."""
    dk = _small_digest_tiles(monkeypatch)
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((21, 4, 128)).astype(np.float32)  # 84 rows: 10 programs and 4 tail rows
    f32[3, 1, 7], f32[20, 3, 127] = np.inf, np.nan
    cases = [
        jnp.asarray(f32),
        jnp.asarray(rng.standard_normal((16, 128)), jnp.bfloat16),
        jnp.asarray(rng.integers(-(2**31), 2**31, (8, 256)), jnp.int32),
    ]
    for x in cases:
        for version in fp.DIGEST_VERSIONS:
            want = [int(v) for v in fp._lane_sums(x, True, version)]
            got = dk.lane_sums(x, salt=int(fp.meta_salt(x)), version=version, count_nonfinite=True, **_HOW)
            assert [int(v) for v in got] == want, (x.dtype, version)
    assert int(dk.lane_sums(cases[0], salt=1, version=2, count_nonfinite=True, **_HOW)[2]) == 2

    def sums(x):
        return [int(v) for v in dk.lane_sums(x, salt=5, version=2, count_nonfinite=False, **_HOW)[:2]]

    base = sums(cases[0])
    swapped = f32.copy()
    swapped[0, 0, [5, 6]] = swapped[0, 0, [6, 5]]
    assert sums(jnp.asarray(swapped)) != base
    ulp = f32.copy()
    ulp.view(np.uint32)[10, 2, 64] ^= 1
    assert sums(jnp.asarray(ulp)) != base

    monkeypatch.setattr(fp, "KERNEL_MIN_PROGRAMS", 2)
    taken = []
    real = dk.lane_sums
    monkeypatch.setattr(dk, "lane_sums", lambda x, **kw: taken.append(x.shape) or real(x, **kw))
    tree = {"a": cases[0], "b": {"w": cases[1], "small": jnp.ones((3, 5))}, "c": cases[2]}
    with_kernel = jax.jit(lambda t: tree_digest_and_finite(t, kernel=True))(tree)
    without = jax.jit(lambda t: tree_digest_and_finite(t, kernel=False))(tree)
    assert np.array_equal(np.asarray(with_kernel[0]), np.asarray(without[0]))
    assert np.asarray(with_kernel[1]).tolist() == np.asarray(without[1]).tolist() == [False, True, True, True]
    assert taken == [(21, 4, 128), (16, 128), (8, 256)]  # the large leaves took the kernel, the (3, 5) one not


@pytest.mark.gpu
def test_digest_kernel_replays_and_matches_on_gpu():
    """Compiled (Triton), at the pinned tiles: the reductions' bits for a (4100, 1024) float32 tensor (64
    whole programs and a tail) and a bfloat16 one, the same bytes on every replay, quiet and beside a GEMM
    stream."""
    from detjax.pallas_kernels.digest import kernel as dk
    from detjax.pallas_kernels.harness import assert_replays_bit_exact, matmul_contention

    x = jax.random.normal(jax.random.key(3), (4100, 1024), jnp.float32).at[77, 5].set(jnp.inf)
    for a in (x, x.astype(jnp.bfloat16)):
        salt = int(fp.meta_salt(a))
        how = dict(_HOW, interpret=False)
        fn = jax.jit(lambda a, salt=salt, how=how: dk.lane_sums(a, salt=salt, version=2, count_nonfinite=True, **how))
        want = [int(v) for v in jax.jit(lambda a: fp._lane_sums(a, True, 2))(a)]
        assert [int(v) for v in fn(a)] == want and want[2] == 1
        assert_replays_bit_exact(fn, (a,), replays=5)
        assert_replays_bit_exact(fn, (a,), replays=3, contention=matmul_contention(256, 5))
