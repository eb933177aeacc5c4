"""Fault injection: kill -9 a training process at random moments (during compile, training and checkpoint
saving), resume it, and check that every interrupted run ends byte-identical to an uninterrupted one.

    python scripts/kill_check.py --config configs/tiny.yaml --trials 20 --steps 16 --every 3 [key=value ...]

The reference run is timed first (with --compile-cache DIR, after an untimed run that fills the cache, so
the trials load executables and their time is mostly training and saving). Trial i is killed at a moment
drawn uniformly from the i-th of --trials equal slices of the reference's wall time, then resumed with
ckpt.resume=true (from its last complete checkpoint, or from step 0 when the kill came before the first
one) until it finishes. Each kill is classified by what the run directory showed at that moment: `compile`
(no fingerprint yet), `saving` (an Orbax temporary checkpoint directory present) or `training`. A trial
counts as identical when fingerprints.jsonl and final_params.npz equal the reference's byte for byte.
Exit 0 when all trials are identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


def _cmd(config: str, run_dir: Path, a, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "detjax.train",
        "--config",
        config,
        "--run-dir",
        str(run_dir),
        f"train.steps={a.steps}",
        f"ckpt.every={a.every}",
        "ckpt.resume=true",
        "run.progress=false",
        "run.log_every=0",
        *extra,
    ]


def _phase(run_dir: Path) -> str:
    fp = run_dir / "fingerprints.jsonl"
    if not fp.exists() or not fp.read_text().strip():
        return "compile"
    ck = run_dir / "checkpoints"
    if ck.exists() and any("tmp" in p.name for p in ck.iterdir()):
        return "saving"
    return "training"


def _same(a: Path, b: Path) -> bool:
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in ("fingerprints.jsonl", "final_params.npz"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=3, help="ckpt.every: save often, so kills land in saves")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--compile-cache",
        default=None,
        help="a JAX persistent compilation cache directory for every run: the trials then load the reference's "
        "executables, so their wall time (and the kills) is mostly training and saving rather than compiling",
    )
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kill_check_"))
    if a.compile_cache:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(Path(a.compile_cache).absolute())
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    rng = random.Random(a.seed)

    ref = work / "reference"
    if a.compile_cache:  # an untimed run fills the cache: the timed reference and every trial load executables
        subprocess.run(_cmd(a.config, work / "warmup", a, a.overrides), capture_output=True, text=True)
    t0 = time.perf_counter()
    r = subprocess.run(_cmd(a.config, ref, a, a.overrides), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"reference run failed:\n{r.stderr[-4000:]}")
    print(f"reference: {a.steps} steps in {wall:.1f} s ({ref})", flush=True)

    results: list[tuple[str, bool]] = []
    for i in range(a.trials):
        run = work / f"trial{i:02d}"
        at = wall * (i + rng.random()) / a.trials
        p = subprocess.Popen(_cmd(a.config, run, a, a.overrides), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.perf_counter() + at
        while time.perf_counter() < deadline and p.poll() is None:
            time.sleep(0.01)
        phase = _phase(run) if p.poll() is None else "finished"
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.communicate()
        resumes = 0
        while not (run / "final_params.npz").exists() and resumes < 3:
            resumes += 1
            r = subprocess.run(_cmd(a.config, run, a, a.overrides), capture_output=True, text=True)
            if r.returncode:
                print(f"trial {i}: resume failed:\n{r.stderr[-2000:]}", flush=True)
                break
        ok = (run / "final_params.npz").exists() and _same(ref, run)
        results.append((phase, ok))
        print(
            f"trial {i:2d}: kill at {at:6.2f} s ({phase:8s}), {resumes} resume(s): "
            + ("identical" if ok else "DIFFERENT"),
            flush=True,
        )

    by_phase = Counter(ph for ph, _ in results)
    good = Counter(ph for ph, ok in results if ok)
    n_ok = sum(ok for _, ok in results)
    print(
        f"\n{n_ok} of {len(results)} identical to the continuous run; by phase at the kill: "
        + ", ".join(f"{ph} {good[ph]}/{n}" for ph, n in sorted(by_phase.items()))
    )
    return 0 if n_ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
