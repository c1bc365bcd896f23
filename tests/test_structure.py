"""Imports go one way: config -> mesh -> models -> parallel -> hf / plan -> runner -> dryrun -> train,
and each rule's error message is written in one module (its owner; other modules call the owner).

Read from the source with ``ast`` (function-level imports included), so a lazy import cannot hide a
back-reference.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "meshtron"

# Lower levels never import higher ones; a package may import itself.
LEVELS = {
    "torch_private": -2,
    "env": -1,
    "extras": -1,
    "config": 0,
    "watch": 0,
    "mesh": 1,
    "checkpoint": 1,
    "data": 1,
    "host": 1,
    "models": 2,
    "optim": 3,  # Muon tells the model's matrices from its head and routers
    "parallel": 3,
    "faults": 3,
    "hf": 4,
    "testing": 4,
    "plan": 4,
    "runner": 5,
    "dryrun": 6,
    "train": 7,
    "__init__": 7,
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
    """Not even through a lazy import (parallel.runner and parallel.pipeline.pipelined_runner had one)."""
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
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


# A message's literal part with this many words names a rule ("must be a multiple of 2 x cp ="); shorter
# ones are the shared phrasing of many rules ("[train] seq_len =", "must be >= 1, got"). Words have a letter.
_RULE_WORDS = 4


def _template(node: ast.expr) -> str:
    """A message expression's text with ``{}`` for each computed part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _template(node.left) + _template(node.right)
    return "{}"


def _messages(tree: ast.AST) -> list[ast.expr]:
    """The message arguments of ``raise SomeError(message, ...)`` and of config's ``_require(ok, message)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            func = node.exc.func
            if (func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")).endswith("Error"):
                found.append(node.exc.args[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_require":
            found.extend(node.args[1:2])
    return found


def _rule_phrases(sources: dict[str, str]) -> tuple[dict[str, set[str]], int]:
    """{literal part of a message: the modules writing it}, and how many messages were read. A message is
    what a module raises, plus what a message helper returns: a function called inside a raised message
    (``not_one_of``, ``unbalanced_seq_len``, ...), so the owner's words count where they are written."""
    trees = {module: ast.parse(text) for module, text in sources.items()}
    messages = {module: _messages(tree) for module, tree in trees.items()}
    helpers = {
        call.func.id if isinstance(call.func, ast.Name) else call.func.attr
        for found in messages.values()
        for message in found
        for call in ast.walk(message)
        if isinstance(call, ast.Call) and isinstance(call.func, (ast.Name, ast.Attribute))
    }
    for module, tree in trees.items():
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name in helpers:
                messages[module] += [r.value for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value]
    phrases: dict[str, set[str]] = defaultdict(set)
    for module, found in messages.items():
        for message in found:
            for part in _template(message).split("{}"):
                part = part.strip(" .,:;'\"()")
                if sum(any(c.isalpha() for c in word) for word in part.split()) >= _RULE_WORDS:
                    phrases[part].add(module)
    return phrases, sum(map(len, messages.values()))


def _package_sources() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_each_rule_message_is_written_in_one_module():
    """One owner per rule: a module that checks another module's rule calls that module's check or
    message helper (``config.not_one_of``, ``config.needs_virtual_schedule``, ``parallel.expert.
    ep_does_not_divide``, ...) instead of typing the words again. Checkable where the words are literal
    text in the message: the same literal part in two modules is found, a message held in a variable or
    a rule reworded is not."""
    phrases, read = _rule_phrases(_package_sources())
    assert read > 150, f"read only {read} error messages; has the way meshtron raises changed?"
    assert phrases["must be one of"] == {"meshtron.config.choices"}, "not_one_of's words are config.choices'"
    twice = sorted(f"{part!r}: {', '.join(sorted(modules))}" for part, modules in phrases.items() if len(modules) > 1)
    assert not twice, "a rule's words written in more than one module (call the owner's check instead):\n" + "\n".join(
        twice
    )


def test_rule_phrases_find_a_rule_written_twice():
    """The check above is not vacuous: the same words raised in two modules, directly or through a
    helper's return value, are found; shared short phrasing is not."""
    sources = {
        "a": "def f(x):\n    raise ValueError(f'[train] x = {x} must be a multiple of 2 x cp = {2 * x}.')\n",
        "b": "def g(x):\n    if x:\n        raise ConfigError(why(x) + ' Use another.')\n"
        "def why(x):\n    return f'[train] x = {x} must be a multiple of 2 x cp = {2 * x}'\n",
        "c": "def h(ok, key, x):\n    _require(ok, f'{key} must be >= 1, got {x}.')\n",
        "d": "def k(key, x):\n    raise ValueError(f'[train] {key} must be >= 1, got {x}')\n",
    }
    phrases, read = _rule_phrases(sources)
    assert read == 5
    assert dict(phrases) == {"must be a multiple of 2 x cp =": {"a", "b"}}


# Python's own private names meshtron calls (not torch's): os._exit, sys._current_frames, atexit's
# _run_exitfuncs, and namedtuple's public API, which has underscores to avoid clashing with fields.
PYTHON_PRIVATE = {"_exit", "_current_frames", "_run_exitfuncs", "_replace", "_asdict", "_fields", "_make"}
DOOR = "meshtron.torch_private"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(trees: dict[str, ast.AST]) -> set[str]:
    """Names meshtron itself defines: functions, classes, variables, arguments, ``self.`` attributes."""
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                own.add(node.attr)
    return own


def _private_torch_uses(sources: dict[str, str]) -> list[str]:
    """Where a module other than the door imports a private torch module or name, or reads an attribute
    with a private name that meshtron does not define (a torch object's internals)."""
    trees = {module: ast.parse(text) for module, text in sources.items() if module != DOOR}
    own = _own_names(trees) - PYTHON_PRIVATE
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                names = [node.module] if any(map(_is_private, node.module.split("."))) else []
                found += [
                    f"{module}:{node.lineno} from {node.module} import {a.name}"
                    for a in node.names
                    if names or _is_private(a.name)
                ]
            elif isinstance(node, ast.Import):
                found += [
                    f"{module}:{node.lineno} import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "torch" and any(map(_is_private, a.name.split(".")))
                ]
            elif (
                isinstance(node, ast.Attribute)
                and _is_private(node.attr)
                and node.attr not in own
                and node.attr not in PYTHON_PRIVATE
            ):
                found.append(f"{module}:{node.lineno} .{node.attr}")
    return found


def test_private_torch_api_only_through_the_door():
    """torch's private names are reached in meshtron/torch_private.py only, so a torch upgrade has one
    file to re-check (issue 47)."""
    found = _private_torch_uses(_package_sources())
    assert not found, "private torch API outside meshtron/torch_private.py (add it there, with why):\n" + "\n".join(
        found
    )


def test_private_torch_uses_are_found():
    """The check above is not vacuous: each way of reaching torch's internals is found; meshtron's own
    private names and the door itself are not."""
    sources = {
        "a": "import torch.utils._pytree as pytree\nfrom torch.distributed.tensor._utils import f\n",
        "b": "from torch._C import _will_engine_execute_node\n",
        "c": "def g(mesh):\n    return mesh._flatten('x'), torch._C._get_tracing_state()\n",
        "d": "class A:\n    def __init__(self):\n        self._held = 1\n"
        "    def _own(self):\n        return self._held, self._own\n",
        DOOR: "import torch.utils._pytree\nx = mesh._flatten('y')\n",
    }
    assert sorted(_private_torch_uses(sources)) == [
        "a:1 import torch.utils._pytree",
        "a:2 from torch.distributed.tensor._utils import f",
        "b:1 from torch._C import _will_engine_execute_node",
        "c:2 ._C",
        "c:2 ._flatten",
        "c:2 ._get_tracing_state",
    ]


def test_ruff_format_and_lint_are_clean():
    """One format and one rule set (pyproject.toml's [tool.ruff]) over meshtron/, tests/ and benchmarks/."""
    import subprocess
    import sys

    root = PACKAGE.parent
    for command in (["format", "--check"], ["check"]):
        run = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=root, capture_output=True, text=True)
        assert "No module named ruff" not in run.stderr, "ruff comes with the test extra: pip install -e '.[test]'"
        assert run.returncode == 0, f"ruff {' '.join(command)}:\n{run.stdout[-3000:]}{run.stderr[-2000:]}"


def test_version_is_written_once_in_each_place():
    """pyproject.toml's version, meshtron.__version__ and the changelog's newest released entry agree; what has
    landed since sits above it, under "Unreleased"."""
    import re

    import meshtron

    root = PACKAGE.parent
    project = re.search(r'^version = "([^"]+)"', (root / "pyproject.toml").read_text(), re.M).group(1)
    entries = re.findall(r"^## (\S+)", (root / "CHANGELOG.md").read_text(), re.M)
    newest = entries[1] if entries[0] == "Unreleased" else entries[0]
    assert "Unreleased" not in entries[1:], entries
    assert project == meshtron.__version__ == newest, (project, meshtron.__version__, newest)


MODULE_DOCSTRING_LINES = 8  # what a module is for and where the docs explain it; the explanation lives there


def test_module_docstrings_are_a_few_lines_and_a_link():
    """Every module docstring in meshtron/ fits in MODULE_DOCSTRING_LINES lines (quotes included), and one longer
    than two lines names the docs page that explains the piece."""
    import ast

    long, unlinked = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        first = tree.body[0] if tree.body else None
        if not (isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)):
            continue
        rel = path.relative_to(PACKAGE.parent)
        lines = first.end_lineno - first.lineno + 1
        if lines > MODULE_DOCSTRING_LINES:
            long.append(f"{rel}: {lines} lines")
        if lines > 2 and not any(page in first.value.value for page in ("docs/", "DESIGN.md", "CONTRIBUTING.md")):
            unlinked.append(str(rel))
    assert not long, long
    assert not unlinked, f"module docstrings that name no docs page: {unlinked}"
