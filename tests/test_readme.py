"""The README and docs/ document exactly what the code has: every recipe key (docs/reference.md, generated
from the schema), every recipe, the quickstart, the tp-plan styles; and every link between the pages resolves."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from meshtron import config
from meshtron.config import SECTION_TYPES, checks, infer_dp, load_config
from meshtron.config.reference import COMMAND, render
from meshtron.plan import predict_memory
from meshtron.plan.recipes import recipe_hardware

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def table_after(heading: str, page: str = "README.md") -> list[list[str]]:
    """Rows (cells stripped) of the first Markdown table after ``heading`` in ``page`` (a path from the
    repository root), header and rule excluded."""
    text = (ROOT / page).read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
        elif rows:
            break
    return rows[2:]


def unquote(cell: str) -> str:
    return cell.strip("`")


def test_key_reference_is_generated_from_the_schema():
    committed = (DOCS / "reference.md").read_text()
    assert committed == render(), f"docs/reference.md differs from the config schema; run `{COMMAND}`"


@pytest.mark.parametrize("section", list(SECTION_TYPES))
def test_key_reference_lists_exactly_the_dataclass_fields(section):
    rows = table_after(f"## `[{section}]`", "docs/reference.md")
    fields = dataclasses.fields(SECTION_TYPES[section])
    assert [unquote(r[0]) for r in rows] == [f.name for f in fields]
    for row, f in zip(rows, fields):
        key, type_, default, meaning = row
        assert type_ == f.type, key
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert tomllib.loads(f"v = {unquote(default)}")["v"] == value, key
        assert meaning, f"{key} has no meaning in docs/reference.md"


def _layout(text: str) -> dict[str, int | bool]:
    layout: dict[str, int | bool] = {k: v for k, v in re.findall(r"\b(pp|dp|cp|ep|tp) (\d+)", text)}
    layout = {k: int(v) for k, v in layout.items()}
    layout["sp"] = "+ SP" in text
    return layout


def test_recipe_table_matches_the_recipes():
    from test_recipe_shapes import PUBLISHED, expected_count

    rows = table_after("# Recipes", "docs/recipes.md")
    assert sorted(unquote(r[0]) for r in rows) == sorted(p.name for p in (ROOT / "recipes").glob("*.toml"))
    for name, _, params, hardware, layout, gib in rows:
        path = ROOT / "recipes" / unquote(name)
        cfg = load_config(path)
        stem = unquote(name)[: -len(".toml")]
        assert int(params.replace(",", "")) == PUBLISHED.get(stem, expected_count(cfg.model)), name
        hw = recipe_hardware(path)
        kind = "CPU ranks" if hw.device == "cpu" else "GPUs"
        assert hardware.startswith(f"{hw.nodes} node{'s' if hw.nodes > 1 else ''} x {hw.per_node} {kind}"), name
        if hw.device == "cuda":
            assert hardware.endswith(f" x {hw.memory_gib:g} GB"), name
        cfg = infer_dp(cfg, hw.world_size)
        p = cfg.parallel
        actual = {k: getattr(p, k) for k in ("pp", "dp", "cp", "ep", "tp") if getattr(p, k) > 1}
        assert _layout(layout) == {**actual, "sp": p.sp}, name
        micro = re.search(r"(\d+) micro-batches", layout)
        assert p.microbatches == (int(micro.group(1)) if micro else 1), name
        assert ("full AC" in layout) == (p.activation_checkpointing == "full"), name
        predicted = predict_memory(cfg, hw.assumptions()).total / 2**30
        assert float(gib) == pytest.approx(predicted, abs=0.051 if predicted > 1 else 0.0006), name


def test_quickstart_has_the_two_commands():
    block = README.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert commands == [
        "pip install torch==2.13.0 && pip install -e . && "
        "torchrun --nproc_per_node 8 -m meshtron.train --recipe recipes/debug_dense.toml",
        "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q",
    ]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in ci and "-e '.[test]'" in ci and "pytest" in ci


# The drawing commands the docs show, each run as typed with matplotlib missing: a -c shim blocks its
# import (as on a machine without the [plot] extra) and runs the module as ``python -m`` would.
WITHOUT_MATPLOTLIB = (
    "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)
DRAWING_COMMANDS = [
    ["meshtron.parallel.pipeline.show", "--pp", "2", "--microbatches", "4"],
    ["meshtron.watch.plot", "runs/a", "-o", "curves.png"],
]


def test_drawing_commands_without_matplotlib_name_the_extra_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WITHOUT_MATPLOTLIB, *command],
            cwd=tmp_path,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for command in DRAWING_COMMANDS
    ]
    for command, proc in zip(DRAWING_COMMANDS, procs):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (command, err[-3000:])
        assert len(err.splitlines()) == 1 and err.rstrip().endswith("needs matplotlib: pip install 'meshtron[plot]'"), (
            command,
            err[-3000:],
        )
    assert not list(tmp_path.iterdir())  # nothing drawn


def test_hf_tp_style_table_lists_every_style():
    """The tp-plan style table names exactly the styles meshtron translates or refuses by name."""
    from meshtron.hf.tp_plan import _REFUSED, _STYLES

    rows = table_after("The tp-plan styles of transformers", "docs/hf.md")
    named = [unquote(s.strip()) for row in rows for s in row[0].split(",")]
    assert sorted(named) == sorted([*_STYLES, *_REFUSED])


def _choice_keys() -> list[tuple[str, tuple[str, ...]]]:
    """Every key meshtron/config/checks.py checks with ``_require_choice`` (found in its source, so a new one is
    covered without a list to keep), and cp_comm_type, which the context layout checks."""
    from meshtron.parallel.context import CP_COMM_TYPES

    source = Path(checks.__file__).read_text()
    found = re.findall(r'_require_choice\(source, "\[(\w+)\] (\w+)", [^,]+, (\w+)\)', source)
    assert len(found) >= 9, found  # the pattern still matches the calls
    return [(f"{section}.{name}", getattr(config, const)) for section, name, const in found] + [
        ("parallel.cp_comm_type", CP_COMM_TYPES)
    ]


@pytest.mark.parametrize("key,choices", _choice_keys())
def test_choice_keys_name_every_choice(key, choices):
    section, name = key.split(".")
    (f,) = [f for f in dataclasses.fields(SECTION_TYPES[section]) if f.name == name]
    missing = [c for c in choices if f"`{c}`" not in f.metadata["meaning"]]
    assert not missing, f"[{section}] {name}: its meaning in meshtron/config/schema.py does not name {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)  # nor code spans (their text may look like one)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in _links(page.read_text()):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not checked offline
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link}: no heading with that anchor in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / link.partition("#")[0]).resolve() for link in _links(README) if link.startswith("docs/")}
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in linked)
    assert not unlinked, f"docs pages the README's Documentation table does not link: {unlinked}"


# A code span on docs/extending.md naming a repository path, with ``: NAME[, NAME]`` (or pytest's ``::NAME``)
# for what that file defines: `meshtron/parallel/context/sharding.py: CP_COMM_TYPES`.
_CITATION = re.compile(r"`([\w./<>-]+?)(?:(?::\s*|::)([A-Za-z_]\w*(?:,\s*[A-Za-z_]\w*)*))?`")
_CITED_ROOTS = ("meshtron/", "tests/", "benchmarks/")


def _defines(source: str, name: str) -> bool:
    """``def NAME``, ``class NAME`` or ``NAME =`` (annotated too) at any indentation of ``source``."""
    name = re.escape(name)
    return (
        re.search(
            rf"^[ \t]*(?:(?:async[ \t]+)?def[ \t]+{name}\b|class[ \t]+{name}\b|{name}[ \t]*(?::[^=\n]*)?=(?!=))",
            source,
            flags=re.M,
        )
        is not None
    )


def test_extending_page_cites_paths_and_names_that_exist():
    """Every meshtron/, tests/ or benchmarks/ path docs/extending.md cites exists, and every name it cites
    as `file.py: NAME` is defined in that file, so the page stays true when code moves or is renamed."""
    text = re.sub(r"```.*?```", "", (DOCS / "extending.md").read_text(), flags=re.S)
    missing, names = [], 0
    for path, cited in _CITATION.findall(text):
        if not (path.startswith(_CITED_ROOTS) or cited):
            continue
        if not path.startswith(_CITED_ROOTS):
            missing.append(f"{path}: {cited}: cite the path from the repository root")
        elif not (ROOT / path).exists():
            missing.append(f"{path}: no such file or folder")
        elif cited:
            source = (ROOT / path).read_text()
            for name in re.split(r",\s*", cited):
                names += 1
                if not _defines(source, name):
                    missing.append(f"{path}: defines no {name}")
    assert names > 100, f"read only {names} cited names; has the citation form `file.py: NAME` changed?"
    assert not missing, "docs/extending.md cites what the code does not have:\n" + "\n".join(missing)
