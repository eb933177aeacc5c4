"""The trace driver: which compiled step runs at each step of a run, and where its records go.

The loop (detjax.train) asks `step_runner` for a callable (step, state, batch) -> (state, metrics). With no
tracing and no fault injection that is the plain compiled train step. With `debug.inject_nondeterminism`
every step runs the instrumented step (detjax.trace.capture) without capture; at `trace.steps` the step
runs with phase or module capture, or under op capture (detjax.trace.opcapture), and its records are
appended to the run's trace streams.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from detjax.config import Config
from detjax.step import Trainer, cache_key, compile_cached
from detjax.trace import streams
from detjax.trace.capture import instrumented_step
from detjax.trace.opcapture import traced_step_fn

StepFn = Callable[[int, Any, Any], tuple[Any, dict[str, Any]]]


def _jit_instrumented(trainer: Trainer, level: str, scope: str, state_sh: Any, batch_sh: Any):
    return compile_cached(
        (cache_key(trainer, f"capture-{level}", state_sh, batch_sh), scope),
        lambda: jax.jit(
            instrumented_step(trainer, level, scope),
            in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, None, None),
            donate_argnums=(0,),
        ),
    )


def step_runner(cfg: Config, trainer: Trainer, plain: Any, run_dir: Path, state_sh: Any, batch_sh: Any) -> StepFn:
    """The per-step callable for this run (see the module docstring)."""
    level, scope = cfg.trace.level, cfg.trace.scope
    trace_steps = set(cfg.trace.step_list()) if level != "none" else set()
    injecting = bool(cfg.debug.inject_nondeterminism.scope)
    if not trace_steps and not injecting:
        return lambda step, state, batch: plain(state, batch)
    device = int(trainer.layout.mesh.devices.reshape(-1)[0].id)
    default = _jit_instrumented(trainer, "none", "", state_sh, batch_sh) if injecting else None
    op_fn: list[Any] = []  # built at the first traced step (it needs example arguments)

    def run(step: int, state: Any, batch: Any):
        if step not in trace_steps:
            if default is None:
                return plain(state, batch)
            state, metrics, _ = default(state, batch)
            return state, metrics
        if level == "op":
            if not op_fn:
                injected = instrumented_step(trainer)
                base = (lambda s, b: injected(s, b)[:2]) if injecting else trainer.train_step
                key = cache_key(trainer, "op", state_sh, batch_sh)
                op_fn.extend(traced_step_fn(base, (state, batch), scope, key))
            fn, rec = op_fn
            (state, metrics), values = fn(state, batch)
            recs = streams.op_records(rec.meta, values, step)
        else:
            state, metrics, taps = _jit_instrumented(trainer, level, scope, state_sh, batch_sh)(state, batch)
            recs = streams.capture_records(taps, step, level)
        streams.append(run_dir, device, recs)
        return state, metrics

    return run
