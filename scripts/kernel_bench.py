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


def rel_err(a, b) -> float:
    """max |a - b| / max |b| over all leaves (float32)."""
    errs = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        errs.append(float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30)))
    return max(errs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument(
        "--kernels", default="rmsnorm,segment_sum,flash_attention,ssd,gmm,matmul,ce,conv,gated_norm,sum_heads"
    )
    a = ap.parse_args()
    which = a.kernels.split(",")
    from detjax.pallas_kernels.harness import count_differing_replays, matmul_contention

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, backend {jax.default_backend()}", flush=True)
    rows = []

    def measure(name, pal, ref, args, alt_name, extra=()):
        """Replays (quiet, contended), error vs the alternative, times; one table row (+ extra alternatives)."""
        err = rel_err(pal(*args), ref(*args))
        d0 = count_differing_replays(pal, args, a.replays)
        d1 = count_differing_replays(pal, args, a.replays, matmul_contention(4096, 20))
        rows.append((name, d0, d1, f"{err:.1e}", bench(pal, args), alt_name, bench(ref, args)))
        for alt, fn in extra:
            rows.append(("", "", "", "", "", alt, bench(fn, args)))
        print(rows[-1 - len(extra)], flush=True)

    k = jax.random.split(jax.random.key(0), 4)
    g = jax.random.normal(k[2], (16384, 512))
    if "rmsnorm" in which:  # the gpu_small shape: 16 x 1024 tokens, d_model 512
        from detjax.pallas_kernels.rmsnorm.ops import rmsnorm
        from detjax.pallas_kernels.rmsnorm.reference import rmsnorm_ref

        x = jax.random.normal(k[0], (16384, 512), jnp.float32)
        w = 1 + 0.1 * jax.random.normal(k[1], (512,))

        def fb(norm):
            return jax.jit(lambda x, w: jax.value_and_grad(lambda x, w: jnp.sum(norm(x, w) * g), argnums=(0, 1))(x, w))

        pal, ref = fb(lambda x, w: rmsnorm(x, w, 1e-5)), fb(lambda x, w: rmsnorm_ref(x, w, 1e-5))
        measure("rmsnorm fwd+bwd", pal, ref, (x, w), "XLA jnp (fused)")
    ids = jax.random.randint(k[3], (16384,), 0, 264)
    scat = jax.jit(lambda i, g: jnp.zeros((264, 512)).at[i].add(g))
    if "segment_sum" in which:  # embedding gradient: 16384 tokens, vocab 264, d 512
        from detjax.pallas_kernels.segment_sum.ops import segment_sum

        seg = jax.jit(lambda i, g: segment_sum(i, g, 264))
        onehot = jax.jit(lambda i, g: jnp.einsum("tv,td->vd", jax.nn.one_hot(i, 264), g))
        measure("segment_sum (embed grad)", seg, scat, (ids, g), "XLA scatter-add", [("XLA one-hot einsum", onehot)])
    if "flash_attention" in which:  # B 16, L 1024, H 8, K 2, head dim 64 (bf16), fwd+bwd
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
        measure("flash attention fwd+bwd", fa, xla, (q, kk, vv), "jax.nn.dot_product_attention")
    if "ssd" in which:  # one gpu_small Mamba2 layer per microbatch: B 8, L 1024, H 16, P 64, N 64, chunk 64
        from detjax.pallas_kernels.ssd.ops import ssd
        from detjax.pallas_kernels.ssd.reference import ssd_chunked

        ks = jax.random.split(jax.random.key(7), 5)
        xs = jax.random.normal(ks[0], (8, 1024, 16, 64)) * 0.1
        av = -jnp.exp(jax.random.normal(ks[1], (8, 1024, 16))) * 0.05
        bs, cs = jax.random.normal(ks[2], (8, 1024, 64)), jax.random.normal(ks[3], (8, 1024, 64))
        gy = jax.random.normal(ks[4], xs.shape)

        def ssd_fb(f):
            return jax.jit(lambda *args: jax.vjp(f, *args)[1](gy))

        measure(
            "ssd scan fwd+bwd",
            ssd_fb(lambda *t: ssd(*t, 64)),
            ssd_fb(lambda *t: ssd_chunked(*t, 64)),
            (xs, av, bs, cs),
            "XLA chunked SSD (jnp einsums)",
        )
    if "gmm" in which:  # MoE up-projection of gpu_small: 8 x 1024 tokens x top-2 rows, 512 -> 768, 8 experts
        from detjax.pallas_kernels.gmm.ops import grouped_matmul

        kg = jax.random.split(jax.random.key(9), 4)
        experts = jax.random.randint(kg[0], (16384,), 0, 8)
        gs = jnp.bincount(experts, length=8).astype(jnp.int32)
        xr = jax.random.normal(kg[1], (16384, 512), jnp.bfloat16)
        wr = (jax.random.normal(kg[2], (8, 512, 768)) * 0.05).astype(jnp.bfloat16)
        gr = jax.random.normal(kg[3], (16384, 768))

        def gmm_fb(f):
            return jax.jit(lambda x, w: jax.vjp(lambda x, w: f(x, w, gs), x, w)[1](gr))

        rd = gmm_fb(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))
        measure("gmm + tgmm (fwd+bwd)", gmm_fb(grouped_matmul), rd, (xr, wr), "jax.lax.ragged_dot fwd+bwd")
    if "matmul" in which:  # the gpu_medium MLP up-projection: 4 x 2048 tokens, 1024 -> 4096, fwd + dx + dw
        from detjax.pallas_kernels.matmul.ops import matmul

        km = jax.random.split(jax.random.key(11), 3)
        xm = jax.random.normal(km[0], (8192, 1024), jnp.bfloat16)
        wm = jax.random.normal(km[1], (1024, 4096)) * 0.03
        gm = jax.random.normal(km[2], (8192, 4096), jnp.bfloat16)

        def mm_fb(f):
            return jax.jit(lambda x, w: jax.vjp(f, x, w)[1](gm))

        xla_mm = mm_fb(lambda x, w: jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype))
        measure("matmul fwd+dx+dw", mm_fb(lambda x, w: matmul(x, w)), xla_mm, (xm, wm), "XLA dot (autotuned) fwd+bwd")
    if "ce" in which:  # the LM head's loss, one gpu_medium microbatch: 4 x 2048 tokens, vocab 32768, bf16 logits
        from detjax.pallas_kernels.backend import interpret_mode
        from detjax.pallas_kernels.ce.kernel import ce_fwd
        from detjax.pallas_kernels.ce.reference import token_ce_ref

        kc = jax.random.split(jax.random.key(13), 2)
        lc = (4 * jax.random.normal(kc[0], (8192, 32768))).astype(jnp.bfloat16)
        tc = jax.random.randint(kc[1], (8192,), 0, 32768)
        one_pass = jax.jit(lambda x, t: ce_fwd(x, t, interpret=interpret_mode()))
        measure("cross-entropy fwd (one pass)", one_pass, jax.jit(token_ce_ref), (lc, tc), "XLA logsumexp + label")
    if "conv" in which:  # the gpu_medium Mamba2 convolution + SiLU: 4 x 2048 tokens, 2048 channels, width 4
        from detjax.pallas_kernels.conv.ops import conv_silu
        from detjax.pallas_kernels.conv.reference import conv_silu_ref

        kv = jax.random.split(jax.random.key(15), 4)
        xv = jax.random.normal(kv[0], (4, 2048, 2048)).astype(jnp.bfloat16)
        wv, bv = 0.5 * jax.random.normal(kv[1], (4, 2048)), 0.1 * jax.random.normal(kv[2], (2048,))
        gv = jax.random.normal(kv[3], (4, 2048, 2048))

        def conv_fb(f):
            return jax.jit(lambda x, w, b: jax.vjp(f, x, w, b)[1](gv))

        measure("conv + silu fwd+bwd", conv_fb(conv_silu), conv_fb(conv_silu_ref), (xv, wv, bv), "XLA autodiff")
    if "gated_norm" in which:  # the gpu_medium Mamba2 gate and gated norm: 4 x 2048 tokens, inner width 2048
        from detjax.pallas_kernels.gated_norm.ops import gated_norm
        from detjax.pallas_kernels.gated_norm.reference import gated_norm_ref
        from detjax.pallas_kernels.rmsnorm.ops import rmsnorm

        kg = jax.random.split(jax.random.key(17), 6)
        yg, xg = jax.random.normal(kg[0], (8192, 2048)), jax.random.normal(kg[1], (8192, 2048))
        zg = jax.random.normal(kg[2], (8192, 2048)).astype(jnp.bfloat16)
        dg, wg = jax.random.normal(kg[3], (2048,)), 1 + 0.1 * jax.random.normal(kg[4], (2048,))
        og = jax.random.normal(kg[5], (8192, 2048)).astype(jnp.bfloat16)

        def unfused(y, x, z, d, w, eps, out_dtype):  # the mixer without model.mamba2.KERNEL_GATE
            g = (y + d[None, :] * x) * jax.nn.silu(z.astype(jnp.float32))
            return rmsnorm(g, w, eps, out_dtype)

        def gate_fb(f):
            return jax.jit(lambda *args: jax.vjp(lambda *a: f(*a, 1e-5, jnp.bfloat16), *args)[1](og))

        measure(
            "gate + gated norm fwd+bwd",
            gate_fb(gated_norm),
            gate_fb(unfused),
            (yg, xg, zg, dg, wg),
            "XLA gate + RMSNorm kernel",
            [("XLA jnp", gate_fb(gated_norm_ref))],
        )
    if "sum_heads" in which:  # the gpu_medium SSD backward's dB / dC slots: 4 batch rows x 32 heads, L 2048, N 64
        from detjax.pallas_kernels.backend import interpret_mode
        from detjax.pallas_kernels.ssd.kernel import sum_heads
        from detjax.pallas_kernels.ssd.ops import _sum_heads_in_order

        kh = jax.random.split(jax.random.key(19), 2)
        sb, sc = jax.random.normal(kh[0], (128, 2048, 64)), jax.random.normal(kh[1], (128, 2048, 64))
        xla_chain = jax.jit(lambda b, c: (_sum_heads_in_order(b, 4, 32), _sum_heads_in_order(c, 4, 32)))
        kernel = jax.jit(lambda b, c: sum_heads(b, c, h=32, interpret=interpret_mode()))
        measure("SSD dB/dC head sum", kernel, xla_chain, (sb, sc), "XLA chain of adds (fused)")
    neg = count_differing_replays(scat, (ids, g), a.replays)
    print(f"\nnegative control: XLA scatter-add (atomics), {neg} of {a.replays - 1} replays differ from the first")
    n = a.replays - 1
    print(
        f"\n| kernel | differing replays (of {n}) | under contention | rel. error vs alternative | Pallas ms "
        "| alternative | alt ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
