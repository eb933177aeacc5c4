"""The shape matrix: deterministic step time against the step a user would otherwise run, over many shapes.

    python3 scripts/shape_matrix.py                                  # the whole matrix (hours on one H200)
    python3 scripts/shape_matrix.py --cells dense:2048:128:4096,hybrid:1536:128:2048 --steps 10
    python3 scripts/shape_matrix.py --list                           # the cells and their derived shapes
    python3 scripts/shape_matrix.py --max-blocks 8 --results $OUT/matrix.jsonl --budget-s 540   # in pieces

A cell is PATTERN:D_MODEL:HEAD_DIM:SEQ_LEN. Its shape is derived, not tuned: heads = d_model / head_dim,
kv heads = heads / 2, ffn 4 x d_model (dense) ; the hybrid repeats "M*EM*E-" with Mamba2 heads of 64 and 8
experts of width d_model (top 2, shared expert); 32768 tokens a step (global batch 32768 / seq_len, four
microbatches, or one sequence each at 8192); vocab 32768. The block count is the largest (a whole number of
pattern repeats, at most 32 blocks) whose model FLOPs (detjax.flops) take <= 0.8 s a step at 40 % MFU.

Per cell, det_tax's workers run, each a fresh process (no compilation cache, no autotune cache):
`plain` (dense) or `fastest` (hybrid), then `strict-kernels` twice. Reported per cell: pipelined step time
and MFU of each, the ratio strict-kernels / baseline, peak memory, and the cold-start L1 verdict (the two
strict-kernels processes' last-step params digests equal). A cell whose mode fails prints what did run and
the error.
A worker builds its data, compiles and times its steps; compilation takes most of it (at 8 blocks on an H100,
2026-12-06: 20-60 s a dense worker, about 55 s a hybrid one). `--overlap` compiles a cell's two strict-kernels
workers side by side and then runs their steps one at a time (det_tax.run_gated), which saves one compilation
a cell. Two workers of a large cell may not fit the GPU's memory together (the d 4096 hybrid cells at 8 blocks
on an 80 GB H100): a worker that ran out of memory beside its twin is run again alone.

`--set MODULE.NAME=VALUE` (repeatable) sets a detjax module constant in the strict-kernels workers (det_tax's
`set=` mode items), so a kernel switch is measured over the matrix before it is the default, e.g. `--set
'detjax.pallas_kernels.flash_attention.mosaic.PERSISTENT[fwd]=True'`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

D_MODELS = (1024, 1536, 2048, 4096)
HEAD_DIMS = (64, 128)
SEQ_LENS = (2048, 4096, 8192)
PATTERNS = {"dense": "*-", "hybrid": "M*EM*E-"}
TOKENS_PER_STEP = 32768
STEP_BUDGET_S, MFU_GUESS, MAX_BLOCKS = 0.8, 0.40, 32


def cell_overrides(
    kind: str, d: int, hd: int, seq: int, blocks: int | None = None, max_blocks: int = MAX_BLOCKS
) -> list[str]:
    """The config overrides (on configs/gpu_dense.yaml) of one cell; `blocks` None: chosen by the budget, at
    most `max_blocks`."""
    heads = d // hd
    gb = TOKENS_PER_STEP // seq
    mb = max(1, gb // 4)
    base = [
        f"model.d_model={d}",
        f"model.head_dim={hd}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={max(1, heads // 2)}",
        f"model.ffn_dim={4 * d}",
        f"train.seq_len={seq}",
        f"train.global_batch={gb}",
        f"train.micro_batch={mb}",
        "run.tensorboard=false",
    ]
    if kind == "hybrid":
        base += [
            f"model.mamba.n_heads={2 * d // 64}",
            "model.mamba.d_state=64",
            "model.mamba.chunk_size=64",
            f"model.moe.ffn_dim={d}",
            "model.moe.n_experts=8",
            "model.moe.top_k=2",
        ]
    unit = PATTERNS[kind]
    if blocks is None:
        blocks = choose_blocks(kind, base, max_blocks)
    return base + [f"model.pattern={unit * (blocks // len(unit))}"]


def choose_blocks(kind: str, base: list[str], max_blocks: int = MAX_BLOCKS) -> int:
    from detjax.config import load_config
    from detjax.flops import PEAK_FLOPS_BF16, model_flops_per_step

    unit = PATTERNS[kind]
    best = len(unit)
    for reps in range(1, max(1, max_blocks // len(unit)) + 1):
        cfg = load_config("configs/gpu_dense.yaml", base + [f"model.pattern={unit * reps}"])
        if model_flops_per_step(cfg) / (MFU_GUESS * PEAK_FLOPS_BF16) > STEP_BUDGET_S:
            break
        best = reps * len(unit)
    return best


def all_cells() -> list[str]:
    return [f"{k}:{d}:{hd}:{s}" for k in PATTERNS for d in D_MODELS for hd in HEAD_DIMS for s in SEQ_LENS]


def parent_on_cpu() -> str | None:
    """Run this process's JAX (the parameter count) on the CPU and return the caller's JAX_PLATFORMS, which the
    workers get back. A GPU backend here would take XLA's preallocated share of the GPU's memory (75 %) for the
    whole matrix and leave the workers the rest: on an 80 GB H100 the plain step then ran out of memory."""
    caller = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # jax read the variable when it was imported
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return caller


def worker_env(environ: dict[str, str], caller_platforms: str | None, overlap: bool = False) -> dict[str, str]:
    """A worker's environment: the caller's, less XLA_FLAGS (det_tax gives each mode its own) and the
    compilation cache (each worker is a cold start), with the caller's JAX_PLATFORMS. `overlap` (every worker
    of an --overlap run): XLA allocates GPU memory as the worker needs it instead of taking 75 % at the start,
    so the two strict-kernels workers of a cell can hold their state side by side."""
    drop = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PLATFORMS")
    env = {k: v for k, v in environ.items() if k not in drop}
    if caller_platforms is not None:
        env["JAX_PLATFORMS"] = caller_platforms
    if overlap:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def worker_cmd(
    mode: str, overrides: list[str], steps: int, warmup: int, caller_platforms: str | None, overlap: bool = False
) -> tuple[list[str], dict[str, str]]:
    """A cell's worker of `mode`: det_tax.worker_command on configs/gpu_dense.yaml, in worker_env."""
    from det_tax import worker_command  # scripts/ is on sys.path when this file runs as a script

    env = worker_env(dict(os.environ), caller_platforms, overlap)
    return worker_command(mode, "configs/gpu_dense.yaml", steps, warmup, overrides, env)


def worker_result(out: subprocess.CompletedProcess) -> dict:
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        from det_tax import error_line  # scripts/ is on sys.path when this file runs as a script

        return {"error": error_line(out)}
    return json.loads(line[0][7:])


def run_worker(
    mode: str, overrides: list[str], steps: int, warmup: int, caller_platforms: str | None, overlap: bool = False
) -> dict:
    cmd, env = worker_cmd(mode, overrides, steps, warmup, caller_platforms, overlap)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    print(f"  {mode}: worker done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return worker_result(out)


def out_of_memory(result: dict) -> bool:
    """Whether a worker's result is a failure to allocate device memory (XLA's RESOURCE_EXHAUSTED, CUDA's
    out-of-memory error)."""
    err = result.get("error", "")
    return "RESOURCE_EXHAUSTED" in err or "OUT_OF_MEMORY" in err.upper().replace(" ", "_")


def strict_mode(settings: list[str]) -> str:
    """The deterministic workers' det_tax mode: strict-kernels with each MODULE.NAME=VALUE of --set as a set=
    item. It is applied here too (this process runs no step), so a malformed item or a name its module lacks is
    a ValueError naming it before any worker starts (det_tax.apply_module_settings)."""
    from det_tax import apply_module_settings

    mode = "+".join(["strict-kernels", *(f"set={x}" for x in settings)])
    apply_module_settings(mode)
    return mode


def run_strict_gated(
    n: int, mode: str, overrides: list[str], steps: int, warmup: int, caller_platforms: str | None
) -> list[dict]:
    """n workers of `mode` (strict_mode) of one cell through run_gated: compiled side by side, timed one at a
    time."""
    from det_tax import run_gated

    t0 = time.perf_counter()
    outs = run_gated([worker_cmd(mode, overrides, steps, warmup, caller_platforms, True)] * n)
    print(f"  strict-kernels x {n}: workers done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return [worker_result(out) for out in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=None, help="comma-separated PATTERN:D:HEAD_DIM:SEQ (default: all)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-l1", action="store_true", help="one strict-kernels process per cell, no L1 verdict")
    ap.add_argument("--list", action="store_true")
    ap.add_argument(
        "--max-blocks",
        type=int,
        default=MAX_BLOCKS,
        help="cap the block count (fewer blocks compile faster; the per-block costs, which the ratio is about, stay)",
    )
    ap.add_argument(
        "--results",
        default=None,
        help="a JSON-lines file: each finished cell is appended; cells already in it (same options) print their "
        "recorded row and are not run again, so a matrix longer than one device call accumulates over calls",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="start no cell once the elapsed time plus the cell's estimated time (cell_estimate_s: from the cells "
        "this call finished) would pass this many seconds",
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="compile a cell's strict-kernels workers side by side (each waits at det_tax.bench_gate after "
        "compiling), then run their steps one at a time, then the baseline's; every worker allocates GPU memory "
        "as it goes (XLA_PYTHON_CLIENT_PREALLOCATE=false). Saves one compilation a cell",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="set a detjax module constant in the strict-kernels workers (det_tax's set= items); repeatable",
    )
    ap.add_argument("overrides", nargs="*", help="key=value applied to every cell and mode")
    a = ap.parse_args()
    try:
        det_mode = strict_mode(a.set)
    except (ValueError, SyntaxError, ImportError) as e:  # as profile_step's --set
        ap.error(f"--set: {e}")
    cells = a.cells.split(",") if a.cells else all_cells()
    options = dict(steps=a.steps, warmup=a.warmup, l1=not a.no_l1, max_blocks=a.max_blocks, extra=a.overrides)
    if a.overlap:  # a record of either way of running serves only that way
        options["overlap"] = True
    if a.set:  # nor does a record of other constants
        options["set"] = a.set
    platforms = parent_on_cpu()
    done = _recorded(a.results, options)
    started, finished = time.perf_counter(), []  # finished: (kind, model FLOPs, seconds) of this call's cells
    from detjax.config import load_config
    from detjax.flops import model_flops_per_step

    if a.set:
        print(f"deterministic workers: {det_mode}")
    print(
        "| cell | blocks | params (M) | baseline | base ms | base MFU | strict-kernels ms | MFU | ratio "
        "| peak GiB (base / det) | cold-start L1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    bad, seen = 0, {}
    for cell in cells:
        kind, d, hd, seq = cell.split(":")
        ov = cell_overrides(kind, int(d), int(hd), int(seq), max_blocks=a.max_blocks) + a.overrides
        cfg = load_config("configs/gpu_dense.yaml", ov)
        flops = model_flops_per_step(cfg)
        nblocks = len(cfg.model.pattern)
        params = _param_count(cfg) / 1e6
        if a.list:
            print(f"| {cell} | {nblocks} | {params:.0f} | {' '.join(ov)} |")
            continue
        if cell in done:
            print(done[cell]["row"] + " (recorded)", flush=True)
            continue
        if a.budget_s and time.perf_counter() - started + cell_estimate_s(kind, flops, finished) > a.budget_s:
            print(f"| {cell} | not run: --budget-s {a.budget_s:.0f} reached |||||||||", flush=True)
            continue
        t_cell = time.perf_counter()
        base_mode = "plain" if kind == "dense" else "fastest"
        n_det = 1 if a.no_l1 else 2
        if a.overlap:  # the strict-kernels workers compile side by side, then the baseline runs alone
            dets = run_strict_gated(n_det, det_mode, ov, a.steps, a.warmup, platforms)
            dets = [  # a worker that did not fit beside its twin runs again alone
                run_worker(det_mode, ov, a.steps, a.warmup, platforms, overlap=True) if out_of_memory(r) else r
                for r in dets
            ]
            base = run_worker(base_mode, ov, a.steps, a.warmup, platforms, overlap=True)
        else:
            base = run_worker(base_mode, ov, a.steps, a.warmup, platforms)
            dets = [run_worker(det_mode, ov, a.steps, a.warmup, platforms) for _ in range(n_det)]
        row, errs = cell_row(cell, nblocks, params, flops, base_mode, base, dets, l1=not a.no_l1)
        bad += bool(errs)
        print(row, flush=True)
        finished.append((kind, flops, time.perf_counter() - t_cell))
        seen = next((r for r in (base, *dets) if "error" not in r), seen)
        if a.results and not errs:  # a failed cell is run again by the next call
            rec = {"cell": cell, "options": options, "row": row, "base": base, "strict": dets}
            with open(a.results, "a") as f:
                f.write(json.dumps(rec) + "\n")
    if not a.list and seen:
        from detjax.determinism import code_line

        dev, jax_v = seen.get("device", "?"), seen.get("jax", "?")
        print(f"\n{dev}, jax {jax_v}, {code_line()}, {a.steps} timed steps after {a.warmup} warm-up, pipelined")
    return 1 if bad else 0


def cell_estimate_s(kind: str, flops: float, finished: list[tuple[str, float, float]]) -> float:
    """How long a cell of this kind and model FLOPs a step should take, from the cells this call finished
    ((kind, flops, seconds) each; 0 before any). A cell's time grows with its FLOPs (its compile and its steps),
    so: the fastest finished cell of the same kind with at least these FLOPs, else the longest of that kind
    scaled by the FLOPs' ratio. With none of its kind finished (a hybrid cell compiles longer than a dense one
    of its FLOPs): the longest cell, scaled up by the FLOPs' ratio where this cell has more."""
    same = [f for f in finished if f[0] == kind]
    if not finished:
        return 0.0
    _, f_long, t_long = max(same or finished, key=lambda f: f[2])
    if not same:
        return t_long * max(1.0, flops / f_long)
    above = [t for _, f, t in same if f >= flops]
    return min(above) if above else t_long * flops / f_long


def cell_row(
    cell: str, nblocks: int, params: float, flops: float, base_mode: str, base: dict, dets: list[dict], l1: bool
) -> tuple[str, list[str]]:
    """One table row from the workers' results (det_tax RESULT records, or {"error": ...}) and the errors.
    What did run is shown when a mode fails (its error follows the row); the L1 verdict needs two strict-kernels
    processes that ran."""
    from detjax.flops import PEAK_FLOPS_BF16

    named = [(base_mode, base)] + [("strict-kernels", r) for r in dets]
    errs = [f"{n}: {r['error']}" for n, r in named if "error" in r]
    ok = [r for r in dets if "error" not in r]
    bms = None if "error" in base else base["pipelined_ms"]
    dms = statistics.median(r["pipelined_ms"] for r in ok) if ok else None
    mfu = [f"{100 * flops / (t / 1e3) / PEAK_FLOPS_BF16:.1f} %" if t else "-" for t in (bms, dms)]
    digests = {json.dumps(r.get("digests"), sort_keys=True) for r in ok}
    verdict = "n/a" if not l1 or len(ok) < 2 else ("equal" if len(digests) == 1 else "DIFFER")
    peak = [f"{(r.get('peak_mem_bytes') or 0) / 2**30:.1f}" if "error" not in r else "-" for r in (base, dets[0])]
    ratio = f"{dms / bms:.3f} x" if bms and dms else "-"
    row = (
        f"| {cell} | {nblocks} | {params:.0f} | {base_mode} | {f'{bms:.1f}' if bms else '-'} | {mfu[0]} "
        f"| {f'{dms:.1f}' if dms else '-'} | {mfu[1]} | {ratio} | {peak[0]} / {peak[1]} | {verdict} |"
    )
    if errs:
        row += " failed: " + "; ".join(errs)
    return row, errs


def _recorded(path: str | None, options: dict) -> dict[str, dict]:
    """The cells of an earlier --results file measured with the same options (the last record of a cell wins)."""
    if not path or not Path(path).exists():
        return {}
    out = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("options") == options:
            out[rec["cell"]] = rec
    return out


def _param_count(cfg) -> int:
    import jax

    from detjax.step import Trainer

    return sum(x.size for x in jax.tree.leaves(Trainer(cfg).abstract_state().params))


if __name__ == "__main__":
    sys.exit(main())
