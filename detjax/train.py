"""`python -m detjax.train --config FILE [--resume | --resume-step N] [key=value ...]`: the thin training loop.

The run directory holds config.yaml (resolved), determinism.json (policy record), fingerprints.jsonl,
metrics.jsonl, checkpoints/ and final_params.npz. XLA flags are set before JAX is imported.
Exit status: 0 done (train.steps or run.stop_after reached), 2 bad input (config, checkpoint, data), 3 stopped
on a non-finite loss, gradient or parameter, 128 + the signal number when SIGTERM/SIGINT stopped the run
(143 for SIGTERM, 130 for SIGINT; the state was saved first when checkpoints are on).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detjax import determinism
from detjax.config import (
    Config,
    ConfigError,
    canonical_notes,
    dump_config,
    leaf_note,
    load_config,
    with_canonical_leaf,
    with_flash_backend,
)


@dataclass
class RunResult:
    run_dir: Path
    state: Any
    records: list[dict[str, Any]]
    stopped_by: str  # "steps", "stop_after" or "signal"
    data_state: dict[str, Any]
    signal: int | None = None  # the signal that stopped the run


def exit_status(result: RunResult) -> int:
    """The process exit status of a finished `train` call (see the module docstring)."""
    return 128 + result.signal if result.stopped_by == "signal" and result.signal else 0


def adopt_horizon(cfg: Config, saved: dict[str, Any]) -> Config:
    """On resume: the schedule horizon the run recorded at its first start, when this config leaves it unset.

    train.decay_steps = 0 means "decay over train.steps" and is resolved to that number when a run starts, so a
    run can later be extended (a larger train.steps) without moving a bit of the steps it already took."""
    if cfg.train.decay_steps:
        return cfg
    t = saved.get("train", {})
    horizon = int(t.get("decay_steps") or t.get("steps") or 0)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, decay_steps=horizon)) if horizon else cfg


def adopt_leaf(cfg: Config, saved: dict[str, Any]) -> Config:
    """On resume: the canonical leaf the run resolved at its first start, when this config leaves it auto (0)."""
    d = cfg.determinism
    leaf = int(saved.get("determinism", {}).get("canonical_leaf") or 0)
    if not d.canonical or d.canonical_leaf or not leaf:
        return cfg
    return dataclasses.replace(cfg, determinism=dataclasses.replace(d, canonical_leaf=leaf))


def adopt_flash_backend(cfg: Config, saved: dict[str, Any]) -> Config:
    """On resume: the flash backend the run started with, when this config leaves it auto (a run written
    before the key existed ran the Triton kernels)."""
    if cfg.model.flash_backend != "auto":
        return cfg
    backend = saved.get("model", {}).get("flash_backend", "triton")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, flash_backend=backend))


def resolve_horizon(cfg: Config) -> Config:
    """A fresh run's config with train.decay_steps = 0 resolved to train.steps (same schedule, now recorded)."""
    if cfg.train.decay_steps:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, decay_steps=cfg.train.steps))


def _numeric_flags(flags: str | None) -> set[str]:
    """The XLA flags that can change numerics: all of XLA_FLAGS but the dump/debug-output ones."""
    return {f for f in (flags or "").split() if not f.startswith(("--xla_dump", "--xla_gpu_dump"))}


def _layout_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Differences between the checkpoint's machine and this one that change single-device bits: device kind
    and platform, the XLA flags, and on CPU the number of host devices (XLA's CPU partitioning of the step
    follows it: the same config diverges at step 0 with 1 and with 8 host devices)."""
    out = [
        f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}"
        for k in ("platform", "device_kind")
        if saved.get(k) != now.get(k)
    ]
    if now.get("platform") == "cpu" and saved.get("device_count") != now.get("device_count"):
        out.append(f"host CPU devices: saved {saved.get('device_count')}, now {now.get('device_count')}")
    a, b = _numeric_flags(saved.get("xla_flags")), _numeric_flags(now.get("xla_flags"))
    if a != b:
        out.append(f"XLA_FLAGS: only at save {sorted(a - b)}, only now {sorted(b - a)}")
    return out


def _policy_drift(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Differences outside the determinism promise that are allowed with a warning."""
    keys = ["versions", "code", "env", "process_count"] + ([] if now.get("platform") == "cpu" else ["device_count"])
    return [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


def _pick_step(ckptr: Any, resume_step: int | None, run_dir: Path, primary: bool) -> int | None:
    """The checkpoint step to resume from: the latest, or `resume_step`, whose later checkpoints are moved to
    <run>/superseded/after_<step>[-N]/ (kept, never deleted) so the continued run can save those steps again."""
    from detjax.ckpt import CheckpointError

    steps = ckptr.all_steps()
    if resume_step is None:
        return steps[-1] if steps else None
    if resume_step not in steps:
        raise CheckpointError(
            f"--resume-step {resume_step}: {ckptr.directory} holds no complete checkpoint at that step (it holds "
            f"{steps or 'none'}). Fix: pick one of those steps"
        )
    later = [s for s in steps if s > resume_step]
    if later and primary:
        dest = Path(run_dir) / "superseded" / f"after_{resume_step}"
        i = 0
        while dest.exists():
            i += 1
            dest = dest.with_name(f"after_{resume_step}-{i}")
        dest.mkdir(parents=True)
        for s in later:
            shutil.move(str(ckptr.directory / str(s)), str(dest / str(s)))
        print(f"moved the later checkpoints {later} to {dest}", file=sys.stderr)
    ckptr.sync("detjax_resume_step")
    return resume_step


def _restore(ckptr: Any, trainer: Any, state_sh: Any, batches: Any, policy: dict[str, Any], step: int):
    """The state at checkpoint `step` (the data iterator is set in place) and its fingerprint history."""
    state, data_state, meta = ckptr.restore(trainer.abstract_state(), state_sh, step)
    saved_mesh, now_mesh = meta["policy"].get("mesh_resolved"), policy.get("mesh_resolved")
    if saved_mesh is not None and saved_mesh != now_mesh and not trainer.canonical:
        from detjax.ckpt import CheckpointError

        raise CheckpointError(
            f"checkpoint step {meta['step']} was written on the mesh {saved_mesh}, this run resolves its mesh "
            f"(mesh.* with the devices present) to {now_mesh}: the trajectory would change at the resume step. "
            "Fix: resume with the same device count (mesh.devices=0 takes all devices present), or start a new run"
        )
    changes = _layout_changes(meta["policy"], policy)
    if changes:
        from detjax.ckpt import CheckpointError

        raise CheckpointError(
            f"checkpoint step {meta['step']} was written on another machine setup; resuming here would change the "
            f"bits: {'; '.join(changes)}. Fix: resume with the same device kind, XLA_FLAGS and (on CPU) host device "
            "count, or start a new run"
        )
    batches.set_state(data_state)
    drift = _policy_drift(meta["policy"], policy)
    if drift:
        warn = "warning: resuming under a different environment (outside the determinism promise):\n  "
        print(warn + "\n  ".join(drift), file=sys.stderr)
    print(f"resumed from {ckptr.directory}/{meta['step']} (step {meta['step']})", file=sys.stderr)
    return state, list(meta["fingerprints"])


def _announce(cfg: Config, primary: bool) -> None:
    for w in cfg.train.warnings() if primary else []:
        print(f"warning: {w}", file=sys.stderr)
    for note in canonical_notes(cfg) if primary else []:
        print(f"note: {note}", file=sys.stderr)


def _initial_state(
    trainer: Any, state_sh: Any, batches: Any, ckptr: Any, policy: dict, restore_step: int | None, resume: bool
) -> tuple[Any, list]:
    """(state, fingerprint history): restored from `restore_step`, or initialised from the seed."""
    import jax

    from detjax.step import compile_init

    if restore_step is not None:
        return _restore(ckptr, trainer, state_sh, batches, policy, restore_step)
    if resume and ckptr is not None:
        print(f"no checkpoint in {ckptr.directory}; starting from step 0", file=sys.stderr)
    return compile_init(trainer, state_sh)(jax.random.key(trainer.cfg.train.seed)), []


def _paths(state: Any) -> list[str]:
    """The parameters' tree paths, as the non-finite report names them."""
    import jax

    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]


def _putter(batch_sh: Any, shape: tuple[int, int]) -> Callable[[Any], Any]:
    """This process's rows of a batch -> the global batch array on the mesh."""
    import jax

    def put(batch: Any) -> Any:
        if jax.process_count() == 1:
            return jax.device_put(batch, batch_sh)
        return jax.make_array_from_process_local_data(batch_sh, batch, shape)

    return put


def _resume_wanted(cfg: Config, resume: bool | None, resume_step: int | None) -> bool:
    resume = (cfg.ckpt.resume if resume is None else resume) or resume_step is not None
    if resume and not cfg.ckpt.enabled:
        raise ConfigError(
            "config key 'ckpt.enabled' = False: resume asks for a checkpoint but checkpoints are off. "
            "Fix: set ckpt.enabled=true"
        )
    return resume


def _restore_point(
    cfg: Config,
    ckptr: Any,
    layout: Any,
    resume: bool,
    resume_step: int | None,
    run_dir: Path,
    primary: bool,
    required: bool,
) -> tuple[Config, int | None]:
    """(the config with its schedule horizon and canonical leaf, the checkpoint step to restore or None to start
    at step 0)."""
    from detjax.ckpt import CheckpointError

    restore_step = None
    if resume and ckptr is not None:
        restore_step = _pick_step(ckptr, resume_step, run_dir, primary)
        if restore_step is None and required:
            raise CheckpointError(
                f"--resume: {ckptr.directory} holds no complete checkpoint, so there is nothing to resume. "
                "Fix: check --run-dir, or drop --resume to start a new run"
            )
    auto_leaf = cfg.determinism.canonical and not cfg.determinism.canonical_leaf
    if restore_step is not None:  # the schedule horizon (and auto leaf) recorded at the run's first start
        saved = ckptr.read_meta(restore_step)["config"]
        cfg = adopt_flash_backend(adopt_leaf(adopt_horizon(cfg, saved), saved), saved)
    else:
        cfg = resolve_horizon(cfg)
    cfg = with_flash_backend(with_canonical_leaf(cfg, layout.degrees), layout.mesh.devices.flat[0])
    if auto_leaf and primary:
        print(f"note: {leaf_note(cfg)}", file=sys.stderr)
    if ckptr is not None:
        ckptr.cfg = cfg
    return cfg, restore_step


def _policy(cfg: Config, layout: Any) -> dict[str, Any]:
    """The run's determinism.json record: the mode's policy, the tokenizer, the resolved mesh."""
    from detjax.data.tokenizer import ByteTokenizer

    policy = determinism.policy_record(cfg)
    policy["tokenizer"] = {
        "kind": "bytes (builtin corpus)" if cfg.data.source == "builtin" else "recorded in data.path/meta.json",
        "sha256": cfg.data.tokenizer_sha256 or ByteTokenizer.sha256,
    }
    policy["mesh_resolved"] = {**layout.degrees, "devices": int(layout.mesh.devices.size)}
    return policy


class _Profile:
    """run.profile_steps=A-B: a jax.profiler trace of steps A..B-1 into RUN/profile."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.range, self.dir, self.on = cfg.run.profile_range(), run_dir / "profile", False

    def before(self, step: int) -> None:
        import jax

        if self.range is not None and step == self.range[0]:
            jax.profiler.start_trace(str(self.dir))
            self.on = True

    def after(self, step: int, state: Any) -> None:
        import jax

        if self.on and step == self.range[1] - 1:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.on = False

    def close(self) -> None:  # stopped inside the profiled steps
        import jax

        if self.on:
            jax.profiler.stop_trace()


def _finish_checkpoints(ckptr: Any, state: Any, batches: Any, log: Any, policy: dict, saved_at: int) -> None:
    """Save the last state unless it is saved already (or is None: not to be saved), and wait for every save to
    be complete."""
    import jax

    if ckptr is None:
        return
    if state is not None and int(jax.device_get(state.step)) != saved_at:
        ckptr.save(state, batches.get_state(), log.records, policy)
    ckptr.wait()
    ckptr.close()


def _compile_step(
    cfg: Config, trainer: Any, shardings: tuple, state: Any, policy: dict, run_dir: Path, primary: bool
) -> Callable:
    """The jitted train step (wrapped by the tracer when the config asks), checked for ops without a
    deterministic path; the run's description is written once the check has passed."""
    import jax
    import numpy as np

    from detjax import rundir
    from detjax.step import compile_train_step
    from detjax.trace.driver import step_runner

    state_sh, batch_sh = shardings
    step_fn = compile_train_step(trainer, state_sh, batch_sh)
    shape = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), np.int32, sharding=batch_sh)
    left = determinism.check_step(cfg, step_fn, state, shape)
    if left:  # strategy=kernels: the (tiny) dots XLA still runs, each with its reason
        policy["xla_dots_left"] = [{k: str(v) for k, v in d.items()} for d in left]
    if primary:
        rundir.write_description(run_dir, cfg, policy)
    return step_runner(cfg, trainer, step_fn, run_dir, state_sh, batch_sh)


class _HeldOut:
    """eval.every: the held-out batches' loss sums after every `every`-th step, queued behind the step."""

    def __init__(self, cfg: Config, trainer: Any, shardings: tuple, batches: list) -> None:
        from detjax.step import compile_eval_step

        self.every, self.batches = cfg.eval.every, batches
        self.tokens = len(batches) * cfg.train.global_batch * cfg.train.seq_len
        self.fn = compile_eval_step(trainer, *shardings) if batches else None

    def add(self, step: int, state: Any, metrics: dict) -> dict:
        if self.fn is None or (step + 1) % self.every:
            return metrics
        import jax.numpy as jnp

        sums = jnp.stack([self.fn(state, b) for b in self.batches])
        return {**metrics, "eval": {"sums": sums, "tokens": self.tokens}}


def train(
    cfg: Config,
    run_dir: Path | None = None,
    resume: bool | None = None,
    after_restore: Callable[[Any, Any], tuple[Any, Any]] | None = None,
    resume_step: int | None = None,
    require_checkpoint: bool = False,
) -> RunResult:
    """Train per `cfg`. With resume, continue from the latest complete checkpoint in the run directory (or from
    `resume_step`, whose later checkpoints are then moved aside, never deleted). `require_checkpoint` (the CLI's
    --resume) refuses to start from step 0 when the directory holds no checkpoint; `ckpt.resume: true` alone
    resumes when there is one and starts fresh otherwise (the pattern of requeued jobs). `after_restore(state,
    batches) -> (state, batches)` exists for negative-control tests only."""
    determinism.apply_config_environment(cfg)
    determinism.check_features(cfg)
    from detjax.sharding.distributed import initialize, is_primary

    initialize(cfg.dist)  # before any JAX backend starts
    import jax
    import numpy as np

    from detjax import rundir
    from detjax.ckpt import Checkpointer, StopSignals
    from detjax.data.pipeline import BatchIterator, eval_batches, make_dataset, resolve_data
    from detjax.runlog import NonFiniteError, RunLog
    from detjax.sharding.mesh import build_layout
    from detjax.step import Trainer

    primary = is_primary()
    _announce(cfg, primary)
    resume = _resume_wanted(cfg, resume, resume_step)
    cfg = resolve_data(cfg)  # the prepared corpus's tokenizer hash joins the config (and its hash)
    must = require_checkpoint
    run_dir = rundir.choose(cfg, run_dir, resume, jax.process_count(), must_exist=must)
    with rundir.locked(run_dir, primary):  # one process at a time per run directory
        layout = build_layout(cfg)  # impossible meshes fail here, before anything compiles
        ckptr = Checkpointer(Path(cfg.ckpt.dir or run_dir / "checkpoints"), cfg) if cfg.ckpt.enabled else None
        cfg, restore_step = _restore_point(cfg, ckptr, layout, resume, resume_step, run_dir, primary, must)
        policy = _policy(cfg, layout)
        trainer = Trainer(cfg, layout=layout)
        state_sh, batch_sh = trainer.state_shardings(), trainer.batch_sharding()
        shape = (cfg.train.global_batch, cfg.train.seq_len + 1)
        rows = process_rows(batch_sh, shape)
        batches = BatchIterator(make_dataset(cfg, rows=rows))
        state, history = _initial_state(trainer, state_sh, batches, ckptr, policy, restore_step, resume)
        if after_restore is not None:
            state, batches = after_restore(state, batches)
        run_step = _compile_step(cfg, trainer, (state_sh, batch_sh), state, policy, run_dir, primary)

        put = _putter(batch_sh, shape)
        held_out = _HeldOut(
            cfg, trainer, (state_sh, batch_sh), [put(b) for b in eval_batches(cfg, rows)] if cfg.eval.every else []
        )
        start = int(jax.device_get(state.step))
        end = min(cfg.train.steps, cfg.run.stop_after) if cfg.run.stop_after else cfg.train.steps
        log = RunLog(cfg, run_dir, history, start, end, primary, list(layout.mesh.devices.flat), _paths(state))
        stopped_by, saved_at, prof = "steps" if end == cfg.train.steps else "stop_after", start, _Profile(cfg, run_dir)
        with StopSignals() as sig:
            try:
                for step in range(start, end):
                    prof.before(step)
                    t_data = time.perf_counter()
                    batch = put(np.asarray(next(batches)))
                    data_wait = time.perf_counter() - t_data
                    state, metrics = run_step(step, state, batch)
                    metrics = held_out.add(step, state, metrics)  # queued after the step
                    prof.after(step, state)
                    log.push(step, metrics, data_wait)  # records step - 1, whose metrics are ready: step is queued
                    done = step + 1
                    stop = sig.stop_at(done)
                    if ckptr is not None and ckptr.due(done, stop):
                        log.flush()  # the saved fingerprint history must reach this step (and passes the guard)
                        saved_at = ckptr.save(state, batches.get_state(), log.records, policy)
                    if stop:
                        stopped_by = "signal"
                        what = f"saved step {done}" if ckptr is not None else f"stopped after step {done} (not saved)"
                        print(f"received signal {sig.received}: {what}, exiting", file=sys.stderr)
                        break
                log.flush()
            except NonFiniteError:  # the non-finite state is never saved: earlier checkpoints finish, then stop
                _finish_checkpoints(ckptr, None, batches, log, policy, saved_at)
                log.close()
                raise
            finally:
                prof.close()
            _finish_checkpoints(ckptr, state, batches, log, policy, saved_at)
        log.close()
        if cfg.run.save_final_params and stopped_by == "steps":
            rundir.write_final_params(run_dir, state.params, primary)
        return RunResult(run_dir, state, log.records, stopped_by, batches.get_state(), sig.received)


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
    ap = argparse.ArgumentParser(
        prog="python -m detjax.train",
        description="Train the detjax hybrid LM.",
        epilog=(
            "Config sections: model (shape, block pattern, mamba, moe, mtp, kernels), train (batch, steps, "
            "optimizer, schedule, on_nonfinite), data (builtin or a prepared directory), eval (held-out loss), "
            "mesh (data/fsdp/tensor/pipeline/expert), determinism (mode, strategy), run (name, out_dir, logging, "
            "TensorBoard / W&B), ckpt, trace, dist. --print-config lists every key with its value; README.md and "
            "docs/ (DETERMINISM, MESHES, CHECKPOINTS, TRACING) explain them. "
            "Exit status: 0 done, 2 bad input, 3 non-finite, 128+N stopped by signal N."
        ),
    )
    ap.add_argument("--config", default=None, help="YAML config file, e.g. configs/tiny.yaml (required to train)")
    ap.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (every key, defaults filled in, overrides applied) as YAML and exit",
    )
    ap.add_argument("--run-dir", default=None, help="exact run directory (default: run.out_dir/run.name[-N])")
    ap.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    ap.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="N",
        help="continue from the complete checkpoint at step N (later ones are moved to <run>/superseded/)",
    )
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 model.d_model=128")
    args = ap.parse_intermixed_args(argv)
    if args.print_config:
        try:
            print(dump_config(load_config(args.config, args.overrides)), end="")
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.config is None:
        print("error: --config FILE is required to train (e.g. --config configs/tiny.yaml)", file=sys.stderr)
        return 2
    cfg = config_for_cli(args.config, args.overrides)
    if cfg is None:
        return 2
    from detjax.ckpt import CheckpointError
    from detjax.data.pipeline import DataError
    from detjax.runlog import NonFiniteError

    try:
        result = train(
            cfg,
            Path(args.run_dir) if args.run_dir else None,
            resume=args.resume or None,
            resume_step=args.resume_step,
            require_checkpoint=args.resume or args.resume_step is not None,
        )
    except (CheckpointError, ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print(f"run directory: {result.run_dir} (stopped by {result.stopped_by})")
    return exit_status(result)


if __name__ == "__main__":
    sys.exit(main())
