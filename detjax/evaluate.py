"""`python -m detjax.evaluate RUN --tasks T1,T2 [...]`: lm-evaluation-harness scores of a run.

The run is exported as a transformers checkpoint (`detjax.export --format hf`, into RUN/hf-export, or
`--step N`'s own directory) and evaluated by lm-eval's `hf` model on it, so the scores are the ones
`lm_eval --model hf --model_args pretrained=RUN/hf-export` gives. The results go to RUN/lm_eval.json and a
table to stdout. `--include-path DIR` adds task YAMLs of your own (lm-eval's format), e.g. a local jsonl task
on a machine without the Hugging Face hub; `--limit N` takes the first N documents of each task.

Needs the `hf` extra (torch, transformers, lm-eval): `pip install -e '.[hf]'`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path


def export_dir(run: Path, step: int | None) -> Path:
    return run / ("hf-export" if step is None else f"hf-export-step{step}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.evaluate", description=__doc__.splitlines()[0].split(": ")[1])
    ap.add_argument("run", help="a run directory")
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (e.g. hellaswag,arc_easy)")
    ap.add_argument("--include-path", default=None, help="a directory of your own lm-eval task YAMLs")
    ap.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    ap.add_argument("--num-fewshot", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="torch device for the transformers model (cpu, cuda)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--step", type=int, default=None, help="evaluate checkpoint step N instead of the final params")
    ap.add_argument("--pad-layers", action="store_true", help="export with zero-weight partners (detjax.export_hf)")
    ap.add_argument("--output", default=None, help="the results JSON (default RUN/lm_eval.json)")
    args = ap.parse_args(argv)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        print("error: lm-eval is not installed. Fix: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    missing = [m for m in ("torch", "transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:  # lm-eval's "hf" model imports them only when it loads the model, deep in a traceback
        need = ", ".join(missing)
        print(f"error: lm-eval's transformers model needs {need}. Fix: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    run = Path(args.run)
    from detjax.export import main as export_main

    out = export_dir(run, args.step)
    pad = ["--pad-layers"] if args.pad_layers else []
    rc = export_main([str(run), str(out), "--format", "hf", "--dtype", args.dtype, *pad] + _step(args.step))
    if rc:
        return rc
    manager = TaskManager(include_path=args.include_path) if args.include_path else TaskManager()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        print(
            f"error: unknown lm-eval task(s) {', '.join(unknown)}. Fix: `lm_eval ls tasks` lists them", file=sys.stderr
        )
        return 2
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(out), "dtype": args.dtype, "device": args.device},
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        limit=args.limit,
        task_manager=manager,
        log_samples=False,
    )
    scores = {task: _numbers(r) for task, r in results["results"].items()}
    dest = Path(args.output) if args.output else run / "lm_eval.json"
    dest.write_text(
        json.dumps({"tasks": tasks, "limit": args.limit, "checkpoint": str(out), "results": scores}, indent=2)
    )
    for task, r in scores.items():
        print(f"{task:24s} " + "  ".join(f"{k} {v:.4f}" for k, v in sorted(r.items())))
    print(f"wrote {dest}")
    return 0


def _step(step: int | None) -> list[str]:
    return [] if step is None else ["--step", str(step)]


def _numbers(r: dict) -> dict[str, float]:
    """lm-eval's per-task dict without its non-numeric entries ("alias", "N/A" stderrs)."""
    return {k: float(v) for k, v in r.items() if isinstance(v, int | float) and not isinstance(v, bool)}


if __name__ == "__main__":
    sys.exit(main())
