"""Chunked SSD vs the quadratic 'minimal SSD' and the token-by-token recurrence.

Tolerance: all three are float32 and mathematically equal; they differ only in summation order and in
exp(cumsum) vs products of exp, so they agree to ~1e-6 relative. We assert max |diff| <= 2e-5 * max |ref|.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detjax.pallas_kernels.ssd.reference import segsum, ssd_chunked, ssd_quadratic, ssd_sequential

TOL = 2e-5


def _inputs(seed, b=2, l=32, h=3, p=4, n=5):
    k = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(k[0], (b, l, h, p))
    dt = jax.nn.softplus(jax.random.normal(k[1], (b, l, h)) - 1.0)
    a = -jnp.exp(jax.random.normal(k[2], (h,)))[None, None, :] * dt
    bb = jax.random.normal(k[3], (b, l, n))
    cc = jax.random.normal(k[4], (b, l, n))
    return x * dt[..., None], a, bb, cc


def _rel(out, ref):
    return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))


@pytest.mark.parametrize("chunk", [4, 8, 32])
def test_chunked_equals_quadratic_and_sequential(chunk):
    args = _inputs(chunk)
    y_c = ssd_chunked(*args, chunk=chunk)
    y_q = ssd_quadratic(*args)
    y_s = ssd_sequential(*args)
    assert _rel(y_c, y_q) <= TOL
    assert _rel(y_c, y_s) <= TOL
    assert _rel(y_q, y_s) <= TOL


def test_chunked_gradients_match_quadratic():
    args = _inputs(7)
    w = jax.random.normal(jax.random.key(9), args[0].shape)

    def loss(fn, *a):
        return jnp.sum(fn(*a) * w)

    g_c = jax.grad(lambda *a: loss(lambda *b: ssd_chunked(*b, chunk=8), *a), argnums=(0, 1, 2, 3))(*args)
    g_q = jax.grad(lambda *a: loss(ssd_quadratic, *a), argnums=(0, 1, 2, 3))(*args)
    for gc, gq in zip(g_c, g_q, strict=True):
        assert np.all(np.isfinite(np.asarray(gc)))
        assert _rel(gc, gq) <= 1e-4


def test_segsum_definition():
    a = jnp.arange(1.0, 5.0)
    s = np.asarray(segsum(a))
    assert s[3, 1] == 3.0 + 4.0 and s[2, 2] == 0.0 and s[1, 2] == -np.inf


def test_chunk_must_divide_length():
    with pytest.raises(ValueError, match="not divisible by chunk"):
        ssd_chunked(*_inputs(0, l=12), chunk=8)
