"""The first-divergence ladder in one command: fingerprints -> phase -> module -> op."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from detjax.compare import first_divergence, load_fingerprints
from detjax.config import Config, TraceConfig
from detjax.trace.analyze import StreamResult, compare_runs, phase_of, report
from detjax.train import train


def _pair(cfg: Config, work: Path, tag: str) -> tuple[Path, Path]:
    dirs = (work / f"{tag}-a", work / f"{tag}-b")
    for d in dirs:
        train(cfg, d)
    return dirs


def _origin(results: list[StreamResult]) -> StreamResult | None:
    return next((r for r in results if r.status == "origin"), None)


def hunt(cfg: Config, work: Path, log=print) -> tuple[int, dict | None]:
    """Returns (exit code, candidate-origin record or None)."""
    base = replace(
        cfg,
        run=replace(cfg.run, progress=False, log_every=0, save_final_params=False),
        trace=TraceConfig(),
        ckpt=replace(cfg.ckpt, enabled=False, every=0, resume=False),  # the hunt's runs are thrown away
    )
    log(f"[1/4] two runs of {cfg.train.steps} steps with fingerprints ...")
    a, b = _pair(base, work, "step")
    d = first_divergence(load_fingerprints(a), load_fingerprints(b))
    if d is None:
        log(f"no divergence: the two runs are bit-identical over {cfg.train.steps} steps")
        return 0, None
    s = d["step"]
    log(f"      first divergent step {s}: " + ", ".join(f[0] for f in d["fields"]))
    stop = replace(base.run, stop_after=s + 1)

    def level(name: str, scope: str = "") -> list[StreamResult]:
        c = replace(base, run=stop, trace=TraceConfig(level=name, steps=str(s), scope=scope))
        ra, rb = _pair(c, work, name)
        return compare_runs(ra, rb)

    def origin_at(name: str) -> StreamResult | None:
        res = level(name)
        o = _origin(res)
        if o is None:
            log(report(res)[0])
        return o

    log(f"[2/4] phase capture at step {s} ...")
    o = origin_at("phase")
    if o is None:
        return 1, None
    phase = o.record["name"]
    log(f"      candidate phase: {phase} (microbatch {o.record.get('micro')})")

    if phase in ("forward", "backward"):
        log(f"[3/4] module capture at step {s} ...")
        o = origin_at("module")
        if o is None:
            return 1, None
        module = o.record["name"].split(":")[0]
        log(f"      candidate module: {module}")
        scope = re.escape(module) + "(/|$)"
    else:
        log("[3/4] origin lies outside the model's modules; skipping module capture")
        scope = phase  # optimizer / grad_accumulate / grad_scale: the named scope of that phase
    log(f"[4/4] op capture at step {s}, scope /{scope}/ ...")
    res = level("op", scope)
    text, rc = report(res)
    o = _origin(res)
    log(text)
    if o is not None:
        r = o.record
        log(f"\nCANDIDATE ORIGIN: {r['primitive']} in {r['scope']} ({phase_of(r)}) at {r['source']}")
        return 1, r
    return 1, None
