"""Which leaves differ after one canonical-numerics step on two meshes (8 virtual CPU devices, one process).

    python scripts/canonical_diff.py --pattern E --mesh-a mesh.devices=1 --mesh-b mesh.data=8 [overrides ...]
    python scripts/canonical_diff.py --pattern 'M*E-M*E-' --mesh-b mesh.pipeline=2,train.micro_batch=1

Builds configs/tiny_mesh.yaml with `model.pattern=PATTERN`, `determinism.numerics=canonical` and the overrides,
runs one train step from the same initial state and batch on mesh A and on mesh B, and prints each optimizer
state leaf (the first step's gradient shows in Adam's mu and nu; the parameters do not move at step 0 under
warm-up) as `same` or `DIFF n/size` with byte equality (uint32 views), plus the largest relative difference.
The diagnosis tool for the one-device MoE router mismatch and the canonical pipeline's differences
(docs/DETERMINISM.md). It runs with canonical numerics' XLA flags (detjax.determinism.CANONICAL_XLA_FLAGS).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + os.environ.get("XLA_FLAGS", "")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from detjax import determinism  # noqa: E402  (imports no jax)

determinism.apply_environment("strict", "xla_flags", "canonical")


def one_step(pattern: str, mesh: list[str], overrides: list[str]):
    import jax

    from detjax.config import load_config
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer, compile_init

    cfg = load_config(
        str(REPO / "configs/tiny_mesh.yaml"),
        [f"model.pattern='{pattern}'", "determinism.numerics=canonical", *overrides, *mesh],
    )
    tr = Trainer(cfg, build_layout(cfg, jax.devices()[: cfg.mesh.devices or 8]))
    ssh, bsh = tr.state_shardings(), tr.batch_sharding()
    state = compile_init(tr, ssh)(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (cfg.train.global_batch, cfg.train.seq_len + 1), 0, 264)
    new, _ = jax.jit(tr.train_step, in_shardings=(ssh, bsh))(state, jax.device_put(batch, bsh))
    return jax.device_get(new.opt_state)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pattern", default="E")
    ap.add_argument("--mesh-a", default="mesh.devices=1")
    ap.add_argument("--mesh-b", default="mesh.data=8")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    import jax
    import numpy as np

    sa = one_step(a.pattern, a.mesh_a.split(","), a.overrides)
    sb = one_step(a.pattern, a.mesh_b.split(","), a.overrides)
    n_diff = 0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(sa), jax.tree.leaves(sb), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype.itemsize != 4:
            continue
        m = x.view(np.uint32) != y.view(np.uint32)
        if m.any():
            n_diff += 1
            rel = float(np.max(np.abs(x[m] - y[m]) / (np.abs(x[m]) + 1e-30)))
            print(f"{jax.tree_util.keystr(path)} DIFF {int(m.sum())}/{x.size} (max relative {rel:.2e})")
        else:
            print(f"{jax.tree_util.keystr(path)} same")
    print(f"{n_diff} leaves differ")
    return 1 if n_diff else 0


if __name__ == "__main__":
    sys.exit(main())
