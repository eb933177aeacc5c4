"""Where a train step's time goes: a jax.profiler trace of a few steps and a table of device time by scope.

    python scripts/profile_step.py --config configs/gpu_dense.yaml [--steps 3] [--out DIR] [key=value ...]

Runs the real train step of the config (the trainer's own compiled step, on the config's mesh), compiles and
warms it up, then traces `--steps` steps with `jax.profiler.trace` (the xplane trace opens in TensorBoard /
xprof; a Perfetto JSON trace is written beside it) and prints:
- the wall-clock step time, the model's MFU (detjax.flops) and the device's peak memory;
- device time grouped by model scope: each device op is mapped, through the compiled HLO's op_name metadata,
  to the Flax/named scope that produced it; `layer_N` becomes `block[<letter>]` so that all blocks of one
  type add up; forward and backward (ops under a transpose) are separate rows;
- the top device ops by time, with their scope (`--source-lines`: and the detjax source lines whose ops each
  one holds, e.g. which lines of model/mamba2.py a loop fusion computes).

`--synced` waits for each traced step before dispatching the next, as det_tax's synced steps do: the idle
table then shows where the device waits for the host's dispatch. The first timed line (untraced) stays
back to back.

`--set MODULE.NAME=VALUE` (repeatable) sets a detjax module constant before the step is built, as det_tax's
`set=` mode items do: a kernel switch profiled before it is the default
(`--set detjax.pallas_kernels.gmm.ops.MOSAIC_BF16=False`).

`--plain` profiles scripts/plain_step.py's plain-JAX step of the same (dense) config instead (its ops carry no
module scopes: read its table by op). It runs the plain step as det_tax's plain mode does, with XLA's default
flags. On the H200 with jax 0.11.2 every variant of --plain tried so far (command buffers off, the step
compiled ahead of time, and this one) failed inside XLA under the profiler (IndexError), while the same step
ran without it in det_tax (docs/benchmarks-history.md sets 17 and 18).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

_STRIP = re.compile(r"^(jit|pjit|jvp|transpose|vmap|remat|checkpoint|custom_jvp_call|custom_vjp_call)\(")
_NOISE = {"while", "body", "cond", "main", "eval_jaxpr", "rematted_computation", "checkpoint"}


def scope_of(op_name: str, pattern: str) -> tuple[str, str, str]:
    """op_name metadata -> (pass "fwd"/"bwd", module scope, op). `layer_N` is renamed by its block letter."""
    parts = [p for p in op_name.split("/") if p]
    bwd = any(p.startswith("transpose(") for p in parts)
    keep = [p for p in parts if not _STRIP.match(p) and p not in _NOISE]
    if not keep:
        return ("bwd" if bwd else "fwd"), "(top)", op_name

    def rename(p: str) -> str:
        m = re.fullmatch(r"(mtp_)?layer_(\d+)", p)
        if m:
            i = int(m.group(2))
            letters = pattern if not m.group(1) else None
            return f"{m.group(1) or ''}block[{letters[i] if letters and i < len(letters) else i}]"
        return p

    keep = [rename(p) for p in keep]
    return ("bwd" if bwd else "fwd"), "/".join(keep[:-1]) or "(top)", keep[-1]


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata (the JAX scope path), from compiled HLO text."""
    out = {}
    for m in re.finditer(r"%?([\w.\-]+) = [^\n]*?metadata=\{[^}]*?op_name=\"([^\"]*)\"", hlo_text):
        out[m.group(1)] = m.group(2)
    return out


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_SHARED = re.compile(r" = \S+ (?:constant|parameter)\(")  # XLA merges equal constants: their line is any one's


def hlo_source_lines(hlo_text: str, under: str = "detjax") -> dict[str, list[tuple[str, int]]]:
    """HLO instruction name -> the source lines of the JAX ops it holds, as ("file.py:LINE", count), the most
    first: a fusion's are those of the instructions of its fused computation (and of what they call in turn),
    another instruction's its own; constants and parameters are left out. Each instruction counts at the
    line its metadata names (the innermost frame outside JAX), its path from `under`'s folder on (elsewhere:
    the basename). Reads both forms of XLA's metadata: the stack-frame tables (`stack_frame_id`) and
    `source_file`/`source_line`."""
    files, locations, frames = {}, {}, {}
    table = None
    comp_lines: dict[str, list[str]] = defaultdict(list)
    calls: dict[str, list[str]] = defaultdict(list)  # instruction -> the computations it calls
    current = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = line
            continue
        if table:
            m = re.match(r"^(\d+) (.*)$", line)
            if not m:
                table = None
            elif table == "FileNames":
                files[int(m.group(1))] = m.group(2).strip('"')
            elif table == "FileLocations":
                fl = re.search(r"file_name_id=(\d+).*?\bline=(\d+)", m.group(2))
                if fl:
                    locations[int(m.group(1))] = (int(fl.group(1)), int(fl.group(2)))
            elif table == "StackFrames":
                sf = re.search(r"file_location_id=(\d+)", m.group(2))
                if sf:
                    frames[int(m.group(1))] = int(sf.group(1))
            continue
        c = _COMPUTATION.match(line)
        if c:
            current = c.group(1)
            continue
        if line.startswith("}"):
            current = None
            continue
        i = _INSTRUCTION.match(line)
        if i and current is not None:
            comp_lines[current].append(line)
            called = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
            if called:
                calls[i.group(1)] += called

    def where(line: str) -> str | None:
        m = re.search(r"stack_frame_id=(\d+)", line)
        if m and int(m.group(1)) in frames:
            loc = locations.get(frames[int(m.group(1))])
            path, lineno = (files.get(loc[0], "?"), loc[1]) if loc else (None, None)
        else:
            m = re.search(r'source_file="([^"]*)" source_line=(\d+)', line)
            path, lineno = (m.group(1), int(m.group(2))) if m else (None, None)
        if path is None:
            return None
        name = path.split(under + "/", 1)[1] if under + "/" in path else Path(path).name
        return f"{name}:{lineno}"

    out = {}
    for line in (x for lines in comp_lines.values() for x in lines):
        name = _INSTRUCTION.match(line).group(1)
        counts: dict[str, int] = defaultdict(int)
        todo, seen = list(calls.get(name, [])), set()
        while todo:  # the called computations, and theirs
            sub = todo.pop()
            if sub in seen:
                continue
            seen.add(sub)
            for inner in comp_lines.get(sub, []):
                w = None if _SHARED.search(inner) else where(inner)
                if w:
                    counts[w] += 1
                todo += calls.get(_INSTRUCTION.match(inner).group(1), [])
        if not seen:
            w = where(line)
            if w:
                counts[w] += 1
        out[name] = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return out


def device_events(trace_dir: Path) -> list[dict]:
    """Complete events of device streams (GPU), or of XLA's CPU op threads, from the Perfetto trace."""
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise SystemExit(f"error: no perfetto_trace.json.gz under {trace_dir}")
    data = json.loads(gzip.open(files[-1]).read())
    events = data["traceEvents"] if isinstance(data, dict) else data
    pnames = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, n in pnames.items() if "/device:GPU" in n}
    picked = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]
    if not picked:  # CPU: XLA ops carry their HLO op name in args
        picked = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    return picked


def traced_events(run, reps: int) -> list[dict]:
    """The device events of `reps` calls of run() (it blocks until its results are ready), traced after one
    untraced call."""
    import tempfile

    import jax

    run()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(reps):
                run()
        return device_events(Path(d))


def device_ms(run, reps: int, kernel: str) -> float:
    """ms per call of run() spent in device events whose name contains `kernel` (traced_events): a kernel's
    own time, without the host's launch and sync overhead that wall-clock timing includes (which dominates
    kernels of a few or a few tens of microseconds). For scripts/tile_sweep.py and scripts/gemm_bench.py."""
    events = [e for e in traced_events(run, reps) if kernel in e.get("name", "")]
    if not events:
        raise RuntimeError(f"no device event named like {kernel!r} in the trace")
    return sum(float(e["dur"]) for e in events) / 1e3 / reps


def op_breakdown(run, reps: int) -> list[tuple[str, float, float]]:
    """Where one call of run() spends its device time, by op name: (name, ms per call, calls per call),
    the most first (traced_events)."""
    ms: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in traced_events(run, reps):
        name = e.get("name", "?")
        ms[name] = ms.get(name, 0.0) + float(e.get("dur", 0.0)) / 1e3
        calls[name] = calls.get(name, 0) + 1
    return sorted(((n, t / reps, calls[n] / reps) for n, t in ms.items()), key=lambda r: -r[1])


def tables(
    events: list[dict],
    names: dict[str, str],
    pattern: str,
    steps: int,
    top: int,
    always: tuple[str, ...] = (),
    sources: dict[str, list[tuple[str, int]]] | None = None,
) -> str:
    """The profile's tables; `sources` (hlo_source_lines): the top ops' table names each op's source lines."""
    timed = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e) for e in events if "ts" in e)
    busy, end, last, gaps = 0.0, float("-inf"), None, []
    for a, b, e in timed:  # the union of the device ops' intervals: time the device had work
        if a > end and last is not None:  # the device idle from `end` to `a`, between `last` and e
            gaps.append((a - end, last.get("name", "?"), e.get("name", "?")))
        if b > end:
            busy += b - max(a, end)
            end, last = b, e
    by_scope: dict[tuple[str, str], float] = defaultdict(float)
    by_op: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    small: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])  # ops under 5 us, by scope
    total = 0.0
    for e in events:
        args = e.get("args", {})
        hlo = args.get("hlo_op") or e.get("name", "?")
        op_name = names.get(hlo) or args.get("tf_op", "")
        pas, scope, op = scope_of(op_name, pattern) if op_name else ("?", "(unmapped)", hlo)
        dur = float(e.get("dur", 0.0)) / 1e3 / steps  # us -> ms per step
        total += dur
        by_scope[(scope, pas)] += dur
        rec = by_op[(e.get("name", hlo), scope, pas)]
        rec[0] += dur
        rec[1] += 1
        if float(e.get("dur", 0.0)) < 5.0:
            small[(scope, pas)][0] += dur
            small[(scope, pas)][1] += 1
    n_small, ms_small = sum(n for _, n in small.values()), sum(ms for ms, _ in small.values())
    span = (end - timed[0][0]) if timed else 0.0  # first start to last end (`end`: the latest end seen)
    lines = [
        f"device time per step: {total:.2f} ms (sum over device ops; overlapping streams add up); "
        f"busy {busy / 1e3 / steps:.2f} ms (union of op intervals)",
        # each launch also leaves the device a gap of about a microsecond: the count says how many there are
        f"device ops per step: {len(events) / steps:.0f}, of which {n_small / steps:.0f} under 5 us "
        f"({ms_small:.2f} ms)",
        # whether the steps are queued back to back or each is waited for (--synced), the device's idle time
        # inside the traced window is what the host (launches, synchronisation, command-buffer boundaries) costs
        f"traced window {span / 1e3 / steps:.2f} ms / step: device idle {(span - busy) / 1e3 / steps:.2f} ms / step "
        f"in {len(gaps) / steps:.0f} gaps, {sum(g for g, *_ in gaps if g >= 20) / 1e3 / steps:.2f} ms of it in "
        f"gaps of 20 us or more",
        "",
    ]
    lines += ["the largest device-idle gaps", "", "| gap (us) | after | before |", "|---|---|---|"]
    for g, prev, nxt in sorted(gaps, key=lambda t: -t[0])[:10]:
        lines.append(f"| {g:.1f} | {prev[:50]} | {nxt[:50]} |")
    lines.append("")
    lines += ["| scope | pass | ms / step | share |", "|---|---|---|---|"]
    for (scope, pas), ms in sorted(by_scope.items(), key=lambda kv: -kv[1]):
        if ms >= 0.005 * total or any(a in scope for a in always):
            lines.append(f"| {scope} | {pas} | {ms:.2f} | {100 * ms / max(total, 1e-9):.1f} % |")
    for a in always:  # a small scope's whole cost (every op whose scope path contains it)
        ms = sum(v for (scope, _), v in by_scope.items() if a in scope)
        lines.append(f"scope '{a}' in all: {ms:.3f} ms / step = {100 * ms / max(total, 1e-9):.3f} % of device time")
    lines += ["", "ops under 5 us by scope (the most first)", "", "| scope | pass | ops / step | ms / step |"]
    lines += ["|---|---|---|---|"]
    for (scope, pas), (ms, n) in sorted(small.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {scope} | {pas} | {n / steps:.0f} | {ms:.3f} |")
    src_head, src_rule = (" source lines (ops there) |", "---|") if sources is not None else ("", "")
    lines += ["", f"top {top} device ops", "", f"| op | scope | pass | ms / step | calls / step |{src_head}"]
    lines += [f"|---|---|---|---|---|{src_rule}"]
    for (name, scope, pas), (ms, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        src = ""
        if sources is not None:
            src = " " + ", ".join(f"{w} ({k})" for w, k in sources.get(name, [])[:4]) + " |"
        lines.append(f"| {name[:60]} | {scope} | {pas} | {ms:.3f} | {n / steps:.0f} |{src}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python scripts/profile_step.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=3, help="traced steps")
    ap.add_argument("--warmup", type=int, default=2, help="untraced steps first (the first compiles)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--scope",
        action="append",
        default=[],
        help="always list scopes whose path contains this name, with their total (e.g. nonfinite_guard)",
    )
    ap.add_argument("--out", default="profiles", help="trace directory (default: profiles/<run name>)")
    ap.add_argument(
        "--keep-command-buffers",
        action="store_true",
        help="leave XLA's CUDA-graph command buffers on (default: off while profiling, so ops map to scopes)",
    )
    ap.add_argument("--dump-events", type=int, default=0, help="print the first N device events (raw)")
    ap.add_argument("--hlo", default=None, help="write the compiled step's HLO text here (gzip)")
    ap.add_argument(
        "--source-lines",
        action="store_true",
        help="the top ops' table names the source lines each op holds (from the compiled HLO's metadata): "
        "which lines of detjax an XLA fusion computes",
    )
    ap.add_argument("--plain", action="store_true", help="profile scripts/plain_step.py's step of the config")
    ap.add_argument("--attention", default="cudnn", choices=["cudnn", "xla"], help="the plain step's attention")
    ap.add_argument("--src", default=None, help="profile the detjax package under this tree (e.g. an older commit)")
    ap.add_argument(
        "--digest-alone-bytes",
        type=int,
        default=None,
        help="digest leaves of at least this many bytes alone, unstacked (detjax.fingerprint.ALONE_BYTES)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="set a detjax module constant before the step is built, as det_tax's set= mode items do "
        "(e.g. detjax.pallas_kernels.gmm.ops.MOSAIC_BF16=False); repeatable",
    )
    ap.add_argument(
        "--synced",
        action="store_true",
        help="wait for each traced step before dispatching the next (det_tax's synced step): the device's idle "
        "time then includes what it waits for the host's dispatch",
    )
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()  # overrides may come before or after the flags

    here = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(Path(a.src).resolve() if a.src else here))
    from detjax.train import config_for_cli

    # the FLOP count is always this tree's detjax/flops.py (an older tree may not have one)
    spec = importlib.util.spec_from_file_location("detjax_flops", here / "detjax" / "flops.py")
    flops_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flops_mod)

    cfg = config_for_cli(a.config, a.overrides)
    if cfg is None:
        return 2
    # CUDA-graph command buffers hide which HLO op each kernel belongs to. The plain step keeps XLA's defaults:
    # it has no scopes to map, and it failed inside XLA with them off (docs/benchmarks-history.md set 17).
    if not a.keep_command_buffers and not a.plain:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
    import jax
    import numpy as np

    from detjax import fingerprint
    from detjax.data.pipeline import make_dataset
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer, compile_init, compile_train_step

    if a.digest_alone_bytes is not None:
        fingerprint.ALONE_BYTES = a.digest_alone_bytes
    if a.set:
        sys.path.insert(0, str(here / "scripts"))
        from det_tax import apply_module_settings

        try:
            apply_module_settings("profile" + "".join(f"+set={item}" for item in a.set))
        except (ValueError, SyntaxError, ImportError) as e:
            print(f"profile_step: --set: {e}", file=sys.stderr)
            return 2
    ds = make_dataset(cfg)
    if a.plain:
        sys.path.insert(0, str(here / "scripts"))
        import plain_step

        init, plain = plain_step.build(cfg, a.attention)
        devices = jax.devices()[:1]
        batches = [jax.device_put(np.asarray(ds[i]), devices[0]) for i in range(4)]
        state = init(jax.random.key(cfg.train.seed))

        def step(state, batch):  # called as det_tax's plain mode calls it (which runs on the H200 unprofiled)
            p, o, loss = plain(*state, batch)
            return (p, o), loss

    else:
        layout = build_layout(cfg)
        devices = list(layout.mesh.devices.flat)
        trainer = Trainer(cfg, layout=layout)
        state_sh, batch_sh = trainer.state_shardings(), trainer.batch_sharding()
        state = compile_init(trainer, state_sh)(jax.random.key(cfg.train.seed))
        step = compile_train_step(trainer, state_sh, batch_sh)
        batches = [jax.device_put(np.asarray(ds[i]), batch_sh) for i in range(4)]
    # the plain step has no module scopes to map to, and is not lowered a second time
    hlo_text = "" if a.plain else step.lower(state, batches[0]).compile().as_text()
    names = hlo_op_names(hlo_text) if hlo_text else {}
    if a.hlo and hlo_text:
        with gzip.open(a.hlo, "wt") as f:
            f.write(hlo_text)
    for i in range(a.warmup):
        state, m = step(state, batches[i % 4])
    jax.block_until_ready((state, m))
    t0 = time.perf_counter()
    for i in range(a.steps):  # the steady-state step time, without the profiler's own overhead
        state, m = step(state, batches[i % 4])
    jax.block_until_ready((state, m))
    dt_plain = (time.perf_counter() - t0) / a.steps
    out = Path(a.out) / (cfg.run.name + ("_plain" if a.plain else ""))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        for i in range(a.steps):
            state, m = step(state, batches[i % 4])
            if a.synced:
                jax.block_until_ready((state, m))
        jax.block_until_ready((state, m))
    dt = (time.perf_counter() - t0) / a.steps
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices() if d in devices]
    peak = max([p for p in peaks if p is not None], default=None)
    flops = flops_mod.model_flops_per_step(cfg)
    what = f"{cfg.run.name}{' (plain step)' if a.plain else ''}"
    print(f"{what}: {jax.devices()[0].device_kind}, jax {jax.__version__}, {len(devices)} device(s)")
    print(
        f"step {1e3 * dt_plain:.2f} ms ({a.steps} steps back to back, wall clock; {1e3 * dt:.2f} ms under the "
        f"profiler{', each step waited for' if a.synced else ''}); "
        f"model {flops / 1e12:.2f} TFLOP/step -> MFU {100 * flops_mod.mfu(cfg, dt_plain, len(devices)):.1f} %"
        + ("" if peak is None else f"; peak memory {peak / 2**30:.2f} GiB")
    )
    print(f"trace: {out}\n")
    events = device_events(out)
    if a.dump_events:
        for e in events[: a.dump_events]:
            print("event", json.dumps(e)[:600])
    sources = hlo_source_lines(hlo_text) if a.source_lines and hlo_text else None
    print(tables(events, names, cfg.model.pattern, a.steps, a.top, tuple(a.scope), sources))
    return 0


if __name__ == "__main__":
    sys.exit(main())
