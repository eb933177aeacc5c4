"""Offline tile sweep of the flash-attention, RMSNorm, SSD, MoE gmm, cross-entropy, Mamba2 conv, fp8
quantization and RoPE-backward kernels.

    python3 scripts/tile_sweep.py                       # every kernel
    python3 scripts/tile_sweep.py --kernels flash,rmsnorm --reps 20
    python3 scripts/tile_sweep.py --kernels flash-bwd   # flash attention's dQ and dK/dV tiles only
    python3 scripts/tile_sweep.py --kernels quantize,swiglu  # model.fp8's quantization kernels (gpu_dense)
    python3 scripts/tile_sweep.py --kernels rope        # RoPE's backward, bf16 and fp8 variants (gpu_dense)
    python3 scripts/tile_sweep.py --kernels norm-stream # RMSNorm's backward adding the stream's cotangent vs XLA
    python3 scripts/tile_sweep.py --kernels ssd,gmm --old-src OLD_TREE  # SSD scan, gmm vs an older tree's, bytes
    python3 scripts/tile_sweep.py --kernels ce,conv     # the cross-entropy forward, the Mamba2 conv backward

For each candidate tile set the kernel's TILES entry is replaced, every jit cache is cleared, and the kernel
(forward, and backward where it has one) is timed: one jitted call runs it on SETS different input sets, the
median of --reps calls divided by SETS (host time: per-call overhead included). The fp8 quantization
kernels, whose calls take microseconds, also print their device time from a profiler trace. The pinned
TILES in each kernel module are chosen from this table and never at run time (a tile change changes a kernel's
reduction order, hence its bits: it is a new trajectory, and is recorded with the table in
docs/BENCHMARKS.md; the quantization kernels are elementwise, so their tiles change speed only). Each row
also says whether two calls of the candidate gave the same bytes.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

SETS = 4

FLASH_FWD = [
    {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 2},
    {"block_q": 128, "block_k": 64, "num_warps": 4, "num_stages": 3},
    {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
    {"block_q": 128, "block_k": 128, "num_warps": 8, "num_stages": 2},
    {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 2},
    {"block_q": 64, "block_k": 128, "num_warps": 4, "num_stages": 2},
    {"block_q": 128, "block_k": 32, "num_warps": 4, "num_stages": 3},
    {"block_q": 256, "block_k": 64, "num_warps": 8, "num_stages": 2},
]
FLASH_BWD = [  # dQ: block_q query rows per program, block_k keys per loop step
    {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 3},
    {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 2},
    {"block_q": 128, "block_k": 32, "num_warps": 4, "num_stages": 3},
    {"block_q": 128, "block_k": 32, "num_warps": 8, "num_stages": 3},
    {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 2},
    {"block_q": 128, "block_k": 64, "num_warps": 4, "num_stages": 3},
    {"block_q": 64, "block_k": 32, "num_warps": 4, "num_stages": 3},
    {"block_q": 64, "block_k": 128, "num_warps": 8, "num_stages": 2},
]
FLASH_DKV = [  # dK/dV: block_k keys per program, block_q query rows per loop step
    {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 3},
    {"block_q": 32, "block_k": 128, "num_warps": 4, "num_stages": 3},
    {"block_q": 32, "block_k": 128, "num_warps": 8, "num_stages": 3},
    {"block_q": 64, "block_k": 128, "num_warps": 8, "num_stages": 2},
    {"block_q": 64, "block_k": 128, "num_warps": 8, "num_stages": 3},
    {"block_q": 32, "block_k": 64, "num_warps": 4, "num_stages": 3},
    {"block_q": 16, "block_k": 128, "num_warps": 4, "num_stages": 3},
    {"block_q": 128, "block_k": 128, "num_warps": 8, "num_stages": 2},
    {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 2},
]
RMSNORM_WIDTHS = (1024, 1536, 2048, 4096)  # the shape matrix's d_model values


def rmsnorm_candidates(dp: int) -> list[dict]:
    """Tile candidates of width class dp: sub-blocks of 1024-8192 elements, 4-16 warps, 1-32 sub-blocks a
    program (the backward's chunk of the weight gradient's token sum is `rows`)."""
    out = []
    for br in (1, 2, 4, 8, 16, 32):
        if not 1024 <= br * dp <= 8192:
            continue
        for warps in (4, 8, 16):
            if br * dp // (32 * warps) < 4:  # fewer than 4 elements of a row block per thread
                continue
            for nsub in (1, 4, 16):
                out.append({"rows": br * nsub, "block_rows": br, "num_warps": warps, "num_stages": 2})
    return out


SSD_WARPS = [4, 2, 8]
SSD_PASS_ROWS = [8, 16, 32, 64]
GMM = [
    # the pinned tiles (gmm's K tile 64, tgmm's 128), then candidates whose K tile serves both (a candidate
    # without tgmm_block_k / tgmm_num_warps runs tgmm with its block_k / num_warps)
    {"block_m": 64, "block_k": 64, "block_n": 128, "num_warps": 4, "num_stages": 3, "tgmm_block_k": 128},
    {"block_m": 64, "block_k": 128, "block_n": 128, "num_warps": 4, "num_stages": 3},
    {"block_m": 64, "block_k": 64, "block_n": 128, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_k": 64, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_k": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"block_m": 64, "block_k": 128, "block_n": 256, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_k": 64, "block_n": 256, "num_warps": 8, "num_stages": 3},
    {"block_m": 32, "block_k": 128, "block_n": 128, "num_warps": 4, "num_stages": 3},
    # 64 x 128 x 128 with 8 warps for both, for tgmm alone, for gmm alone (scripts/triton_regs.py: both spilled
    # registers at 4 before their masked loads and stores)
    {"block_m": 64, "block_k": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
    {"block_m": 64, "block_k": 128, "block_n": 128, "num_warps": 4, "num_stages": 3, "tgmm_num_warps": 8},
    {"block_m": 64, "block_k": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "tgmm_num_warps": 4},
]

SWIGLU_FWD = [
    {"block_m": 32, "block_n": 256, "num_warps": 4},
    {"block_m": 64, "block_n": 128, "num_warps": 4},
    {"block_m": 128, "block_n": 128, "num_warps": 8},
    {"block_m": 32, "block_n": 128, "num_warps": 4},
    {"block_m": 64, "block_n": 256, "num_warps": 4},
    {"block_m": 32, "block_n": 256, "num_warps": 8},
    {"block_m": 32, "block_n": 512, "num_warps": 4},
    {"block_m": 16, "block_n": 256, "num_warps": 4},
    {"block_m": 32, "block_n": 256, "num_warps": 4, "t32": True},
    {"block_m": 64, "block_n": 128, "num_warps": 4, "t32": True},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "t32": True},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "t32": True},
]
SWIGLU_BWD = [  # "pair": one program writes both halves of dy's tile; else one program per half
    {"block_m": 32, "block_n": 128, "num_warps": 4, "pair": True},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "pair": True},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "pair": False},
    {"block_m": 32, "block_n": 64, "num_warps": 4, "pair": True},
    {"block_m": 32, "block_n": 128, "num_warps": 8, "pair": True},
    {"block_m": 32, "block_n": 256, "num_warps": 4, "pair": True},
    {"block_m": 16, "block_n": 128, "num_warps": 4, "pair": True},
    {"block_m": 16, "block_n": 256, "num_warps": 4, "pair": True},
    {"block_m": 32, "block_n": 128, "num_warps": 4, "pair": True, "t32": True},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "pair": True, "t32": True},
    {"block_m": 64, "block_n": 128, "num_warps": 8, "pair": True, "t32": True},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "pair": False, "t32": True},
]
TRANSPOSED = [  # quantize_transposed: the tile must divide 128
    {"block_m": 128, "block_n": 128, "num_warps": 8},
    {"block_m": 64, "block_n": 128, "num_warps": 4},
    {"block_m": 64, "block_n": 64, "num_warps": 4},
    {"block_m": 32, "block_n": 128, "num_warps": 4},
    {"block_m": 64, "block_n": 64, "num_warps": 2},
    {"block_m": 128, "block_n": 64, "num_warps": 4},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "t32": True},
    {"block_m": 64, "block_n": 64, "num_warps": 2, "t32": True},
    {"block_m": 64, "block_n": 128, "num_warps": 4, "t32": True},
]

ROPE = [  # rope.kernel: block_n whole heads (head_dim 64) dividing the q and k/v widths; elementwise, so speed only
    {"block_m": 128, "block_n": 128, "num_warps": 8},
    {"block_m": 128, "block_n": 128, "num_warps": 4},
    {"block_m": 64, "block_n": 128, "num_warps": 4},
    {"block_m": 32, "block_n": 128, "num_warps": 4},
    {"block_m": 128, "block_n": 64, "num_warps": 4},
    {"block_m": 64, "block_n": 256, "num_warps": 8},
    {"block_m": 256, "block_n": 64, "num_warps": 8},
]


def _time(fn, args, reps: int) -> float:
    """ms per input set: kernel_bench's median over `reps` calls of the jitted call over SETS sets."""
    from kernel_bench import bench  # scripts/ is on sys.path when this file runs as a script

    return bench(fn, args, reps) / SETS


def _bytes(tree) -> bytes:
    return b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(tree))


def _many(fn):
    """One jitted call of fn over SETS input sets (each argument a list of SETS arrays: no slicing copies)."""
    return jax.jit(lambda *sets: [fn(*(a[s] for a in sets)) for s in range(SETS)])


def _device_ms(fn, args, reps: int, kernel: str) -> float:
    """ms per input set of `kernel`'s device events (profile_step.device_ms), without _time's host overhead."""
    from profile_step import device_ms  # scripts/ is on sys.path when this file runs as a script

    return device_ms(lambda: jax.block_until_ready(fn(*args)), reps, kernel) / SETS


def _sweep(title, tiles, key, cands, cases, reps, kernel: str | None = None):
    """cases: [(name, fn, args (lists of SETS arrays))]; prints one row per candidate. kernel: a kernel name
    (as the profiler shows it) whose device time is printed too."""
    keep = dict(tiles[key]) if key is not None else dict(tiles)
    first = {}  # each case's bytes under the first candidate that ran it
    try:
        for ci, cand in enumerate(cands):
            if key is None:
                tiles.update(cand)
            else:
                tiles[key] = dict(cand)
            jax.clear_caches()
            cells = []
            for name, fn, args in cases:
                try:
                    f = _many(fn)
                    b = _bytes(f(*args))
                    same = b == _bytes(f(*args))
                    other = first.setdefault(name, (ci, b))
                    dev = f" (device {_device_ms(f, args, reps, kernel):.4f} ms)" if kernel else ""
                    note = "" if same else " (REPLAY DIFFERS)"
                    note += "" if other[1] == b else f" (BYTES DIFFER FROM #{other[0]})"
                    cells.append(f"{name} {_time(f, args, reps):.4f} ms{dev}{note}")
                except Exception as e:  # a candidate that does not compile (shared memory, registers) is a row too
                    cells.append(f"{name} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            print(f"  {title} #{ci} {cand}: " + "; ".join(cells), flush=True)
    finally:
        if key is None:
            tiles.clear()
            tiles.update(keep)
        else:
            tiles[key] = keep
        jax.clear_caches()


def _stack(key, shape, dtype, scale=1.0):
    """SETS separate arrays (a list, so the timed call reads each one in place)."""
    return [(scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype) for k in jax.random.split(key, SETS)]


def _old_kernel(old_src: str, name: str):
    """detjax/pallas_kernels/<name>/kernel.py of an older tree, for before/after and a bit comparison."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_old", f"{old_src}/detjax/pallas_kernels/{name}/kernel.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    return old


def _against_old(title, tiles, old_tiles, cases, old_cases, reps) -> None:
    """The pinned kernels of this tree (cases) and of an older one (old_cases: the same names and arguments)
    timed in turn, then whether each case's outputs have the same bytes in both trees."""
    _sweep(f"{title} (pinned, this tree)", tiles, None, [dict(tiles)], cases, reps)
    _sweep(f"{title} (pinned, old tree)", old_tiles, None, [dict(old_tiles)], old_cases, reps)
    for (name, new_fn, args), (_, old_fn, _) in zip(cases, old_cases, strict=True):
        one = tuple(a[0] for a in args)
        same = _bytes(jax.jit(new_fn)(*one)) == _bytes(jax.jit(old_fn)(*one))
        print(f"  {name}: this tree's bytes {'equal' if same else 'DIFFER FROM'} the old tree's", flush=True)


def sweep_flash(reps: int, forward: bool = True, old_src: str | None = None) -> None:
    from detjax.pallas_kernels.flash_attention import kernel as fk

    # gpu_dense attention per microbatch: B 4, 16 query heads, 4 kv heads, L 2048, head dim 64, bf16
    b, h, kh, length, d = 4, 16, 4, 2048, 64
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (_stack(ks[i], (b, length, h if i in (0, 3) else kh, d), jnp.bfloat16) for i in range(4))

    def fwd(q, k, v):
        return fk.flash_fwd(q, k, v, interpret=False)

    def bwd(q, k, v, o, lse, do):
        return fk.flash_bwd(q, k, v, o, lse, do, interpret=False)

    outs = [fwd(*a) for a in zip(q, k, v, strict=True)]
    o, lse = [x[0] for x in outs], [x[1] for x in outs]
    bwd_args = (q, k, v, o, lse, do)
    if forward:
        _sweep("flash fwd", fk.TILES, "fwd", FLASH_FWD, [("fwd", fwd, (q, k, v))], reps)
    # the backward alone (o and lse from the pinned forward); dQ's and dK/dV's tiles are swept one at a time
    _sweep("flash dQ (bwd with it)", fk.TILES, "bwd", FLASH_BWD, [("bwd", bwd, bwd_args)], reps)
    _sweep("flash dK/dV (bwd with it)", fk.TILES, "dkv", FLASH_DKV, [("bwd", bwd, bwd_args)], reps)
    if old_src:  # the pinned kernels of an older tree (same (B, L, H, Q) layout): time, then bits of fwd + bwd
        old = _old_kernel(old_src, "flash_attention")

        def old_bwd(q, k, v, o, lse, do):
            return old.flash_bwd(q, k, v, o, lse, do, interpret=False)

        _sweep("flash bwd (pinned, this tree)", fk.TILES, None, [dict(fk.TILES)], [("bwd", bwd, bwd_args)], reps)
        _sweep("flash bwd (pinned, old tree)", old.TILES, None, [dict(old.TILES)], [("bwd", old_bwd, bwd_args)], reps)
        one = (q[0], k[0], v[0], do[0])

        def both(mod, q, k, v, do):
            o, lse = mod.flash_fwd(q, k, v, interpret=False)
            return o, lse, mod.flash_bwd(q, k, v, o, lse, do, interpret=False)

        same = _bytes(jax.jit(lambda *a: both(fk, *a))(*one)) == _bytes(jax.jit(lambda *a: both(old, *a))(*one))
        print(f"  flash new vs old tree, o, lse, dq, dk, dv byte-equal: {same}", flush=True)


def sweep_rmsnorm(reps: int, widths=RMSNORM_WIDTHS) -> None:
    """Per width class: every candidate's device time for the forward (float32 stream in, bf16 out) and the
    backward with the stream's float32 cotangent added (ops.rmsnorm_stream, as the blocks run it; the weight
    gradient's tree included), as effective bandwidth over the bytes each must move, against XLA's fused
    jnp RMSNorm (fwd + bwd, nondeterministic choices its own). 4 x 2048 tokens, one microbatch of the matrix."""
    from detjax.pallas_kernels.rmsnorm import kernel as rk
    from detjax.pallas_kernels.rmsnorm.reference import rmsnorm_ref

    n = 8192
    for d in widths:
        dp = rk.width_class(d)
        ks = jax.random.split(jax.random.key(1), 4)
        x, dy = _stack(ks[0], (n, d), jnp.float32), _stack(ks[1], (n, d), jnp.bfloat16)
        w, g = _stack(ks[2], (d,), jnp.float32), _stack(ks[3], (n, d), jnp.float32)
        rstd = [rk.rmsnorm_fwd(a, b, eps=1e-5, interpret=False)[1] for a, b in zip(x, w, strict=True)]

        def fwd(x, w):
            return rk.rmsnorm_fwd(x, w, eps=1e-5, interpret=False, out_dtype=jnp.bfloat16)

        def bwd(x, w, r, dy, g):
            return rk.rmsnorm_bwd(x, w, r, dy, g, interpret=False)

        def xla(x, w, dy, g):
            y, vjp = jax.vjp(lambda x, w: rmsnorm_ref(x, w, 1e-5).astype(jnp.bfloat16), x, w)
            dx, dw = vjp(dy)
            return y, dx + g, dw

        fwd_gb, bwd_gb = n * d * (4 + 2) / 1e9, n * d * (4 + 2 + 4 + 4) / 1e9  # bytes that must move
        xla_ms = _device_ms(_many(xla), (x, w, dy, g), reps, "")
        print(f"  rmsnorm d={d} (class {dp}): XLA fused jnp fwd+bwd+add {xla_ms:.4f} ms (device)", flush=True)
        for which, fn, args, gb in (("fwd", fwd, (x, w), fwd_gb), ("bwd", bwd, (x, w, rstd, dy, g), bwd_gb)):
            keep = dict(rk.TILES[which][dp])
            rows = []
            try:
                for cand in [keep] + [c for c in rmsnorm_candidates(dp) if c != keep]:
                    rk.TILES[which][dp] = cand
                    jax.clear_caches()
                    try:
                        f = _many(fn)
                        same = _bytes(f(*args)) == _bytes(f(*args))
                        ms = _device_ms(f, args, reps, "")
                        rows.append((ms, cand, same))
                    except Exception as e:  # a candidate that does not compile is a row too
                        print(f"    {which} {cand} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            finally:
                rk.TILES[which][dp] = keep
                jax.clear_caches()
            for ms, cand, same in sorted(rows, key=lambda r: r[0])[:5]:
                pinned = " (pinned)" if cand == keep else ""
                print(
                    f"    {which} {ms:.4f} ms = {gb / ms:.2f} TB/s{pinned} {cand}"
                    + ("" if same else " (REPLAY DIFFERS)"),
                    flush=True,
                )
            pin = [r for r in rows if r[1] == keep]
            if pin:
                print(f"    {which} pinned {pin[0][0]:.4f} ms = {gb / pin[0][0]:.2f} TB/s {keep}", flush=True)


def sweep_ssd(reps: int, old_src: str | None, pinned_only: bool = False) -> None:
    """The SSD scan as the model calls it (ssd.ops.ssd, forward and fwd+bwd, layout copies included), over
    the chunk kernels' warps and the walks' state rows per program; the outputs' digest of the pinned tiles.
    old_src: the same timing and digest under an older tree's detjax (a child process), for before/after."""
    import hashlib
    import os
    import subprocess

    import detjax
    from detjax.pallas_kernels.ssd import kernel as sk
    from detjax.pallas_kernels.ssd.ops import ssd

    # gpu_medium Mamba2 layer per microbatch: B 4, L 2048, H 32, P 64, N 64, chunk 64
    b, h, length, p, n, chunk = 4, 32, 2048, 64, 64, 64
    ks = jax.random.split(jax.random.key(2), 5)
    x = _stack(ks[0], (b, length, h, p), jnp.float32)
    a = [-jax.nn.softplus(t) for t in _stack(ks[1], (b, length, h), jnp.float32)]
    bb, cc = _stack(ks[2], (b, length, n), jnp.float32), _stack(ks[3], (b, length, n), jnp.float32)
    dy = _stack(ks[4], (b, length, h, p), jnp.float32)

    def fwd(x, a, bb, cc):
        return ssd(x, a, bb, cc, chunk)

    def both(x, a, bb, cc, dy):
        y, vjp = jax.vjp(fwd, x, a, bb, cc)
        return y, vjp(dy)

    cases = [("fwd", fwd, (x, a, bb, cc)), ("fwd+bwd", both, (x, a, bb, cc, dy))]
    pinned = dict(sk.TILES)
    cands = [pinned]
    if not pinned_only:
        cands += [{**pinned, "num_warps": w} for w in SSD_WARPS if w != pinned["num_warps"]]
        cands += [{**pinned, "bwd_num_warps": w} for w in SSD_WARPS if w not in (2, pinned["bwd_num_warps"])]
        cands += [{**pinned, "pass_rows": r} for r in SSD_PASS_ROWS if r != pinned.get("pass_rows")]
    _sweep("ssd", sk.TILES, None, cands, cases, reps)
    out = jax.jit(both)(*(t[0] for t in cases[1][2]))
    digest = hashlib.sha256(_bytes(out)).hexdigest()[:16]
    print(f"  ssd fwd+bwd digest (pinned tiles): {digest}; detjax from {detjax.__path__[0]}", flush=True)
    if old_src:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([old_src, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, __file__, "--kernels", "ssd", "--reps", str(reps), "--ssd-pinned-only"]
        print(f"  the tree {old_src}:", flush=True)
        subprocess.run(cmd, env=env, check=False)


def sweep_gmm(reps: int, old_src: str | None = None) -> None:
    """gmm and tgmm over GMM's tiles; with old_src, then the pinned kernels of this tree and an older one timed
    in turn, and whether their outputs have the same bytes."""
    from detjax.pallas_kernels.gmm import kernel as gk

    # gpu_medium MoE per microbatch: 8192 tokens x top-2 = 16384 rows sorted by expert, d 1024, expert ffn 1024
    r, e, k, n = 16384, 8, 1024, 1024
    ks = jax.random.split(jax.random.key(3), 3)
    x, dy = _stack(ks[0], (r, k), jnp.bfloat16), _stack(ks[1], (r, n), jnp.bfloat16)
    w = _stack(ks[2], (e, k, n), jnp.bfloat16, 0.03)
    sizes = jnp.array([1500, 2600, 1900, 2300, 2048, 1800, 2136, 2100], jnp.int32)  # skewed, sums to r
    gs = [sizes] * SETS

    def fwd(x, w, gs):
        return gk.gmm(x, w, gs, out_dtype=jnp.bfloat16, interpret=False)

    def wgrad(x, dy, gs):
        return gk.tgmm(x, dy, gs, out_dtype=jnp.float32, interpret=False)

    cases = [("gmm", fwd, (x, w, gs)), ("tgmm", wgrad, (x, dy, gs))]
    cands = [{"tgmm_num_warps": c["num_warps"], "tgmm_block_k": c["block_k"], **c} for c in GMM]
    _sweep("gmm", gk.TILES, None, cands, cases, reps)
    if old_src:
        old = _old_kernel(old_src, "gmm")

        def old_fwd(x, w, gs):
            return old.gmm(x, w, gs, out_dtype=jnp.bfloat16, interpret=False)

        def old_wgrad(x, dy, gs):
            return old.tgmm(x, dy, gs, out_dtype=jnp.float32, interpret=False)

        old_cases = [("gmm", old_fwd, (x, w, gs)), ("tgmm", old_wgrad, (x, dy, gs))]
        _against_old("gmm", gk.TILES, old.TILES, cases, old_cases, reps)


CE = [
    {"block_rows": 16, "block_vocab": 1024, "num_warps": 4, "num_stages": 2},
    {"block_rows": 16, "block_vocab": 1024, "num_warps": 8, "num_stages": 2},
    {"block_rows": 32, "block_vocab": 1024, "num_warps": 8, "num_stages": 2},
    {"block_rows": 16, "block_vocab": 2048, "num_warps": 8, "num_stages": 2},
    {"block_rows": 8, "block_vocab": 1024, "num_warps": 4, "num_stages": 2},
]
CONV = [  # dx_in_kernel: dx in the kernel (one pass) or from the kernel's dconv by XLA (two passes)
    {"block_rows": 32, "block_channels": 128, "num_warps": 4, "num_stages": 1, "dx_in_kernel": True},
    {"block_rows": 32, "block_channels": 128, "num_warps": 8, "num_stages": 1, "dx_in_kernel": True},
    {"block_rows": 64, "block_channels": 128, "num_warps": 8, "num_stages": 1, "dx_in_kernel": True},
    {"block_rows": 32, "block_channels": 256, "num_warps": 8, "num_stages": 1, "dx_in_kernel": True},
    {"block_rows": 16, "block_channels": 128, "num_warps": 4, "num_stages": 1, "dx_in_kernel": True},
    {"block_rows": 64, "block_channels": 64, "num_warps": 4, "num_stages": 1, "dx_in_kernel": True},
    {"block_rows": 128, "block_channels": 128, "num_warps": 8, "num_stages": 1, "dx_in_kernel": True},
    {"block_rows": 32, "block_channels": 128, "num_warps": 4, "num_stages": 1, "dx_in_kernel": False},
    {"block_rows": 32, "block_channels": 128, "num_warps": 8, "num_stages": 1, "dx_in_kernel": False},
    {"block_rows": 64, "block_channels": 128, "num_warps": 4, "num_stages": 1, "dx_in_kernel": False},
    {"block_rows": 64, "block_channels": 128, "num_warps": 8, "num_stages": 1, "dx_in_kernel": False},
    {"block_rows": 16, "block_channels": 128, "num_warps": 4, "num_stages": 1, "dx_in_kernel": False},
]


def sweep_ce(reps: int) -> None:
    """The one-pass cross-entropy forward at gpu_medium's head (8192 tokens x 32768, bf16 logits); the rows'
    block and the warps change time, the vocabulary block the bits (the bytes column says)."""
    from detjax.pallas_kernels.ce import kernel as ck

    ks = jax.random.split(jax.random.key(13), 2)
    x = _stack(ks[0], (8192, 32768), jnp.bfloat16, 4.0)
    t = [jax.random.randint(k, (8192,), 0, 32768) for k in jax.random.split(ks[1], SETS)]
    _sweep("ce", ck.TILES, None, CE, [("ce_fwd", lambda x, t: ck.ce_fwd(x, t, interpret=False), (x, t))], reps)


def sweep_conv(reps: int, old_src: str | None = None) -> None:
    """The Mamba2 convolution + SiLU forward and backward at gpu_medium's mixer (4 x 2048 tokens, 2048
    channels, width 4), the backward on the Pallas kernel; then XLA's autodiff of the same formula (the
    alternative) and, with old_src, the backward kernel alone of this tree and an older one, and whether their
    outputs have the same bytes."""
    from detjax.pallas_kernels.conv import kernel as vk
    from detjax.pallas_kernels.conv.ops import conv_silu
    from detjax.pallas_kernels.conv.reference import conv_silu_ref

    ks = jax.random.split(jax.random.key(15), 4)
    x = _stack(ks[0], (4, 2048, 2048), jnp.bfloat16)
    w, b = _stack(ks[1], (4, 2048), jnp.float32, 0.5), _stack(ks[2], (2048,), jnp.float32, 0.1)
    g = _stack(ks[3], (4, 2048, 2048), jnp.float32)

    def fwd_bwd(x, w, b, g):
        return jax.vjp(conv_silu, x, w, b)[1](g)

    def fwd_bwd_xla(x, w, b, g):
        return jax.vjp(conv_silu_ref, x, w, b)[1](g)

    _sweep("conv", vk.TILES, None, CONV, [("conv fwd+bwd", fwd_bwd, (x, w, b, g))], reps)
    _sweep("conv (XLA autodiff)", {}, None, [{}], [("conv fwd+bwd", fwd_bwd_xla, (x, w, b, g))], reps)
    if old_src:
        old = _old_kernel(old_src, "conv")
        cases = [("conv bwd", lambda *a: vk.conv_silu_bwd(*a, interpret=False), (x, w, b, g))]
        old_cases = [("conv bwd", lambda *a: old.conv_silu_bwd(*a, interpret=False), (x, w, b, g))]
        _against_old("conv", vk.TILES, old.TILES, cases, old_cases, reps)


def sweep_quantize(reps: int) -> None:
    from detjax.model import fp8
    from detjax.pallas_kernels.matmul import quantize as qz

    # model.fp8's quantization with the transposed copy at gpu_dense's shapes, one microbatch: a block's
    # normed input (8192 x 1024 bf16, e4m3) and the attention's q+k+v gradient (8192 x 1536 bf16, e5m2)
    ks = jax.random.split(jax.random.key(2), 2)
    x, dy = _stack(ks[0], (8192, 1024), jnp.bfloat16), _stack(ks[1], (8192, 1536), jnp.bfloat16, 1e-3)

    def one(dtype, scale):
        return lambda v: qz.quantize_transposed(v, jnp.float32(scale), dtype=dtype, interpret=False)

    cases = [("x 8192x1024", one(fp8.E4M3, 64.0), (x,)), ("dy 8192x1536", one(fp8.E5M2, 4096.0), (dy,))]
    _sweep("quantize_transposed", qz.TILES, "transposed", TRANSPOSED, cases, reps, "fp8_quantize_transposed")
    # the residual stream's float32 cotangent (8192 x 1024), rounded to bf16 in the kernel, to e5m2: its own tile
    g = _stack(jax.random.key(3), (8192, 1024), jnp.float32, 1e-3)

    def wide(v):
        return qz.quantize_transposed(v, jnp.float32(4096.0), dtype=fp8.E5M2, interpret=False, round_to=jnp.bfloat16)

    f32 = [("g 8192x1024 f32", wide, (g,))]
    _sweep("quantize_transposed f32", qz.TILES, "transposed_f32", TRANSPOSED, f32, reps, "fp8_quantize_transposed")


def sweep_swiglu(reps: int) -> None:
    from detjax.model import fp8
    from detjax.pallas_kernels.matmul import quantize as qz

    # gpu_dense's MLP at one microbatch: y = [gate | up] (8192 x 8192 bf16), dh (8192 x 4096 bf16); the
    # forward writes h's two e4m3 copies (64 MiB, reading 128), the backward dy's two e5m2 copies (128 MiB,
    # reading 192)
    m, f = 8192, 4096
    ks = jax.random.split(jax.random.key(3), 2)
    y, dh = _stack(ks[0], (m, 2 * f), jnp.bfloat16, 2.0), _stack(ks[1], (m, f), jnp.bfloat16, 1e-3)

    def fwd(y):
        return qz.swiglu_quantize_transposed(y, jnp.float32(64.0), dtype=fp8.E4M3, interpret=False)

    def bwd(y, dh):
        return qz.swiglu_bwd_quantize_transposed(y, dh, jnp.float32(4096.0), dtype=fp8.E5M2, interpret=False)

    _sweep(
        "swiglu fwd (192 MiB)", qz.TILES, "swiglu_fwd", SWIGLU_FWD, [("fwd", fwd, (y,))], reps, "fp8_swiglu_quantize"
    )
    _sweep("swiglu bwd (320 MiB)", qz.TILES, "swiglu_bwd", SWIGLU_BWD, [("bwd", bwd, (y, dh))], reps, "fp8_swiglu_bwd")


def sweep_rope(reps: int) -> None:
    from detjax.model import fp8
    from detjax.pallas_kernels.rope import kernel as rk
    from detjax.pallas_kernels.rope.reference import tables

    # gpu_dense's attention at one microbatch: dq (8192 x 1024), dk and dv (8192 x 256) bf16 in, dy (8192 x 1536)
    # out: in bf16 (48 MiB moved) or as two e5m2 copies (48 MiB)
    ks = jax.random.split(jax.random.key(4), 3)
    dq, dk, dv = (_stack(k, (8192, n), jnp.bfloat16, 1e-3) for k, n in zip(ks, (1024, 256, 256), strict=True))
    cos, sin = tables(2048, 64, 1e4)

    def bf16(dq, dk, dv):
        return rk.rope_grad_concat(dq, dk, dv, cos, sin, length=2048, head_dim=64, interpret=False)

    def e5m2(dq, dk, dv):
        s = jnp.float32(4096.0)
        return rk.rope_grad_quantize_transposed(
            dq, dk, dv, cos, sin, s, length=2048, head_dim=64, dtype=fp8.E5M2, interpret=False
        )

    args = (dq, dk, dv)
    _sweep("rope bwd, bf16", rk.TILES, None, ROPE, [("bf16", bf16, args)], reps, "rope_grad_concat")
    _sweep("rope bwd, e5m2", rk.TILES, None, ROPE, [("e5m2", e5m2, args)], reps, "fp8_rope_grad_quantize")


def time_norm_stream(reps: int) -> None:
    """RMSNorm's backward with the residual stream's cotangent added in the kernel (rmsnorm_stream) against
    the backward followed by XLA's add, at gpu_dense's block input (8192 x 1024 float32 stream, bf16 dy):
    device time of every op of each (the weight's ordered sum included), and how many of dx's elements
    differ in their bytes. One comparison, no tile candidates."""
    from detjax.pallas_kernels.rmsnorm import kernel as rk

    ks = jax.random.split(jax.random.key(6), 4)
    x, w = _stack(ks[0], (8192, 1024), jnp.float32, 3.0), _stack(ks[1], (1024,), jnp.float32)
    dy, g = _stack(ks[2], (8192, 1024), jnp.bfloat16), _stack(ks[3], (8192, 1024), jnp.float32, 0.1)
    rstd = [rk.rmsnorm_fwd(a, b, eps=1e-5, interpret=False)[1] for a, b in zip(x, w, strict=True)]

    def fused(x, w, r, dy, g):
        return rk.rmsnorm_bwd(x, w, r, dy, g, interpret=False)

    def composed(x, w, r, dy, g):
        dx, dw = rk.rmsnorm_bwd(x, w, r, dy, interpret=False)
        return dx + g, dw

    f, c = _many(fused), _many(composed)
    args = (x, w, rstd, dy, g)
    a, b = f(*args), c(*args)
    differ = sum(int(jnp.sum(p[0].view(jnp.uint32) != q[0].view(jnp.uint32))) for p, q in zip(a, b, strict=True))
    dw_same = all(bool(jnp.array_equal(p[1], q[1])) for p, q in zip(a, b, strict=True))
    dev, host = [_device_ms(v, args, reps, "") for v in (f, c)], [_time(v, args, reps) for v in (f, c)]
    print(
        f"  norm-stream 8192x1024: fused {dev[0]:.4f} ms (device), backward + add {dev[1]:.4f} ms (device); "
        f"host {host[0]:.4f} / {host[1]:.4f} ms; "
        f"dx elements with other bytes: {differ} of {SETS * 8192 * 1024}; dw same bytes: {dw_same}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="flash,rmsnorm,ssd,gmm,quantize,swiglu,rope")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--widths", default=",".join(map(str, RMSNORM_WIDTHS)), help="RMSNorm widths to sweep")
    ap.add_argument(
        "--old-src", default=None, help="an older tree: time and compare its ssd / flash / gmm / conv kernels"
    )
    ap.add_argument("--ssd-pinned-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if jax.default_backend() != "gpu":
        print("tile_sweep: needs a GPU (the tiles are Triton launch parameters)", file=sys.stderr)
        return 2
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    which = a.kernels.split(",")
    if "flash" in which or "flash-bwd" in which:
        sweep_flash(a.reps, forward="flash" in which, old_src=a.old_src)
    if "rmsnorm" in which:
        sweep_rmsnorm(a.reps, [int(x) for x in a.widths.split(",")])
    if "ssd" in which:
        sweep_ssd(a.reps, a.old_src, a.ssd_pinned_only)
    if "gmm" in which:
        sweep_gmm(a.reps, a.old_src)
    if "ce" in which:
        sweep_ce(a.reps)
    if "conv" in which:
        sweep_conv(a.reps, a.old_src)
    if "quantize" in which:
        sweep_quantize(a.reps)
    if "swiglu" in which:
        sweep_swiglu(a.reps)
    if "rope" in which:
        sweep_rope(a.reps)
    if "norm-stream" in which:
        time_norm_stream(a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
