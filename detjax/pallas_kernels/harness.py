"""Replay harness: run a kernel N times on identical inputs and compare the output bytes.

Bytes, not values: signed zeros and NaN payloads count. `contention` runs a concurrent workload on the
device between and during replays (a thread dispatching independent work), to expose ordering races that
a quiet device hides.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _bytes(tree: Any) -> list[bytes]:
    out = []
    for x in jax.tree.leaves(tree):
        a = np.asarray(jax.device_get(x))
        out.append(a.dtype.str.encode() + str(a.shape).encode() + a.tobytes())
    return out


def matmul_contention(size: int = 2048, iters: int = 50) -> Callable[[threading.Event], None]:
    """A background workload: chains of large matmuls until stopped."""
    a = jax.random.normal(jax.random.key(123), (size, size), jnp.float32)
    f = jax.jit(lambda m: (m @ m) * 1e-3)

    def run(stop: threading.Event) -> None:
        m = a
        while not stop.is_set():
            for _ in range(iters):
                m = f(m)
            m.block_until_ready()

    return run


def count_differing_replays(
    fn: Callable[..., Any], inputs: tuple, replays: int = 20, contention: Callable | None = None
) -> int:
    """How many replays' output bytes differ from the first replay's."""
    stop = threading.Event()
    worker = threading.Thread(target=contention, args=(stop,), daemon=True) if contention else None
    if worker:
        worker.start()
    try:
        ref = _bytes(jax.block_until_ready(fn(*inputs)))
        diff = 0
        for _ in range(replays - 1):
            diff += _bytes(jax.block_until_ready(fn(*inputs))) != ref
    finally:
        stop.set()
        if worker:
            worker.join()
    return diff


def assert_replays_bit_exact(
    fn: Callable[..., Any], inputs: tuple, replays: int = 20, contention: Callable | None = None
) -> None:
    n = count_differing_replays(fn, inputs, replays, contention)
    if n:
        raise AssertionError(f"{n} of {replays - 1} replays differ in output bytes from the first replay")
