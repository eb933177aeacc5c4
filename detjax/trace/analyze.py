"""Offline comparison of two runs' trace streams: align by run-independent identity, classify the first
mismatch of each stream (inputs match + outputs differ = candidate
origin; inputs differ = downstream receiver; none of the former = origin outside the capture)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TraceInputError(ValueError):
    pass


def identity(r: dict[str, Any]) -> tuple:
    return (r["level"], r["step"], r.get("micro"), r.get("iteration"), r["kind"], r["name"], r["occurrence"])


def load_streams(run: str | Path) -> dict[str, list[dict[str, Any]]]:
    d = Path(run)
    d = d / "trace" if (d / "trace").is_dir() else d
    files = sorted(d.glob("stream-*.jsonl")) if d.is_dir() else []
    if not files:
        raise TraceInputError(f"{run}: no trace streams (expected <run>/trace/stream-*.jsonl; set trace.level)")
    out = {}
    for f in files:
        recs = []
        for n, line in enumerate(f.read_text().splitlines(), 1):
            try:
                r = json.loads(line)
                identity(r)
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise TraceInputError(f"{f}:{n}: malformed trace record ({e})") from e
            recs.append(r)
        out[f.stem] = recs
    return out


@dataclass
class StreamResult:
    stream: str
    status: str  # "match", "origin", "downstream", "structure"
    record: dict[str, Any] | None = None
    other: dict[str, Any] | None = None
    detail: list[str] = field(default_factory=list)


def phase_of(r: dict[str, Any]) -> str:
    if r["kind"] == "phase":
        return r["name"]
    scope = r.get("scope", r["name"])
    if "optimizer" in scope:
        return "optimizer"
    if "grad_accumulate" in scope or "grad_scale" in scope:
        return "gradient accumulation"
    if r["kind"] == "op":
        return "backward" if r.get("backward") else "forward"
    return "forward"


def compare_stream(name: str, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> StreamResult:
    by_b = {identity(r): r for r in b}
    seen = set()
    for ra in a:
        k = identity(ra)
        seen.add(k)
        rb = by_b.get(k)
        if rb is None:
            return StreamResult(name, "structure", ra, None, [f"record {k} is only in run A"])
        if ra["inputs"] != rb["inputs"]:
            diff = [i for i, (x, y) in enumerate(zip(ra["inputs"], rb["inputs"], strict=True)) if x != y]
            return StreamResult(name, "downstream", ra, rb, [f"input(s) {diff} differ"])
        if ra["outputs"] != rb["outputs"]:
            diff = [i for i, (x, y) in enumerate(zip(ra["outputs"], rb["outputs"], strict=True)) if x != y]
            return StreamResult(name, "origin", ra, rb, [f"inputs equal, output(s) {diff} differ"])
    extra = [identity(r) for r in b if identity(r) not in seen]
    if extra:
        return StreamResult(name, "structure", None, None, [f"record {extra[0]} is only in run B"])
    return StreamResult(name, "match")


def compare_runs(run_a: str | Path, run_b: str | Path) -> list[StreamResult]:
    sa, sb = load_streams(run_a), load_streams(run_b)
    if set(sa) != set(sb):
        raise TraceInputError(f"the runs have different streams: {sorted(sa)} vs {sorted(sb)}")
    return [compare_stream(s, sa[s], sb[s]) for s in sorted(sa)]


def describe(r: dict[str, Any]) -> str:
    where = f"step {r['step']}"
    if r.get("micro") is not None:
        where += f", microbatch {r['micro']}"
    if r.get("iteration") is not None:
        where += f", scan iteration {r['iteration']}"
    lines = [f"{where}, phase {phase_of(r)}", f"  {r['kind']}: {r['name']} (occurrence {r['occurrence']})"]
    if r.get("primitive"):
        lines.append(f"  primitive: {r['primitive']}   module path: {r.get('scope', '')}")
    if r.get("source"):
        lines.append(f"  source: {r['source']}")
    lines.append(f"  inputs: {r['in_shapes']}  outputs: {r['out_shapes']}")
    return "\n".join(lines)


def report(results: list[StreamResult]) -> tuple[str, int]:
    agree = sum(r.status == "match" for r in results)
    lines = [f"{agree} of {len(results)} stream(s) agree"]
    for res in results:
        if res.status == "match":
            continue
        lines.append(
            f"\n[{res.stream}] first mismatch: "
            + {
                "origin": "CANDIDATE ORIGIN (inputs match, outputs differ)",
                "downstream": "downstream receiver (inputs already differ) — no origin in the capture: widen "
                "trace.steps to earlier steps or trace.scope to more modules",
                "structure": "the runs captured different records (different program or scope?)",
            }[res.status]
        )
        if res.record is not None:
            lines.append(describe(res.record))
        lines += [f"  {d}" for d in res.detail]
    return "\n".join(lines), (0 if agree == len(results) else 1)
