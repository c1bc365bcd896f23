"""The hardware a recipe's layout is for, read from the machine-readable line in its header
(``# Hardware: 4 nodes x 8 GPUs x 80 GB``: nodes x devices per node x memory per device, GB read as GiB), and
the header's predicted-memory line, which ``python -m meshtron.plan.recipes recipes/*.toml`` rewrites from the
planner (the tests fail when a header disagrees with the plan). See docs/recipes.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from meshtron.config import ConfigError, infer_dp, load_config
from meshtron.plan.fit import CPU_ASSUMPTIONS
from meshtron.plan.memory import GIB, Assumptions, predict_memory
from meshtron.plan.speed import Hardware

HARDWARE_LINE = re.compile(
    r"^# Hardware: (?P<nodes>\d+) nodes? x (?P<per_node>\d+) (?P<kind>GPUs|CPU ranks) x (?P<memory>\d+(?:\.\d+)?) GB\b",
    re.MULTILINE,
)


@dataclass(frozen=True, kw_only=True)  # built from a parsed line: fields by name, never by position
class RecipeHardware:
    nodes: int
    per_node: int
    device: str  # "cuda" or "cpu"
    memory_gib: float

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def hardware(self) -> Hardware:
        return Hardware(gpus_per_node=self.per_node, memory_gib=self.memory_gib)

    def assumptions(self) -> Assumptions:
        return CPU_ASSUMPTIONS if self.device == "cpu" else Assumptions()


def recipe_hardware(path: str | Path) -> RecipeHardware:
    """The ``# Hardware:`` line of the recipe at ``path`` (before ``[model]``)."""
    header = Path(path).read_text().split("\n[", 1)[0]
    found = HARDWARE_LINE.findall(header)
    if len(found) != 1:
        raise ConfigError(
            f"{path}: the header needs exactly one line like "
            f"'# Hardware: 1 node x 8 GPUs x 80 GB' (found {len(found)})."
        )
    nodes, per_node, kind, memory = found[0]
    return RecipeHardware(
        nodes=int(nodes),
        per_node=int(per_node),
        device="cpu" if kind == "CPU ranks" else "cuda",
        memory_gib=float(memory),
    )


PREDICTION = re.compile(r"meshtron\.plan predicts (?P<gib>\d+(?:\.\d+)?) GiB per GPU")


def planned_gib(path: str | Path) -> float:
    """``meshtron.plan``'s busiest-rank memory for the recipe's layout on its stated hardware."""
    hw = recipe_hardware(path)
    cfg = infer_dp(load_config(path), hw.world_size)
    return predict_memory(cfg, hw.assumptions()).total / GIB


def stated_gib(path: str | Path) -> float | None:
    """The prediction the recipe's header states, or None when it states none."""
    found = PREDICTION.search(Path(path).read_text().split("\n[", 1)[0])
    return float(found["gib"]) if found else None


def write_prediction(path: str | Path) -> bool:
    """Rewrite the header's prediction with the planner's (0.1 GiB); True when it changed."""
    path = Path(path)
    text = path.read_text()
    header, rest = text.split("\n[", 1)
    updated = PREDICTION.sub(f"meshtron.plan predicts {planned_gib(path):.1f} GiB per GPU", header, count=1)
    if updated == header:
        return False
    path.write_text(f"{updated}\n[{rest}")
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m meshtron.plan.recipes RECIPE...``: refresh the stated predictions."""
    import sys

    for path in sys.argv[1:] if argv is None else argv:
        if stated_gib(path) is not None and write_prediction(path):
            print(f"{path}: meshtron.plan predicts {planned_gib(path):.1f} GiB per GPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
