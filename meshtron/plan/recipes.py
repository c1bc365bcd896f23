"""The hardware a recipe's layout is for, read from the machine-readable line in its header:

    # Hardware: 4 nodes x 8 GPUs x 80 GB

(nodes x devices per node x memory per device). ``GB`` is read as GiB, as ``--gpu-memory`` is: an
"80 GB" H100 exposes 79.6 GiB, within the 10 % headroom the recipes keep. The tiny debug recipes
say ``CPU ranks``; their memory is the host RAM per rank, and the planner then leaves out the CUDA
context and communicator buffers (:data:`meshtron.plan.fit.CPU_ASSUMPTIONS`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from meshtron.config import ConfigError
from meshtron.plan.fit import CPU_ASSUMPTIONS
from meshtron.plan.memory import Assumptions
from meshtron.plan.speed import Hardware

HARDWARE_LINE = re.compile(
    r"^# Hardware: (?P<nodes>\d+) nodes? x (?P<per_node>\d+) (?P<kind>GPUs|CPU ranks) x (?P<memory>\d+(?:\.\d+)?) GB\b",
    re.MULTILINE,
)


@dataclass(frozen=True)
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
        raise ConfigError(f"{path}: the header needs exactly one line like "
                          f"'# Hardware: 1 node x 8 GPUs x 80 GB' (found {len(found)}).")
    nodes, per_node, kind, memory = found[0]
    return RecipeHardware(int(nodes), int(per_node), "cpu" if kind == "CPU ranks" else "cuda", float(memory))
