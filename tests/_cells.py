"""Shared by the mesh tests: the cells (configs/meshes.yaml), their configs, and the run-and-check helper."""

import json
from pathlib import Path

import numpy as np
import yaml

from detjax.config import load_config

REPO = Path(__file__).resolve().parents[1]
MESH_CFG = REPO / "configs" / "tiny_mesh.yaml"
STEPS = 3
BASE = "M*E-"

# The module-test cells of Megatron-LM plus dp8 and dp2-tp2-pp2, on 8 devices (configs/meshes.yaml says
# how Megatron's names map onto detjax's five multiplying axes).
CELLS = {k: v for k, v in yaml.safe_load((REPO / "configs" / "meshes.yaml").read_text()).items() if k != "single"}
# Pipeline stages hold identical block sequences: two stages get the whole hybrid BASE each (all four
# block kinds inside pipeline stages); four (pp4, pp2 x 2 virtual) get attention + MLP each, which tests
# the 4-stage and interleaved schedules at half the compile time of Mamba2 + MoE stages.
PATTERNS = {1: BASE, 2: BASE * 2, 4: "*-" * 4}


def cell_overrides(cell: str) -> list[str]:
    mesh = CELLS[cell]
    chunks = mesh.get("pipeline", 1) * mesh.get("pipeline_virtual", 1)
    return [f"mesh.{k}={v}" for k, v in mesh.items()] + [f"model.pattern={PATTERNS[chunks]}"]


def cfg_for(*overrides: str):
    return load_config(MESH_CFG, [f"train.steps={STEPS}", "ckpt.enabled=false", *overrides])


def run(cfg, run_dir: Path) -> tuple[bytes, dict]:
    from detjax.train import train

    train(cfg, run_dir)
    return (run_dir / "fingerprints.jsonl").read_bytes(), dict(np.load(run_dir / "final_params.npz"))


def params_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k].view(np.uint32), b[k].view(np.uint32), err_msg=k)


class Reference:
    """Single-device runs of the mesh config, one per pattern, made on first use."""

    def __init__(self, root: Path) -> None:
        self.root, self.cache = root, {}

    def __call__(self, pattern: str) -> list[dict]:
        if pattern not in self.cache:
            d = self.root / f"ref{len(self.cache)}"
            fps, _ = run(cfg_for("mesh.devices=1", f"model.pattern={pattern}"), d)
            self.cache[pattern] = [json.loads(line) for line in fps.decode().splitlines()]
        return self.cache[pattern]


def check_cell(cell: str, tmp_path: Path, reference: Reference) -> None:
    """Two runs of the cell: byte-identical fingerprints and final params; losses track single-device."""
    cfg = cfg_for(*cell_overrides(cell))
    fp_a, params_a = run(cfg, tmp_path / "a")
    fp_b, params_b = run(cfg, tmp_path / "b")  # same process: the compiled step is reused, the run is not
    assert len(fp_a.splitlines()) == STEPS
    assert not (tmp_path / "a" / "checkpoints").exists()  # ckpt.enabled=false: nothing saved
    assert fp_a == fp_b, f"{cell}: fingerprints differ between two runs"
    params_equal(params_a, params_b)
    # Not yet bitwise equal to the single-device run (a later issue); the losses agree to within bf16
    # rounding of reordered sums: 2e-3 relative over 3 steps (observed: <= 1e-4).
    ref = reference(cfg.model.pattern)
    ours = [json.loads(line) for line in fp_a.decode().splitlines()]
    for r, o in zip(ref, ours, strict=True):
        for key in ("lm_loss", "mtp_loss"):
            a, b = r[key]["value"], o[key]["value"]
            assert abs(a - b) <= 2e-3 * abs(a), f"{cell} step {o['step']} {key}: {b} vs single-device {a}"
