"""Per-step records of a run: fingerprints.jsonl, metrics.jsonl and the progress line.

Reading a step's metrics is the loop's one host sync per step; the loop hands step N's metrics over only
after dispatching step N+1 (`push`), so the device never waits for the host.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from detjax import fingerprint as fp
from detjax.config import Config
from detjax.flops import mfu, peak_flops


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient or parameter; the run stops before saving it."""


QUANTITIES = ("lm_loss", "mtp_loss", "aux_loss", "grad_norm")


def nonfinite_problem(step: int, host: dict[str, Any], param_paths: list[str]) -> str | None:
    """The non-finite guard, on the metrics a step returned (already on host): None when every checked
    value is finite, else one line naming the step, the first non-finite quantity (losses, gradient norm,
    then the parameters after the update), the first gradient or parameter leaf holding one, and the digests."""
    bad = [q for q in QUANTITIES if not np.isfinite(float(host[q]))]
    grads_ok, params_ok = np.asarray(host["finite"]["grads"]), np.asarray(host["finite"]["params"])
    if not bad and grads_ok.all() and params_ok.all():
        return None
    what = bad[0] if bad else "the update (parameters after the optimizer step)"
    leaf = ""
    if not grads_ok.all():
        leaf = f"; first non-finite gradient leaf: {param_paths[int(np.argmin(grads_ok))]}"
    elif not params_ok.all():
        leaf = f"; first non-finite parameter leaf after the update: {param_paths[int(np.argmin(params_ok))]}"
    digests = " ".join(f"{k}={fp.digest_hex(host['digest'][k])}" for k in fp.DIGEST_FIELDS) if "digest" in host else ""
    return (
        f"non-finite value at step {step}: {what} is {', '.join(f'{q}={float(host[q])}' for q in QUANTITIES)}"
        f"{leaf}; digests {digests or '(run.fingerprints off)'}. No checkpoint or fingerprint holds this step. "
        "Fix: lower train.lr, raise train.warmup_steps or train.eps, or resume from the last checkpoint with "
        "other settings"
    )


def peak_memory_bytes(devices: list[Any]) -> int | None:
    """The largest peak bytes in use over `devices` (None where the backend keeps no statistics, e.g. CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


class RunLog:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        history: list[dict[str, Any]],
        start: int,
        end: int,
        primary: bool,
        devices: list[Any] | None = None,
        param_paths: list[str] | None = None,
    ):
        """`devices`: the mesh's devices (MFU divides by their count; peak memory reads the local ones).
        `param_paths`: the parameter leaves' paths in pytree order (the non-finite guard names them)."""
        self.cfg = cfg
        self.param_paths = list(param_paths or [])
        self.devices = list(devices) if devices is not None else jax.devices()[:1]
        self._local = [d for d in self.devices if d.process_index == jax.process_index()]
        self._peak = peak_flops(self.devices[0].device_kind)  # None: MFU is not reported (n/a)
        self.records = list(history)
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self._pending: tuple[int, Any, float | None] | None = None
        self._fp = None
        if cfg.run.fingerprints and primary:
            # Rewritten from the checkpoint's history: steps after the checkpoint are redone, bit for bit.
            self._fp = (run_dir / "fingerprints.jsonl").open("w")
            for r in self.records:
                self._fp.write(fp.dumps(r) + "\n")
        self._metrics = _metrics_file(run_dir / "metrics.jsonl", start) if primary else None
        self._sinks = open_sinks(cfg, run_dir, start) if primary else []
        show = cfg.run.progress and primary
        self._bar = tqdm(total=end, initial=start, disable=not show, desc=cfg.run.name, dynamic_ncols=True)
        self._primary = primary
        self._t_last = time.perf_counter()

    def push(self, step: int, metrics: Any, data_wait: float | None = None) -> None:
        """Record the previous step (its metrics are ready by now) and hold on to this one. `data_wait`: the
        seconds the loop spent getting this step's batch onto the devices."""
        self.flush()
        self._pending = (step, metrics, data_wait)

    def flush(self) -> None:
        """Record the held step now (before a checkpoint: the saved history must reach it)."""
        if self._pending is not None:
            self._emit(*self._pending)
            self._pending = None

    def _emit(self, step: int, metrics: Any, data_wait: float | None = None) -> None:
        # Host sync: reading step `step`'s metrics waits for that step only; the next step is already queued.
        host = jax.device_get(metrics)
        now = time.perf_counter()
        # Wall time between two records: the device's step time once the queue is steady (the first record
        # after a start or a checkpoint also holds compile or save time).
        dt = max(now - self._t_last, 1e-9)
        self._t_last = now
        tok_s = self.tokens_per_step / dt
        line = {k: float(host[k]) for k in fp.FLOAT_FIELDS} | {
            "step": step,
            "step_time_s": dt,
            "tokens_per_s": tok_s,
            "mfu": mfu(self.cfg, dt, len(self.devices), self._peak) if self._peak else None,
            "peak_mem_bytes": peak_memory_bytes(self._local),
        }
        if data_wait is not None:
            line["data_wait_s"] = data_wait
        if "skipped" in host:  # train.on_nonfinite=skip_step
            line["skipped"] = bool(host["skipped"])
        if "eval" in host:  # a step that ran the held-out evaluation
            line["eval_loss"] = fp.eval_summary(host["eval"])[0]
            line["eval_ppl"] = math.exp(min(line["eval_loss"], 700.0))
        if self._metrics is not None:
            self._metrics.write(json.dumps(line) + "\n")
            self._metrics.flush()
        for sink in self._sinks:
            sink.write(step, line)
        if "skipped" in host:  # the step kept the old state: say so and go on
            if line["skipped"] and self._primary:
                why = _skip_reason(host)
                self._bar.write(f"warning: step {step} skipped (train.on_nonfinite=skip_step): {why} not finite")
        else:
            problem = nonfinite_problem(step, host, self.param_paths) if "finite" in host else None
            if problem is not None:  # before this step's fingerprint is recorded or any checkpoint can save it
                raise NonFiniteError(problem)
        if self.cfg.run.fingerprints:
            rec = fp.record(step, host)
            self.records.append(rec)
            if self._fp is not None:
                self._fp.write(fp.dumps(rec) + "\n")
                self._fp.flush()
        self._bar.set_postfix(loss=f"{line['lm_loss']:.4f}", tok_s=f"{tok_s:,.0f}")
        self._bar.update(1)
        every = self.cfg.run.log_every
        if self._primary and every and (step % every == 0 or step == self.cfg.train.steps - 1):
            self._bar.write(
                f"step {step:5d}  lm_loss {line['lm_loss']:.4f}  mtp {line['mtp_loss']:.4f}  "
                f"aux {line['aux_loss']:.4f}  gnorm {line['grad_norm']:.3f}  {1e3 * dt:.1f} ms  {tok_s:,.0f} tok/s  "
                + ("MFU n/a" if line["mfu"] is None else f"MFU {100 * line['mfu']:.1f} %")
                + _mem(line["peak_mem_bytes"])
            )

    def close(self) -> None:
        self.flush()
        self._bar.close()
        for sink in self._sinks:
            sink.close()
        for f in (self._metrics, self._fp):
            if f is not None:
                f.close()


SINK_FIELDS = (
    "lm_loss", "mtp_loss", "aux_loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu", "peak_mem_bytes",
    "data_wait_s", "eval_loss", "eval_ppl",
)  # fmt: skip


class TensorBoardSink:
    """Scalars of every step as TensorBoard event files in <run>/tensorboard (tensorboardX). On a resume the
    events of steps >= the restored step are purged (the steps are redone)."""

    def __init__(self, run_dir: Path, start: int) -> None:
        from tensorboardX import SummaryWriter

        # written by tensorboardX's own thread, flushed every 10 s and at close (metrics.jsonl is the per-step,
        # crash-safe record)
        self._w = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start if start > 0 else None, flush_secs=10)

    def write(self, step: int, line: dict[str, Any]) -> None:
        for k in SINK_FIELDS:
            if line.get(k) is not None:
                self._w.add_scalar(f"train/{k}" if not k.startswith("eval") else f"eval/{k[5:]}", line[k], step)

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """The same scalars to Weights & Biases (run.wandb_project), the run named after the run directory."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        import wandb

        self._run = wandb.init(project=cfg.run.wandb_project, name=run_dir.name, config=cfg.to_dict(), resume="allow")

    def write(self, step: int, line: dict[str, Any]) -> None:
        self._run.log({k: line[k] for k in SINK_FIELDS if line.get(k) is not None}, step=step)

    def close(self) -> None:
        self._run.finish()


def open_sinks(cfg: Config, run_dir: Path, start: int) -> list[Any]:
    sinks: list[Any] = []
    if cfg.run.tensorboard:
        sinks.append(TensorBoardSink(run_dir, start))
    if cfg.run.wandb_project:
        sinks.append(WandbSink(cfg, run_dir))
    return sinks


def _skip_reason(host: dict[str, Any]) -> str:
    """Which quantities were non-finite in a skipped step (the guard's wording, without leaf names)."""
    bad = [q for q in QUANTITIES if not np.isfinite(float(host[q]))]
    if not np.all(np.asarray(host["finite"]["grads"])):
        bad.append("a gradient leaf")
    return ", ".join(bad) or "the update (parameters after the optimizer step)"


def _metrics_file(path: Path, start: int):
    """metrics.jsonl opened for appending after step `start` - 1: on a resume, lines of steps >= start
    (written before the kill, about to be redone) are dropped, so every step has one line."""
    if start > 0 and path.exists():
        kept = []
        for line in path.read_text().splitlines():
            try:
                if int(json.loads(line)["step"]) < start:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a kill
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        tmp.replace(path)
    return path.open("a" if start > 0 else "w")


def _mem(peak: int | None) -> str:
    return "" if peak is None else f"  peak mem {peak / 2**30:.2f} GiB"
