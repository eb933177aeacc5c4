"""The kernel coverage gate: every kernel-bearing file is registered in MANIFEST.toml with existing tests
(or an exemption with a reason)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent


KERNEL_ENTRY_POINTS = ("pallas_call", "plgpu.kernel")  # Pallas' Triton/interpreter and Mosaic GPU launchers


def kernel_files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*.py") if any(e in p.read_text() for e in KERNEL_ENTRY_POINTS)
    )


def _test_exists(repo: Path, ref: str) -> bool:
    path, _, name = ref.partition("::")
    f = repo / path
    if not f.is_file() or not name:
        return False
    tree = ast.parse(f.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def check_manifest(root: Path = HERE, repo: Path | None = None) -> list[str]:
    """Problems found; an empty list means the gate passes."""
    repo = repo or root.parents[1]
    manifest = root / "MANIFEST.toml"
    if not manifest.is_file():
        return [f"{manifest} is missing"]
    entries = tomllib.loads(manifest.read_text())
    problems = []
    for f in kernel_files(root):
        if f == "manifest.py":
            continue
        e = entries.get(f)
        if e is None:
            problems.append(f"kernel file {f} is not registered in MANIFEST.toml (add its tests or an exemption)")
        elif not e.get("tests") and not e.get("exempt"):
            problems.append(f"kernel file {f} has neither tests nor an exemption reason")
    for f, e in entries.items():
        if not (root / f).is_file():
            problems.append(f"MANIFEST.toml lists {f}, which does not exist")
        for t in e.get("tests", []):
            if not _test_exists(repo, t):
                problems.append(f"MANIFEST.toml: {f} -> test {t} does not exist")
    return problems
