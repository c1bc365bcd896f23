"""Will it fit, and which layout is fastest? Memory and step-time models of a recipe's layout.

``python -m meshtron.plan --recipe R --gpus N`` prints the recipe's layout with its per-rank memory and step time,
then every valid layout for N devices ranked by throughput; ``meshtron.train`` refuses a layout that cannot fit
with :func:`check_memory`. Sits above ``meshtron.parallel``, below ``meshtron.train``. See docs/planner.md.
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
