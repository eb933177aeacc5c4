"""Causal GQA attention kernels on one GPU, forward and forward + backward: detjax's two fixed-order flash
attentions (model.flash_backend triton / mosaic) against cuDNN's and XLA's (jax.nn.dot_product_attention), at
the shapes of the shape matrix. Per shape: median time, TFLOP/s, ratio to cuDNN, ||out - ref|| / ||ref|| against a
float32 reference on the same bf16 inputs (the largest over the output and the three gradients), and
byte-equal replays of each detjax backend (forward outputs and the three gradients).

    python3 scripts/attention_bench.py --shapes 2:4096:16:8:128,1:8192:16:8:128,4:2048:16:4:64

A shape is BATCH:SEQ:HEADS:KV_HEADS:HEAD_DIM (bf16). FLOPs count the causal half of the four (forward: two)
products: forward 2 * 2 * B * H * L^2 * D / 2, backward 2.5 x that (five products, one of them recomputed).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from kernel_bench import bench  # scripts/ is on sys.path when this file runs as a script


def rel_err(a, b) -> float:
    """max over leaves of ||a - b|| / ||b|| (Frobenius norms, float32)."""
    errs = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        errs.append(float(jnp.linalg.norm(x - y) / jnp.maximum(jnp.linalg.norm(y), 1e-30)))
    return max(errs)


def by_kv_heads(ref, q, k, v, g, budget_bytes=2**31):
    """ref(q, k, v, g) -> (o, (dq, dk, dv)) computed over groups of kv heads (each with its query heads), so
    that one group's float32 scores stay within budget_bytes: the yardstick at 64 heads x 8192 tokens would
    otherwise hold 16 GiB of scores and their residuals at once. The groups are independent, so the result is
    the whole call's."""
    b, length, h, _ = q.shape
    kh = k.shape[2]
    per_kv = b * (h // kh) * length * k.shape[1] * 4
    n = max((m for m in range(1, kh + 1) if kh % m == 0 and m * per_kv <= budget_bytes), default=1)
    g_q = (h // kh) * n
    parts = [
        ref(
            q[:, :, i * g_q : (i + 1) * g_q],
            k[:, :, i * n : (i + 1) * n],
            v[:, :, i * n : (i + 1) * n],
            g[:, :, i * g_q : (i + 1) * g_q],
        )
        for i in range(kh // n)
    ]
    o = jnp.concatenate([p[0] for p in parts], axis=2)
    grads = tuple(jnp.concatenate([p[1][j] for p in parts], axis=2) for j in range(3))
    return o, grads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2:4096:16:8:128,1:8192:16:8:128,2:4096:16:4:64,4:2048:16:4:64")
    ap.add_argument("--backends", default="triton,mosaic,cudnn,xla")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--replays", type=int, default=4)
    ap.add_argument("--stages", default="", help="Mosaic ring depths to try instead of mosaic.STAGES, e.g. fwd=2,dkv=2")
    ap.add_argument(
        "--fwd",
        default="",
        help="the Mosaic forward's options instead of mosaic.FWD, e.g. block_kv=128,pingpong=1,fold_scale=0",
    )
    ap.add_argument(
        "--persistent",
        default="",
        help="the Mosaic kernels to run persistent (mosaic.PERSISTENT; time only), e.g. fwd,dq,dkv",
    )
    a = ap.parse_args()
    from detjax.pallas_kernels.flash_attention import mosaic

    # block_kv and fold_scale change the bits (a test says which for block_kv); pingpong, persistent change time only
    for name in filter(None, a.persistent.split(",")):
        if name not in mosaic.PERSISTENT:
            ap.error(f"--persistent takes {', '.join(mosaic.PERSISTENT)}; got {name}")
        mosaic.PERSISTENT[name] = True
    for item in filter(None, a.fwd.split(",")):
        key, value = item.split("=")
        mosaic.FWD[key] = int(value) if key == "block_kv" else bool(int(value))

    for item in filter(None, a.stages.split(",")):  # ring depth: time only (the bytes are the same, a test says)
        kernel_name, depth = item.split("=")
        mosaic.STAGES[kernel_name] = int(depth)
    from detjax.pallas_kernels.flash_attention.ops import flash_attention
    from detjax.pallas_kernels.harness import count_differing_replays

    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, Mosaic rings {mosaic.STAGES}, forward {mosaic.FWD}, "
        f"persistent {mosaic.PERSISTENT}",
        flush=True,
    )
    impls = {
        "triton": lambda q, k, v: flash_attention(q, k, v, "triton"),
        "mosaic": lambda q, k, v: flash_attention(q, k, v, "mosaic"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    }
    rows = []
    for spec in a.shapes.split(","):
        b, length, h, kh, d = (int(x) for x in spec.split(":"))
        ks = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(ks[0], (b, length, h, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, length, kh, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, length, kh, d), jnp.bfloat16)
        g = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
        fwd_flops = 2 * 2 * b * h * length * length * d / 2
        from detjax.pallas_kernels.flash_attention.reference import attention_reference

        def ref32(q, k, v, g):  # float32 on the bf16 inputs, IEEE products: the yardstick of every backend
            with jax.default_matmul_precision("highest"):
                up = [x.astype(jnp.float32) for x in (q, k, v)]
                o, vjp = jax.vjp(attention_reference, *up)
                return o, vjp(g.astype(jnp.float32))

        want = by_kv_heads(jax.jit(ref32), q, k, v, g)
        results = {}
        for name in a.backends.split(","):
            if name == "mosaic" and not (mosaic.available() and mosaic.fits(length, d)):
                print(f"{spec} mosaic: not run ({mosaic.refusal(length, d, q.dtype) or 'needs a Hopper GPU'})")
                continue
            f = impls[name]
            fwd = jax.jit(f)
            fb = jax.jit(lambda q, k, v, f=f, g=g: jax.vjp(f, q, k, v)[1](g))
            try:
                out = (fwd(q, k, v), fb(q, k, v))
            except Exception as e:  # a backend that does not take this shape: say so, keep the others
                print(f"{spec} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            t_fwd, t_fb = bench(fwd, (q, k, v), a.reps), bench(fb, (q, k, v), a.reps)
            replays = ""
            if name in ("triton", "mosaic"):
                both = jax.jit(lambda q, k, v, f=f, g=g: (f(q, k, v), jax.vjp(f, q, k, v)[1](g)))
                replays = f"{count_differing_replays(both, (q, k, v), a.replays)} of {a.replays - 1}"
            err = rel_err(out, want)
            results[name] = (err, t_fwd, t_fb - t_fwd, replays)
            print(
                f"{spec} {name}: fwd {t_fwd:.3f} ms, bwd {t_fb - t_fwd:.3f} ms, rel. err {err:.1e}, "
                f"differing replays {replays}",
                flush=True,
            )
        base = results.get("cudnn")
        for name, (err, t_fwd, t_bwd, replays) in results.items():
            ratio = f"{t_fwd / base[1]:.2f} / {t_bwd / base[2]:.2f}" if base else "n/a"
            tf = f"{fwd_flops / t_fwd / 1e9:.0f} / {2.5 * fwd_flops / t_bwd / 1e9:.0f}"
            rows.append((spec, name, f"{t_fwd:.3f}", f"{t_bwd:.3f}", tf, ratio, f"{err:.1e}", replays or "-"))
    print(
        "\n| B:L:H:K:D | kernel | fwd ms | bwd ms | TFLOP/s fwd / bwd | x cuDNN fwd / bwd | rel. err vs float32 "
        "| differing replays |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
