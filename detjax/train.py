"""`python -m detjax.train --config FILE [--resume] [key=value ...]`: the thin training loop.

The run directory holds config.yaml (resolved), determinism.json (policy record), fingerprints.jsonl,
metrics.jsonl, checkpoints/ and final_params.npz. XLA flags are set before JAX is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detjax import determinism
from detjax.config import Config, ConfigError, dump_config, load_config

# Test hook: SIGKILL this process right after the async save of this step has started (see tests).
KILL_DURING_SAVE_ENV = "DETJAX_DEBUG_KILL_DURING_SAVE"


@dataclass
class RunResult:
    run_dir: Path
    state: Any
    records: list[dict[str, Any]]
    stopped_by: str  # "steps", "stop_after" or "signal"
    data_state: dict[str, Any]


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

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


class _Signals:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and exits cleanly after the current step."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if _in_main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _policy_drift(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    keys = ("xla_flags", "versions", "device_kind", "platform", "env")
    return [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


class _Tracer:
    """Runs the capture variant of the step at trace.steps and appends its records to the trace stream."""

    def __init__(self, cfg: Config, trainer: Any, run_dir: Path, state_sharding: Any, batch_sharding: Any) -> None:
        self.cfg, self.trainer, self.run_dir = cfg, trainer, run_dir
        self.state_sharding, self.batch_sharding = state_sharding, batch_sharding
        self.steps = set(cfg.trace.step_list()) if cfg.trace.level != "none" else set()
        self._fn = None
        self._rec = None

    def active(self, step: int) -> bool:
        return step in self.steps

    def step(self, step: int, state: Any, batch: Any):

        from detjax.step import Trainer, compile_train_step
        from detjax.trace import streams
        from detjax.trace.opcapture import traced_step_fn

        level, scope = self.cfg.trace.level, self.cfg.trace.scope
        device = int(self.trainer.layout.mesh.devices.reshape(-1)[0].id)
        if level == "op":
            if self._fn is None:
                from detjax.step import _cache_key

                key = _cache_key(self.trainer, "op", self.state_sharding, self.batch_sharding)
                self._fn, self._rec = traced_step_fn(self.trainer.train_step, (state, batch), scope, key)
            (state, metrics), values = self._fn(state, batch)
            recs = streams.op_records(self._rec.meta, values, step)
        else:
            if self._fn is None:
                self._trainer = Trainer(self.cfg, capture=level, scope=scope, layout=self.trainer.layout)
                self._fn = compile_train_step(self._trainer, self.state_sharding, self.batch_sharding)
            state, metrics = self._fn(state, batch)
            tr = metrics.pop("trace")
            meta = self._trainer.trace_meta
            recs = streams.capture_records(meta["micro"], tr["micro"], meta["step"], tr["step"], step, level)
        streams.append(self.run_dir, device, recs)
        return state, metrics


def train(
    cfg: Config,
    run_dir: Path | None = None,
    resume: bool | None = None,
    after_restore: Callable[[Any, Any], tuple[Any, Any]] | None = None,
) -> RunResult:
    """Train per `cfg`. With resume, continue from the latest complete checkpoint in the run directory.

    `after_restore(state, batches) -> (state, batches)` exists for negative-control tests only.
    """
    determinism.apply_config_environment(cfg)
    determinism.check_features(cfg)
    from detjax.sharding.distributed import initialize, is_primary

    initialize(cfg.dist)  # before any JAX backend starts
    import jax
    import numpy as np
    from tqdm import tqdm

    from detjax import fingerprint as fp
    from detjax.ckpt import Checkpointer
    from detjax.data.pipeline import BatchIterator, make_dataset
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer, compile_init, compile_train_step

    primary = is_primary()
    resume = cfg.ckpt.resume if resume is None else resume
    if resume and not cfg.ckpt.enabled:
        raise ConfigError(
            "config key 'ckpt.enabled' = False: resume asks for a checkpoint but checkpoints are off. "
            "Fix: set ckpt.enabled=true"
        )
    if run_dir is None and jax.process_count() > 1 and not resume:
        # every process must agree on the directory (checkpoints are written by all of them)
        run_dir = Path(cfg.run.out_dir) / cfg.run.name
        if (run_dir / "fingerprints.jsonl").exists():
            raise ConfigError(
                f"run directory {run_dir} already holds a run; a multi-process run does not pick a new name. "
                "Fix: pass --run-dir, change run.name, or add --resume"
            )
    if run_dir is None:
        run_dir = Path(cfg.run.out_dir) / cfg.run.name if resume else make_run_dir(cfg)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    policy = determinism.policy_record(cfg)
    ckptr = None
    if cfg.ckpt.enabled:
        ckptr = Checkpointer(Path(cfg.ckpt.dir) if cfg.ckpt.dir else run_dir / "checkpoints", cfg)

    layout = build_layout(cfg)  # impossible meshes fail here, before anything compiles
    trainer = Trainer(cfg, layout=layout)
    abstract = trainer.abstract_state()
    state_shardings = trainer.state_shardings()
    batch_sharding = trainer.batch_sharding()
    g, width = cfg.train.global_batch, cfg.train.seq_len + 1
    rows = process_rows(batch_sharding, (g, width))
    batches = BatchIterator(make_dataset(cfg, rows=rows))
    history: list[dict[str, Any]] = []

    def put(batch: Any) -> Any:
        if jax.process_count() == 1:
            return jax.device_put(batch, batch_sharding)
        return jax.make_array_from_process_local_data(batch_sharding, batch, (g, width))

    if resume and ckptr is not None and ckptr.latest_step() is not None:
        state, data_state, meta = ckptr.restore(abstract, state_shardings)
        batches.set_state(data_state)
        history = list(meta["fingerprints"])
        drift = _policy_drift(meta["policy"], policy)
        if drift:
            print(
                "warning: resuming under a different environment (outside the determinism promise):\n  "
                + "\n  ".join(drift),
                file=sys.stderr,
            )
        print(f"resumed from {ckptr.directory}/{meta['step']} (step {meta['step']})", file=sys.stderr)
    else:
        if resume:
            print(f"no checkpoint in {ckptr.directory}; starting from step 0", file=sys.stderr)
        state = compile_init(trainer, state_shardings)(jax.random.key(cfg.train.seed))
    if after_restore is not None:
        state, batches = after_restore(state, batches)

    step_fn = compile_train_step(trainer, state_shardings, batch_sharding)
    batch_spec = jax.ShapeDtypeStruct((g, width), np.int32, sharding=batch_sharding)
    left = determinism.check_step(cfg, step_fn, state, batch_spec)
    if left:  # strategy=kernels: the (tiny) dots XLA still runs, each with its reason
        policy["xla_dots_left"] = [{k: str(v) for k, v in d.items()} for d in left]
    if primary:
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        (run_dir / "config_hash").write_text(cfg.hash() + "\n")
        with open(run_dir / "determinism.json", "w") as f:
            json.dump(policy, f, indent=2, sort_keys=True)

    tracer = _Tracer(cfg, trainer, run_dir, state_shardings, batch_sharding)
    t = cfg.train
    start = int(jax.device_get(state.step))
    end = min(t.steps, cfg.run.stop_after) if cfg.run.stop_after else t.steps
    tokens_per_step = t.global_batch * t.seq_len
    records = history
    fp_file = None
    if cfg.run.fingerprints and primary:
        # Rewritten from the checkpoint's history: steps after the checkpoint are redone, bit for bit.
        fp_file = (run_dir / "fingerprints.jsonl").open("w")
        for r in records:
            fp_file.write(fp.dumps(r) + "\n")
    metrics_file = (run_dir / "metrics.jsonl").open("a") if primary else None
    bar = tqdm(
        total=end, initial=start, disable=not (cfg.run.progress and primary), desc=cfg.run.name, dynamic_ncols=True
    )
    t_last = time.perf_counter()
    kill_at = int(os.environ.get(KILL_DURING_SAVE_ENV, "-1"))

    def emit(step: int, metrics: Any) -> None:
        nonlocal t_last
        # Host sync: reading step `step`'s metrics waits for that step only; the next step is already queued.
        host = jax.device_get(metrics)
        now = time.perf_counter()
        tok_s = tokens_per_step / max(now - t_last, 1e-9)
        t_last = now
        line = {k: float(host[k]) for k in fp.FLOAT_FIELDS} | {"step": step, "tokens_per_s": tok_s}
        if metrics_file is not None:
            metrics_file.write(json.dumps(line) + "\n")
        if cfg.run.fingerprints:
            rec = fp.record(step, host)
            records.append(rec)
            if fp_file is not None:
                fp_file.write(fp.dumps(rec) + "\n")
                fp_file.flush()
        bar.set_postfix(loss=f"{line['lm_loss']:.4f}", tok_s=f"{tok_s:,.0f}")
        bar.update(1)
        if primary and cfg.run.log_every and (step % cfg.run.log_every == 0 or step == t.steps - 1):
            bar.write(
                f"step {step:5d}  lm_loss {line['lm_loss']:.4f}  mtp {line['mtp_loss']:.4f}  "
                f"aux {line['aux_loss']:.4f}  gnorm {line['grad_norm']:.3f}  {tok_s:,.0f} tok/s"
            )

    def save(done: int) -> None:
        if ckptr is None:
            return
        ckptr.save(state, batches.get_state(), records, policy)
        if done == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    pending = None
    stopped_by = "steps" if end == t.steps else "stop_after"
    saved_at = start
    with _Signals() as sig:
        for step in range(start, end):
            batch = put(np.asarray(next(batches)))
            if tracer.active(step):
                state, metrics = tracer.step(step, state, batch)
            else:
                state, metrics = step_fn(state, batch)
            if pending is not None:
                emit(*pending)
            pending = (step, metrics)
            done = step + 1
            if (ckptr is not None and ckptr.should_save(done)) or sig.received is not None:
                emit(*pending)  # the saved fingerprint history must reach this step
                pending = None
                save(done)
                saved_at = done
            if sig.received is not None:
                stopped_by = "signal"
                what = f"saved step {done}" if ckptr is not None else f"stopped after step {done} (not saved)"
                print(f"received signal {sig.received}: {what}, exiting", file=sys.stderr)
                break
        if pending is not None:
            emit(*pending)
        final = int(jax.device_get(state.step))
        if final != saved_at:
            save(final)
        if ckptr is not None:
            ckptr.wait()
            ckptr.close()
    bar.close()
    if metrics_file is not None:
        metrics_file.close()
    if fp_file is not None:
        fp_file.close()
    if cfg.run.save_final_params and stopped_by == "steps":
        params = state.params
        if jax.process_count() > 1:  # every process takes part in the gather; process 0 writes
            from jax.experimental import multihost_utils

            params = multihost_utils.process_allgather(params, tiled=True)
        if primary:
            np.savez(run_dir / "final_params.npz", **flat_params(params))
    return RunResult(run_dir, state, records, stopped_by, batches.get_state())


def process_rows(sharding: Any, shape: tuple[int, int]) -> tuple[int, int]:
    """The contiguous block of batch rows this process's devices hold (all rows with one process)."""
    spans = sorted(
        {
            (idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
            for idx in sharding.addressable_devices_indices_map(shape).values()
        }
    )
    lo, hi = spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > hi:
            raise ValueError(f"this process's batch rows are not contiguous: {spans}")
        hi = max(hi, b)
    return lo, hi


def config_for_cli(path: str, overrides: list[str]) -> Config | None:
    """Load and check a config for a command line tool, setting the XLA environment before JAX starts;
    prints the error and returns None on bad input."""
    try:
        cfg = load_config(path, overrides)
        # Before anything imports jax: XLA reads XLA_FLAGS once, when its backends start.
        determinism.apply_config_environment(cfg)
        determinism.check_features(cfg)
    except (ConfigError, determinism.DeterminismError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.train", description="Train the detjax hybrid LM.")
    ap.add_argument("--config", required=True, help="YAML config file, e.g. configs/tiny.yaml")
    ap.add_argument("--run-dir", default=None, help="exact run directory (default: run.out_dir/run.name[-N])")
    ap.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 model.d_model=128")
    args = ap.parse_intermixed_args(argv)
    cfg = config_for_cli(args.config, args.overrides)
    if cfg is None:
        return 2
    from detjax.ckpt import CheckpointError

    try:
        result = train(cfg, Path(args.run_dir) if args.run_dir else None, resume=args.resume or None)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"run directory: {result.run_dir} (stopped by {result.stopped_by})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
