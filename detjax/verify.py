"""`python -m detjax.verify REFERENCE_RUN [--steps N] [key=value ...]`: fleet health / silent-data-corruption check.

Re-runs the first N steps of a reference run on this machine, from the reference's own resolved config
(REFERENCE_RUN/config.yaml), and compares every fingerprint field (losses, gradient norm, learning rate, and
the digests of parameters, gradients, optimizer state, batch and RNG) with the reference's fingerprints.jsonl.
Use it as a node-admission test: record one reference run per machine kind and config, then verify each new
or suspect node against it. A node whose arithmetic or memory is faulty gives other bits, usually at step 0.

Exit 0: identical. Exit 1: differs (the first differing step and every differing field are printed).
Exit 2: bad input (no such run, no fingerprints, a config that does not load, N beyond what was recorded).
The rerun writes to a temporary run directory (or --run-dir), with checkpoints and final params off.
Only runs on the same kind of machine, with the same XLA flags and device layout, are expected to match:
the reference's machine setup is compared with this one and any difference is printed first.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from detjax.compare import InputError, first_divergence, load_fingerprints, print_divergence


def _reference(run: Path, steps: int | None) -> tuple[Path, list[dict], int]:
    if not run.is_dir():
        raise InputError(f"{run} is not a run directory. Fix: pass the directory a reference run wrote")
    config = run / "config.yaml"
    if not config.is_file():
        raise InputError(f"{config} does not exist; the reference run wrote no resolved config. Fix: pass a run dir")
    recs = load_fingerprints(run)
    n = len(recs) if steps is None else steps
    if n < 1 or n > len(recs) or [r["step"] for r in recs[:n]] != list(range(n)):
        raise InputError(
            f"--steps {n}: the reference recorded steps {recs[0]['step']}..{recs[-1]['step']} ({len(recs)} records); "
            "verify re-runs steps 0..N-1 from the start. Fix: choose 1 <= N <= the recorded steps from step 0"
        )
    return config, recs[:n], n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.verify", description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("reference", help="the reference run directory (config.yaml + fingerprints.jsonl)")
    ap.add_argument("--steps", type=int, default=None, help="re-run steps 0..N-1 (default: every recorded step)")
    ap.add_argument("--run-dir", default=None, help="where the rerun writes (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="bookkeeping overrides (run.*, trace.*), e.g. run.progress=false")
    args = ap.parse_intermixed_args(argv)
    from detjax.config import ConfigError, load_config

    try:
        config, want, n = _reference(Path(args.reference), args.steps)
        saved = load_config(config)
    except (InputError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the schedule horizon the reference ran with (runs written before it was recorded: its train.steps)
    horizon = saved.train.decay_steps or saved.train.steps
    over = [f"train.steps={n}", f"train.decay_steps={horizon}", "run.save_final_params=false", "run.stop_after=0"]
    over += ["ckpt.enabled=false", "ckpt.every=0", "ckpt.resume=false"]
    from detjax.train import config_for_cli  # sets XLA_FLAGS from the config before JAX starts

    cfg = config_for_cli(str(config), [*over, "run.fingerprints=true", *args.overrides])
    if cfg is None:
        return 2
    if cfg.hash() != saved.hash():
        print("error: the overrides change the trajectory config; verify takes run.* and trace.* only", file=sys.stderr)
        return 2
    from detjax.train import _layout_changes, _policy_drift, train

    policy_path = Path(args.reference) / "determinism.json"
    out = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="detjax_verify_"))
    result = train(cfg, out / "run" if args.run_dir is None else out)
    if policy_path.is_file():
        from detjax import determinism

        saved, now = json.loads(policy_path.read_text()), determinism.policy_record(cfg)
        for c in _layout_changes(saved, now):
            print(f"note: this machine differs from the reference's: {c}", file=sys.stderr)
        for c in _policy_drift(saved, now):  # library versions, the detjax code: outside the promise
            print(f"note: outside the determinism promise, this run differs from the reference's: {c}", file=sys.stderr)
    got = load_fingerprints(result.run_dir)
    d = first_divergence(want, got)
    if d is None:
        print(f"identical: steps 0..{n - 1} of {args.reference} re-ran bit for bit on this machine")
        return 0
    print_divergence(d, "DIFFERS", "reference", "this node")
    return 1


if __name__ == "__main__":
    sys.exit(main())
