"""Mosaic GPU vs Triton matmul on the GPU: bits and time of every product (fwd, dx, dw) of every gpu_dense and
gpu_medium weight shape at M = 8192, each forced through one kernel (matmul_kernel's sweep_tiles `backend`;
the Triton side with the tile set the shape class pins). Prints per product both times (median of 5 timings
of 20 back-to-back calls, ms, and TFLOP/s), the speed ratio and whether the outputs are byte-equal; MOSAIC_OK
at the end when every product ran. Needs a Hopper GPU.

    python3 scripts/matmul_kernels_check.py

docs/benchmarks-history.md set 16 ran this logic as a one-off script before it was tidied into this file (same
products, inputs, timing and comparison).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from detjax.pallas_kernels.matmul import mosaic
from detjax.pallas_kernels.matmul.kernel import TILE_SETS, matmul_kernel, tile_set

M = 8192
WEIGHTS = [  # (K, N) of every bf16 projection of gpu_dense and gpu_medium (scripts/gemm_bench.py SHAPES)
    (1024, 1536),
    (1024, 1024),
    (1024, 8192),
    (4096, 1024),
    (1024, 32768),
    (1024, 4352),
    (2048, 1024),
    (1024, 2048),
]


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)


def _bench(f, *args, n: int = 20) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            r = f(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t) / n * 1e3)
    return sorted(times)[2]


def _product(kind: str, out_dtype, tiles: tuple):
    return jax.jit(lambda a, b: matmul_kernel(a, b, kind=kind, out_dtype=out_dtype, interpret=False, sweep_tiles=tiles))


def main() -> None:
    print("mosaic available:", mosaic.available(), jax.devices()[0].compute_capability, flush=True)
    ok = True
    for k, n in WEIGHTS:
        ks = jax.random.split(jax.random.key(k + n), 3)
        x = jax.random.normal(ks[0], (M, k), jnp.float32).astype(jnp.bfloat16)
        w = jax.random.normal(ks[1], (k, n), jnp.float32).astype(jnp.bfloat16)
        g = jax.random.normal(ks[2], (M, n), jnp.float32).astype(jnp.bfloat16)
        for kind, a, b, od in [("fwd", x, w, jnp.bfloat16), ("dx", g, w, jnp.bfloat16), ("dw", x, g, jnp.float32)]:
            triton = tuple(sorted(TILE_SETS[tile_set(kind, jnp.bfloat16, k, n)].items()))
            try:
                fm, ft = _product(kind, od, (("backend", "mosaic"),)), _product(kind, od, triton)
                om, ot = fm(a, b), ft(a, b)
                same = np.array_equal(_bits(om), _bits(ot))
                om32, ot32 = om.astype(jnp.float32), ot.astype(jnp.float32)
                rel = float(jnp.max(jnp.abs(om32 - ot32)) / jnp.max(jnp.abs(ot32)))
                tm, tt = _bench(fm, a, b), _bench(ft, a, b)
                fl = 2 * M * k * n
                print(
                    f"{k}x{n} {kind}: mosaic {tm:.4f} ms ({fl / tm / 1e9:.0f}) triton {tt:.4f} ({fl / tt / 1e9:.0f}) "
                    f"x{tt / tm:.2f} byte-equal {same} rel {rel:.1e}",
                    flush=True,
                )
            except Exception as e:  # report every product, then fail at the end
                ok = False
                print(f"{k}x{n} {kind}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
    print("MOSAIC_OK" if ok else "MOSAIC_FAILED")


if __name__ == "__main__":
    main()
