"""`python -m detjax.trace compare RUN_A RUN_B` and `python -m detjax.trace hunt --config FILE [k=v ...]`.

compare: exit 0 when every stream matches, 1 on a mismatch (with its classification), 2 for bad input.
hunt: exit 0 when two runs are identical, 1 when a divergence was localised (or could not be), 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detjax.trace", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="compare two runs' trace streams")
    c.add_argument("run_a")
    c.add_argument("run_b")
    h = sub.add_parser("hunt", help="find the first op whose inputs match and outputs differ")
    h.add_argument("--config", required=True)
    h.add_argument("--workdir", default=None, help="where the hunt's runs go (default: a new temp dir)")
    h.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    if a.cmd == "compare":
        from detjax.trace.analyze import TraceInputError, compare_runs, report

        try:
            text, rc = report(compare_runs(a.run_a, a.run_b))
        except TraceInputError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(text)
        return rc
    from detjax.train import config_for_cli

    cfg = config_for_cli(a.config, a.overrides)
    if cfg is None:
        return 2
    from detjax.trace.hunt import hunt

    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="detjax_hunt_"))
    print(f"hunt workdir: {work}")
    rc, _ = hunt(cfg, work)
    return rc


if __name__ == "__main__":
    sys.exit(main())
