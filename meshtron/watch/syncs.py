"""Count host syncs of a piece of work on any device, the CPU included.

A GPU step is fast when the host never waits for the device; ``torch.cuda.set_sync_debug_mode`` catches the
waits on CUDA only, so :class:`HostSyncCounter` records value reads, data-dependent output sizes and host/device
copies from the dispatcher and CPU tests can assert a step has none. See docs/benchmarks.md, 'Performance on GPUs'.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from meshtron.torch_private import LOCAL_SCALAR_DENSE, TO_COPY, UNIQUE2, TorchDispatchMode

aten = torch.ops.aten

_READS = {LOCAL_SCALAR_DENSE, aten.equal}
_DATA_DEPENDENT = {aten.nonzero, aten.masked_select, UNIQUE2, aten.unique_dim, aten.unique_consecutive, aten.bincount}
_MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_}
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy}  # no dispatched op on a CPU tensor


@dataclass(frozen=True)
class Sync:
    op: str  # the op or method that waits for the device
    where: str  # the innermost caller outside torch ("file:line in function")


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _masked_fill(packet, args) -> bool:
    """``t[mask] = scalar``: with one mask and a one-element host value (Python scalars stay on the
    host for CUDA tensors) ATen runs ``masked_fill_``, which needs no sizes from the device."""
    if packet is aten.index:
        return False
    indices, value = [t for t in args[1] if t is not None], args[2]
    accumulate = len(args) > 3 and args[3]
    return len(indices) == 1 and value.numel() == 1 and value.device.type == "cpu" and not accumulate


def _device_of(t) -> torch.device | None:
    return t.device if isinstance(t, torch.Tensor) else None


def _waits(func, args, kwargs) -> bool:
    packet = func.overloadpacket
    if packet in _READS or packet in _DATA_DEPENDENT:
        return True
    if packet is aten.repeat_interleave:
        return func is not aten.repeat_interleave.self_int and kwargs.get("output_size") is None
    if packet in _MASK_INDEXED:
        return any(_is_mask(t) for t in (args[1] or ())) and not _masked_fill(packet, args)
    if packet is TO_COPY:  # a non-blocking copy to the host lands in pinned memory torch allocates for it
        return _copy_waits(_device_of(args[0]), kwargs.get("device"), kwargs.get("non_blocking", False), True)
    if packet is aten.copy_:
        return _copy_waits(_device_of(args[1]), _device_of(args[0]), kwargs.get("non_blocking", False))
    return False


def _copy_waits(source, target, non_blocking: bool, pinned_result: bool = False) -> bool:
    """Whether a copy waits for the device: one to the host unless it is non-blocking into pinned memory
    (then the wait is the reader's synchronize, counted there), one to the device unless non-blocking."""
    if source is None or target is None or torch.device(target) == source:
        return False
    if torch.device(target).type == "cpu":
        return not (non_blocking and pinned_result)
    return not non_blocking


# Files that wait on the host's behalf, not where a wait is asked for: this one, and those that name
# themselves with :func:`not_a_caller` (the dry run's tracer, its CUDA stand-ins, its collective checks).
_NOT_CALLERS = {__file__}


def not_a_caller(path: str) -> None:
    """Leave the frames of file ``path`` (a module's ``__file__``) out of :func:`call_site`."""
    _NOT_CALLERS.add(path)


def call_site() -> str:
    """The innermost frame outside torch and :data:`_NOT_CALLERS` (``file:line in function``): where a
    sync, or a collective, was asked for. Where torch asks on its own, from a callback the autograd engine
    runs (FSDP2's end of backward), its own innermost frame outside its dispatch machinery, named from
    ``torch/``."""
    stack = [frame for frame in reversed(traceback.extract_stack()) if frame.filename not in _NOT_CALLERS]
    for frame in stack:
        if "/torch/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    for frame in stack:
        inside = frame.filename[frame.filename.rindex("/torch/") + 1 :]
        if not inside.startswith(("torch/_", "torch/utils/")):
            return f"{inside}:{frame.lineno} in {frame.name}"
    return "?"


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _waits(func, args, kwargs):
            self.counter._record(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)


class _MethodRecorder(TorchFunctionMode):
    """``tolist``/``numpy`` read a CPU tensor's memory directly, without any op the dispatcher sees."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _HOST_READS:
            return func(*args, **kwargs)
        self.counter._record(func.__name__)
        with self.counter._muted():  # on a GPU the same read also copies to the host: count it once
            return func(*args, **kwargs)


_active: list[HostSyncCounter] = []  # the counters entered, innermost last


def record(op: str) -> None:
    """A host sync no dispatched op shows: a wait for the device (``torch.cuda.synchronize``) or, in a dry
    run, a read :mod:`meshtron.host` answers with its assumption where a real step reads the device.
    Recorded by every counter entered."""
    for counter in _active:
        counter._record(op)


class HostSyncCounter:
    """Context manager recording every host sync (docs/benchmarks.md lists the kinds) issued inside it.

    ``syncs``: the :class:`Sync` records in order; ``count``: how many. Works with DTensor, FSDP2
    and autograd (the backward's ops are recorded when ``backward()`` runs inside the block).

    ``methods=False`` leaves out the reads of host memory no op shows (``tolist``, ``numpy``), for work on
    fake tensors (a dry run): a fake tensor's ``tolist`` reaches the dispatcher as ``_local_scalar_dense``
    (its ``numpy`` fails outright), and the torch-function mode that sees the methods costs CPU on every torch
    call of the traced step.
    """

    def __init__(self, methods: bool = True):
        self.syncs: list[Sync] = []
        self._mute = 0
        self._modes = ((_MethodRecorder(self),) if methods else ()) + (_DispatchRecorder(self),)

    @property
    def count(self) -> int:
        return len(self.syncs)

    def by_op(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for sync in self.syncs:
            counts[sync.op] = counts.get(sync.op, 0) + 1
        return counts

    def _record(self, op: str) -> None:
        if not self._mute:
            self.syncs.append(Sync(op, call_site()))

    @contextlib.contextmanager
    def _muted(self):
        self._mute += 1
        try:
            yield
        finally:
            self._mute -= 1

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def __str__(self) -> str:
        return f"{self.count} host syncs" + "".join(f"\n  {s.op} at {s.where}" for s in self.syncs)


@contextlib.contextmanager
def no_host_syncs(device: torch.device, enabled: bool = True):
    """``torch.cuda.set_sync_debug_mode("error")`` for the block: any host sync raises (CUDA only;
    :class:`HostSyncCounter` is the check that runs everywhere)."""
    if device.type != "cuda" or not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
