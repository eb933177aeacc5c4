"""Run one config over several meshes (each twice, in separate processes) and print a table.

    python scripts/mesh_sweep.py --config configs/tiny_mesh.yaml --meshes single,dp8,tp4,pp2 \
        --cpu-devices 8 model.pattern='M*E-M*E-M*E-M*E-' train.steps=3

Columns: mesh, steps, final lm loss (hex), fingerprint digest (sha256 of fingerprints.jsonl, 12 hex),
repeat-identical (the two runs' fingerprint files are byte-equal), equal to the first row (same bytes), the
median step time and tokens/s of the first run's steps after the first two (compilation and warm-up; from
its metrics.jsonl: the wall time between two records, the device's step time once the queue is steady), and
the wall time of the mesh's runs.
Mesh names come from configs/meshes.yaml; `k=v,k=v` (e.g. `tensor=2,expert=2`) also works.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def mesh_overrides(name: str, presets: dict) -> list[str]:
    if name in presets:
        spec = presets[name] or {}
    else:
        try:
            spec = dict(kv.split("=", 1) for kv in name.split(","))
        except ValueError:
            raise SystemExit(f"error: unknown mesh {name!r}; use a name from configs/meshes.yaml or k=v,k=v") from None
    return [f"mesh.{k}={v}" for k, v in spec.items()]


def run_once(cfg: str, overrides: list[str], run_dir: Path, env: dict) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "detjax.train", "--config", cfg, "--run-dir", str(run_dir), "run.progress=false"]
    cmd += ["ckpt.enabled=false"]  # the sweep compares fingerprints; an override after it can turn saving back on
    p = subprocess.run(cmd + overrides, env=env, capture_output=True, text=True, cwd=REPO)
    return p.returncode, p.stdout + p.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--meshes", required=True, help="comma-separated names from configs/meshes.yaml (or k=v;k=v)")
    ap.add_argument("--cpu-devices", type=int, default=0, help="run on N virtual CPU devices (0: the real devices)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="", help="directory for the runs (default: a temporary one)")
    ap.add_argument("--json", default="", help="also write the rows as JSON here")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every mesh")
    args = ap.parse_args(argv)
    presets = yaml.safe_load((REPO / "configs" / "meshes.yaml").read_text())
    names = args.meshes.split(";") if ";" in args.meshes else args.meshes.split(",")
    env = dict(os.environ)
    if args.cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
        ).strip()
    out = Path(args.out or tempfile.mkdtemp(prefix="mesh_sweep_"))
    rows = []
    first: bytes | None = None
    print(
        f"{'mesh':14s} {'steps':>5s}  {'final lm loss (hex)':24s} {'digest':12s}  repeat  =first "
        f"{'step ms':>9s} {'tokens/s':>10s}  time"
    )
    for name in names:
        ov = mesh_overrides(name, presets)
        fps = []
        t0 = time.time()
        for r in range(args.repeats):
            d = out / f"{name}-{r}"
            rc, log = run_once(args.config, [*args.overrides, *ov], d, env)
            if rc != 0:
                print(f"{name:14s} FAILED (exit {rc}):\n{log[-3000:]}", file=sys.stderr)
                fps = []
                break
            fps.append((d / "fingerprints.jsonl").read_bytes())
        if not fps:
            rows.append({"mesh": name, "failed": True})
            print(f"{name:14s} failed")
            continue
        recs = [json.loads(line) for line in fps[0].decode().splitlines()]
        first = fps[0] if first is None else first
        row = {
            "mesh": name,
            "steps": len(recs),
            "final_lm_loss_hex": recs[-1]["lm_loss"]["hex"],
            "final_lm_loss": recs[-1]["lm_loss"]["value"],
            "digest": hashlib.sha256(fps[0]).hexdigest()[:12],
            "repeat_identical": all(f == fps[0] for f in fps),
            "equal_to_first": fps[0] == first,
            "seconds": round(time.time() - t0, 1),
        }
        timed = [json.loads(line) for line in (out / f"{name}-0" / "metrics.jsonl").read_text().splitlines()][2:]
        row["step_ms"] = 1e3 * statistics.median(r["step_time_s"] for r in timed) if timed else float("nan")
        row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed) if timed else float("nan")
        rows.append(row)
        print(
            f"{name:14s} {row['steps']:5d}  {row['final_lm_loss_hex']:24s} {row['digest']:12s}  "
            f"{str(row['repeat_identical']):6s}  {str(row['equal_to_first']):6s} {row['step_ms']:9.2f} "
            f"{row['tokens_per_s']:10.0f} {row['seconds']:5.0f}s",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    ok = all(not r.get("failed") and r["repeat_identical"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
