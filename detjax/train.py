"""`python -m detjax.train --config FILE [key=value ...]`: the thin training loop.

The run directory holds config.yaml (resolved), determinism.json (policy record), fingerprints.jsonl,
metrics.jsonl and final_params.npz. XLA flags are set before JAX is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detjax import determinism
from detjax.config import Config, ConfigError, dump_config, load_config


@dataclass
class RunResult:
    run_dir: Path
    state: Any
    records: list[dict[str, Any]]


def make_run_dir(cfg: Config) -> Path:
    """A fresh directory under run.out_dir; an existing run is never overwritten (a suffix is added)."""
    base = Path(cfg.run.out_dir) / cfg.run.name
    path, i = base, 0
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    path.mkdir(parents=True)
    return path


def flat_params(params: Any) -> dict[str, Any]:
    import jax
    import numpy as np

    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }


def train(cfg: Config, run_dir: Path | None = None) -> RunResult:
    determinism.apply_environment(cfg.determinism.mode)
    determinism.check_features(cfg)
    import jax
    import numpy as np
    from tqdm import tqdm

    from detjax import fingerprint as fp
    from detjax.data.pipeline import BatchIterator, make_dataset
    from detjax.sharding.mesh import replicated, single_device_mesh
    from detjax.step import Trainer, compile_init, compile_train_step

    run_dir = make_run_dir(cfg) if run_dir is None else Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "config_hash").write_text(cfg.hash() + "\n")
    determinism.write_policy(cfg, run_dir / "determinism.json")

    mesh = single_device_mesh()
    rep = replicated(mesh)
    trainer = Trainer(cfg)
    state = compile_init(trainer, rep)(jax.random.key(cfg.train.seed))
    step_fn = compile_train_step(trainer, rep, rep)
    batches = BatchIterator(make_dataset(cfg), start_step=int(state.step))

    t = cfg.train
    tokens_per_step = t.global_batch * t.seq_len
    records: list[dict[str, Any]] = []
    fp_file = (run_dir / "fingerprints.jsonl").open("w") if cfg.run.fingerprints else None
    metrics_file = (run_dir / "metrics.jsonl").open("w")
    bar = tqdm(total=t.steps, disable=not cfg.run.progress, desc=cfg.run.name, dynamic_ncols=True)
    t_last = time.perf_counter()

    def emit(step: int, metrics: Any) -> None:
        nonlocal t_last
        # Host sync: reading step `step`'s metrics waits for that step only; the next step is already queued.
        host = jax.device_get(metrics)
        now = time.perf_counter()
        tok_s = tokens_per_step / max(now - t_last, 1e-9)
        t_last = now
        line = {k: float(host[k]) for k in fp.FLOAT_FIELDS} | {"step": step, "tokens_per_s": tok_s}
        metrics_file.write(json.dumps(line) + "\n")
        if fp_file is not None:
            rec = fp.record(step, host)
            records.append(rec)
            fp_file.write(fp.dumps(rec) + "\n")
        bar.set_postfix(loss=f"{line['lm_loss']:.4f}", tok_s=f"{tok_s:,.0f}")
        bar.update(1)
        if cfg.run.log_every and (step % cfg.run.log_every == 0 or step == t.steps - 1):
            bar.write(
                f"step {step:5d}  lm_loss {line['lm_loss']:.4f}  mtp {line['mtp_loss']:.4f}  "
                f"aux {line['aux_loss']:.4f}  gnorm {line['grad_norm']:.3f}  {tok_s:,.0f} tok/s"
            )

    pending = None
    for step in range(int(state.step), t.steps):
        batch = jax.device_put(np.asarray(next(batches)), rep)
        state, metrics = step_fn(state, batch)
        if pending is not None:
            emit(*pending)
        pending = (step, metrics)
    if pending is not None:
        emit(*pending)
    bar.close()
    metrics_file.close()
    if fp_file is not None:
        fp_file.close()
    np.savez(run_dir / "final_params.npz", **flat_params(state.params))
    return RunResult(run_dir, state, records)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.train", description="Train the detjax hybrid LM.")
    ap.add_argument("--config", required=True, help="YAML config file, e.g. configs/tiny.yaml")
    ap.add_argument("--run-dir", default=None, help="exact run directory (default: run.out_dir/run.name[-N])")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 model.d_model=128")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        # Before anything imports jax: XLA reads XLA_FLAGS once, when its backends start.
        determinism.apply_environment(cfg.determinism.mode)
        determinism.check_features(cfg)
    except (ConfigError, determinism.DeterminismError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = train(cfg, Path(args.run_dir) if args.run_dir else None)
    print(f"run directory: {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
