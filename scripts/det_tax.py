"""Determinism-tax benchmark: paired step-time runs of one config in several modes, one process per mode.

    python scripts/det_tax.py --config configs/gpu_medium.yaml --steps 30 --warmup 8 --rounds 2 \
        --modes fastest,strict,strict-kernels

Modes (each a separate process, since XLA reads its flags once):
  plain       scripts/plain_step.py: the plain-JAX step a user writes (jnp matmuls, cuDNN attention, optax
              AdamW, lax.scan over microbatches); dense patterns only. `plain+model.fp8.enabled=true`: its
              projections through Flax's fp8 recipe (fp8_ops.fp8_scaled_dot_general, XLA's fp8 GEMMs)
  fastest     per component the fastest nondeterministic option JAX offers: cuDNN attention, autotuned XLA
              GEMMs, scatter-add MoE combine and embedding gradient, the Pallas gmm for the experts; the
              baseline taxes are against
  fast        determinism.mode=off, scatter-add MoE combine, XLA attention, ragged_dot experts (the old
              baseline, kept for comparison with earlier figures)
  off         determinism.mode=off with the deterministic model path (no XLA determinism flags)
  strict      determinism.mode=strict: XLA deterministic ops + pinned autotuning + deterministic path
  pallas      determinism.mode=off + model.kernels=pallas (every Pallas kernel, XLA autotuning on)
  strict-kernels  determinism.mode=strict, strategy=kernels: the Pallas kernels (every GEMM included), no
              XLA deterministic flag, XLA autotuning off; the step is checked for scatter and XLA GEMMs
  canonical   strict-kernels with determinism.numerics=canonical (mesh-invariant sums: leaves of
              determinism.canonical_leaf sequences, by default the microbatch (0: auto), gradients summed by
              the pair tree; e.g. `canonical+determinism.canonical_leaf=1`)
A mode may carry overrides of its own after "+": `strict-kernels+model.fp8.enabled=true` is strict-kernels in
fp8; `+noguard` drops the non-finite guard's on-device checks from the step (its cost is the difference:
`--modes strict-kernels,strict-kernels+noguard`), `+set=MODULE.NAME=VALUE` sets a detjax module constant in
that mode's worker (`strict-kernels+set=detjax.model.ce.KERNEL_FWD=True`: a kernel switch against the
default; `+set=detjax.pallas_kernels.gmm.kernel.TILES[tgmm_num_warps]=8`: one entry of a dict), `+xla=FLAG`
starts that mode's worker with an XLA flag (`strict-kernels+xla=--xla_gpu_graph_min_graph_size=1`), and
`+src=DIR` runs that mode's worker from another tree (DIR/scripts/det_tax.py with DIR's detjax, e.g. an older
commit's `git archive`), so two trees' steps are paired in one call: `--modes
strict-kernels,strict-kernels+src=old`. Workers never inherit the caller's XLA_FLAGS.
The trailing key=value arguments apply to every mode; run.fingerprints is on unless they say otherwise.
`--overlap` compiles the round's strict-kernels and canonical modes side by side (their XLA autotuning is off,
so compiling times nothing on the GPU) and runs their steps one at a time after the round's other modes, each
of which compiles and runs alone (run_gated, bench_gate): one compilation a round instead of one a mode.
Rounds alternate the modes (fastest, strict, ..., fastest, strict, ...) so drift hits all alike. Reported:
each round's last-step params digest and fp8 collections digest (equal digests across rounds, or across two
commits' runs, mean the same trajectory bit for bit), the median steady-state step time per mode (warm-up
steps dropped; each step synchronised), MFU (detjax.flops), peak device memory, and the tax
(mode / baseline - 1) x 100 %, the baseline being `fastest` when it runs (else the first mode); and the same
for the pipelined step time (steps dispatched back to back, as the training loop runs them;
plain_step.time_steps), and the GPU's median SM clock and power draw over each mode's timed steps
(plain_step.GpuSampler, nvidia-smi; "n/a" without it). A mode that fails is reported with its error and
dropped; the others still run, and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# this tree's detjax, whatever PYTHONPATH says: a worker run from another tree (`src=DIR`, or `cd DIR &&
# python3 scripts/det_tax.py`) must time that tree's code, not the detjax a PYTHONPATH entry names first
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {
    "plain": [],
    "fastest": [
        "determinism.mode=off",
        "model.attention_impl=cudnn",
        "model.moe.combine=scatter_add",
        "model.moe.experts_impl=pallas",
        "model.embed_grad=scatter_add",
    ],
    "fast": ["determinism.mode=off", "model.moe.combine=scatter_add", "model.attention_impl=xla"],
    "off": ["determinism.mode=off"],
    "strict": ["determinism.mode=strict"],
    # no XLA flag: every Pallas kernel, XLA autotuning left on
    "pallas": ["determinism.mode=off", "model.kernels=pallas"],
    "strict-kernels": ["determinism.mode=strict", "determinism.strategy=kernels", "model.kernels=pallas"],
    "canonical": [
        "determinism.mode=strict",
        "determinism.strategy=kernels",
        "model.kernels=pallas",
        "determinism.numerics=canonical",
    ],
}


def split_mode(mode: str) -> tuple[str, list[str], list[str]]:
    """A mode's name, its config overrides and its XLA flags (the `xla=FLAG` items after "+")."""
    name, *items = mode.split("+")
    flags = [x[4:] for x in items if x.startswith("xla=")]
    return name, [x for x in items if not x.startswith(("xla=", "src=", "set=")) and x != "noguard"], flags


def module_settings(mode: str) -> list[tuple[str, str, object]]:
    """A mode's `set=MODULE.NAME=VALUE` items as (module, name, value): a detjax module constant the worker sets
    before it builds the step, e.g. `strict-kernels+set=detjax.model.ce.KERNEL_FWD=True` (a kernel switch
    timed against the default in one call). VALUE is a Python literal. NAME may be `DICT[KEY]`, one entry of
    a module's dict, e.g. `set=detjax.pallas_kernels.gmm.kernel.TILES[tgmm_num_warps]=8` (a pinned tile
    against the default)."""
    import ast

    out = []
    for item in mode.split("+")[1:]:
        if not item.startswith("set="):
            continue
        target, eq, value = item[4:].partition("=")
        module, _, name = target.rpartition(".")
        if not eq or not module:
            raise ValueError(f"mode item {item!r}: write set=MODULE.NAME=VALUE (a Python literal)")
        out.append((module, name, ast.literal_eval(value)))
    return out


def apply_module_settings(mode: str) -> None:
    """Set the mode's set= constants; a name the module does not have is an error, so a typo cannot time the
    default twice."""
    import importlib

    for module, name, value in module_settings(mode):
        mod = importlib.import_module(module)
        base, _, key = name.partition("[")
        if not hasattr(mod, base):
            raise ValueError(f"set={module}.{name}: {module} has no {base}")
        if not key:
            setattr(mod, name, value)
            continue
        table, key = getattr(mod, base), key.removesuffix("]")
        if not isinstance(table, dict) or key not in table:
            raise ValueError(f"set={module}.{name}: {module}.{base} has no entry {key!r}")
        table[key] = value


def worker_command(
    mode: str, config: str, steps: int, warmup: int, overrides: list[str], environ: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """One mode's worker: its command and environment. The worker starts from no XLA flags (its determinism
    mode adds its own, and the mode's xla= items add theirs; the caller's XLA_FLAGS are not passed on). A
    `src=DIR` item runs DIR's det_tax on the mode without that item. The worker's tree comes first on its
    PYTHONPATH, so it imports that tree's detjax even where its det_tax predates ROOT's sys.path entry."""
    items = mode.split("+")
    src = [x[4:] for x in items[1:] if x.startswith("src=")]
    root = Path(src[-1]).resolve() if src else ROOT
    script = root / "scripts" / "det_tax.py"
    if not script.is_file():
        raise FileNotFoundError(f"mode {mode!r}: {script} does not exist; src=DIR names a detjax tree")
    env = {k: v for k, v in environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [environ.get("PYTHONPATH")])])
    flags = split_mode(mode)[2]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    plain_mode = "+".join([items[0], *(x for x in items[1:] if not x.startswith("src="))])
    cmd = [sys.executable, str(script), "--config", config, "--steps", str(steps), "--warmup", str(warmup)]
    return [*cmd, "--worker", plain_mode, *overrides], env


GATE_ENV, GATE_ID_ENV = "DETJAX_BENCH_GATE", "DETJAX_BENCH_GATE_ID"


def bench_gate(poll_s: float = 0.05) -> bool:
    """Where a worker started by run_gated (det_tax or shape_matrix --overlap) waits once it has compiled and
    before it runs a step: it writes DIR/ready.ID and waits for DIR/go.ID (DIR, ID: the environment's
    DETJAX_BENCH_GATE and DETJAX_BENCH_GATE_ID), which the parent writes when every gated worker is ready and
    the one before it has exited. So workers compile side by side but run their steps one at a time. Returns whether it
    waited (False without the variables)."""
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return False
    ident = os.environ[GATE_ID_ENV]
    Path(gate, f"ready.{ident}").touch()
    while not Path(gate, f"go.{ident}").exists():
        time.sleep(poll_s)
    return True


def run_gated(
    commands: list[tuple[list[str], dict[str, str]]], poll_s: float = 0.05
) -> list[subprocess.CompletedProcess]:
    """Start every (command, environment) at once, each told its gate (det_tax.bench_gate): they compile side
    by side; once every one is at its gate or has exited, let them through one at a time in the given order,
    each after the one before has exited. So no worker's steps share the machine with another worker's
    compilation or steps. Returns each command's completed process (stdout and stderr as text)."""
    with tempfile.TemporaryDirectory(prefix="detjax-gate-") as gate:
        procs = []
        for i, (cmd, env) in enumerate(commands):
            out, err = open(Path(gate, f"out.{i}"), "w+"), open(Path(gate, f"err.{i}"), "w+")
            env = {**env, GATE_ENV: gate, GATE_ID_ENV: str(i)}
            procs.append((subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env), out, err))
        ready = [Path(gate, f"ready.{i}") for i in range(len(procs))]
        while not all(r.exists() or p.poll() is not None for r, (p, _, _) in zip(ready, procs, strict=True)):
            time.sleep(poll_s)
        done = []
        for i, (p, out, err) in enumerate(procs):
            Path(gate, f"go.{i}").touch()
            p.wait()
            out.seek(0), err.seek(0)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
            out.close(), err.close()
        return done


# modes whose XLA autotuning is off (strategy=kernels): their compilation does not time anything on the GPU, so
# several can compile side by side (--overlap); the others compile and run alone
GATED = ("strict-kernels", "canonical")


def gated_modes(modes: list[str]) -> list[str]:
    """The modes --overlap compiles side by side: strategy=kernels modes of this tree (a `src=` worker's det_tax
    may not know the gate, and would run its steps while the others compile)."""
    return [m for m in modes if m.split("+")[0] in GATED and not any(x.startswith("src=") for x in m.split("+")[1:])]


def error_line(out: subprocess.CompletedProcess) -> str:
    """The line that names a failed worker's error (the last `...Error: ...` line, else the last line)."""
    lines = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()
    errors = [x for x in lines if re.match(r"^[\w.]*(Error|Exception)\b.*:", x) or x.startswith("error:")]
    return (errors or lines)[-1][:300]


def worker(config: str, mode: str, overrides: list[str], steps: int, warmup: int) -> dict:
    from detjax import determinism
    from detjax.config import load_config

    name, extra, _ = split_mode(mode)
    apply_module_settings(mode)
    if name == "plain":
        import plain_step

        return plain_step.measure(load_config(config, extra + overrides + ["determinism.mode=off"]), steps, warmup)
    overrides = ["run.fingerprints=true"] + MODES[name] + extra + overrides

    cfg = load_config(config, overrides)
    determinism.apply_config_environment(cfg)
    determinism.check_features(cfg)
    import jax
    import numpy as np

    from detjax.data.pipeline import make_dataset
    from detjax.sharding.mesh import replicated, single_device_mesh
    from detjax.step import Trainer, compile_init, compile_train_step

    rep = replicated(single_device_mesh())
    trainer = Trainer(cfg)
    trainer.guard_nonfinite = "noguard" not in mode.split("+")
    state = compile_init(trainer, rep)(jax.random.key(cfg.train.seed))
    step = compile_train_step(trainer, rep, rep)
    ds = make_dataset(cfg)
    batches = [jax.device_put(np.asarray(ds[i]), rep) for i in range(8)]  # rotate: not one cached input
    determinism.check_step(cfg, step, state, batches[0])
    compile_s = None
    if os.environ.get(GATE_ENV):  # compile before the gate; the step's first call finds it in jax's cache
        t0 = time.perf_counter()
        step.lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - t0
        bench_gate()
    from plain_step import result, time_steps

    timing, m = time_steps(step, state, batches, steps, warmup)
    if compile_s is not None:
        timing["compile_s"] = compile_s  # first_step_s then counts the first step without its compilation
    from detjax.fingerprint import digest_hex

    # the last step's digests (every worker of a config runs the same steps on the same batches): equal digests
    # across rounds, or across two commits' runs, mean the same trajectory bit for bit
    digests = {
        k: digest_hex(jax.device_get(v))
        for k, v in sorted(m.get("digest", {}).items())
        if k in ("params", "collections")
    }
    return {**result(timing, cfg, float(m["lm_loss"])), "digests": digests}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="fastest,strict,strict-kernels")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="compile the strategy=kernels modes (strict-kernels, canonical; not src= ones) side by side, then run "
        "their steps one at a time, after the other modes of the round, which run alone; every worker allocates "
        "GPU memory as it goes (XLA_PYTHON_CLIENT_PREALLOCATE=false)",
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.config, a.worker, a.overrides, a.steps, a.warmup)))
        return 0
    modes = a.modes.split(",")
    unknown = [m for m in modes if m.split("+")[0] not in MODES]
    if unknown:
        print(f"error: unknown mode(s) {unknown}; choose from {list(MODES)}", file=sys.stderr)
        return 2
    for mode in modes:
        try:
            worker_command(mode, a.config, a.steps, a.warmup, a.overrides, {})
            module_settings(mode)
        except (FileNotFoundError, ValueError, SyntaxError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if os.environ.get("XLA_FLAGS"):
        print(
            f"note: XLA_FLAGS={os.environ['XLA_FLAGS']!r} is not passed to the workers; give a mode its flags "
            "with +xla=FLAG (e.g. strict-kernels+xla=--xla_gpu_graph_min_graph_size=1)",
            file=sys.stderr,
        )
    results: dict[str, list[dict]] = {m: [] for m in modes}
    failed: dict[str, str] = {}  # a mode that fails is reported and dropped; the others still run

    def command(mode):
        environ = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false") if a.overlap else dict(os.environ)
        return worker_command(mode, a.config, a.steps, a.warmup, a.overrides, environ)

    def record(r, mode, out):
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
            failed[mode] = error_line(out)
            print(f"round {r} {mode:7s} FAILED (exit {out.returncode}): {failed[mode]}", flush=True)
            return
        res = json.loads(line[0][7:])
        results[mode].append(res)
        gpu = res.get("gpu")
        clocks = (
            f"; SM {gpu['sm_clock_mhz']:.0f} MHz, {gpu['power_w']:.0f} W, max {gpu['temp_c_max']:.0f} C" if gpu else ""
        )
        compiled = f"compiled before the gate in {res['compile_s']:.1f} s, " if "compile_s" in res else ""
        print(
            f"round {r} {mode:7s} median {res['median_ms']:.2f} ms  (min {res['min_ms']:.2f}, "
            f"max {res['max_ms']:.2f}; pipelined {res['pipelined_ms']:.2f} ms; "
            f"dispatch {res['dispatch_ms']:.2f} ms; "
            f"{compiled}first step {res['first_step_s']:.1f} s{clocks}; "
            f"digests {' '.join(f'{k}={v}' for k, v in res.get('digests', {}).items())})",
            flush=True,
        )

    together = gated_modes(modes) if a.overlap else []
    for r in range(a.rounds):
        for mode in modes:
            if mode not in failed and mode not in together:
                cmd, env = command(mode)
                record(r, mode, subprocess.run(cmd, capture_output=True, text=True, env=env))
        live = [m for m in together if m not in failed]  # compiled side by side, then timed one at a time
        for mode, out in zip(live, run_gated([command(m) for m in live]), strict=True):
            record(r, mode, out)
    ran = [m for m in modes if m not in failed]
    if not ran:
        print("error: every mode failed", file=sys.stderr)
        return 1
    base_mode = "fastest" if "fastest" in ran else ran[0]
    base = statistics.median(x["median_ms"] for x in results[base_mode])
    any_res = results[ran[0]][0]
    from detjax.config import load_config
    from detjax.determinism import code_line
    from detjax.flops import PEAK_FLOPS_BF16, model_flops_per_step

    flops = model_flops_per_step(load_config(a.config, a.overrides))
    print(
        f"\n{any_res['device']}, jax {any_res['jax']}, {code_line()}, {any_res['tokens_per_step']} tokens/step, "
        f"{flops / 1e12:.2f} model TFLOP/step, {a.rounds} rounds x {a.steps} timed steps"
    )
    pbase = statistics.median(x["pipelined_ms"] for x in results[base_mode])
    print(
        f"| mode | median step (ms) | tokens/s | MFU | peak mem (GiB) | tax vs {base_mode} "
        "| pipelined step (ms) | pipelined MFU | pipelined tax | SM clock (MHz) | power (W) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in ran:
        med = statistics.median(x["median_ms"] for x in results[mode])
        pip = statistics.median(x["pipelined_ms"] for x in results[mode])
        tok_s = any_res["tokens_per_step"] / (med / 1e3)
        mfu, pmfu = (flops / (t / 1e3) / PEAK_FLOPS_BF16 for t in (med, pip))
        peak = max((x.get("peak_mem_bytes") or 0) for x in results[mode]) / 2**30
        gpus = [x["gpu"] for x in results[mode] if x.get("gpu")]
        clock = f"{statistics.median(g['sm_clock_mhz'] for g in gpus):.0f}" if gpus else "n/a"
        power = f"{statistics.median(g['power_w'] for g in gpus):.0f}" if gpus else "n/a"
        print(
            f"| {mode} | {med:.2f} | {tok_s:,.0f} | {100 * mfu:.1f} % | {peak:.1f} | {100 * (med / base - 1):+.1f} % "
            f"| {pip:.2f} | {100 * pmfu:.1f} % | {100 * (pip / pbase - 1):+.1f} % | {clock} | {power} |"
        )
    for mode, why in failed.items():
        print(f"| {mode} | failed: {why} | | | | | | | | | |")
    for mode in ran:
        if len(results[mode]) > 1:  # the same steps in every round: their digests must agree (L1)
            same = len({json.dumps(x.get("digests"), sort_keys=True) for x in results[mode]}) == 1
            verdict = "equal in all" if same else "DIFFER across the"
            print(f"{mode}: last-step digests {verdict} {len(results[mode])} rounds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
