"""How much of canonical numerics' cost is its optimizer: one det_tax worker run of a canonical config with
canonical numerics' optimizer (clip by the pair-tree norm + optim.pinned_adamw, the product) or, as a probe,
with default numerics' optimizer (optax.clip_by_global_norm + optax.adamw) on the same canonical gradients.
The second is not mesh-invariant (docs/DETERMINISM.md, "The optimizer"); its time is the floor an optimizer
change could reach. Run the variants alternately, each in its own process, on one GPU:

    for v in pinned default-opt pinned default-opt; do python3 scripts/optimizer_probe.py $v; done
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variant", choices=["pinned", "default-opt"])
    ap.add_argument("--config", default="configs/gpu_small.yaml")
    ap.add_argument("--mode", default="canonical+determinism.canonical_leaf=8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("overrides", nargs="*", default=["run.tensorboard=false"])
    a = ap.parse_args()
    if a.variant == "default-opt":
        import detjax.step as step
        from detjax.optim import make_optimizer

        step.make_optimizer = lambda t, canonical=False: make_optimizer(t, False)
    import det_tax

    r = det_tax.worker(a.config, a.mode, a.overrides, a.steps, a.warmup)
    print("PROBE", a.variant, json.dumps({k: r[k] for k in ("median_ms", "pipelined_ms")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
