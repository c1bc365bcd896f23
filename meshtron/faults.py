"""Failure injection for tests: ``MESHTRON_FAULT``, a comma-separated list of KIND:RANK:STEP acting on that rank
(raise, hang, delay, stall, slow), in the launcher's first attempt only, so a restart runs clean.

The trainer (``meshtron/train.py``) calls these hooks; without the variable they do nothing.
See docs/failures.md, 'Fault injection'.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from torch import nn

from meshtron.models.moe import MoE
from meshtron.models.qwen2 import Block

FAULT_ENV = "MESHTRON_FAULT"
SLOW_FAULT_S = 1.0


def _faults(rank: int, kind: str) -> list[str]:
    """The steps (as written) of this rank's injected faults of ``kind``."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return []
    specs = [spec.split(":") for spec in os.environ.get(FAULT_ENV, "").split(",") if spec]
    return [step for k, r, step in specs if k == kind and int(r) == rank]


def inject_fault(rank: int, step: int) -> None:
    """The "raise", "hang" and "delay" faults of this rank before ``step`` (0: before start-up)."""
    if str(step) in _faults(rank, "raise"):
        raise RuntimeError(f"{FAULT_ENV} injected a failure on rank {rank} before step {step}")
    if str(step) in _faults(rank, "hang"):
        time.sleep(10**6)
    if str(step) in _faults(rank, "delay"):
        time.sleep(5)


def slow_down(rank: int, step: int) -> None:
    """The "slow" fault: extra time in this rank's ``step``."""
    if {"*", str(step)} & set(_faults(rank, "slow")):
        time.sleep(SLOW_FAULT_S)


def install_stall(model: nn.Module, rank: int, current_step: Callable[[], int]) -> None:
    """The "stall" fault: a forward pre-hook that never returns in the given step (``current_step()``,
    the trainer's step when the hook runs)."""
    steps = {int(step) for step in _faults(rank, "stall")}
    if not steps:
        return
    blocks = [m for m in model.modules() if isinstance(m, MoE)] or [m for m in model.modules() if isinstance(m, Block)]

    def stall(module, args):
        if current_step() in steps:
            time.sleep(10**6)

    blocks[-1].register_forward_pre_hook(stall)
