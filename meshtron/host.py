"""Values the training step reads on the host, and what a dry run assumes in their place.

A dry run executes the real step on fake tensors, which have no values, so every place where the step turns
device values into host numbers asks :func:`simulating` and uses the assumption stated here instead (routing,
document starts, completed sends, ...). See docs/planner.md, 'Dry run at real scale'.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from meshtron.torch_private import fake_tensor_mode_class
from meshtron.watch.syncs import Sync, record

_fake_mode = None  # the dry run's FakeTensorMode, while one runs
_routing = "balanced"  # the dry run's assumption of how the routers spread token copies
ROUTINGS = ("balanced", "skewed")


def simulating() -> bool:
    """True inside :func:`simulated`: tensors are fake and hold no values to read."""
    return _fake_mode is not None


@contextlib.contextmanager
def simulated(routing: str = "balanced") -> Iterator[None]:
    """A dry run: :func:`fake_tensors` allocates fake tensors (shapes, dtypes, devices; no storage);
    MoE routers are assumed to spread token copies as ``routing`` (:data:`ROUTINGS`) says."""
    FakeTensorMode = fake_tensor_mode_class()
    global _fake_mode, _routing
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    previous, _fake_mode = _fake_mode, FakeTensorMode(allow_non_fake_inputs=True)
    previous_routing, _routing = _routing, routing
    try:
        yield
    finally:
        _fake_mode, _routing = previous, previous_routing


def fake_tensors() -> contextlib.AbstractContextManager:
    """Where tensors are allocated: fake ones in a dry run, real ones otherwise. Meshes are built and
    sliced outside it (a mesh's rank table must hold real values)."""
    return _fake_mode if _fake_mode is not None else contextlib.nullcontext()


class KeptReads:
    """The host reads of one call of a checkpointed block, kept by its forward (:meth:`keeping`) for its
    recomputations in backward (:meth:`replaying`): a recomputation replays the same tokens through the
    same routing (same inputs, same RNG state), so the values it would read are those the forward read,
    and reading them again would wait for the device a second time (per MoE layer)."""

    def __init__(self):
        self.values: list = []

    @contextlib.contextmanager
    def keeping(self) -> Iterator[None]:
        global _kept
        outer, _kept = _kept, self.values
        try:
            yield
        finally:
            _kept = outer

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        global _replayed
        outer, _replayed = _replayed, iter(self.values)  # each recomputation reads from the first again
        try:
            yield
        finally:
            _replayed = outer


_kept: list | None = None  # where a checkpointed forward keeps its reads (KeptReads.keeping)
_replayed: Iterator | None = None  # what a recomputation takes in their place (KeptReads.replaying)


def _kept_for_recomputation(read: Callable) -> Callable:
    """``read`` kept by a checkpointed forward and answered from that in its recomputation (:class:`KeptReads`)."""

    @functools.wraps(read)
    def kept_or_read(*args):
        if _replayed is not None:
            return next(_replayed)
        values = read(*args)
        if _kept is not None:
            _kept.append(values)
        return values

    return kept_or_read


@_kept_for_recomputation
def split_sizes(sizes: torch.Tensor, assumed: Callable[[str], list[int]]) -> list[int]:
    """Host ints of the 1-D ``sizes`` (split sizes of uneven collectives): the one device-to-host read
    of the expert dispatch. A dry run has no values and takes ``assumed(routing)``, the sizes under its
    routing: ``balanced`` (every expert gets as many copies, see :func:`even_split`) or ``skewed`` (every
    rank sends all its copies to the first ep rank's experts: the most any rank can receive, since
    capacity drops copies only after computing them). A real run never calls ``assumed``."""
    if simulating():
        record("tolist")  # the real step's read, counted where it is made
        return list(assumed(_routing))
    return sizes.tolist()


@_kept_for_recomputation
def document_starts(bounds: torch.Tensor) -> list[list[int]]:
    """Host ints of ``bounds`` ``[2, chunks]``, the earliest and latest document start of each local query
    chunk: the one host read of context parallelism over packed documents. A dry run's batch is one
    document per window (its ``position_ids`` are each window's ``0 .. S - 1``, as without document
    masks), so every document starts at 0: every causal block runs, none needs a mask."""
    if simulating():
        record("tolist")  # the real step's read, counted where it is made
        return [[0] * bounds.shape[1]] * 2
    return bounds.tolist()


def declared(sync: Sync) -> bool:
    """Whether a host sync of the training step is one this module declares: the step may read the
    device only through it (the log step's reads of loss and grad norm come after the step), or one of
    torch's own that :data:`TORCH_WAITS` names."""
    return sync.where.startswith(__file__) or any(_torch_wait(sync, *wait) for wait in TORCH_WAITS)


def _torch_wait(sync: Sync, place: str, function: str, op: str) -> bool:
    """Whether ``sync`` is the wait ``op`` torch makes in ``function`` of its file ``place`` (any line: the
    line moves between torch versions, the function and the op do not)."""
    return sync.op == op and sync.where.startswith(place) and sync.where.endswith(function)


# (file, function, op) of the waits torch makes on the step's behalf, each with [parallel] offload =
# "optimizer" (FSDP2's CPUOffloadPolicy, pinned host memory):
TORCH_WAITS = (
    # At the end of backward FSDP2 waits for each gradient's copy to the host, which the host's optimizer
    # step reads (one wait for the device; the rest find their copies done).
    ("torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "in finalize_backward", "Event.synchronize"),
    # Each micro-batch after the first: FSDP2 accumulates the micro-batch's reduce-scattered gradient shard
    # into the gradient already on the host, and the host's add needs the shard there first, so foreach_reduce
    # copies it device-to-host blocking (non_blocking only when nothing accumulates): one wait per parameter.
    # meshtron.plan.speed.accumulation_seconds costs it (exposed, not hidden behind compute).
    ("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "in foreach_reduce", "_to_copy"),
)


def copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. With ``[parallel] offload = "optimizer"`` the step's values that cross between
    the device and the host's optimizer come here (its skip flag and clipping coefficient, the host's
    gradient sums for the norm's all-reduce): each such copy waits for the device. On one device: ``t``."""
    return t.to(device)


def even_split(total: int, peers: int) -> list[int]:
    """``total`` rows spread evenly over ``peers`` (the first take the remainder)."""
    return [total // peers + (i < total % peers) for i in range(peers)]


__all__ = [
    "ROUTINGS",
    "TORCH_WAITS",
    "KeptReads",
    "completed",
    "copy_to",
    "declared",
    "document_starts",
    "even_split",
    "fake_tensors",
    "simulated",
    "simulating",
    "split_sizes",
]


def completed(work) -> bool:
    """Whether a posted p2p send is done, so its tensor can be freed. A fake process group's works never
    report completion; a device's send completes once its peer has received it, which the pipeline
    schedules post in the same slot: a dry run assumes it done by the next exchange (else it would hold
    every send of the step, which a real stage frees as it goes: docs/planner.md)."""
    return simulating() or work.is_completed()
