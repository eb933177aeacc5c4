"""L2 check: a continuous run vs one interrupted (stopped, checkpointed, restarted in a new process) at
the given steps. Exit 0 when every fingerprint and the final state (params, optimizer state, RNG, data
iterator) are bit-identical; exit 1 with the first divergence otherwise.

    python scripts/resume_check.py --config configs/tiny.yaml --stops 5,9 --steps 15 [key=value ...]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _train(config: str, run_dir: Path, steps: int, extra: list[str], resume: bool, stop: int | None) -> None:
    cmd = [
        sys.executable,
        "-m",
        "detjax.train",
        "--config",
        config,
        "--run-dir",
        str(run_dir),
        f"train.steps={steps}",
        "run.progress=false",
        "run.log_every=0",
        *extra,
    ]
    if resume:
        cmd.append("--resume")
    if stop is not None:
        cmd.append(f"run.stop_after={stop}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"training failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def final_state_diff(a: Path, b: Path) -> str | None:
    """Restore both final checkpoints and compare every leaf's bytes and the data iterator state."""
    import jax

    from detjax.ckpt import Checkpointer
    from detjax.ckpt.manager import host_bytes
    from detjax.config import load_config
    from detjax.sharding.mesh import build_layout, replicated, single_device_mesh
    from detjax.step import Trainer

    cfg = load_config(a / "config.yaml")
    trainer = Trainer(cfg, build_layout(cfg))  # the run's own layout (a pipeline's state is stacked by stage)
    abstract = trainer.abstract_state()
    sh = jax.tree.map(lambda _: replicated(single_device_mesh()), abstract)
    restored = []
    for d in (a, b):
        ck = Checkpointer(d / "checkpoints", cfg)
        restored.append(ck.restore(abstract, sh))
        ck.close()
    (sa, da, _), (sb, db, _) = restored
    if da != db:
        return f"data iterator state differs: {da} vs {db}"
    ba, bb = host_bytes(sa), host_bytes(sb)
    for k in ba:
        if ba[k] != bb.get(k):
            return f"final state leaf {k} differs"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--stops", required=True, help="comma-separated steps at which to stop and restart")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir, removed)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    stops = sorted(int(s) for s in a.stops.split(",") if s)
    if any(not 0 < s < a.steps for s in stops):
        sys.exit(f"error: every stop must lie in 1..{a.steps - 1}, got {stops}")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="resume_check_"))
    cont, intr = work / "continuous", work / "interrupted"
    for d in (cont, intr):
        if d.exists():
            sys.exit(f"error: {d} exists; pass an empty --workdir")
    _train(a.config, cont, a.steps, a.overrides, resume=False, stop=None)
    for i, s in enumerate(stops):
        _train(a.config, intr, a.steps, a.overrides, resume=i > 0, stop=s)
    _train(a.config, intr, a.steps, a.overrides, resume=True, stop=None)

    from detjax.compare import first_divergence, load_fingerprints

    d = first_divergence(load_fingerprints(cont), load_fingerprints(intr))
    rc = 0
    if d is not None:
        fields = ", ".join(f[0] for f in d["fields"]) or d["note"]
        print(f"DIVERGED at step {d['step']}: {fields}")
        rc = 1
    else:
        diff = final_state_diff(cont, intr)
        if diff:
            print(f"DIVERGED in the final state: {diff}")
            rc = 1
        else:
            print(
                f"identical: continuous vs stops {stops} over {a.steps} steps — every fingerprint, and final params, "
                "optimizer state, RNG and data iterator state bit-equal"
            )
    if a.workdir is None and rc == 0:
        shutil.rmtree(work)
    elif rc:
        print(f"runs kept in {work}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
