"""GEMM table: detjax's pinned-tile Pallas matmul against XLA's autotuned dot, for every projection shape
of gpu_medium and gpu_dense (forward, dx and dw), plus the offline tile sweep that chose the matmul tile
sets and shape classes (detjax/pallas_kernels/matmul/kernel.py: TILE_SETS, tile_set).

    python3 scripts/gemm_bench.py                   # the table with the pinned tile sets
    python3 scripts/gemm_bench.py --rounds 5        # + four more passes: each pass's aggregate and the median
    python3 scripts/gemm_bench.py --sweep           # time every candidate tile set per product and shape
    python3 scripts/gemm_bench.py --tile-bits       # do the output bits depend on the tile set? (same block_r)
    python3 scripts/gemm_bench.py --sweep --kinds dw --no-table   # one product only, no table
    python3 scripts/gemm_bench.py --sweep --kinds dw --dw-chunks 1024,4096 --no-table   # pinned dw vs other chunks
    python3 scripts/gemm_bench.py --fp8 --no-table  # model.fp8's products (Mosaic fp8 wgmma, Triton) against bf16
    python3 scripts/gemm_bench.py --mosaic-variants --no-table  # the Mosaic kernel's speed knobs: time and bits
    python3 scripts/gemm_bench.py --mosaic-variants --no-table --only mlp  # the MLP's products only
    python3 scripts/gemm_bench.py --grouped --no-table  # gpu_medium's experts: bf16 Triton / Mosaic, fp8 Mosaic
    python3 scripts/gemm_bench.py --swiglu --no-table   # their whole SwiGLU: Triton / Mosaic on the padded layout
    python3 scripts/gemm_bench.py --config configs/gpu_dense.yaml model.d_model=4096 ...   # another dense shape

Run with XLA's default flags (autotuning on): the XLA column is the GEMM XLA picks for the shape. Times: one
jitted call runs the product on 8 different input sets (so no launch or host sync is timed per product);
median of --reps calls, divided by 8; in the table the Pallas and XLA calls alternate. The aggregate weights
each shape by how often one step uses it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# (name, K, N, dtype, count per forward) at M = 4 x 2048 tokens (one microbatch of both configs); projections
# of one input run as one product over the concatenated weights (layers.proj_many), as in the model.
SHAPES = {
    "gpu_dense": [
        ("attn q+k+v", 1024, 1536, "bfloat16", 16),
        ("attn o", 1024, 1024, "bfloat16", 16),
        ("mlp gate+up", 1024, 8192, "bfloat16", 16),
        ("mlp down", 4096, 1024, "bfloat16", 16),
        ("lm head", 1024, 32768, "bfloat16", 1),
    ],
    "gpu_medium": [
        ("mamba z+x+B,C+dt (+96 zero columns)", 1024, 4352, "bfloat16", 4),
        ("mamba out", 2048, 1024, "bfloat16", 4),
        ("attn q+k+v", 1024, 1536, "bfloat16", 4),
        ("attn o, shared down, mtp proj", 1024, 1024, "bfloat16", 10),
        ("shared expert gate+up", 1024, 2048, "bfloat16", 4),
        ("mlp gate+up (+ mtp)", 1024, 8192, "bfloat16", 3),
        ("mlp down (+ mtp)", 4096, 1024, "bfloat16", 3),
        ("moe router (fp32)", 1024, 8, "float32", 4),
        ("lm head (+ mtp)", 1024, 32768, "bfloat16", 2),
    ],
}
M = 8192
SETS = 8


def config_shapes(path: str, overrides: list[str]) -> tuple[int, list[tuple]]:
    """(rows of one microbatch, SHAPES rows) of a dense config's projections: attention's fused q+k+v (zero
    columns up to the fused multiple, as matmul.ops.fuse pads), o, the MLP's fused gate+up, down and the LM
    head, each counted once per block that has it. Mamba2, MoE and MTP products are not listed."""
    from detjax.config import load_config
    from detjax.pallas_kernels.matmul.ops import FUSED_COLUMN_MULTIPLE

    c = load_config(path, overrides)
    m = c.model
    if set(m.pattern) - {"*", "-"}:
        raise SystemExit(f"gemm_bench --config: dense patterns only ('*' and '-'), got {m.pattern!r}")
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    fused = q + 2 * kv
    fused += -fused % FUSED_COLUMN_MULTIPLE
    att, mlp = m.pattern.count("*"), m.pattern.count("-")
    gate_up = 2 * m.ffn_dim + -(2 * m.ffn_dim) % FUSED_COLUMN_MULTIPLE
    rows = [
        ("attn q+k+v", m.d_model, fused, "bfloat16", att),
        ("attn o", q, m.d_model, "bfloat16", att),
        ("mlp gate+up", m.d_model, gate_up, "bfloat16", mlp),
        ("mlp down", m.ffn_dim, m.d_model, "bfloat16", mlp),
        ("lm head", m.d_model, m.vocab_size, "bfloat16", 1),
    ]
    return c.train.micro_batch * c.train.seq_len, [r for r in rows if r[-1]]


EXTRA_BF16 = [
    {"bm": 256, "bn": 128, "block_r": 64, "num_warps": 8, "num_stages": 3, "split": 0},
    {"bm": 128, "bn": 64, "block_r": 64, "num_warps": 4, "num_stages": 4, "split": 0},
    {"bm": 128, "bn": 256, "block_r": 64, "num_warps": 8, "num_stages": 4, "split": 0},
    {"bm": 128, "bn": 256, "block_r": 128, "num_warps": 8, "num_stages": 2, "split": 0},
    {"bm": 128, "bn": 128, "block_r": 128, "num_warps": 8, "num_stages": 3, "split": 0},
    {"bm": 128, "bn": 128, "block_r": 128, "num_warps": 4, "num_stages": 3, "split": 0},
]


EXTRA_F32 = [  # the MoE router's float32 products (K or N = 8): wider tiles for the memory-bound fwd / dx
    {"bm": 128, "bn": 128, "block_r": 16, "num_warps": 4, "num_stages": 2, "split": 0},
    {"bm": 64, "bn": 256, "block_r": 16, "num_warps": 4, "num_stages": 2, "split": 0},
    {"bm": 128, "bn": 16, "block_r": 64, "num_warps": 4, "num_stages": 3, "split": 0},
]


def candidates(dtype: str, kind: str = "fwd") -> list[dict[str, int]]:
    """The pinned sets of this dtype and the extra ones; for dw each also as a split set (one program per
    (token chunk, tile)), which gives the same bits (kernel.py docstring)."""
    from detjax.pallas_kernels.matmul.kernel import TILE_SETS

    base = [t for name, t in TILE_SETS.items() if name.startswith("f32_") == (dtype == "float32")]
    base = [dict(t, split=0) for t in base] + (EXTRA_BF16 if dtype == "bfloat16" else EXTRA_F32)
    uniq = []
    for t in base + ([dict(t, split=1) for t in base] if kind == "dw" else []):
        if t not in uniq:
            uniq.append(t)
    return uniq


KINDS = ("fwd", "dx", "dw")


def _shapes(kind, k, n):
    return {"fwd": ((M, k), (k, n)), "dx": ((M, n), (k, n)), "dw": ((M, k), (M, n))}[kind]


def inputs(kind, k, n, dtype):
    dt = jnp.dtype(dtype)
    out = []
    for s in range(SETS):
        ks = jax.random.split(jax.random.key(s), 2)
        out.append(
            tuple(
                jax.random.normal(kk, sh, jnp.float32).astype(dt)
                for kk, sh in zip(ks, _shapes(kind, k, n), strict=True)
            )
        )
    return out


def pallas_fn(kind, dtype, tiles=None):
    from detjax.pallas_kernels.matmul.kernel import matmul_kernel

    out_dtype = jnp.float32 if kind == "dw" or "float8" in dtype else jnp.dtype(dtype)
    st = tuple(sorted(tiles.items())) if tiles else None
    one = lambda a, b: matmul_kernel(a, b, kind=kind, out_dtype=out_dtype, interpret=False, sweep_tiles=st)  # noqa: E731
    return jax.jit(lambda sets: [one(a, b) for a, b in sets])


def xla_fn(kind, dtype):
    dt = jnp.dtype(dtype)
    hi = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    one = {
        "fwd": lambda a, b: jnp.dot(a, b, precision=hi, preferred_element_type=jnp.float32).astype(dt),
        "dx": lambda a, b: jnp.dot(a, b.T, precision=hi, preferred_element_type=jnp.float32).astype(dt),
        "dw": lambda a, b: jnp.dot(a.T, b, precision=hi, preferred_element_type=jnp.float32),
    }[kind]
    return jax.jit(lambda sets: [one(a, b) for a, b in sets])


def timed(fn, sets, reps: int) -> float:
    """Milliseconds per product."""
    jax.block_until_ready(fn(sets))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(sets))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts) / SETS


def timed_pair(f1, f2, sets, reps: int) -> tuple[float, float]:
    """Milliseconds per product of two functions timed alternately (so drifts in clock or load hit both)."""
    jax.block_until_ready(f1(sets))
    jax.block_until_ready(f2(sets))
    ts = ([], [])
    for _ in range(reps):
        for f, acc in zip((f1, f2), ts, strict=True):
            t = time.perf_counter()
            jax.block_until_ready(f(sets))
            acc.append(time.perf_counter() - t)
    return tuple(1e3 * statistics.median(x) / SETS for x in ts)


def device_ms(fn, sets, reps: int, kernel: str) -> float:
    """ms per product of `kernel`'s device events (profile_step.device_ms), without timed()'s host overhead,
    which dominates products of tens of microseconds."""
    from profile_step import device_ms as traced  # scripts/ is on sys.path when this file runs as a script

    return traced(lambda: jax.block_until_ready(fn(sets)), reps, kernel) / SETS


def all_shapes():
    seen = {}
    for cfg, rows in SHAPES.items():
        for name, k, n, dtype, count in rows:
            seen.setdefault((k, n, dtype), []).append((cfg, name, count))
    return seen


def table(reps: int, rounds: int = 1) -> None:
    """The table (first round) and each round's aggregate; with rounds > 1 also the median aggregate, since
    two tables on one machine can differ by a few percent (docs/benchmarks-history.md set 15)."""
    print(
        "| config | projection | M x K x N | product | Pallas ms | XLA ms | XLA/Pallas | Pallas TFLOP/s | XLA TFLOP/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    # inputs and jitted functions built once: later rounds reuse the compiled programs
    cases = [
        (k, n, dtype, users, kind, inputs(kind, k, n, dtype), pallas_fn(kind, dtype), xla_fn(kind, dtype))
        for (k, n, dtype), users in all_shapes().items()
        for kind in KINDS
    ]
    for rnd in range(rounds):
        agg = {}
        for k, n, dtype, users, kind, sets, pf, xf in cases:
            tp, tx = timed_pair(pf, xf, sets, reps)
            fl = 2 * M * k * n
            for cfg, name, count in users:
                p, x = agg.get(cfg, (0.0, 0.0))
                agg[cfg] = (p + count * tp, x + count * tx)
                if rnd == 0:
                    print(
                        f"| {cfg} | {name} | {M}x{k}x{n} {dtype} | {kind} | {tp:.4f} | {tx:.4f} | {tx / tp:.2f} | "
                        f"{fl / tp / 1e9:.0f} | {fl / tx / 1e9:.0f} |",
                        flush=True,
                    )
        for cfg, (p, x) in agg.items():
            ratios.setdefault(cfg, []).append(x / p)
            print(
                f"aggregate {cfg} round {rnd} (count-weighted, fwd + dx + dw): Pallas {p:.3f} ms, XLA {x:.3f} ms, "
                f"XLA/Pallas {x / p:.3f}",
                flush=True,
            )
    if rounds > 1:
        for cfg, r in ratios.items():
            print(
                f"aggregate {cfg}: median XLA/Pallas over {rounds} rounds {statistics.median(r):.3f} "
                f"(min {min(r):.3f}, max {max(r):.3f})"
            )


def chunk_candidates(chunks: tuple[int, ...]) -> list[dict[str, int]]:
    """Split dw sets with token chunks other than dw_row_chunk's. Another chunk is another reduction order (a
    new trajectory, unlike the tile sets), so these rows only say whether a different fixed rule would pay."""
    shapes = [(128, 128, 8), (128, 256, 8), (256, 128, 8)]
    return [
        {"bm": bm, "bn": bn, "block_r": 64, "num_warps": w, "num_stages": 3, "split": 1, "r_chunk": c}
        for c in chunks
        for bm, bn, w in shapes
    ]


def sweep(reps: int, kinds: tuple[str, ...], dw_chunks: tuple[int, ...] = ()) -> None:
    from detjax.pallas_kernels.matmul.kernel import TILE_SETS, tile_set

    for (k, n, dtype), _users in all_shapes().items():
        for kind in kinds:
            cands = candidates(dtype, kind)
            if kind == "dw" and dtype == "bfloat16" and dw_chunks:  # the pinned set, then the other chunks
                cands = [{"split": 0, **TILE_SETS[tile_set(kind, dtype, k, n)]}] + chunk_candidates(dw_chunks)
            sets = inputs(kind, k, n, dtype)
            times = [timed(pallas_fn(kind, dtype, c), sets, reps) for c in cands]
            best = min(range(len(cands)), key=times.__getitem__)
            cells = " ".join(f"{t:.4f}" for t in times)
            print(f"sweep {kind} {M}x{k}x{n} {dtype}: {cells}  best #{best} {cands[best]}", flush=True)


def fp8_table(reps: int) -> None:
    """model.fp8's products as the model runs them (kernel.fp8_product: fp8 operands, the dequantizing scale,
    the output in the compute dtype; dx and dw multiply e5m2 gradients by e4m3 values) through the Mosaic
    GPU kernel (fp8 wgmma, operands laid out with the reduced dimension contiguous) and through the Triton
    kernel, against the pinned bf16 product of the same shape (gpu_dense's projections, weighted by use)."""
    from detjax.pallas_kernels.matmul import mosaic
    from detjax.pallas_kernels.matmul.kernel import fp8_product

    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    print(f"mosaic available {mosaic.available()}, e5m2 x e4m3 wgmma {mosaic.mixed_fp8()}", flush=True)
    types = {"fwd": (e4, e4), "dx": (e5, e4), "dw": (e4, e5)}
    total = {"bf16": 0.0, "mosaic": 0.0, "triton": 0.0}
    for name, k, n, _, count in SHAPES["gpu_dense"]:
        for kind in KINDS:
            od = jnp.float32 if kind == "dw" else jnp.bfloat16
            sets = [
                tuple(
                    jax.random.normal(jax.random.key(10 * i + j), sh, jnp.float32).astype(types[kind][j])
                    for j, sh in enumerate(_shapes(kind, k, n))
                )
                for i in range(SETS)
            ]
            row = {"bf16": timed(pallas_fn(kind, "bfloat16"), inputs(kind, k, n, "bfloat16"), reps)}
            for backend in ("mosaic", "triton"):
                one = functools.partial(fp8_product, kind=kind, out_dtype=od, interpret=False, backend=backend)
                fn = jax.jit(lambda sets, one=one: [one(a, b, jnp.float32(0.5)) for a, b in sets])
                try:
                    row[backend] = timed(fn, sets, reps)
                except Exception as e:  # e.g. a jax whose wgmma refuses the mixed fp8 pair
                    print(f"fp8 {kind} {name}: {backend} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    row[backend] = float("nan")
            for key in total:
                total[key] += count * row[key]
            print(
                f"fp8 {kind} {M}x{k}x{n} ({name}): bf16 {row['bf16']:.4f} ms | fp8 mosaic {row['mosaic']:.4f} "
                f"({row['bf16'] / row['mosaic']:.2f} x) | fp8 triton {row['triton']:.4f} "
                f"({row['bf16'] / row['triton']:.2f} x)",
                flush=True,
            )
    print(
        f"fp8 weighted (one forward + backward of gpu_dense's projections): bf16 {total['bf16']:.3f} ms, fp8 mosaic "
        f"{total['mosaic']:.3f} ms ({total['bf16'] / total['mosaic']:.2f} x), fp8 triton {total['triton']:.3f} ms "
        f"({total['bf16'] / total['triton']:.2f} x)",
        flush=True,
    )


GROUPED = [("experts gate", 1024, 1024, 4), ("experts up", 1024, 1024, 4), ("experts down", 1024, 1024, 4)]


def grouped_table(reps: int, breakdown: int = 0) -> None:
    """The routed experts' grouped products of gpu_medium, forward and backward together (one jax.vjp and its
    pullback), at one microbatch's 4 x 2048 tokens x top-2 = 16384 rows over 8 experts, the group sizes of
    a random routing: the bf16 step's grouped_matmul through the Triton gmm/tgmm and through the Mosaic
    kernel (bf16 wgmma on the padded group layout), timed alternately, with whether the two give the same
    bytes; and model.fp8's fp8_grouped_matmul through the Mosaic kernel (kernels=pallas on Hopper), which
    runs twice more and its bits are compared (a replay). `breakdown` > 0: for the first product, each path's
    device time by op (profile_step.op_breakdown), its `breakdown` largest ops: which part of a path is the
    kernels and which the copies around them."""
    from detjax.model import fp8
    from detjax.pallas_kernels.gmm.ops import grouped_matmul

    rows, e = 16384, 8
    counts = np.bincount(np.random.default_rng(0).integers(0, e, rows), minlength=e)
    gs = jnp.asarray(counts, jnp.int32)
    print(f"grouped: {rows} rows over {e} experts, group sizes {counts.tolist()}", flush=True)
    names = ("triton", "mosaic", "fp8")
    total = dict.fromkeys(names, 0.0)
    scale = jnp.asarray([8.0, 64.0, 4096.0], jnp.float32)
    for name, k, n, count in GROUPED:
        sets = [
            (
                jax.random.normal(jax.random.key(3 * i), (rows, k), jnp.float32).astype(jnp.bfloat16),
                0.02 * jax.random.normal(jax.random.key(3 * i + 1), (e, k, n), jnp.float32),
                jax.random.normal(jax.random.key(3 * i + 2), (rows, n), jnp.float32),
            )
            for i in range(SETS)
        ]

        def fwd_bwd(product):
            def one(x, w, g):
                y, pull = jax.vjp(product, x, w)
                return y, *pull(g.astype(y.dtype))

            return jax.jit(lambda batch: [one(*s) for s in batch])

        fns = {
            impl: fwd_bwd(lambda x, w, impl=impl: grouped_matmul(x, w.astype(jnp.bfloat16), gs, impl))
            for impl in ("triton", "mosaic")
        }
        fns["fp8"] = fwd_bwd(lambda x, w: fp8.fp8_grouped_matmul(x, w, gs, scale, "pallas", jnp.bfloat16))
        row = dict(zip(("triton", "mosaic"), timed_pair(fns["triton"], fns["mosaic"], sets, reps), strict=True))
        row["fp8"] = timed(fns["fp8"], sets, reps)
        for key in total:
            total[key] += count * row[key]

        def same(u, v):
            return all(
                np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(v), strict=True)
            )

        if breakdown and name == GROUPED[0][0]:
            print_breakdown(fns, sets, reps, breakdown)
        kernels_same = same(fns["triton"](sets[:1]), fns["mosaic"](sets[:1]))
        replay = same(fns["fp8"](sets[:1]), fns["fp8"](sets[:1]))
        print(
            f"grouped fwd+bwd {rows}x{k}x{n} x {e} ({name}): bf16 triton {row['triton']:.4f} ms | bf16 mosaic "
            f"{row['mosaic']:.4f} ({row['triton'] / row['mosaic']:.2f} x) | bf16 bytes equal {kernels_same} | "
            f"fp8 mosaic {row['fp8']:.4f} ({row['triton'] / row['fp8']:.2f} x, replay bit-equal {replay})",
            flush=True,
        )
    print(
        f"grouped weighted (gpu_medium's 4 MoE blocks, one microbatch): bf16 triton {total['triton']:.3f} ms, "
        f"bf16 mosaic {total['mosaic']:.3f} ms ({total['triton'] / total['mosaic']:.2f} x), fp8 mosaic "
        f"{total['fp8']:.3f} ms ({total['triton'] / total['fp8']:.2f} x)",
        flush=True,
    )


def swiglu_table(reps: int, breakdown: int = 0, shape: tuple[int, int, int, int] = (16384, 8, 1024, 1024)) -> None:
    """gpu_medium's routed experts' whole SwiGLU (gate and up products, silu(g) * u, down product) at one
    microbatch's 16384 rows over 8 experts, forward and backward, reading bf16 weight copies (made inside the
    timed call, alike for both): the default (dispatch.expert_ffn's three products on the Triton gmm / tgmm,
    grouped_matmul_copy) against the Mosaic
    path with the rows kept in the padded group layout (gmm.ops.grouped_swiglu_padded), timed alternately,
    with whether the two give the same bytes. `breakdown` > 0: each path's device time by op. `shape`: (rows,
    experts, d, f)."""
    from detjax.pallas_kernels.gmm.ops import grouped_compute_copy, grouped_matmul_copy, grouped_swiglu_padded

    (rows, e, d, f), bf = shape, jnp.bfloat16
    counts = np.bincount(np.random.default_rng(0).integers(0, e, rows), minlength=e)
    gs = jnp.asarray(counts, jnp.int32)
    sets = []
    for i in range(SETS):
        ks = jax.random.split(jax.random.key(100 + i), 5)
        shapes = [(e, d, f), (e, d, f), (e, f, d)]
        ws = tuple(0.02 * jax.random.normal(k, shape) for k, shape in zip(ks[1:4], shapes, strict=True))
        x = jax.random.normal(ks[0], (rows, d)).astype(bf)
        sets.append((x, ws, jax.random.normal(ks[4], (rows, d))))

    def fwd_bwd(ffn):
        def one(x, ws, g):
            copies = tuple(grouped_compute_copy(w, bf) for w in ws)  # once per step in training
            y, pull = jax.vjp(lambda x, *ws: ffn(x, ws, copies), x, *ws)
            return y, *pull(g)

        return jax.jit(lambda batch: [one(*s) for s in batch])

    def triton(x, ws, copies):  # dispatch.expert_ffn's default path
        def mm(a, w, c):
            return grouped_matmul_copy(a, w, gs, c, "triton")

        return mm((jax.nn.silu(mm(x, ws[0], copies[0])) * mm(x, ws[1], copies[1])).astype(bf), ws[2], copies[2])

    fns = {
        "triton": fwd_bwd(triton),
        "padded mosaic": fwd_bwd(lambda x, ws, copies: grouped_swiglu_padded(x, gs, ws, bf, copies)),
    }
    if breakdown:
        print_breakdown(fns, sets, reps, breakdown, "SwiGLU")
    t_tri, t_pad = timed_pair(fns["triton"], fns["padded mosaic"], sets, reps)
    outs = [jax.tree.leaves(fn(sets[:1])) for fn in fns.values()]
    same = all(
        np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)) for a, b in zip(*outs, strict=True)
    )
    print(
        f"experts' SwiGLU fwd+bwd {rows} rows, d {d}, f {f}, {e} experts: triton (three grouped_matmul) "
        f"{t_tri:.4f} ms | padded-layout mosaic {t_pad:.4f} ms ({t_tri / t_pad:.2f} x) | bytes equal {same}",
        flush=True,
    )


def print_breakdown(fns: dict, sets, reps: int, top: int, unit: str = "product") -> None:
    """Each function's device time per `unit` (one input set) by op, its `top` largest ops and the rest, each
    with the detjax source lines it computes (profile_step.hlo_source_lines)."""
    from profile_step import hlo_source_lines, op_breakdown  # scripts/ is on sys.path when this runs as a script

    for key, fn in fns.items():
        rows = op_breakdown(lambda fn=fn: jax.block_until_ready(fn(sets)), reps)
        sources = hlo_source_lines(fn.lower(sets).compile().as_text())
        total = sum(ms for _, ms, _ in rows) / SETS
        print(f"  {key}: {total:.4f} ms of device time a {unit}, by op:", flush=True)
        for name, ms, calls in rows[:top]:
            where = ", ".join(f"{w} ({k})" for w, k in sources.get(name, [])[:4])
            print(f"    {ms / SETS:.4f} ms  {calls / SETS:g} calls  {name}  {where}".rstrip(), flush=True)
        rest = sum(ms for _, ms, _ in rows[top:]) / SETS
        print(f"    {rest:.4f} ms  the other {len(rows[top:])} ops", flush=True)


MOSAIC_VARIANTS = {  # (warpgroup tile columns of "nt", pipeline stages, wgmmas left in flight, streamed)
    "fp8": [(128, 4, 1, False), (128, 4, 1, True), (128, 4, 0, True)],
    "bf16": [(128, 4, 0, False), (128, 4, 0, True), (128, 4, 1, True)],
}


def mosaic_variants(reps: int, only: str = "") -> None:
    """The Mosaic kernel's speed knobs (mosaic.mosaic_matmul's wg_n, stages, delay, stream) on gpu_dense's
    shapes at M rows, each variant timed alternately with the first listed (one pipeline per tile, wg_n 128,
    4 stages; delay 1 for fp8 (mosaic.FP8_DELAY), 0 for bf16: the settings before 2026-12-03) and its output
    compared bytewise with the first's. (2026-12-02 wg_n 256 variants were 2-5 x slower and are no longer
    listed.) Each line also gives the Mosaic kernel's device time per product from a profiler trace (the
    partial sums' XLA adds of a chunked dw not included), which host timing's noise cannot blur; `only`: the
    shapes whose name contains it. fp8: the three products as the model poses them to kernel.fp8_nt
    (operands laid out with R contiguous, dw in dw_row_chunk's token chunks); bf16: the three kinds of the
    weights that take the Mosaic kernel (kernel.use_mosaic)."""
    from detjax.pallas_kernels.matmul import mosaic
    from detjax.pallas_kernels.matmul.kernel import MOSAIC_MIN_SIZE, dw_row_chunk

    e4, e5, bf = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
    totals = {}  # (precision, knobs) -> [ms of the variant, ms of the first], weighted by use
    for name, k, n, _, count in SHAPES["gpu_dense"]:
        if only not in name:
            continue
        for kind in KINDS:
            for prec in ("fp8", "bf16"):
                if prec == "bf16" and k * n < MOSAIC_MIN_SIZE:
                    continue
                chunk = dw_row_chunk(k, n) if kind == "dw" else 0
                if prec == "fp8":  # nt operands: (rows, R) and (cols, R)
                    sh, ty = {
                        "fwd": (((M, k), (n, k)), (e4, e4)),
                        "dx": (((M, n), (k, n)), (e5, e4)),
                        "dw": (((k, M), (n, M)), (e4, e5)),
                    }[kind]
                    mk = "nt"
                else:
                    sh, ty, mk = _shapes(kind, k, n), (bf, bf), kind
                od = jnp.float32 if kind == "dw" else bf
                sets = [
                    tuple(
                        jax.random.normal(jax.random.key(10 * i + j), s_, jnp.float32).astype(ty[j])
                        for j, s_ in enumerate(sh)
                    )
                    for i in range(SETS)
                ]
                rows = {"fwd": M, "dx": M, "dw": k}[kind]
                flops = 2 * M * k * n
                base = None
                for wg_n, stages, delay, stream in MOSAIC_VARIANTS[prec]:
                    one = functools.partial(
                        mosaic.mosaic_matmul,
                        kind=mk,
                        out_dtype=od,
                        r_chunk=chunk if 0 < chunk < M else 0,
                        stages=stages,
                        wg_n=wg_n,
                        delay=delay,
                        stream=stream,
                    )
                    scale = jnp.ones((1,), jnp.float32) if prec == "fp8" and not chunk else None
                    fn = jax.jit(lambda sets, one=one, scale=scale: [one(a, b, scale) for a, b in sets])
                    tag = f"{prec} {kind} {M}x{k}x{n} ({name}) wg_n={wg_n} stages={stages} delay={delay}"
                    tag += f" stream={stream}"
                    try:
                        out = np.asarray(fn(sets[:1])[0])
                    except Exception as e:  # a variant this jax or device refuses (shared memory, API)
                        print(f"{tag}: failed: {type(e).__name__}: {str(e).splitlines()[0][:240]}", flush=True)
                        continue
                    bits = out.view(np.uint32 if out.dtype == np.float32 else np.uint16)
                    dev = device_ms(fn, sets, reps, "mosaic_gpu_kernel")
                    if base is None:
                        base = (fn, bits, dev)
                        t = timed(fn, sets, reps)
                        same, t0 = "(reference)", t
                    else:
                        t0, t = timed_pair(base[0], fn, sets, reps)
                        same = "same bits" if np.array_equal(bits, base[1]) else "DIFFERENT BITS"
                    tot = totals.setdefault((prec, wg_n, stages, delay, stream), [0.0, 0.0, 0.0, 0.0])
                    for i, v in enumerate((t, t0, dev, base[2])):
                        tot[i] += count * v
                    print(
                        f"{tag}: device {1e3 * dev:.1f} us ({flops / dev / 1e9:.0f} TFLOP/s), first "
                        f"{1e3 * base[2]:.1f} us, {base[2] / dev:.3f} x; host {t:.4f} ms, first {t0:.4f} ms, "
                        f"{t0 / t:.3f} x; {same}; {rows} output rows",
                        flush=True,
                    )
    for (prec, wg_n, stages, delay, stream), (t, t0, dev, dev0) in totals.items():
        print(
            f"variants weighted ({prec}) wg_n={wg_n} stages={stages} delay={delay} stream={stream}: device "
            f"{dev:.3f} ms, first {dev0:.3f} ms ({dev0 / dev:.3f} x); host {t:.3f} ms, first {t0:.3f} ms "
            f"({t0 / t:.3f} x)",
            flush=True,
        )


def tile_bits() -> None:
    """Same product, every candidate tile set with the same block_r: are the output bits identical?"""
    for kind in KINDS:
        for k, n, dtype in ((1024, 1024, "bfloat16"), (1024, 8, "float32")):
            cands = candidates(dtype, kind)
            a, b = inputs(kind, k, n, dtype)[0]
            ref = None
            for c in cands:
                out = np.asarray(pallas_fn(kind, dtype, c)([(a, b)])[0]).view(
                    np.uint32 if kind == "dw" or dtype == "float32" else np.uint16
                )
                ref = out if ref is None else ref
                print(f"tile-bits {kind} {dtype} {c}: {'same' if np.array_equal(out, ref) else 'DIFFERENT'} as #0")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1, help="table passes; > 1 adds the median aggregate")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tile-bits", action="store_true")
    ap.add_argument("--kinds", default="fwd,dx,dw", help="products to sweep (comma-separated)")
    ap.add_argument(
        "--dw-chunks", default="", help="dw: the pinned set against split sets with these token chunks (e.g. 1024,4096)"
    )
    ap.add_argument("--no-table", action="store_true")
    ap.add_argument(
        "--mosaic-variants", action="store_true", help="the Mosaic kernel's wg_n / stages / delay / stream knobs"
    )
    ap.add_argument("--only", default="", help="--mosaic-variants: only the shapes whose name contains this")
    ap.add_argument("--fp8", action="store_true", help="model.fp8's products (Mosaic and Triton) against bf16")
    ap.add_argument("--grouped", action="store_true", help="gpu_medium's experts: bf16 Triton / Mosaic, fp8 Mosaic")
    ap.add_argument(
        "--swiglu", action="store_true", help="gpu_medium's experts' whole SwiGLU: Triton vs padded-layout Mosaic"
    )
    ap.add_argument("--breakdown", type=int, default=0, help="--grouped / --swiglu: each path's N largest device ops")
    ap.add_argument("--config", help="the table over this dense config's projections instead (config_shapes)")
    ap.add_argument("overrides", nargs="*", help="--config: key=value overrides")
    a = ap.parse_args()
    if a.overrides and not a.config:
        ap.error("overrides need --config")
    if a.config and (a.fp8 or a.grouped or a.swiglu or a.mosaic_variants or a.tile_bits):
        ap.error("--config sets the shapes of the table and --sweep only")
    if a.config:
        global M
        M, rows = config_shapes(a.config, a.overrides)
        SHAPES.clear()
        SHAPES[Path(a.config).stem] = rows
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, M = {M} rows", flush=True)
    if a.tile_bits:
        tile_bits()
    if a.sweep:
        sweep(a.reps, tuple(a.kinds.split(",")), tuple(int(c) for c in a.dw_chunks.split(",") if c))
    if a.fp8:
        fp8_table(a.reps)
    if a.swiglu:
        swiglu_table(a.reps, a.breakdown)
    if a.grouped:
        grouped_table(a.reps, a.breakdown)
    if a.mosaic_variants:
        mosaic_variants(a.reps, a.only)
    if not a.no_table:
        table(a.reps, a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
