"""Will it fit, and which layout is fastest? Memory and step-time models of a recipe's layout.

``python -m meshtron.plan --recipe R --gpus N`` prints the recipe's layout with its per-rank memory
breakdown and predicted step time, then every valid layout for N devices ranked by throughput.
``meshtron.train`` uses :func:`check_memory` to refuse a layout that cannot fit before allocating.

Sits above ``meshtron.parallel`` (it reads the pipeline schedules and the simulator) and below
``meshtron.train``.
"""

from meshtron.plan.memory import TERMS, Assumptions, Breakdown, predict_memory
from meshtron.plan.parameters import Coords, state_bytes
from meshtron.plan.search import LayoutPlan, evaluate, fitting_layout, rank_layouts
from meshtron.plan.speed import Hardware, StepTime, predict_step_time

__all__ = [
    "TERMS",
    "Assumptions",
    "Breakdown",
    "Coords",
    "Hardware",
    "LayoutPlan",
    "StepTime",
    "evaluate",
    "fitting_layout",
    "predict_memory",
    "predict_step_time",
    "rank_layouts",
    "state_bytes",
]
