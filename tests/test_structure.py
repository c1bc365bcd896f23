"""Imports go one way: config -> mesh -> models -> parallel -> train (the HF adapter sits above parallel).

Read from the source with ``ast`` (function-level imports included), so a lazy import cannot hide a
back-reference.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "meshtron"

# Lower levels never import higher ones; a package may import itself.
LEVELS = {
    "config": 0, "env": 0, "host": 0, "report": 0, "collective_log": 0,
    "mesh": 1, "checkpoint": 1, "data": 1, "metrics": 1, "optim": 1, "syncs": 1,
    "models": 2, "watchdog": 2,
    "parallel": 3,
    "hf": 4, "pipeline": 4, "testing": 4, "plan": 4, "plot": 4,
    "dryrun": 5,
    "train": 6, "__init__": 6,
}


def _part(module: str) -> str:
    """The top-level part of meshtron a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "meshtron":
            if node.module == "meshtron":  # from meshtron import env -> meshtron.env
                found |= {f"meshtron.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "meshtron"}
    return found


def test_imports_go_one_way():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        here = _part(".".join(rel.parts)) if rel.name != "__init__" or len(rel.parts) > 2 else "__init__"
        assert here in LEVELS, f"{rel}: new top-level module; give it a level in LEVELS"
        for target in _imports(path):
            there = _part(target)
            if there != here and LEVELS[there] >= LEVELS[here]:
                wrong.append(f"{rel} imports {target} ({here} level {LEVELS[here]} -> {there} level {LEVELS[there]})")
    assert not wrong, "imports against the one-way order:\n" + "\n".join(wrong)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def test_no_import_cycles_between_modules():
    """Not even through a lazy import (parallel.runner and parallel.pipeline.runner had one)."""
    graph = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}

    def owner(target: str) -> str:  # `from meshtron.parallel import x` names a package or a module
        return target if target in graph else target.rsplit(".", 1)[0]

    edges = {m: {owner(t) for t in targets if owner(t) in graph and owner(t) != m} for m, targets in graph.items()}
    # Packages re-export their modules, so edges into a package's own __init__ from inside it are expected.
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:  # on the current path
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
