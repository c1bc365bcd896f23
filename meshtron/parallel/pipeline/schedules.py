"""Pipeline schedules as data: per pp-rank ordered lists of compute actions (``F``, ``B``, ``W``) and p2p
batches, one builder per ``[parallel] schedule``, and the counts the planner reads off them.

See docs/pipeline.md#schedules for the vocabulary, the tensor roles, matching and the batching rule.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

# The schedules' recipe names are defined in meshtron.config (which checks a recipe against them and
# cannot import this module) and re-exported here.
from meshtron.config import (
    SCHEDULES,
    V_SHAPED,
    VIRTUAL,
    fewest_microbatches,
    microbatch_multiple,
    needs_two_virtual_stages,
    needs_virtual_schedule,
)
from meshtron.parallel.pipeline.split import chunk_rank

__all__ = [
    "B",
    "F",
    "W",
    "P2P",
    "RECV_B",
    "RECV_F",
    "SEND_B",
    "SEND_F",
    "SCHEDULES",
    "V_SHAPED",
    "VIRTUAL",
    "SPLIT_BACKWARD",
    "Action",
    "Schedule",
    "Entry",
    "build_schedule",
    "built_schedule",
    "check_schedule",
    "dualpipev",
    "gpipe",
    "held_by_stage",
    "held_counts",
    "interleaved_1f1b",
    "interleaving_refused",
    "last_weight_passes",
    "one_f_one_b",
    "peak_in_flight",
    "runs_backward_whole",
    "split_backwards",
    "steady_microbatches",
    "zb1p",
    "zbv",
]

F, B, W = "F", "B", "W"
SPLIT_BACKWARD = ("zb1p", "zbv", "dualpipev")  # the schedules with ``W`` actions (split backwards)
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"


@dataclass(frozen=True)
class Action:
    """One compute action or one p2p op (tensor roles: docs/pipeline.md#schedules)."""

    kind: str
    mb: int
    stage: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.kind}(s{self.stage},mb{self.mb}){peer}"


@dataclass(frozen=True)
class P2P:
    """p2p ops posted together in one batch and all waited for before the next entry."""

    ops: tuple[Action, ...]

    def __str__(self) -> str:
        return "P2P[" + " ".join(str(op) for op in self.ops) + "]"


Entry = Action | P2P  # one item of a rank's schedule, run in order
Schedule = list[list[Entry]]


def _check_microbatches(name: str, pp: int, m: int) -> None:
    if pp < 1:
        raise ValueError(f"{name}: pp must be >= 1, got {pp}")
    if m < fewest_microbatches(name, pp):
        raise ValueError(
            f"{name}: microbatches = {m} is fewer than pp = {pp} stages; a pipeline needs at "
            f"least one microbatch per stage: set [parallel] microbatches >= {pp} or lower pp."
        )


def _gpipe_slots(m: int, rank: int) -> list[list[Action]]:
    return [[Action(kind, i, rank)] for kind in (F, B) for i in range(m)]


def _one_f_one_b_slots(pp: int, m: int, rank: int) -> list[list[Action]]:
    warmup = pp - rank - 1
    slots = [[Action(F, i, rank)] for i in range(warmup)]
    for i in range(m - warmup):
        slots += [[Action(F, warmup + i, rank)], [Action(B, i, rank)]]
    return slots + [[Action(B, i, rank)] for i in range(m - warmup, m)]


def _interleaved_slots(pp: int, m: int, v: int, rank: int) -> list[list[Action]]:
    """Megatron's virtual-pipeline order: microbatches advance in groups of ``pp`` per chunk."""

    def nth(k: int, kind: str) -> Action:
        group, within = divmod(k, pp * v)
        local = within // pp
        chunk = local if kind == F else v - 1 - local
        return Action(kind, group * pp + within % pp, chunk * pp + rank)

    total = m * v
    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    slots = [[nth(k, F)] for k in range(warmup)]
    slots += [[nth(warmup + k, F), nth(k, B)] for k in range(total - warmup)]
    return slots + [[nth(k, B)] for k in range(total - warmup, total)]


# The p2p op kind by (the action is a forward, the op carries its output away).
_P2P_KINDS = {(True, True): SEND_F, (True, False): RECV_F, (False, True): SEND_B, (False, False): RECV_B}


def _peer_ops(a: Action, ranks: list[int], sending: bool) -> list[Action]:
    """The p2p op that brings ``a`` its input (``sending`` False) or carries its output away;
    ``ranks[s]``: the pp-rank of stage ``s``.

    Stages on the same rank (the turn of a V) exchange nothing: the executor hands over locally.
    """
    if a.kind == W:
        return []
    forward = a.kind == F
    other = a.stage + (1 if forward == sending else -1)
    if not 0 <= other < len(ranks) or ranks[other] == ranks[a.stage]:
        return []
    return [Action(_P2P_KINDS[(forward, sending)], a.mb, a.stage, ranks[other])]


def _with_p2p(slots: list[list[Action]], pp: int, num_stages: int, v_shape: bool = False) -> list[Entry]:
    """Interleave one rank's compute ``slots`` with p2p batches.

    The batch between two slots holds the sends of the slot before and the receives of the
    slot after, so neighbours meet in matching batches.
    """
    ranks = [chunk_rank(s, pp, v_shape) for s in range(num_stages)]
    entries: list[Entry] = []
    before: list[Action] = []
    for slot in slots:
        ops = [op for a in before for op in _peer_ops(a, ranks, True)]
        ops += [op for a in slot for op in _peer_ops(a, ranks, False)]
        if ops:
            entries.append(P2P(tuple(ops)))
        entries += slot
        before = slot
    tail = [op for a in before for op in _peer_ops(a, ranks, True)]
    if tail:
        entries.append(P2P(tuple(tail)))
    return entries


def gpipe(pp: int, m: int) -> Schedule:
    """All forwards, then all backwards: ``m`` microbatches of activations live at the peak."""
    _check_microbatches("gpipe", pp, m)
    return [_with_p2p(_gpipe_slots(m, r), pp, pp) for r in range(pp)]


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): ``pp - rank - 1`` warmup forwards, then alternate F and B."""
    _check_microbatches("1f1b", pp, m)
    return [_with_p2p(_one_f_one_b_slots(pp, m, r), pp, pp) for r in range(pp)]


def interleaving_refused(pp: int, v: int) -> str | None:
    """Why ``interleaved`` cannot run ``v`` virtual stages per rank on ``pp`` ranks (None: it can). The
    rule's one owner: the builder below and the recipe check (``parallel/layout.py``) call it."""
    if pp >= 2 and v >= 2:
        return None
    return f"needs pp >= 2 and virtual_stages >= 2, got pp = {pp}, virtual_stages = {v}"


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B over ``v`` virtual stages (model chunks) per rank.

    Needs ``pp >= 2``, ``v >= 2`` (:func:`interleaving_refused`) and ``m`` a multiple of ``pp``
    (microbatches enter each chunk in groups of ``pp``).
    """
    _check_interleaved(pp, m, v)
    return [_with_p2p(_interleaved_slots(pp, m, v, r), pp, pp * v) for r in range(pp)]


def _check_interleaved(pp: int, m: int, v: int) -> None:
    name = "interleaved"
    refused = interleaving_refused(pp, v)
    if refused:
        raise ValueError(f"{name}: {refused}; use schedule = '1f1b'.")
    _check_microbatches(name, pp, m)
    if m % microbatch_multiple(name, pp):
        lower, upper = m - m % pp, m + pp - m % pp
        raise ValueError(
            f"{name}: microbatches = {m} is not a multiple of pp = {pp}; the interleaved schedule "
            f"feeds each chunk microbatches in groups of pp: use microbatches = {lower} or {upper}."
        )


def _zb1p_slots(pp: int, m: int, rank: int) -> list[list[Action]]:
    """1F1B's order of F and B with every backward split; rank ``r`` runs the ``W`` of a
    micro-batch ``r`` backwards later, so the late ranks hurry the gradients back to the early
    ones and the deferred ``W`` fill the drain."""
    slots, deferred = [], deque()
    for slot in _one_f_one_b_slots(pp, m, rank):
        slots.append(slot)
        if slot[0].kind == B:
            deferred.append(Action(W, slot[0].mb, rank))
            if len(deferred) > rank:
                slots.append([deferred.popleft()])
    return slots + [[w] for w in deferred]


class _Counter:
    """Next micro-batch per (kind, stage), for the schedules written as action patterns."""

    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = {}

    def __call__(self, kind: str, stage: int) -> Action:
        mb = self.next.get((kind, stage), 0)
        self.next[(kind, stage)] = mb + 1
        return Action(kind, mb, stage)

    def count(self, kind: str, stage: int) -> int:
        return self.next.get((kind, stage), 0)


def _zbv_slots(pp: int, m: int, rank: int) -> list[list[Action]]:
    """ZB-V (Qi et al., section 6): rank ``r`` runs stage ``r`` (down) and ``2 pp - 1 - r`` (up).

    Warm-up fills both chunks (more of the first on the early ranks, which wait longest for
    gradients), the steady state repeats ``F B W`` on each chunk, and the cool-down runs the
    input gradients first and the deferred ``W`` last.
    """
    down, up, nxt = rank, 2 * pp - 1 - rank, _Counter()
    slots = [[nxt(F, down)] for _ in range(2 * (pp - rank) - 1)]
    for _ in range(rank):
        slots += [[nxt(F, up)], [nxt(F, down)]]
    for _ in range(pp - rank):
        slots += [[nxt(F, up)], [nxt(B, up)], [nxt(W, up)]]
    while nxt.count(F, up) < nxt.count(F, down) or nxt.count(F, down) < m:
        if nxt.count(F, down) < m:
            slots.append([nxt(F, down)])
        slots += [[nxt(B, down)], [nxt(W, down)], [nxt(F, up)], [nxt(B, up)], [nxt(W, up)]]
    for _ in range(rank):
        slots += [[nxt(B, down)], [nxt(B, up)]]
    for _ in range(pp - rank):
        slots += [[nxt(B, down)], [nxt(W, down)]]
    for stage in (up, down):
        slots += [[nxt(W, stage)] for _ in range(nxt.count(B, stage) - nxt.count(W, stage))]
    return slots


def _dualpipev_slots(pp: int, m: int, rank: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto ``pp`` ranks, V placement as ``zbv``).

    Its steady state pairs the forward of one chunk with the full backward of the other in one
    slot (one micro-batch going down, an older one coming back up), so on hardware with separate
    streams an MoE layer's all-to-all of one hides behind the other's compute. The fill and drain
    split backwards and put the deferred ``W`` where the rank would wait.
    """
    down, up, nxt = rank, 2 * pp - 1 - rank, _Counter()
    deferred: deque[Action] = deque()

    def split_b(stage: int) -> list[Action]:
        b = nxt(B, stage)
        deferred.append(Action(W, b.mb, stage))
        return [b]

    def full_b(stage: int) -> Action:
        return nxt(B, stage)  # no W follows: the backward is whole

    def pending_w() -> list[list[Action]]:
        return [[deferred.popleft()]] if deferred else []

    slots = [[nxt(F, down)] for _ in range(2 * (pp - rank - 1))]
    for _ in range(rank + 1):
        slots += [[nxt(F, down)], [nxt(F, up)]]
    for _ in range(pp - rank - 1):
        slots += [split_b(up)] + pending_w() + [[nxt(F, up)]]
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:  # the V's tip: its first backward follows at once, unpaired
            slots += [[nxt(F, down)], [full_b(up)]]
        else:
            slots.append([nxt(F, down), full_b(up)])
        slots.append([nxt(F, up), full_b(down)])
    for _ in range(pp - rank - 1):
        slots += [[full_b(up)], [nxt(F, up), full_b(down)]]
    split = False
    for i in range(rank + 1):
        for stage, parity in ((up, 1), (down, 0)):
            split = split or (i == (rank + 1) // 2 and rank % 2 == parity)
            slots.append(split_b(stage) if split else [full_b(stage)])
    for _ in range(pp - rank - 1):
        slots += pending_w() + [split_b(down) if split else [full_b(down)]]
    return slots + [[w] for w in deferred]


# Why a V-shaped schedule needs its fewest micro-batches ({n}: ``fewest_microbatches``).
_V_FEWEST_WHY = {
    "zbv": "2 * pp = {n} (zbv's warm-up fills both chunks of every rank)",
    "dualpipev": "the {n} stages (dualpipev needs a micro-batch per stage)",
}


def _check_v_shape(name: str, pp: int, m: int, v: int) -> None:
    if v != 2:
        raise ValueError(f"{name}: {needs_two_virtual_stages(v)}: set [parallel] virtual_stages = 2")
    fewest = fewest_microbatches(name, pp)
    if m < fewest:
        why = _V_FEWEST_WHY[name].format(n=fewest)
        raise ValueError(f"{name}: microbatches = {m} is fewer than {why}: set [parallel] microbatches >= {fewest}")


def zb1p(pp: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR 2024): 1F1B with split backwards; at most ``pp`` micro-batches in
    flight on any rank (1F1B's peak) and, for ``F = B = W``, a third of 1F1B's bubble."""
    _check_microbatches("zb1p", pp, m)
    return [_with_p2p(_zb1p_slots(pp, m, r), pp, pp) for r in range(pp)]


def zbv(pp: int, m: int, v: int = 2) -> Schedule:
    """ZB-V: two chunks per rank in a V; 1F1B's activation memory and, for ``F = B = W`` and
    ``m >= 2 pp``, no bubble beyond the fill of one chunk. Needs ``m >= 2 pp``."""
    _check_v_shape("zbv", pp, m, v)
    return [_with_p2p(_zbv_slots(pp, m, r), pp, 2 * pp, v_shape=True) for r in range(pp)]


def dualpipev(pp: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV: V placement, forward and backward of two micro-batches paired in one slot.
    Needs ``m >= 2 pp`` (as many micro-batches as stages)."""
    _check_v_shape("dualpipev", pp, m, v)
    return [_with_p2p(_dualpipev_slots(pp, m, r), pp, 2 * pp, v_shape=True) for r in range(pp)]


def build_schedule(name: str, pp: int, m: int, v: int = 1) -> Schedule:
    """Schedule by its recipe name (one of ``SCHEDULES``)."""
    check_schedule(name, pp, m, v)
    if name == "gpipe":
        return gpipe(pp, m)
    if name == "1f1b":
        return one_f_one_b(pp, m)
    if name == "zb1p":
        return zb1p(pp, m)
    if name == "zbv":
        return zbv(pp, m, v)
    if name == "dualpipev":
        return dualpipev(pp, m, v)
    return interleaved_1f1b(pp, m, v)


def check_schedule(name: str, pp: int, m: int, v: int = 1) -> None:
    """Raise ``ValueError`` for a schedule :func:`build_schedule` refuses, without building it (the layout
    search checks schedules of thousands of micro-batches it then walks at fewer, :func:`steady_microbatches`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule '{name}': use {', '.join(SCHEDULES)}")
    if v != 1 and name not in VIRTUAL:
        raise ValueError(f"{name}: {needs_virtual_schedule(v)}")
    if name == "interleaved":
        _check_interleaved(pp, m, v)
    elif name in V_SHAPED:
        _check_v_shape(name, pp, m, v)
    else:
        _check_microbatches(name, pp, m)


# From this many micro-batches per stage on, a schedule's steady state repeats (:func:`steady_microbatches`).
STEADY_MICROBATCHES_PER_STAGE = 4


def steady_microbatches(name: str, pp: int, m: int) -> int:
    """A micro-batch count whose schedule holds what ``m``'s holds and idles as long: every schedule but
    ``gpipe`` fills the pipeline, repeats one steady-state pattern (each rank busy, the same micro-batches
    of each stage held) and drains it, so past 4 pp micro-batches (a multiple of interleaved's group of
    pp; a V's and dualpipev's fill and drain end within 3 pp + 1) more only repeat that pattern:
    ``min(m, 4 pp)``. ``gpipe`` holds all of them: ``m``. The layout search walks and simulates that
    count instead of thousands (``tests/test_pipeline_schedules.py`` holds both to the full schedule's)."""
    return m if name == "gpipe" else min(m, STEADY_MICROBATCHES_PER_STAGE * pp)


@functools.lru_cache(maxsize=8)
def built_schedule(name: str, pp: int, m: int, v: int = 1) -> tuple[tuple[Entry, ...], ...]:
    """:func:`build_schedule`, read-only and kept: the layout search checks, simulates and walks each
    schedule of a mesh shape several times (every checkpointing mode; thousands of micro-batches at
    a large batch over few data-parallel ranks), one shape after another."""
    return tuple(tuple(entries) for entries in build_schedule(name, pp, m, v))


def split_backwards(entries: list[Entry]) -> set[tuple[int, int]]:
    """(stage, mb) whose backward is split: the ``B`` computes input gradients only."""
    return {(s.stage, s.mb) for s in entries if isinstance(s, Action) and s.kind == W}


_Part = TypeVar("_Part")


def runs_backward_whole(
    parts: Iterable[_Part], checkpointed: Callable[[_Part], bool], compiled: Callable[[_Part], bool]
) -> bool:
    """Whether a stage made of ``parts`` runs each backward whole at ``B`` even where its schedule splits it
    into ``B`` and ``W`` (the executor's ``unsplit``): it does when any part is checkpointed or compiled.

    Splitting would cost those parts their backward twice: a checkpointed one replays its forward once per
    restarted ``W`` pass, and a compiled one is one fused backward node (input and weight gradients
    together) that ``B`` and ``W`` would each run. The rule's one owner: the pipelined runner asks it of a
    chunk's modules, the planner (``plan/moments.py: unsplit_stages``) of a stage's layers under a recipe.
    """
    return any(checkpointed(part) or compiled(part) for part in parts)


def peak_in_flight(entries: list[Entry]) -> int:
    """Most forwards whose backward has not run yet on one rank: the activations it must keep.

    A split backward keeps them until its ``W`` (the weight gradients need the layer inputs).

    With virtual stages each counts one chunk's activations (a ``1/v`` share of the rank's layers).
    """
    return max((live for live, _ in held_counts(entries)), default=0)


def held_counts(entries: list[Entry], unsplit: Collection[int] = ()) -> Iterator[tuple[int, int]]:
    """After each action of one rank: (forwards whose activations are still held, of them the split
    backwards whose ``B`` ran and whose ``W`` has not, which also hold the gradients ``W`` restarts
    from). ``unsplit`` stages run the whole backward at ``B`` (the executor's ``unsplit``)."""
    for _, held in held_by_stage(entries, unsplit):
        yield sum(live for live, _ in held.values()), sum(waiting for _, waiting in held.values())


def held_by_stage(
    entries: list[Entry], unsplit: Collection[int] = ()
) -> Iterator[tuple[int, dict[int, tuple[int, int]]]]:
    """:func:`held_counts` per stage: after each action, (its index in ``entries``, {stage: (held,
    waiting)}). A rank's chunks hold different tensors (the last stage its loss's, the first stage's
    split backward no recorded gradients), so the memory model weighs each stage's count."""
    split = {key for key in split_backwards(entries) if key[0] not in unsplit}
    live: dict[int, int] = {}
    waiting: dict[int, int] = {}
    for index, entry in enumerate(entries):
        if isinstance(entry, Action) and not (entry.kind == W and (entry.stage, entry.mb) not in split):
            split_b = entry.kind == B and (entry.stage, entry.mb) in split
            frees = entry.kind == W or (entry.kind == B and not split_b)
            s = entry.stage
            live[s] = live.get(s, 0) + (1 if entry.kind == F else -1 if frees else 0)
            waiting[s] = waiting.get(s, 0) + (1 if split_b else -1 if entry.kind == W else 0)
            yield index, {t: (live[t], waiting.get(t, 0)) for t in live}


def last_weight_passes(entries: list[Entry]) -> dict[int, int]:
    """{stage: index in ``entries`` of its last weight-gradient pass (a ``W``, or a ``B`` without one)}:
    where the executor releases the stage's FSDP units, whose gradients are complete only then."""
    split = split_backwards(entries)
    return {
        entry.stage: i
        for i, entry in enumerate(entries)
        if isinstance(entry, Action) and (entry.kind == W or (entry.kind == B and (entry.stage, entry.mb) not in split))
    }
