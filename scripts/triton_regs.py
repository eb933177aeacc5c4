"""Registers and spills of detjax's Pallas Triton kernels, read on a machine without a GPU.

    python3 scripts/triton_regs.py                       # every kernel at its pinned warps
    python3 scripts/triton_regs.py --kernels ssd,gmm --warps 4,8

Each kernel is lowered for CUDA at gpu_medium's shapes (jax.export with platforms=["cuda"], Pallas' Triton
lowering told that it targets compute capability 9.0), compiled by the `triton` package for sm_90a with the
kernel's own num_warps and num_stages (or each of --warps), and its PTX assembled by the ptxas that comes with
that package, whose report gives the registers a thread uses and the bytes it spills to local memory.

A static reading, not a timing: XLA compiles these kernels with the Triton bundled in jaxlib, which may be of
another version than the `triton` package (`pip install triton`), and a kernel that spills may still be faster
than one that does not. It says where to look before a GPU is at hand; scripts/tile_sweep.py and
scripts/kernel_bench.py time what it suggests. It reads two names inside jax's Pallas Triton lowering
(`gpu_info_lib`, `lowering.lower_jaxpr_to_triton_module`), so a jax release that moves them stops it with
a one-line error.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
import types

import jax
import jax.numpy as jnp

SHAPES = (
    "gpu_medium: 4 x 2048 tokens, d 1024, Mamba2 32 heads x 64 (state 64, chunk 64), 8 experts of 1024, vocab 32768"
)


@contextlib.contextmanager
def lowering_for_hopper():
    """While open: jax's Pallas Triton lowering believes it targets a compute-capability-9.0 GPU and records
    (name, num_warps, num_stages, Triton IR text) of every kernel it lowers into the list it yields, and
    detjax's kernel wrappers take their compiled (not interpreted) path. Everything is restored on exit."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as reg

        lower, gpu_info = reg.lowering.lower_jaxpr_to_triton_module, reg.gpu_info_lib
    except (ImportError, AttributeError) as e:
        raise SystemExit(
            f"triton_regs: this jax ({jax.__version__}) lowers Pallas Triton kernels differently: {e}"
        ) from None
    found = []

    def recording(*args, **kwargs):
        result = lower(*args, **kwargs)
        caller = inspect.currentframe().f_back.f_locals
        asm = result.module.operation.get_asm(enable_debug_info=False)
        found.append((caller.get("name"), caller.get("num_warps"), caller.get("num_stages"), asm))
        return result

    wrappers = [
        m
        for n, m in list(sys.modules.items())
        if n.startswith("detjax.pallas_kernels") and hasattr(m, "interpret_mode")
    ]
    kept = [m.interpret_mode for m in wrappers]
    reg.gpu_info_lib = types.SimpleNamespace(get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    reg.lowering.lower_jaxpr_to_triton_module = recording
    for m in wrappers:
        m.interpret_mode = lambda: False
    try:
        yield found
    finally:
        reg.gpu_info_lib, reg.lowering.lower_jaxpr_to_triton_module = gpu_info, lower
        for m, f in zip(wrappers, kept, strict=True):
            m.interpret_mode = f


def lowered(fn, args) -> list[tuple]:
    """The distinct Triton kernels (name, num_warps, num_stages, IR text) of fn(*args) lowered for CUDA."""
    with lowering_for_hopper() as found:
        lower_for_cuda(fn, *args)
    out = []
    for kernel in found:  # the same kernel may be lowered twice (a jit inside a vjp)
        if (kernel[0], kernel[3]) not in {(k[0], k[3]) for k in out}:
            out.append(kernel)
    return out


def lower_for_cuda(fn, *args) -> None:
    from jax import export

    check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[check])(*args)


def cases():
    """name -> (function, abstract arguments): each kernel as the model calls it, forward and backward."""
    from detjax.pallas_kernels.ce.kernel import ce_fwd
    from detjax.pallas_kernels.conv.ops import conv_silu
    from detjax.pallas_kernels.flash_attention.ops import flash_attention
    from detjax.pallas_kernels.gated_norm.ops import gated_norm
    from detjax.pallas_kernels.gmm import kernel as gk
    from detjax.pallas_kernels.rmsnorm.ops import rmsnorm
    from detjax.pallas_kernels.segment_sum.ops import segment_sum
    from detjax.pallas_kernels.ssd.kernel import sum_heads
    from detjax.pallas_kernels.ssd.ops import ssd

    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    a = jax.ShapeDtypeStruct
    b, length, d, vocab = 4, 2048, 1024, 32768
    tokens = b * length

    def fwd_bwd(f, n_args):
        def run(*args):
            out, pull = jax.vjp(f, *args[:n_args])
            return out, pull(args[n_args])

        return run

    h, p, n = 32, 64, 64
    return {
        "ssd": (
            fwd_bwd(lambda x, da, bb, cc: ssd(x, da, bb, cc, 64), 4),
            (a((b, length, h, p), f32), a((b, length, h), f32), a((b, length, n), f32), a((b, length, n), f32))
            + (a((b, length, h, p), f32),),
        ),
        "sum_heads": (
            lambda db, dc: sum_heads(db, dc, h=h, interpret=False),
            (a((b * h, length, n), f32), a((b * h, length, n), f32)),
        ),
        "gmm": (
            lambda x, w, dy, gs: (
                gk.gmm(x, w, gs, out_dtype=bf16, interpret=False),
                gk.tgmm(x, dy, gs, out_dtype=f32, interpret=False),
            ),
            (a((2 * tokens, d), bf16), a((8, d, 1024), bf16), a((2 * tokens, 1024), bf16), a((8,), i32)),
        ),
        "rmsnorm": (
            fwd_bwd(lambda x, w: rmsnorm(x, w, 1e-5, bf16), 2),
            (a((tokens, d), f32), a((d,), f32)) + (a((tokens, d), bf16),),
        ),
        "gated_norm": (
            fwd_bwd(lambda y, x, z, dd, w: gated_norm(y, x, z, dd, w, 1e-5, bf16), 5),
            (a((tokens, 2 * d), f32), a((tokens, 2 * d), f32), a((tokens, 2 * d), bf16), a((2 * d,), f32))
            + (a((2 * d,), f32), a((tokens, 2 * d), bf16)),
        ),
        "ce": (lambda x, t: ce_fwd(x, t, interpret=False), (a((tokens, vocab), bf16), a((tokens,), i32))),
        "conv": (
            fwd_bwd(conv_silu, 3),
            (a((b, length, 2 * d), bf16), a((4, 2 * d), f32), a((2 * d,), f32)) + (a((b, length, 2 * d), f32),),
        ),
        "flash_triton": (
            fwd_bwd(lambda q, k, v: flash_attention(q, k, v, "triton"), 3),
            (a((b, length, 16, 64), bf16), a((b, length, 4, 64), bf16), a((b, length, 4, 64), bf16))
            + (a((b, length, 16, 64), bf16),),
        ),
        "segment_sum": (lambda ids, g: segment_sum(ids, g, vocab), (a((tokens,), i32), a((tokens, d), f32))),
    }


def ptxas_report(ttir: str, num_warps: int, num_stages: int, workdir: str) -> tuple[int, int, int]:
    """(registers a thread, spill store bytes, spill load bytes) of one Triton module compiled for sm_90a."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile

    path = os.path.join(workdir, f"k{abs(hash((ttir, num_warps, num_stages)))}.ttir")  # the suffix names the IR
    with open(path, "w") as f:
        f.write(ttir)
    kernel = triton_compile(
        path, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    ptx = path + ".ptx"
    with open(ptx, "w") as f:
        f.write(kernel.asm["ptx"])
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull], capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if out.returncode or not regs or not spills:
        raise RuntimeError(f"ptxas: {text.strip().splitlines()[-1] if text.strip() else 'no report'}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="ssd,sum_heads,gmm,rmsnorm,gated_norm,ce,conv,flash_triton,segment_sum")
    ap.add_argument("--warps", default="", help="num_warps to compile each kernel with (default: its pinned one)")
    a = ap.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton_regs: needs the `triton` package (pip install triton); it compiles, it runs nothing")
        return 2
    jax.config.update("jax_platforms", "cpu")
    table = cases()
    unknown = sorted(set(a.kernels.split(",")) - set(table))
    if unknown:
        print(f"triton_regs: unknown kernels {unknown}; choose from {sorted(table)}")
        return 2
    warps = [int(w) for w in a.warps.split(",") if w]
    print(f"jax {jax.__version__}, triton {triton.__version__}, sm_90a; shapes of {SHAPES}\n")
    print("| case | kernel | num_warps | num_stages | registers / thread | spill stores / loads (bytes / thread) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as workdir:
        for case in a.kernels.split(","):
            for name, pinned_warps, stages, ttir in lowered(*table[case]):
                for w in warps or [pinned_warps]:
                    mark = "" if w == pinned_warps else " (not pinned)"
                    try:
                        regs, st, ld = ptxas_report(ttir, w, stages, workdir)
                        row = f"{regs} | {st} / {ld}"
                    except Exception as e:  # a setting that does not compile is a row too
                        row = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]} |"
                    print(f"| {case} | {name} | {w}{mark} | {stages} | {row} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
