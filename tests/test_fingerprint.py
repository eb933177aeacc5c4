"""Digests: deterministic, sensitive to one bit, to permutation, to dtype and shape; row-wise mode."""

import jax
import jax.numpy as jnp
import numpy as np

from detjax.fingerprint import digest_hex, row_digest, tensor_digest, tree_digest


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


def test_digest_values_are_pinned():
    """The digest is a file format (fingerprints.jsonl, checkpoint meta): these values were produced by the
    first implementation (two separate reductions); the current one (one reduction over both lanes) must
    give the same bits, sharded or not, so that old runs and checkpoints stay comparable."""
    f32 = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 7
    assert digest_hex(tensor_digest(f32)) == "e236fcd004494196"
    assert digest_hex(row_digest(f32)) == "e92d87c7c7d88f2cbf74d7affe1a9ac08aa63a0f39b01f00"
    assert digest_hex(tensor_digest((jnp.arange(10, dtype=jnp.float32) - 5).astype(jnp.bfloat16))) == (
        "6d36d1ba419cbb94"
    )
    i32 = jnp.arange(6, dtype=jnp.int32).reshape(2, 3, 1)
    assert digest_hex(tensor_digest(i32)) == "a59fe698a1a15f22"
    assert digest_hex(row_digest(i32)) == "408d334f4728c6b734e970797dcdd7c9"
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if len(jax.devices()) < 4:  # a one-GPU run (DETJAX_TEST_GPU=1) checks the values above only
        return
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    big = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) / 3
    split = jax.device_put(big, NamedSharding(mesh, PartitionSpec("a", "b")))
    assert digest_hex(jax.jit(tensor_digest)(split)) == digest_hex(tensor_digest(big))
