"""The run directory: which directory a run writes to, and the files that describe the run.

<run>/config.yaml (resolved), config_hash, determinism.json (policy record) -- written by this module;
fingerprints.jsonl and metrics.jsonl (detjax.runlog), checkpoints/ (detjax.ckpt), trace/ (detjax.trace),
final_params.npz (here too). Imported after the XLA flags are set (it imports JAX). An existing run is
never overwritten: a fresh run gets a new suffix.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from detjax.config import Config, ConfigError, dump_config


def fresh_dir(cfg: Config) -> Path:
    """A new directory under run.out_dir named run.name, or run.name-N when that exists."""
    base = Path(cfg.run.out_dir) / cfg.run.name
    path, i = base, 0
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    path.mkdir(parents=True)
    return path


def choose(cfg: Config, run_dir: Path | None, resume: bool, process_count: int, must_exist: bool | None = None) -> Path:
    """The run directory: the one given; when resuming, run.out_dir/run.name; with several processes (which
    must agree without talking) run.out_dir/run.name, refused if it already holds a run; else a fresh one.
    `must_exist` (default: `resume`): an explicit --resume refuses a directory that does not exist, while
    ckpt.resume=true (resume if there is something to resume) creates it."""
    must_exist = resume if must_exist is None else must_exist
    if run_dir is not None:
        path = Path(run_dir)
        if must_exist and not path.is_dir():
            raise ConfigError(
                f"--resume: run directory {path} does not exist, so there is nothing to resume. Fix: check the "
                "--run-dir path, or drop --resume to start a new run"
            )
    elif resume:
        path = Path(cfg.run.out_dir) / cfg.run.name
    elif process_count > 1:
        path = Path(cfg.run.out_dir) / cfg.run.name
        if (path / "fingerprints.jsonl").exists():
            raise ConfigError(
                f"run directory {path} already holds a run; a multi-process run does not pick a new name. "
                "Fix: pass --run-dir, change run.name, or add --resume"
            )
    else:
        return fresh_dir(cfg)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def locked(path: Path, primary: bool) -> Iterator[None]:
    """Hold <run>/.lock (an exclusive, non-blocking flock; the primary process only) while training, so two
    processes never write one run directory; the OS drops the lock when the process dies (kill -9 too)."""
    if not primary:
        yield
        return
    f = (path / ".lock").open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ConfigError(
            f"run directory {path} is in use by another training process (pid {holder}). Fix: wait for it to "
            "finish or stop it, or pass another --run-dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def flat_params(params: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def write_final_params(path: Path, params: Any, primary: bool) -> None:
    """final_params.npz: every parameter by its tree path (gathered from all processes; process 0 writes)."""
    if jax.process_count() > 1:  # every process takes part in the gather
        params = multihost_utils.process_allgather(params, tiled=True)
    if primary:  # written beside, then renamed: a reader never sees a half-written file
        tmp = path / "final_params.npz.tmp.npz"
        np.savez(tmp, **flat_params(params))
        os.replace(tmp, path / "final_params.npz")


def write_description(path: Path, cfg: Config, policy: dict[str, Any]) -> None:
    """config.yaml, config_hash and determinism.json (primary process only)."""
    (path / "config.yaml").write_text(dump_config(cfg))
    (path / "config_hash").write_text(cfg.hash() + "\n")
    (path / "determinism.json").write_text(json.dumps(policy, indent=2, sort_keys=True))
