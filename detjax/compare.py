"""`python -m detjax.compare RUN_A RUN_B`: first divergent step and every differing field.

Exit 0: identical fingerprints. Exit 1: divergence (first step, fields, both exact values). Exit 2: missing
or malformed input. RUN_* is a run directory or a fingerprints.jsonl file. No JAX import.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


class InputError(ValueError):
    pass


def load_fingerprints(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        p = p / "fingerprints.jsonl"
    if not p.is_file():
        raise InputError(f"{p} does not exist (expected a run directory holding fingerprints.jsonl)")
    recs = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{p}:{n}: not valid JSON ({e})") from e
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise InputError(f"{p}:{n}: a fingerprint record must be an object with an integer 'step'")
        recs.append(rec)
    if not recs:
        raise InputError(f"{p} holds no fingerprint records")
    return recs


def _flatten(rec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaf fields; an exact float {'hex', 'value'} is one field compared by its hex."""
    out: dict[str, Any] = {}
    for k, v in rec.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and "hex" in v:
            out[key] = v
        elif isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _exact(v: Any) -> Any:
    return v["hex"] if isinstance(v, dict) and "hex" in v else v


def _show(v: Any) -> str:
    if isinstance(v, dict) and "hex" in v:
        return f"{v['hex']} ({v['value']!r})"
    return repr(v)


def record_differences(ra: dict[str, Any], rb: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every leaf field whose exact value differs between two records of one step: (name, a, b)."""
    fa, fb = _flatten(ra), _flatten(rb)
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if _exact(fa.get(k)) != _exact(fb.get(k))]


def first_divergence(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any] | None:
    """None when identical; else {'step', 'fields': [(name, a, b)], 'note'}."""
    by_a = {r["step"]: r for r in a}
    by_b = {r["step"]: r for r in b}
    for step in sorted(set(by_a) | set(by_b)):
        ra, rb = by_a.get(step), by_b.get(step)
        if ra is None or rb is None:
            return {"step": step, "fields": [], "note": f"step {step} is only in run {'A' if ra else 'B'}"}
        diffs = record_differences(ra, rb)
        if diffs:
            return {"step": step, "fields": diffs, "note": ""}
    return None


def print_divergence(d: dict[str, Any], head: str, a: str = "A", b: str = "B") -> None:
    """`head` at step N (+ note), then every differing field with both exact values."""
    print(f"{head} at step {d['step']}" + (f": {d['note']}" if d["note"] else ""))
    for name, va, vb in d["fields"]:
        print(f"  {name}\n    {a}: {_show(va)}\n    {b}: {_show(vb)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.compare", description=__doc__.splitlines()[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    args = ap.parse_args(argv)
    try:
        a, b = load_fingerprints(args.run_a), load_fingerprints(args.run_b)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    va, vb = a[0].get("digest_version", 1), b[0].get("digest_version", 1)  # records before version 2 had none
    if va != vb:
        print(
            f"error: {args.run_a} holds version-{va} digests and {args.run_b} version-{vb} digests "
            "(written by different detjax versions); re-run one of them with this detjax to compare them",
            file=sys.stderr,
        )
        return 2
    d = first_divergence(a, b)
    if d is None:
        print(f"identical: {len(a)} steps (steps {a[0]['step']}..{a[-1]['step']}), every field bit-equal")
        return 0
    print_divergence(d, "DIVERGED")
    return 1


if __name__ == "__main__":
    sys.exit(main())
