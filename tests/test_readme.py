"""The README documents exactly what the code has: every recipe key, every recipe, the quickstart."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from meshtron.config import _SECTION_TYPES, infer_dp, load_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def table_after(heading: str) -> list[list[str]]:
    """Rows (cells stripped) of the first Markdown table after ``heading``, header and rule excluded."""
    start = README.index(heading)
    rows = []
    for line in README[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def unquote(cell: str) -> str:
    return cell.strip("`")


@pytest.mark.parametrize("section", list(_SECTION_TYPES))
def test_key_reference_lists_exactly_the_dataclass_fields(section):
    rows = table_after(f"### `[{section}]`")
    fields = dataclasses.fields(_SECTION_TYPES[section])
    assert [unquote(r[0]) for r in rows] == [f.name for f in fields]
    for row, f in zip(rows, fields):
        key, type_, default, meaning = row
        assert type_ == f.type, key
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert tomllib.loads(f"v = {unquote(default)}")["v"] == value, key
        assert meaning, f"{key} has no meaning in the README"


def _layout(text: str) -> dict[str, int | bool]:
    layout: dict[str, int | bool] = {k: v for k, v in re.findall(r"\b(pp|dp|cp|ep|tp) (\d+)", text)}
    layout = {k: int(v) for k, v in layout.items()}
    layout["sp"] = "+ SP" in text
    return layout


def test_recipe_table_matches_the_recipes():
    from test_recipe_shapes import PUBLISHED, expected_count

    rows = table_after("## Recipes")
    assert sorted(unquote(r[0]) for r in rows) == sorted(p.name for p in (ROOT / "recipes").glob("*.toml"))
    for name, _, params, layout in rows:
        cfg = load_config(ROOT / "recipes" / unquote(name))
        stem = unquote(name)[: -len(".toml")]
        assert int(params.replace(",", "")) == PUBLISHED.get(stem, expected_count(cfg.model)), name
        p = infer_dp(cfg, 8).parallel  # the table's layouts are for 8 GPUs
        actual = {k: getattr(p, k) for k in ("pp", "dp", "cp", "ep", "tp") if getattr(p, k) > 1}
        assert _layout(layout) == {**actual, "sp": p.sp}, name


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
