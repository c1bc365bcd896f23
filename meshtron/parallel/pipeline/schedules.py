"""Pipeline schedules as data: per pp-rank ordered lists of compute actions and p2p batches.

Vocabulary. The model is cut into ``pp * v`` chunks (global *stages*, see ``split.py``); stage
``s`` runs on pp-rank ``s % pp``. A schedule is ``list[list[Step]]``: for every pp-rank the steps
it executes in order. A step is either

* an :class:`Action` of kind ``F`` (forward of ``stage`` on microbatch ``mb``) or ``B`` (its
  backward), or
* a :class:`P2P` batch: point-to-point ops (``Action`` of kind ``SEND_F``, ``RECV_F``, ``SEND_B``,
  ``RECV_B``) that the executor posts together in one ``batch_isend_irecv`` and waits for
  before the next step.

Tensor roles (``peer`` is the other side's rank in pp-group coordinates):

* ``SEND_F(s, i)``: the output activation of ``F(s, i)``, to the rank of stage ``s + 1``;
* ``RECV_F(s, i)``: the input activation of ``F(s, i)``, from the rank of stage ``s - 1``;
* ``SEND_B(s, i)``: the gradient w.r.t. the input of stage ``s``, to the rank of stage ``s - 1``;
* ``RECV_B(s, i)``: the gradient w.r.t. the output of stage ``s``, from the rank of stage ``s + 1``.

So ``SEND_F(s, i)`` pairs with ``RECV_F(s + 1, i)`` and ``SEND_B(s, i)`` with ``RECV_B(s - 1, i)``.

Matching and deadlock-freedom. Backends match p2p messages between a pair of ranks in posting
order (NCCL ignores tags), so for every directed pair (src, dst) the sequence of sends on src
must equal the sequence of receives on dst (``simulate.match_p2p`` verifies it); an executor
must post a batch's ops in their list order. A batch is modelled as *rendezvous*: it completes
only once every op in it has met its partner op (a send may wait until the peer posts the
receive, as NCCL's grouped p2p can). A schedule that finishes under this model also finishes
when sends complete without waiting for the receiver, because that can only make batches
complete earlier. :func:`simulate` runs the model and raises on
deadlock; the tests run every schedule through it.

Batching rule. A rank's compute steps are grouped into *slots*; the batch between two slots
holds the sends of the slot before and the receives of the slot after. GPipe and 1F1B use one
compute step per slot (Megatron's ``send_forward_recv_backward`` and friends). The interleaved
schedule's steady-state slot is a forward followed by a backward with no p2p in between (as in
Megatron), so its batches carry up to two sends and two receives. This matters: with a batch
between that forward and backward, every rank can block in ``{SEND_B to previous, RECV_F from
previous}`` while its previous rank blocks in the same kind of batch, a cycle around the ring
of virtual stages (the simulator finds it for pp=2, 4, 8 with v=2, and gloo hangs on it).
"""

from __future__ import annotations

from dataclasses import dataclass

F, B = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"


@dataclass(frozen=True)
class Action:
    """One compute action or one p2p op (see the module doc for the tensor roles)."""

    kind: str
    mb: int
    stage: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.kind}(s{self.stage},mb{self.mb}){peer}"


@dataclass(frozen=True)
class P2P:
    """p2p ops posted together in one batch and all waited for before the next step."""

    ops: tuple[Action, ...]

    def __str__(self) -> str:
        return "P2P[" + " ".join(str(op) for op in self.ops) + "]"


Step = Action | P2P
Schedule = list[list[Step]]


def _check_microbatches(name: str, pp: int, m: int) -> None:
    if pp < 1:
        raise ValueError(f"{name}: pp must be >= 1, got {pp}")
    if m < pp:
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


def _recvs_before(a: Action, pp: int, num_stages: int) -> list[Action]:
    if a.kind == F and a.stage > 0:
        return [Action(RECV_F, a.mb, a.stage, (a.stage - 1) % pp)]
    if a.kind == B and a.stage < num_stages - 1:
        return [Action(RECV_B, a.mb, a.stage, (a.stage + 1) % pp)]
    return []


def _sends_after(a: Action, pp: int, num_stages: int) -> list[Action]:
    if a.kind == F and a.stage < num_stages - 1:
        return [Action(SEND_F, a.mb, a.stage, (a.stage + 1) % pp)]
    if a.kind == B and a.stage > 0:
        return [Action(SEND_B, a.mb, a.stage, (a.stage - 1) % pp)]
    return []


def _with_p2p(slots: list[list[Action]], pp: int, num_stages: int) -> list[Step]:
    """Interleave one rank's compute ``slots`` with p2p batches.

    The batch between two slots holds the sends of the slot before and the receives of the
    slot after, so neighbours meet in matching batches.
    """
    steps: list[Step] = []
    before: list[Action] = []
    for slot in slots:
        ops = [op for a in before for op in _sends_after(a, pp, num_stages)]
        ops += [op for a in slot for op in _recvs_before(a, pp, num_stages)]
        if ops:
            steps.append(P2P(tuple(ops)))
        steps += slot
        before = slot
    tail = [op for a in before for op in _sends_after(a, pp, num_stages)]
    if tail:
        steps.append(P2P(tuple(tail)))
    return steps


def gpipe(pp: int, m: int) -> Schedule:
    """All forwards, then all backwards: ``m`` microbatches of activations live at the peak."""
    _check_microbatches("gpipe", pp, m)
    return [_with_p2p(_gpipe_slots(m, r), pp, pp) for r in range(pp)]


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): ``pp - rank - 1`` warmup forwards, then alternate F and B."""
    _check_microbatches("1f1b", pp, m)
    return [_with_p2p(_one_f_one_b_slots(pp, m, r), pp, pp) for r in range(pp)]


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B over ``v`` virtual stages (model chunks) per rank.

    Needs ``pp >= 2``, ``v >= 1`` and ``m`` a multiple of ``pp`` (microbatches enter each chunk
    in groups of ``pp``).
    """
    name = "interleaved"
    if v < 1:
        raise ValueError(f"{name}: virtual_stages must be >= 1, got {v}")
    if pp < 2:
        raise ValueError(f"{name}: interleaving needs pp >= 2, got pp = {pp}; use schedule = '1f1b'.")
    _check_microbatches(name, pp, m)
    if m % pp:
        lower, upper = m - m % pp, m + pp - m % pp
        raise ValueError(
            f"{name}: microbatches = {m} is not a multiple of pp = {pp}; the interleaved schedule "
            f"feeds each chunk microbatches in groups of pp: use microbatches = {lower} or {upper}."
        )
    return [_with_p2p(_interleaved_slots(pp, m, v, r), pp, pp * v) for r in range(pp)]


def build_schedule(name: str, pp: int, m: int, v: int = 1) -> Schedule:
    """Schedule by its recipe name (``gpipe`` | ``1f1b`` | ``interleaved``)."""
    if v != 1 and name != "interleaved":
        raise ValueError(f"{name}: virtual_stages = {v} needs schedule = 'interleaved'")
    if name == "gpipe":
        return gpipe(pp, m)
    if name == "1f1b":
        return one_f_one_b(pp, m)
    if name == "interleaved":
        return interleaved_1f1b(pp, m, v)
    raise ValueError(f"unknown pipeline schedule '{name}': use gpipe, 1f1b or interleaved")


def peak_in_flight(steps: list[Step]) -> int:
    """Most forwards whose backward has not run yet on one rank: the activations it must keep.

    With virtual stages each counts one chunk's activations (a ``1/v`` share of the rank's layers).
    """
    live = peak = 0
    for step in steps:
        if isinstance(step, Action):
            live += 1 if step.kind == F else -1
            peak = max(peak, live)
    return peak
