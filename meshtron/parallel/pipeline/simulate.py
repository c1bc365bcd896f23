"""Execute schedules on a model clock: timelines, makespan, bubble fraction, deadlock detection.

See docs/pipeline.md#schedules ('The simulator') for the model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

from meshtron.parallel.pipeline.schedules import (
    P2P,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    W,
    split_backwards,
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


def match_p2p(schedules: Schedule, one_channel: bool = False) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """Pair every p2p op with its partner by posting order per directed rank pair and stream.

    The executor sends activations and gradients over two communicators, so each directed rank
    pair carries two independently ordered streams; ``one_channel`` checks the stricter order
    of a single communicator for both (all schedules but the V-shaped ones meet it). Ops are
    addressed as ``(rank, entry index, op index)``. Raises ``ValueError`` when the n-th send from
    one rank to another is not the counterpart of the n-th receive there, or when counts differ:
    such a schedule would pair the wrong tensors or hang.
    """
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, entries in enumerate(schedules):
        for i, entry in enumerate(entries):
            if isinstance(entry, P2P):
                for j, op in enumerate(entry.ops):
                    stream = () if one_channel else (op.kind in (SEND_F, RECV_F),)
                    if op.kind in (SEND_F, SEND_B):
                        sends[(rank, op.peer, *stream)].append((rank, i, j))
                    else:
                        recvs[(op.peer, rank, *stream)].append((rank, i, j))
    partner = {}
    for channel in sends.keys() | recvs.keys():
        out, inn = sends[channel], recvs[channel]
        if len(out) != len(inn):
            raise ValueError(f"ranks {channel[:2]}: {len(out)} sends but {len(inn)} receives")
        for s, r in zip(out, inn):
            send, recv = _op(schedules, s), _op(schedules, r)
            if _partner_kind(send) != (recv.kind, recv.stage) or send.mb != recv.mb:
                raise ValueError(f"ranks {channel[:2]}: {send} is matched with {recv} (posting order differs)")
            partner[s], partner[r] = r, s
    return partner


def _op(schedules: Schedule, address: tuple[int, int, int]) -> Action:
    rank, i, j = address
    return schedules[rank][i].ops[j]


def simulate(
    schedules: Schedule,
    f_cost: float = 1,
    b_cost: float = 2,
    p2p_cost: float = 0,
    w_cost: float = 0,
    rendezvous: bool = True,
) -> SimResult:
    """Run all ranks' entries; raise :class:`DeadlockError` if stuck.

    ``b_cost`` is a backward's input-gradient part and ``w_cost`` its weight-gradient part: a
    split backward's ``B`` and ``W`` cost those, a whole backward their sum (``w_cost = 0``: the
    whole backward costs ``b_cost``). ``rendezvous`` picks the model (docs/pipeline.md#schedules): batches that
    complete only when all their partners are posted, or the executor's (sends never wait, a
    receive is waited for by the action that consumes it).
    """
    partner = match_p2p(schedules)
    pp = len(schedules)
    split = [split_backwards(entries) for entries in schedules]
    clock, pos = [0.0] * pp, [0] * pp
    pending: list[list[tuple[int, int, int]]] = [[] for _ in range(pp)]
    inbox: list[dict[tuple[int, int], tuple[int, int, int]]] = [{} for _ in range(pp)]
    done: list[set[tuple[str, int, int]]] = [set() for _ in range(pp)]
    forwarded: list[set[int]] = [set() for _ in range(pp)]  # stages with a forward done, per rank
    posted: dict[tuple[int, int, int], float] = {}
    timelines: list[list[Span]] = [[] for _ in range(pp)]

    def arrived(rank: int, ops: list[tuple[int, int, int]]) -> bool:
        """Advance the rank's clock to when ``ops`` met their partners; False if some have not yet."""
        if any(partner[op] not in posted for op in ops):
            return False
        clock[rank] = max([clock[rank]] + [posted[partner[op]] + p2p_cost for op in ops])
        return True

    def ready(rank: int, entry) -> bool:
        if rendezvous:  # the last batch completes before the next F, B or batch (a W needs none of it)
            if (isinstance(entry, P2P) or entry.kind != W) and not arrived(rank, pending[rank]):
                return False
            pending[rank] = [] if isinstance(entry, P2P) or entry.kind != W else pending[rank]
            return True
        if isinstance(entry, P2P) or (entry.kind, entry.stage, entry.mb) not in inbox[rank]:
            return True
        if not arrived(rank, [inbox[rank][(entry.kind, entry.stage, entry.mb)]]):
            return False
        del inbox[rank][(entry.kind, entry.stage, entry.mb)]
        return True

    progress = True
    while progress:
        progress = False
        for rank, entries in enumerate(schedules):
            while pos[rank] < len(entries):
                i, entry = pos[rank], entries[pos[rank]]
                if not ready(rank, entry):
                    break
                if isinstance(entry, Action):
                    _check_local_order(entry, done[rank], forwarded[rank])
                    cost = {F: f_cost, W: w_cost}.get(entry.kind, b_cost)
                    if entry.kind == B and (entry.stage, entry.mb) not in split[rank]:
                        cost += w_cost
                    end = clock[rank] + cost
                    timelines[rank].append(Span(rank, entry.kind, entry.mb, clock[rank], end, entry.stage))
                    done[rank].add((entry.kind, entry.stage, entry.mb))
                    if entry.kind == F:
                        forwarded[rank].add(entry.stage)
                    clock[rank] = end
                else:
                    pending[rank] = [(rank, i, j) for j in range(len(entry.ops))]
                    for j, op in enumerate(entry.ops):
                        posted[(rank, i, j)] = clock[rank]
                        if op.kind in (RECV_F, RECV_B):
                            inbox[rank][(F if op.kind == RECV_F else B, op.stage, op.mb)] = (rank, i, j)
                pos[rank] += 1
                progress = True
            if rendezvous and pos[rank] == len(entries) and pending[rank] and arrived(rank, pending[rank]):
                pending[rank], progress = [], True
    # A blocked rank waits on its last batch (rendezvous) or on the entry it cannot start.
    stuck = {r: str(schedules[r][pos[r]]) for r in range(pp) if pos[r] < len(schedules[r])}
    if rendezvous:
        stuck = {r: str(schedules[r][pending[r][0][1]]) for r in range(pp) if pending[r]}
    if stuck:
        raise DeadlockError("pipeline schedule deadlocks; stuck entries per rank: " + repr(stuck))
    makespan = max(clock)
    busy = sum(s.end - s.start for line in timelines for s in line)
    return SimResult(timelines, makespan, 1 - busy / (pp * makespan) if makespan else 0.0)


def _check_local_order(a: Action, done: set[tuple[str, int, int]], forwarded: set[int]) -> None:
    """A rank's own order must respect the data flow through its stages (the turn of a V runs two
    neighbouring stages on one rank, with no p2p op to wait on); ``forwarded``: the rank's stages
    with a forward done (whether a neighbouring stage runs here, in constant time: the search
    simulates schedules of thousands of micro-batches)."""
    needs = {F: [], B: [(F, a.stage, a.mb)], W: [(B, a.stage, a.mb)]}[a.kind]
    if a.kind == F and a.stage - 1 in forwarded:
        needs.append((F, a.stage - 1, a.mb))
    if a.kind == B and a.stage + 1 in forwarded:
        needs.append((B, a.stage + 1, a.mb))
    missing = [n for n in needs if n not in done]
    if missing:
        raise ValueError(f"{a} runs before {missing[0][0]}(s{missing[0][1]},mb{missing[0][2]}) on the same rank")


def analytic_bubble(pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of ``pp * makespan`` for GPipe, 1F1B (``v = 1``) and interleaved 1F1B.

    With per-chunk costs f and b, each rank is busy ``v * m * (f + b)`` and the schedules take
    ``(v * m + pp - 1) * (f + b)`` (the fill and drain add ``pp - 1`` chunk slots), so the idle
    fraction is ``(pp - 1) / (v * m + pp - 1)``. Megatron quotes bubble time over ideal time,
    ``(pp - 1) / (v * m)``; the two are related by ``x / (1 + x)``.
    """
    return (pp - 1) / (v * m + pp - 1)


def unit_cost_bubble(schedule: str, pp: int, m: int) -> float:
    """Idle fraction of the zero-bubble schedules for unit chunk costs ``F = B = W``.

    Qi et al. give bubble time over ideal time: ZB-H1 ``(pp-1)/(3m)`` (a third of 1F1B's); ZB-V
    ``0`` up to its fill, which is one chunk slot per rank, ``(pp-1)/(6m)`` with two chunks;
    DualPipeV's paired slots run whole backwards, so its fill is two chunk slots,
    ``2(pp-1)/(6m)``. The idle fraction is ``x / (1 + x)`` of that ratio ``x``.
    """
    ratio = {"zb1p": (pp - 1) / (3 * m), "zbv": (pp - 1) / (6 * m), "dualpipev": 2 * (pp - 1) / (6 * m)}[schedule]
    return ratio / (1 + ratio)
