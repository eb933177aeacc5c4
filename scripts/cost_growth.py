"""Cost growth of the deterministic step: step time, MFU and peak memory of one config (strict, kernels
strategy) as seq_len and d_model change, at fixed tokens per step.

    python3 scripts/cost_growth.py --config configs/gpu_medium.yaml --seq 1024,2048,4096,8192 --d-model 512,2048

seq_len variants keep global_batch x seq_len and the number of microbatches of the config (so the tokens per
microbatch stay the same too); d_model variants keep the config's seq_len. Every row is one fresh process
(scripts/det_tax.py's `strict-kernels` worker: compile, --warmup steps dropped, median of --steps steps) and
is printed as soon as it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def variants(cfg, seqs: list[int], d_models: list[int]) -> list[tuple[str, list[str]]]:
    t = cfg.train
    tokens, n_micro = t.global_batch * t.seq_len, t.global_batch // t.micro_batch
    out = []
    for s in seqs:
        if tokens % s or (tokens // s) % n_micro:
            raise SystemExit(f"error: seq_len {s} does not split {tokens} tokens into {n_micro} microbatches")
        gb = tokens // s
        out.append(
            (f"seq_len {s}", [f"train.seq_len={s}", f"train.global_batch={gb}", f"train.micro_batch={gb // n_micro}"])
        )
    for d in d_models:
        out.append((f"d_model {d}", [f"model.d_model={d}"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--seq", default="1024,2048,4096,8192")
    ap.add_argument("--d-model", default="512,1024,2048")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from detjax.config import load_config
    from detjax.flops import PEAK_FLOPS_BF16, model_flops_per_step

    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    base = load_config(a.config, a.overrides)
    print("| variant | tokens/step | step (ms) | tokens/s | MFU | peak mem (GiB) |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for name, extra in variants(base, ints(a.seq), ints(a.d_model)):
        overrides = [*a.overrides, *extra]
        cmd = [sys.executable, str(HERE / "det_tax.py"), "--config", a.config, "--steps", str(a.steps)]
        cmd += ["--warmup", str(a.warmup), "--worker", "strict-kernels", *overrides]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            print(f"| {name} | failed: {(out.stderr.strip().splitlines() or ['?'])[-1][:200]} |||||", flush=True)
            continue
        res = json.loads(line[0][7:])
        ms = res["median_ms"]
        mfu = model_flops_per_step(load_config(a.config, overrides)) / (ms / 1e3) / PEAK_FLOPS_BF16
        tok = res["tokens_per_step"]
        peak = (res.get("peak_mem_bytes") or 0) / 2**30
        print(f"| {name} | {tok} | {ms:.2f} | {tok / (ms / 1e3):,.0f} | {100 * mfu:.1f} % | {peak:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
