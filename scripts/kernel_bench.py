"""Pallas kernels on the GPU: bit-exact replays (forward and backward, quiet and under contention), the
atomic negative control, and kernel time vs the fastest XLA alternative.

    python3 scripts/kernel_bench.py --replays 20

Run without determinism flags (XLA's scatter-add must be free to use atomics for the negative control).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp


def bench(fn, args, reps=50):
    import statistics
    import time

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=20)
    a = ap.parse_args()
    from detjax.pallas_kernels.harness import count_differing_replays, matmul_contention
    from detjax.pallas_kernels.rmsnorm.ops import rmsnorm
    from detjax.pallas_kernels.rmsnorm.reference import rmsnorm_ref
    from detjax.pallas_kernels.segment_sum.ops import segment_sum

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, backend {jax.default_backend()}")
    rows = []
    k = jax.random.split(jax.random.key(0), 4)
    # RMSNorm at the gpu_small shape: 16 x 1024 tokens, d_model 512
    x = jax.random.normal(k[0], (16384, 512), jnp.float32)
    w = 1 + 0.1 * jax.random.normal(k[1], (512,))
    g = jax.random.normal(k[2], (16384, 512))

    def fb(norm):
        return jax.jit(lambda x, w: jax.value_and_grad(lambda x, w: jnp.sum(norm(x, w) * g), argnums=(0, 1))(x, w))

    pal, ref = fb(lambda x, w: rmsnorm(x, w, 1e-5)), fb(lambda x, w: rmsnorm_ref(x, w, 1e-5))
    d0 = count_differing_replays(pal, (x, w), a.replays)
    d1 = count_differing_replays(pal, (x, w), a.replays, matmul_contention(4096, 20))
    rows.append(("rmsnorm fwd+bwd", d0, d1, bench(pal, (x, w)), "XLA jnp (fused)", bench(ref, (x, w))))
    # embedding gradient: 16384 tokens, vocab 264, d 512
    ids = jax.random.randint(k[3], (16384,), 0, 264)
    seg = jax.jit(lambda i, g: segment_sum(i, g, 264))
    scat = jax.jit(lambda i, g: jnp.zeros((264, 512)).at[i].add(g))
    onehot = jax.jit(lambda i, g: jnp.einsum("tv,td->vd", jax.nn.one_hot(i, 264), g))
    d0 = count_differing_replays(seg, (ids, g), a.replays)
    d1 = count_differing_replays(seg, (ids, g), a.replays, matmul_contention(4096, 20))
    rows.append(("segment_sum (embed grad)", d0, d1, bench(seg, (ids, g)), "XLA scatter-add", bench(scat, (ids, g))))
    rows.append(("", "", "", "", "XLA one-hot einsum", bench(onehot, (ids, g))))
    # causal GQA attention at the gpu_small shape: B 16, L 1024, H 8, K 2, head dim 64 (bf16), fwd+bwd
    from detjax.pallas_kernels.flash_attention.ops import flash_attention

    ka = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(ka[0], (16, 1024, 8, 64), jnp.bfloat16)
    kk = jax.random.normal(ka[1], (16, 1024, 2, 64), jnp.bfloat16)
    vv = jax.random.normal(ka[2], (16, 1024, 2, 64), jnp.bfloat16)
    go = jax.random.normal(ka[3], q.shape, jnp.bfloat16)

    def attn_fb(f):
        return jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](go))

    fa = attn_fb(flash_attention)
    xla = attn_fb(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    d0 = count_differing_replays(fa, (q, kk, vv), a.replays)
    d1 = count_differing_replays(fa, (q, kk, vv), a.replays, matmul_contention(4096, 20))
    rows.append(
        (
            "flash attention fwd+bwd",
            d0,
            d1,
            bench(fa, (q, kk, vv)),
            "jax.nn.dot_product_attention",
            bench(xla, (q, kk, vv)),
        )
    )
    neg = count_differing_replays(scat, (ids, g), a.replays)
    print(f"\nnegative control: XLA scatter-add (atomics), {neg} of {a.replays - 1} replays differ from the first")
    n = a.replays - 1
    print(f"\n| kernel | differing replays (of {n}) | under contention | Pallas ms | alternative | alt ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
