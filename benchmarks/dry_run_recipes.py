"""meshtron.plan held to the dry run: every shipped real-size recipe at its stated layout, plus pipeline
layouts, traced rank by rank on fake tensors (``python -m meshtron.train --recipe R --dry-run N``).

Per distinct rank: the traced peak of the second training step, the planner's prediction for the
same rank without its reserve and slack terms, their ratio, the step's FLOPs, the bytes it sends (all
collectives) traced and planned, the step's roofline compute time on an H100 SXM and the predicted
tokens/s per GPU, and the dry run's wall time on this machine (2 cores, two ranks traced at a time).

    PYTHONPATH=. python benchmarks/dry_run_recipes.py           # ~10 minutes on 2 cores
    PYTHONPATH=. python benchmarks/dry_run_recipes.py --replan  # seconds: the planned columns only

Writes benchmarks/results/dry_run.json and dry_run.md. ``--replan`` keeps the stored traces (what the
training step allocates and sends does not depend on the planner) and recomputes the planner's memory
prediction and ratio for each row with the current ``meshtron.plan``: for a change to the planner alone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.config import load_config  # noqa: E402
from meshtron.dryrun import dry_run, layout_text, tokens_per_second_per_device  # noqa: E402
from meshtron.plan.recipes import recipe_hardware  # noqa: E402

RECIPES = (
    "qwen2p5_0p5b",
    "qwen2p5_1p5b",
    "qwen2p5_3b",
    "qwen2p5_7b",
    "qwen2p5_14b",
    "qwen2p5_32b",
    "qwen2p5_72b",
    "qwen1p5_moe_a2p7b",
    "qwen2_57b_a14b",
)
_7B_PP2 = ["--parallel.pp", "2", "--parallel.dp", "2", "--parallel.tp", "2", "--parallel.microbatches", "4"]
_72B_PP4 = ["--parallel.pp", "4", "--parallel.dp", "4", "--parallel.tp", "4", "--parallel.microbatches", "4"]


def _chunks(schedule: str, virtual: int, ac: str) -> list[str]:
    return [
        "--parallel.schedule",
        schedule,
        "--parallel.virtual_stages",
        str(virtual),
        "--parallel.activation_checkpointing",
        ac,
    ]


# (recipe, world size, overrides): pipeline layouts the recipes do not state: 1F1B, then the schedules
# holding several chunks per rank or deferring weight passes, with and without checkpointing.
PIPELINES = (
    ("qwen2p5_7b", 8, _7B_PP2),
    ("qwen2p5_72b", 64, _72B_PP4),
    *(
        ("qwen2p5_7b", 8, _7B_PP2 + _chunks(schedule, virtual, ac))
        for schedule, virtual in (("interleaved", 2), ("zb1p", 1), ("zbv", 2), ("dualpipev", 2))
        for ac in ("none", "full")
    ),
    ("qwen2p5_72b", 64, _72B_PP4 + _chunks("interleaved", 2, "full")),
)
# Packed documents kept apart (one document per window: the dry run's assumption), without and with cp.
_DOCUMENTS = ["--data.document_mask", "true", "--train.seq_len", "2048"]
DOCUMENTS = (
    ("qwen2p5_0p5b", None, _DOCUMENTS),
    ("qwen2p5_0p5b", None, _DOCUMENTS + ["--parallel.dp", "4", "--parallel.cp", "2"]),
)
# Data parallelism other than FSDP: HSDP (replicated over dp, sharded over cp) and full replicas.
DATA_PARALLEL = tuple(
    (
        "qwen2p5_0p5b",
        None,
        [
            "--parallel.dp",
            "2",
            "--parallel.cp",
            "2",
            "--parallel.tp",
            "2",
            "--parallel.data_parallel",
            mode,
            "--parallel.microbatches",
            "4",
            "--train.seq_len",
            "1024",
        ],
    )
    for mode in ("hsdp", "replicate")
)


def measure(recipe: str, world: int | None, overrides: list[str]) -> list[dict]:
    path = ROOT / "recipes" / f"{recipe}.toml"
    cfg = load_config(path, overrides)
    world = world or recipe_hardware(path).world_size
    start = time.perf_counter()
    traces = dry_run(cfg, world)
    seconds = time.perf_counter() - start
    print(f"{recipe} {layout_text(cfg)}: {seconds:.0f} s", flush=True)
    speed = tokens_per_second_per_device(cfg, world, traces)
    return [
        {
            "recipe": recipe,
            "world_size": world,
            "overrides": overrides,
            "layout": layout_text(cfg),
            "schedule": cfg.parallel.schedule,
            "microbatches": cfg.parallel.microbatches,
            "ac": cfg.parallel.activation_checkpointing,
            "rank": t.rank,
            "pp": t.coords["pp"],
            "traced_gib": t.traced_gib,
            "planned_gib": t.planned_gib,
            "ratio": t.ratio,
            "tflop": t.flops / 1e12,
            "sent_traced_gib": sum(a for a, _ in t.comm.values()) / 2**30,
            "sent_planned_gib": sum(b for _, b in t.comm.values()) / 2**30,
            "roofline_s": t.compute_seconds,
            "tokens_per_s_per_gpu": speed,
            "seconds": seconds,
        }
        for t in traces
    ]


def table(rows: list[dict], extra: tuple[str, ...] = ()) -> str:
    """The rows as a markdown table; ``extra`` keys become columns after the layout's; a row's ``note``
    (e.g. traced before a change that moved its figures) marks its rank with the note's sign
    (:func:`note_signs`), and the note follows the table."""
    signs = note_signs(rows)
    lines = [
        "| recipe | options | ranks | layout | schedule | AC | micro-batches | "
        + "".join(f"{k} | " for k in extra)
        + "rank (stage) | traced GiB | planned GiB | traced / planned "
        "| TFLOP | sent GiB traced | sent GiB planned | roofline s | predicted tok/s/GPU | dry run s |",
        "|---" * (17 + len(extra)) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {_options(r['recipe'], r['overrides'])} | {r['world_size']} | {r['layout']} | "
            f"{r['schedule']} | {r['ac']} | "
            f"{r['microbatches']} | "
            + "".join(f"{r[k]} | " for k in extra)
            + f"{r['rank']} ({r['pp']}){' ' + signs[r['note']] if r.get('note') else ''} | {r['traced_gib']:.2f} | "
            f"{r['planned_gib']:.2f} | {r['ratio']:.3f} | "
            f"{r['tflop']:.0f} | {r['sent_traced_gib']:.3f} | {r['sent_planned_gib']:.3f} | "
            f"{r['roofline_s']:.2f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def note_signs(rows: list[dict]) -> dict[str, str]:
    """Each distinct note of ``rows`` (in order of first use) -> the sign that marks its rows: †, ‡, §, ...,
    so that a table holding rows traced before different changes says which is which."""
    notes = dict.fromkeys(r["note"] for r in rows if r.get("note"))
    return {note: "†‡§¶"[i % 4] * (i // 4 + 1) for i, note in enumerate(notes)}


# Overrides the table's own columns show.
_COLUMNS = {"pp", "dp", "cp", "ep", "tp", "schedule", "virtual_stages", "microbatches", "activation_checkpointing"}


def _options(recipe: str, overrides: list[str]) -> str:
    """The overrides that change the recipe outside the table's columns (``document_mask true, seq_len 2048``)."""
    base = load_config(ROOT / "recipes" / f"{recipe}.toml")
    changed = []
    for key, value in zip(overrides[::2], overrides[1::2]):
        section, name = key.removeprefix("--").split(".")
        if name not in _COLUMNS and str(getattr(getattr(base, section), name)).lower() != value.lower():
            changed.append(f"{name} {value}")
    return ", ".join(changed)


REPLANNED = (
    "; the traced columns (peak, TFLOP, bytes sent, roofline, wall time) are from its last full run, "
    "the planned ones and the predicted tokens/s recomputed from them with `--replan` after a change to the "
    "planner alone"
)


def _layouts() -> list[tuple[str, int | None, list[str]]]:
    return [(recipe, None, []) for recipe in RECIPES] + list(PIPELINES) + list(DOCUMENTS) + list(DATA_PARALLEL)


def replan_rows(rows: list[dict], layouts: list[tuple[str, int | None, list[str]]]) -> list[dict]:
    """``rows`` (from a full run over ``layouts``, in order) with the current planner's figures: memory
    and ratio, bytes sent, and the predicted tokens/s from the stored roofline times."""
    from meshtron.dryrun import TRACE_ASSUMPTIONS
    from meshtron.plan.communication import communication
    from meshtron.plan.memory import rank_breakdown
    from meshtron.plan.parameters import Coords
    from meshtron.plan.speed import Hardware, predict_step_time

    out, rest = [], iter(rows)
    for recipe, _, overrides in layouts:
        cfg = load_config(ROOT / "recipes" / f"{recipe}.toml", overrides)
        stored = [dict(next(rest)) for _ in range(cfg.parallel.pp)]  # one distinct rank per stage
        for row in stored:
            if (row["recipe"], row["layout"], row["schedule"]) != (recipe, layout_text(cfg), cfg.parallel.schedule):
                raise SystemExit(
                    f"the stored rows do not follow this script's layouts at {row['recipe']} "
                    f"{row['layout']}: run it without --replan"
                )
        step = max(predict_step_time(cfg, Hardware(), row["roofline_s"]).seconds for row in stored)
        for row in stored:
            planned = rank_breakdown(cfg, Coords(pp=row["pp"]), TRACE_ASSUMPTIONS).total / 2**30
            out.append(
                {
                    **row,
                    "overrides": overrides,
                    "planned_gib": planned,
                    "ratio": row["traced_gib"] / planned,
                    "sent_planned_gib": sum(communication(cfg, row["pp"]).values()) / 2**30,
                    "tokens_per_s_per_gpu": cfg.train.global_batch_size * cfg.train.seq_len / step / row["world_size"],
                }
            )
    return out


def main() -> None:
    out = ROOT / "benchmarks" / "results"
    if "--replan" in sys.argv:
        rows = replan_rows(json.loads((out / "dry_run.json").read_text()), _layouts())
    else:
        rows = [row for recipe, world, overrides in _layouts() for row in measure(recipe, world, overrides)]
    write_results(
        out / "dry_run",
        rows,
        "# meshtron.plan against the dry run\n\n"
        "`python -m meshtron.train --recipe R --dry-run N` traces the second training step of every distinct "
        "rank on fake tensors (bf16 compute, fp32 master weights and AdamW state, the recipe's shapes); "
        "`planned` is `meshtron.plan`'s prediction for the same rank without its reserve (CUDA context) and "
        "slack terms, which a tensor trace cannot see. Written by `benchmarks/dry_run_recipes.py` on a 2-core "
        f"CPU machine{REPLANNED if '--replan' in sys.argv else ''}.",
    )


def write_results(stem: Path, rows: list[dict], intro: str, extra: tuple[str, ...] = ()) -> None:
    """``rows`` as ``stem``.json and as ``stem``.md: ``intro``, the table and the rank furthest from the plan."""
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    within = sum(abs(r["ratio"] - 1) <= 0.05 for r in rows)
    notes = "".join(f"\n\n{sign}: {note}" for note, sign in note_signs(rows).items())
    text = (
        f"{intro}\n\n{table(rows, extra)}{notes}\n\nFurthest from 1: {worst['recipe']} on {worst['world_size']} ranks, "
        f"{worst['layout']} {worst['schedule']}, rank {worst['rank']}: {worst['ratio']:.3f}; {within} of "
        f"{len(rows)} ranks within 5 %.\n"
    )
    stem.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
