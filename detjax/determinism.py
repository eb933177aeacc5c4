"""Deterministic mode: canonical XLA/NCCL environment, feature refusal, and the JSON policy record.

`apply_environment` must run before JAX initialises its backends (it only edits os.environ); nothing
here imports JAX at module import time.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detjax.config import Config
from detjax.jaxprs import iter_eqns

# `xla_gpu_deterministic_ops` makes XLA pick deterministic implementations (e.g. sorted scatter instead of
# atomics) and also disables run-time autotuning, so kernel choice is pinned; the cost is measured in
# docs/BENCHMARKS.md. The exclusion flag is implied by it but stated for the record.
STRICT_XLA_FLAGS: tuple[str, ...] = (
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_exclude_nondeterministic_ops=true",
)
# The "kernels" strategy: no deterministic-ops flag (its cost is what the Pallas kernels avoid). Every GEMM of
# the step is a detjax kernel with tiles pinned in code (detjax/pallas_kernels/matmul, gmm), so no run-time
# choice can change the bits on a fresh machine; XLA's autotuner is switched off so that nothing it would
# still pick (a leftover tiny dot, a fusion config) depends on a timing race or on a cache file.
KERNELS_XLA_FLAGS: tuple[str, ...] = ("--xla_gpu_autotune_level=0",)
# Canonical numerics (any strategy): XLA's "excess precision" lets a fusion keep a bf16 intermediate in float32
# and skip its rounding where it likes, and whether it does depends on the whole program. A pipeline stage's
# program and the one-device leaf program then compute other bits from the same inputs (measured on the CPU:
# the MoE and the MTP head; an MTP loss term 83.81279 against 83.81363). With it off every bf16 op rounds.
CANONICAL_XLA_FLAGS: tuple[str, ...] = ("--xla_allow_excess_precision=false",)
# A dot left to XLA in the kernels strategy must be at most this many FLOPs (microseconds on a GPU). Larger
# ones are refused: they belong in detjax.pallas_kernels.matmul. Each one left is listed in the error/report.
TINY_DOT_FLOPS = 1 << 22
# Ops that XLA runs with atomics (or an arrival-order-dependent combine) unless the deterministic flag is on.
NONDETERMINISTIC_HLO_OPS: tuple[str, ...] = ("scatter", "select_and_scatter")

# NCCL chooses algorithm and protocol per message size and topology; each changes the reduction order.
# Pin both so multi-GPU runs cannot switch. (Canonical mesh-invariant numerics avoid library reductions
# altogether; these settings guard any collective that still reaches NCCL.)
STRICT_ENV: dict[str, str] = {
    "NCCL_ALGO": "Ring",
    "NCCL_PROTO": "Simple",
    "TF_CUDNN_DETERMINISTIC": "1",
}


class DeterminismError(RuntimeError):
    """Deterministic mode cannot be guaranteed for this run (environment or feature)."""


@dataclass(frozen=True)
class Refusal:
    key: str
    applies: Callable[[Config], bool]
    why: str
    fix: str


# Features without a deterministic path. Strict mode refuses each with its reason and the fix.
REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "model.moe.combine",
        lambda c: c.model.moe.combine == "scatter_add",
        "scatter-add combine sums expert outputs with GPU atomics, so the sum order depends on arrival order",
        "use model.moe.combine=gather (permutation + gather + fixed-order sum), or determinism.mode=off",
    ),
    Refusal(
        "model.embed_grad",
        lambda c: c.model.embed_grad == "scatter_add",
        "a scatter-add embedding gradient sums repeated tokens with GPU atomics, in arrival order",
        "use model.embed_grad=fixed (a fixed-order segment sum), or determinism.mode=off",
    ),
    Refusal(
        "debug.inject_nondeterminism",
        lambda c: bool(c.debug.inject_nondeterminism.scope) and not c.debug.allow_injection_in_strict,
        "fault injection makes the run nondeterministic on purpose",
        "set debug.allow_injection_in_strict=true to test the tracer, or determinism.mode=off",
    ),
    Refusal(
        "model.attention_impl",
        lambda c: c.model.attention_impl == "xla",
        "jax.nn.dot_product_attention with implementation='xla' is not a path detjax has verified",
        "use model.attention_impl=reference, or determinism.mode=off",
    ),
    # cuDNN's flash attention on its own replays byte-equal under XLA's deterministic-ops flag (XLA asks cuDNN
    # for its deterministic backward) and differs in every replay without it (scripts/cudnn_attention_check.py,
    # docs/benchmarks-history.md set 17). But the strict step with it failed at its first execution on jax 0.11.2
    # (an IndexError from inside XLA's executable), so no strategy offers it yet.
    Refusal(
        "model.attention_impl",
        lambda c: c.model.attention_impl == "cudnn",
        "cuDNN's fused attention is deterministic only under XLA's deterministic-ops flag, and the strict "
        "step with it fails inside XLA on jax 0.11.2 (docs/benchmarks-history.md set 17)",
        "use model.attention_impl=reference (the Pallas flash attention under model.kernels=pallas), or "
        "determinism.mode=off",
    ),
)


def refused_features(cfg: Config) -> list[Refusal]:
    return [r for r in REFUSALS if r.applies(cfg)]


def check_features(cfg: Config) -> None:
    """Raise if strict mode is asked for together with a feature that has no deterministic path."""
    if cfg.determinism.mode != "strict":
        return
    bad = refused_features(cfg)
    if bad:
        lines = [f"- {r.key}: {r.why}. Fix: {r.fix}" for r in bad]
        raise DeterminismError(
            "determinism.mode=strict refuses feature(s) with no deterministic path:\n" + "\n".join(lines)
        )


def nondeterministic_ops(lowered_text: str) -> dict[str, int]:
    """Count the ops in a lowered (StableHLO) program that have no deterministic path without XLA's flag."""
    found = {}
    for op in NONDETERMINISTIC_HLO_OPS:
        # the op itself ("stablehlo.scatter"(...) or HLO's scatter(...)), not its attributes (#stablehlo.scatter<)
        n = len(re.findall(rf"\bstablehlo\.{op}\"?[\s(]|[\s=]{op}\(", lowered_text))
        if n:
            found[op] = n
    return found


def check_step(cfg: Config, step_fn: Any, *args: Any) -> list[dict[str, Any]]:
    """Trace and lower the jitted train step (no compile) and check it, when strategy=kernels asks.

    Returns the XLA dots left in the step (each tiny, with its reason); raises DeterminismError otherwise."""
    if cfg.determinism.mode != "strict" or cfg.determinism.strategy != "kernels":
        return []
    traced = step_fn.trace(*args)
    check_lowered_step(cfg, traced.lower().as_text())
    return check_xla_dots(xla_dots(traced.jaxpr))


def apply_config_environment(cfg: Config) -> None:
    """apply_environment for a config: its mode, strategy and numerics."""
    apply_environment(cfg.determinism.mode, cfg.determinism.strategy, cfg.determinism.numerics)


# Primitives that reach a GEMM/convolution library (cuBLAS, cuDNN, XLA's autotuned Triton GEMMs).
XLA_GEMM_PRIMITIVES = ("dot_general", "ragged_dot_general", "conv_general_dilated")


def xla_dots(jaxpr: Any) -> list[dict[str, Any]]:
    """Every GEMM-like op of a (closed) jaxpr that XLA would run, outside Pallas kernels: primitive, name
    scope, operand shapes and FLOPs. Pallas kernel bodies are not entered: their dots are detjax's own."""
    found: list[dict[str, Any]] = []
    for eqn in iter_eqns(jaxpr, skip=("pallas_call",)):
        name = eqn.primitive.name
        if name not in XLA_GEMM_PRIMITIVES:
            continue
        shapes = [tuple(v.aval.shape) for v in eqn.invars[:2]]
        out = tuple(eqn.outvars[0].aval.shape)
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            k = math.prod(shapes[0][d] for d in lc)
        else:  # ragged / conv: bound by the full lhs times the output's last dim
            k = shapes[0][-1]
        flops = 2 * math.prod(out) * k
        found.append(
            {"primitive": name, "scope": str(eqn.source_info.name_stack), "shapes": shapes, "out": out, "flops": flops}
        )
    return found


def check_xla_dots(dots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """strategy=kernels: every dot left to XLA must be tiny; returns them, each with its reason."""
    big = [d for d in dots if d["flops"] > TINY_DOT_FLOPS]
    if big:
        lines = [
            f"- {d['primitive']} {d['shapes']} -> {d['out']} ({d['flops']:.2e} FLOPs) at '{d['scope']}'" for d in big
        ]
        raise DeterminismError(
            f"determinism.strategy=kernels: {len(big)} GEMM(s) in the train step would run in XLA (cuBLAS/cuDNN/"
            "autotuned Triton), whose algorithm choice is not detjax's:\n" + "\n".join(lines) + "\nFix: route "
            "them through detjax.pallas_kernels.matmul (model code: layers.proj with kernels=pallas), or use "
            "determinism.strategy=xla_flags"
        )
    return [
        {**d, "reason": f"tiny (<= {TINY_DOT_FLOPS} FLOPs); XLA autotuning is off, so its algorithm is fixed"}
        for d in dots
    ]


def check_lowered_step(cfg: Config, lowered_text: str) -> None:
    """Strict mode with strategy=kernels: refuse a train step that still contains ops whose GPU kernels
    combine in arrival order (XLA's deterministic flag is what would otherwise fix them)."""
    if cfg.determinism.mode != "strict" or cfg.determinism.strategy != "kernels":
        return
    bad = nondeterministic_ops(lowered_text)
    if bad:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(bad.items()))
        raise DeterminismError(
            f"determinism.strategy=kernels: the compiled train step contains {ops}, which run with atomics "
            "on the GPU unless XLA's deterministic flag is on. Fix: determinism.strategy=xla_flags, or remove "
            "the feature that introduces them (see determinism.json for the model settings)"
        )


def _flags_in(env_value: str) -> set[str]:
    return set(env_value.split())


def required_flags(mode: str, strategy: str = "xla_flags", numerics: str = "default") -> tuple[str, ...]:
    if mode != "strict":
        return ()
    flags = KERNELS_XLA_FLAGS if strategy == "kernels" else STRICT_XLA_FLAGS
    return flags + (CANONICAL_XLA_FLAGS if numerics == "canonical" else ())


def missing_flags(
    env: dict[str, str] | None = None, mode: str = "strict", strategy: str = "xla_flags", numerics: str = "default"
) -> list[str]:
    env = dict(os.environ) if env is None else env
    have = _flags_in(env.get("XLA_FLAGS", ""))
    return [f for f in required_flags(mode, strategy, numerics) if f not in have]


def _jax_initialised() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def apply_environment(mode: str, strategy: str = "xla_flags", numerics: str = "default") -> None:
    """Set the canonical environment for `mode`; must run before JAX initialises its backends."""
    if mode != "strict":
        return
    missing = missing_flags(mode=mode, strategy=strategy, numerics=numerics)
    if missing and _jax_initialised():
        raise DeterminismError(
            "determinism.mode=strict needs XLA flags "
            f"{missing} but JAX was already initialised with XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
            "XLA reads its flags once. Fix: start through `python -m detjax.train` (it sets them first), or "
            f"export XLA_FLAGS='{' '.join(required_flags(mode, strategy, numerics))}' before anything "
            "imports jax"
        )
    if missing:
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *missing]).strip()
    for k, v in STRICT_ENV.items():
        os.environ.setdefault(k, v)


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def code_revision(root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The detjax code a run used: its installed version and, where detjax runs from a git checkout of its own
    (`root`, default the directory above the package, is the checkout's top level), the commit and whether
    tracked files differ from it; None for what cannot be read (no git, not a checkout, another repository
    around an installed copy)."""
    top = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    rec: dict[str, Any] = {"detjax": _version("detjax"), "git_commit": None, "git_dirty": None}

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(top), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    level = git("rev-parse", "--show-toplevel")
    if level is None or Path(level).resolve() != top.resolve():
        return rec
    rec["git_commit"] = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    rec["git_dirty"] = None if status is None else bool(status)
    return rec


def code_line(rec: dict[str, Any] | None = None) -> str:
    """code_revision in words, for a benchmark's output: "code 1a2b3c4d5e6f" (", with local changes" where
    tracked files differ from the commit), or the installed version where there is no checkout."""
    rec = code_revision() if rec is None else rec
    if rec["git_commit"] is None:
        return f"code: detjax {rec['detjax']} (not a git checkout)"
    return f"code {rec['git_commit'][:12]}" + (", with local changes" if rec["git_dirty"] else "")


def policy_record(cfg: Config) -> dict[str, Any]:
    """Everything that is a 'fixed input' beyond the config: mode, flags, versions, the detjax code
    (code_revision), device."""
    import jax

    devices = jax.devices()
    return {
        "mode": cfg.determinism.mode,
        "config_hash": cfg.hash(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "strategy": cfg.determinism.strategy,
        "required_xla_flags": list(
            required_flags(cfg.determinism.mode, cfg.determinism.strategy, cfg.determinism.numerics)
        ),
        "env": {k: os.environ.get(k) for k in STRICT_ENV},
        "refusals_checked": [r.key for r in REFUSALS],
        "versions": {
            "python": platform.python_version(),
            **{
                p: _version(p) for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "grain", "numpy")
            },
        },
        "code": code_revision(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "process_count": jax.process_count(),
    }


def write_policy(cfg: Config, path: str | os.PathLike[str]) -> dict[str, Any]:
    rec = policy_record(cfg)
    with open(path, "w") as f:
        json.dump(rec, f, indent=2, sort_keys=True)
    return rec
