"""meshtron.plan's own choices held to the dry run: for Qwen2.5-7B, Qwen2.5-72B and Qwen2-57B-A14B on 8, 64
and 512 GPUs (8 per node, 80 GB), the planner's top three layouts (``rank_layouts``: fitting ones first,
by predicted throughput), each traced rank by rank on fake tensors as ``--dry-run`` does.

    PYTHONPATH=. python benchmarks/dry_run_plan_top.py            # hours on 2 cores; resumes where it stopped
    PYTHONPATH=. python benchmarks/dry_run_plan_top.py --replan   # seconds: the planned columns only

Writes benchmarks/results/dry_run_plan_top.json and .md (columns as in ``dry_run_recipes.py``, plus the
layout's place in the planner's ranking and whether it predicted a fit).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dry_run_recipes import ROOT, measure, replan_rows, write_results  # noqa: E402

from meshtron.config import load_config  # noqa: E402
from meshtron.plan.recipes import recipe_hardware  # noqa: E402
from meshtron.plan.search import rank_layouts  # noqa: E402

RECIPES = ("qwen2p5_7b", "qwen2p5_72b", "qwen2_57b_a14b")
GPUS = (8, 64, 512)
TOP = 3


def top_layouts(recipe: str, gpus: int) -> list[tuple[int, bool, list[str]]]:
    """(place in the ranking, predicted to fit, the overrides selecting it) of the planner's first three."""
    path = ROOT / "recipes" / f"{recipe}.toml"
    plans = rank_layouts(load_config(path), gpus, recipe_hardware(path).hardware())
    return [(place, plan.fits, plan.overrides().split()) for place, plan in enumerate(plans[:TOP], 1)]


def main() -> None:
    out = ROOT / "benchmarks" / "results"
    # Every recipe and size's first choice before any second: a long run covers each of them early.
    layouts = sorted(
        ((recipe, gpus, *top) for recipe in RECIPES for gpus in GPUS for top in top_layouts(recipe, gpus)),
        key=lambda layout: layout[2],
    )
    stored = out / "dry_run_plan_top.json"
    chosen = {(recipe, gpus, tuple(overrides)): (place, fits) for recipe, gpus, place, fits, overrides in layouts}
    rows = json.loads(stored.read_text()) if stored.exists() else []
    # Layouts the planner no longer ranks in its top three leave the table; the others take their current place.
    rows = [
        {**r, **dict(zip(("place", "fits"), chosen[key]))}
        for r in rows
        if (key := (r["recipe"], r["world_size"], tuple(r["overrides"]))) in chosen
    ]
    done = {(r["recipe"], r["world_size"], tuple(r["overrides"])) for r in rows}
    if "--replan" in sys.argv:
        first = {}
        for index, r in enumerate(rows):
            first.setdefault((r["recipe"], r["world_size"], tuple(r["overrides"])), index)
        rows = replan_rows(
            rows, [(recipe, gpus, list(overrides)) for recipe, gpus, overrides in sorted(first, key=first.get)]
        )
    else:  # resumes: layouts already in the stored rows are not traced again
        for recipe, gpus, place, fits, overrides in layouts:
            if (recipe, gpus, tuple(overrides)) not in done:
                rows += [{**row, "place": place, "fits": fits} for row in measure(recipe, gpus, overrides)]
                write(out, rows)
    write(out, rows)


def write(out: Path, rows: list[dict]) -> None:
    """The json and the table of ``rows`` (rewritten after every layout: a long run leaves what it traced)."""
    write_results(
        out / "dry_run_plan_top",
        rows,
        "# meshtron.plan's top three layouts against the dry run\n\n"
        "For each recipe and GPU count (8 per node, 80 GB), `meshtron.plan`'s first three layouts (`place`: "
        "their rank in its list, fitting layouts first; `fits`: whether it predicted they fit), each traced "
        "rank by rank with `--dry-run` on fake tensors. Columns as in `dry_run.md`. Written by "
        "`benchmarks/dry_run_plan_top.py` on a 2-core CPU machine.",
        extra=("place", "fits"),
    )


if __name__ == "__main__":
    main()
