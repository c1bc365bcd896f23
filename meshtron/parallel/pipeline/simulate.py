"""Execute schedules on a model clock: timelines, makespan, bubble fraction, deadlock detection.

Model: a rank runs its steps in order. ``F`` and ``B`` take ``f_cost`` and ``b_cost``. A
:class:`P2P` batch is posted when the rank reaches it and completes ``p2p_cost`` after the
last of its ops' partner ops was posted (rendezvous: sends wait for the receive as well,
the strictest behaviour of NCCL and gloo, see ``schedules.py``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

from meshtron.parallel.pipeline.schedules import (
    B,
    F,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    P2P,
    Schedule,
)


class Span(NamedTuple):
    """One compute action on the clock; measured timelines use the same row layout."""

    rank: int
    kind: str
    mb: int
    start: float
    end: float
    stage: int = 0


@dataclass
class SimResult:
    timelines: list[list[Span]]
    makespan: float
    bubble: float  # idle fraction of pp * makespan


class DeadlockError(RuntimeError):
    pass


def _partner_kind(op: Action) -> tuple[str, int]:
    """Kind and stage of the op on the peer that this op meets."""
    return {
        SEND_F: (RECV_F, op.stage + 1),
        RECV_F: (SEND_F, op.stage - 1),
        SEND_B: (RECV_B, op.stage - 1),
        RECV_B: (SEND_B, op.stage + 1),
    }[op.kind]


def match_p2p(schedules: Schedule) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """Pair every p2p op with its partner by posting order per directed rank pair.

    Ops are addressed as ``(rank, step index, op index)``. Raises ``ValueError`` when the n-th
    send from one rank to another is not the counterpart of the n-th receive there, or when
    counts differ: such a schedule would pair the wrong tensors or hang.
    """
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, steps in enumerate(schedules):
        for i, step in enumerate(steps):
            if isinstance(step, P2P):
                for j, op in enumerate(step.ops):
                    if op.kind in (SEND_F, SEND_B):
                        sends[(rank, op.peer)].append((rank, i, j))
                    else:
                        recvs[(op.peer, rank)].append((rank, i, j))
    partner = {}
    for channel in sends.keys() | recvs.keys():
        out, inn = sends[channel], recvs[channel]
        if len(out) != len(inn):
            raise ValueError(f"ranks {channel}: {len(out)} sends but {len(inn)} receives")
        for s, r in zip(out, inn):
            send, recv = _op(schedules, s), _op(schedules, r)
            if _partner_kind(send) != (recv.kind, recv.stage) or send.mb != recv.mb:
                raise ValueError(f"ranks {channel}: {send} is matched with {recv} (posting order differs)")
            partner[s], partner[r] = r, s
    return partner


def _op(schedules: Schedule, address: tuple[int, int, int]) -> Action:
    rank, i, j = address
    return schedules[rank][i].ops[j]


def simulate(schedules: Schedule, f_cost: float = 1, b_cost: float = 2, p2p_cost: float = 0) -> SimResult:
    """Run all ranks' steps under the rendezvous model; raise :class:`DeadlockError` if stuck."""
    partner = match_p2p(schedules)
    pp = len(schedules)
    cost = {F: f_cost, B: b_cost}
    clock, pos = [0.0] * pp, [0] * pp
    posted: dict[tuple[int, int, int], float] = {}
    timelines: list[list[Span]] = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for rank, steps in enumerate(schedules):
            while pos[rank] < len(steps):
                i, step = pos[rank], steps[pos[rank]]
                if isinstance(step, Action):
                    end = clock[rank] + cost[step.kind]
                    timelines[rank].append(Span(rank, step.kind, step.mb, clock[rank], end, step.stage))
                    clock[rank] = end
                else:
                    ops = [(rank, i, j) for j in range(len(step.ops))]
                    for op in ops:
                        posted.setdefault(op, clock[rank])
                    if any(partner[op] not in posted for op in ops):
                        break
                    clock[rank] = max([clock[rank]] + [posted[partner[op]] for op in ops]) + p2p_cost
                pos[rank] += 1
                progress = True
    stuck = {r: str(schedules[r][pos[r]]) for r in range(pp) if pos[r] < len(schedules[r])}
    if stuck:
        raise DeadlockError("pipeline schedule deadlocks; stuck steps per rank: " + repr(stuck))
    makespan = max(clock)
    busy = sum(s.end - s.start for line in timelines for s in line)
    return SimResult(timelines, makespan, 1 - busy / (pp * makespan) if makespan else 0.0)


def analytic_bubble(pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of ``pp * makespan`` for GPipe, 1F1B (``v = 1``) and interleaved 1F1B.

    With per-chunk costs f and b, each rank is busy ``v * m * (f + b)`` and the schedules take
    ``(v * m + pp - 1) * (f + b)`` (the fill and drain add ``pp - 1`` chunk slots), so the idle
    fraction is ``(pp - 1) / (v * m + pp - 1)``. Megatron quotes bubble time over ideal time,
    ``(pp - 1) / (v * m)``; the two are related by ``x / (1 + x)``.
    """
    return (pp - 1) / (v * m + pp - 1)
