"""The package's import graph (docs/ARCHITECTURE.md): no import circle, function-level imports included."""

import ast
from pathlib import Path

import detjax

ROOT = Path(detjax.__file__).parent


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports (at any depth of its code), from the source alone."""
    mods = {}
    for p in root.rglob("*.py"):
        parts = (package, *p.relative_to(root).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                target = owner(name) if name.split(".")[0] == package else None
                # a module importing its own package (its __init__) is not an edge: Python runs that first
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_detjax_has_no_import_circle():
    graph = import_graph(ROOT, "detjax")
    assert len(graph) > 50 and graph["detjax.step"]  # the whole package was read
    assert circles(graph) == []


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    """Negative control: a -> b at module level, b -> a inside a function, c imports its own package."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import c\n")
    (pkg / "sub" / "c.py").write_text("from pkg.sub import helper\nfrom . import c\n")
    graph = import_graph(pkg, "pkg")
    assert circles(graph) == [["pkg.a", "pkg.b"]]
    (pkg / "b.py").write_text("def f():\n    return 1\n")
    assert circles(import_graph(pkg, "pkg")) == []
