"""`python -m detjax.plot RUN [RUN ...] [--out FILE.png] [--field lm_loss]`: loss curves of runs as a PNG.

Reads each run directory's metrics.jsonl (the field per step, default `lm_loss`; with --eval also the held-out
loss where the run evaluated). With exactly two runs whose fingerprints.jsonl both exist, a divergence strip
is added below the curves: for each step, which fingerprint fields differ (one row per field group: losses,
each digest, eval), and a line at the first divergent step. Exit 0 written, 2 bad input. No JAX import.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from detjax.compare import InputError, load_fingerprints, record_differences


def load_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The records of RUN/metrics.jsonl (a line cut by a kill is skipped), in step order."""
    p = Path(run)
    p = p / "metrics.jsonl" if p.is_dir() else p
    if not p.is_file():
        raise InputError(f"{p} does not exist (expected a run directory holding metrics.jsonl)")
    out = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    if not out:
        raise InputError(f"{p} holds no metrics records")
    return sorted(out, key=lambda r: r["step"])


def _group(field: str) -> str:
    """A fingerprint field's row in the strip: `digest.params` stays, `lm_loss` -> `losses`, eval.* -> eval."""
    if field.startswith("digest."):
        return field
    if field.startswith("eval"):
        return "eval"
    return "losses / lr / grad norm" if field in ("lm_loss", "mtp_loss", "aux_loss", "grad_norm", "lr") else field


def divergence_strip(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[dict[str, list[int]], int | None]:
    """({row: steps where that group of fields differs}, first divergent step or None). Steps present in one
    run only count as divergent in every row."""
    by_a, by_b = {r["step"]: r for r in a}, {r["step"]: r for r in b}
    rows: dict[str, list[int]] = {}
    first = None
    for step in sorted(set(by_a) | set(by_b)):
        ra, rb = by_a.get(step), by_b.get(step)
        if ra is None or rb is None:
            fields = ["(step in one run only)"]
        else:
            fields = [f for f, _, _ in record_differences(ra, rb)]
        for f in fields:
            rows.setdefault(_group(f), []).append(step)
        if fields and first is None:
            first = step
    return rows, first


def plot(runs: list[str], out: Path, field: str = "lm_loss", with_eval: bool = True) -> dict[str, Any]:
    """Write the PNG; -> a summary (first divergent step when two runs are compared)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [(r, load_metrics(r)) for r in runs]
    for r, recs in series:
        if not any(field in x for x in recs):
            raise InputError(f"{r}: metrics.jsonl has no field {field!r}")
    fps = None
    if len(runs) == 2 and all((Path(r) / "fingerprints.jsonl").is_file() for r in runs):
        fps = [load_fingerprints(r) for r in runs]
    if fps is not None:
        fig, (ax, strip) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=(3, 1))
    else:
        fig, ax = plt.subplots(figsize=(9, 5))
        strip = None
    for r, recs in series:
        xs = [x["step"] for x in recs if field in x]
        ax.plot(xs, [x[field] for x in recs if field in x], lw=1.2, label=f"{Path(r).name} {field}")
        ev = [x for x in recs if "eval_loss" in x]
        if with_eval and ev:
            ax.plot([x["step"] for x in ev], [x["eval_loss"] for x in ev], "o--", ms=3, label=f"{Path(r).name} eval")
    ax.set_ylabel(field)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    summary: dict[str, Any] = {"runs": runs, "out": str(out)}
    if strip is not None:
        rows, first = divergence_strip(*fps)
        summary["first_divergent_step"] = first
        names = sorted(rows)
        for i, name in enumerate(names):
            strip.scatter(rows[name], [i] * len(rows[name]), marker="|", s=60, color="tab:red")
        strip.set_yticks(range(len(names)), names, fontsize=7)
        strip.set_ylim(-0.5, max(len(names), 1) - 0.5)
        title = "identical fingerprints" if first is None else f"first divergent step: {first}"
        strip.set_title(f"fingerprint fields that differ per step ({title})", fontsize=9)
        if first is not None:
            for a_ in (ax, strip):
                a_.axvline(first, color="tab:red", lw=0.8, ls=":")
        strip.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.plot", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories (each holding metrics.jsonl)")
    ap.add_argument("--out", default=None, help="PNG to write (default: loss.png in the first run directory)")
    ap.add_argument("--field", default="lm_loss", help="metrics.jsonl field to plot (default lm_loss)")
    ap.add_argument("--no-eval", action="store_true", help="leave out the held-out loss points")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else Path(a.runs[0]) / "loss.png"
    try:
        s = plot(a.runs, out, a.field, not a.no_eval)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    extra = ""
    if "first_divergent_step" in s:
        d = s["first_divergent_step"]
        extra = "; fingerprints identical" if d is None else f"; first divergent step {d}"
    print(f"wrote {out}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
