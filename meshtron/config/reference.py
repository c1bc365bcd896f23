"""The recipe key reference, docs/reference.md, generated from the config schema itself, so it cannot drift.

Each key's name, type, default and meaning are its :mod:`meshtron.config.schema` field's, each section's
introduction its class docstring; ``tests/test_readme.py`` fails when the committed page differs from :func:`render`.

    python -m meshtron.config.reference            # print the page
    python -m meshtron.config.reference --write    # rewrite docs/reference.md after a schema change
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

from meshtron.config import SECTION_TYPES, Config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
COMMAND = "python -m meshtron.config.reference --write"


def toml_value(value: Any) -> str:
    """A default written as TOML (the way a recipe spells it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string for these plain values
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    raise TypeError(f"no TOML spelling for the default {value!r}")


def default_of(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _doc(cls: type) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass writes the signature when there is none
        raise ValueError(f"{cls.__name__} needs a docstring: it introduces its section of the reference")
    return doc


def section_rows(section: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every key of ``[section]``, in declaration order."""
    rows = []
    for f in dataclasses.fields(SECTION_TYPES[section]):
        meaning = f.metadata.get("meaning", "")
        if not meaning or "\n" in meaning:
            raise ValueError(f"[{section}] {f.name}: declare it with recipe_key(default, one-line meaning)")
        rows.append((f.name, str(f.type), toml_value(default_of(f)), meaning.replace("|", "\\|")))
    return rows


def render() -> str:
    """The whole reference page."""
    lines = [
        "# Recipe key reference",
        "",
        f"<!-- Generated from meshtron/config/schema.py by `{COMMAND}`; edit the schema there, not this page. -->",
        "",
        _doc(Config),
    ]
    for section, cls in SECTION_TYPES.items():
        lines += ["", f"## `[{section}]`", "", _doc(cls), "", "| key | type | default | meaning |", "|---|---|---|---|"]
        lines += [
            f"| `{key}` | {type_} | `{default}` | {meaning} |" for key, type_, default, meaning in section_rows(section)
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshtron.config.reference", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--write", action="store_true", help=f"rewrite {PAGE.parent.name}/{PAGE.name} instead of printing"
    )
    args = parser.parse_args(argv)
    if args.write:
        PAGE.write_text(render(), encoding="utf-8")
        print(f"wrote {PAGE}")
    else:
        print(render(), end="")


if __name__ == "__main__":
    main()
