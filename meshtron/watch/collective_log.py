"""The last collectives each rank issued and how long it waited in them: the hang report's evidence and
the straggler metric's clock.

One thin wrapper around each c10d and functional collective (installed once per process by :func:`install`)
records every call and when it completes. :meth:`CollectiveLog.waited` is the union of the intervals this
process spent inside them, not their sum: a rank's step time less that is its own work. See
docs/failures.md (the hang report) and docs/training.md (stragglers).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from meshtron.torch_private import default_group, funcol, resolve_group

LOG_SIZE = 32

# c10d functions that communicate; whichever of them this torch has are wrapped (names vary by version).
_C10D_OPS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
)
_FUNCOL_OPS = (
    "all_reduce",
    "all_gather_tensor",
    "all_gather_single",
    "all_gather_tensor_autograd",
    "all_gather_single_autograd",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor_autograd",
    "reduce_scatter_single_autograd",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "permute_tensor",
    "broadcast",
)
_P2P = {"send", "recv", "isend", "irecv"}


@dataclass
class Entry:
    seq: int  # this rank's count of collectives, this one included
    group_seq: int  # this rank's count of collectives on this group, this one included
    op: str
    group: tuple[int, ...]  # the group's global ranks
    tensors: tuple  # (shape, dtype) of the first tensors passed, formatted only for the report
    started: float  # time.monotonic() when issued
    peers: str = ""  # a p2p call's peers, e.g. "send to 3, recv from 1"
    state: str = "issued"
    pending: int = 1  # Work objects of the call not yet waited for

    def line(self, now: float) -> str:
        age = f"{now - self.started:.1f} s ago"
        which = f"({self.peers})" if self.peers else f"(its #{self.group_seq})"
        return (
            f"#{self.seq:<6d} {self.op:<26s} group {_ranks_text(self.group)} {which} "
            f"{_tensors_text(self.tensors):<32s} {self.state} (issued {age})"
        )


class CollectiveLog:
    """This process's record (one per process: collectives of every thread land here)."""

    def __init__(self, size: int = LOG_SIZE):
        self.entries: deque[Entry] = deque(maxlen=size)
        self.counts: dict[tuple[int, ...], int] = {}  # group ranks -> collectives issued on it (p2p excluded)
        self.issued = 0
        self._waited = 0.0  # seconds in which some thread was inside a collective, up to ``_since``
        self._inside = 0  # collective calls and waits in progress, over threads and nesting
        self._since = 0.0  # perf_counter() when ``_inside`` last rose from 0
        self._pending: dict[int, Entry] = {}  # id(Work) or id(tensor awaiting wait_tensor) -> entry
        self._lock = threading.Lock()

    def issue(self, op: str, group: tuple[int, ...], tensors: tuple, peers: str = "") -> Entry:
        with self._lock:
            self.issued += 1
            key = group if op not in _P2P else None
            count = self.counts.get(key, 0) + 1 if key is not None else 0
            if key is not None:
                self.counts[key] = count
            entry = Entry(self.issued, count, op, group, tensors, time.monotonic(), peers)
            if len(self.entries) == self.entries.maxlen:
                self._forget(self.entries[0])
            self.entries.append(entry)
            return entry

    def _forget(self, entry: Entry) -> None:
        for key in [k for k, e in self._pending.items() if e is entry]:
            del self._pending[key]

    def await_(self, handle: object, entry: Entry) -> None:
        """``entry`` completes when ``handle`` (a Work, or a tensor of a functional collective) is waited for."""
        with self._lock:
            self._pending[id(handle)] = entry

    def waited_on(self, handle: object) -> None:
        with self._lock:
            entry = self._pending.pop(id(handle), None)
            if entry is not None:
                entry.pending -= 1
                if entry.pending <= 0:
                    entry.state = "completed"

    def completed(self, entry: Entry) -> None:
        with self._lock:
            entry.state = "completed"

    def enter(self) -> None:
        """A collective call or wait begins (pair with :meth:`leave` in a ``finally``)."""
        with self._lock:
            if not self._inside:
                self._since = time.perf_counter()
            self._inside += 1

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1
            if not self._inside:
                self._waited += time.perf_counter() - self._since

    def waited(self) -> float:
        """Seconds (``time.perf_counter``) in which this process was inside a collective, a wait in
        progress included: between two reads it grows by at most the time between them."""
        with self._lock:
            return self._waited + (time.perf_counter() - self._since if self._inside else 0.0)

    def snapshot(self) -> tuple[list[Entry], dict[tuple[int, ...], int]]:
        """A consistent copy for another thread (the watchdog) to read."""
        with self._lock:
            return [Entry(**vars(e)) for e in self.entries], dict(self.counts)


LOG = CollectiveLog()
_originals: dict[tuple[object, str], object] = {}
_active = threading.local()  # depth of wrapped calls: a collective built from others is recorded once
_ranks_cache: dict[object, tuple[int, ...]] = {}


def install() -> None:
    """Wrap torch.distributed's collectives so that :data:`LOG` records them (idempotent)."""
    if _originals:
        return
    for name in _C10D_OPS:
        if hasattr(c10d, name):
            _patch_c10d(name)
    for name in _FUNCOL_OPS:
        if hasattr(funcol, name):
            _patch(funcol, name, _recording(getattr(funcol, name), name, functional=True))
    _patch(funcol, "wait_tensor", _timed_wait_tensor(funcol.wait_tensor))
    _patch(c10d.Work, "wait", _timed_work_wait(c10d.Work.wait))


def uninstall() -> None:
    """Restore the unwrapped functions (for A/B measurements of the recording's cost)."""
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()


def _patch(owner: object, name: str, wrapper) -> None:
    _originals[(owner, name)] = getattr(owner, name)
    setattr(owner, name, wrapper)


def _patch_c10d(name: str) -> None:
    original = getattr(c10d, name)
    wrapper = _recording(original, name)
    _patch(c10d, name, wrapper)
    if getattr(dist, name, None) is original:  # torch.distributed re-exports most of them
        _patch(dist, name, wrapper)


def _recording(fn, op: str, functional: bool = False):
    group_of = _arguments(fn)

    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling() or getattr(_active, "depth", 0):
            return fn(*args, **kwargs)
        entry = LOG.issue(op, *group_of(args, kwargs, op))
        _active.depth = 1
        LOG.enter()
        try:
            out = fn(*args, **kwargs)
        finally:
            LOG.leave()
            _active.depth = 0
        _track(entry, out, functional)
        return out

    wrapper.__wrapped__ = fn
    wrapper.__name__ = fn.__name__
    return wrapper


def _track(entry: Entry, out, functional: bool) -> None:
    """Blocking calls complete now; asynchronous ones when their Work or tensor is waited for."""
    if functional:
        if isinstance(out, funcol.AsyncCollectiveTensor):
            LOG.await_(out.elem, entry)
        else:
            LOG.completed(entry)  # waited inside the call
        return
    works = out if isinstance(out, list) else [out]
    works = [w for w in works if isinstance(w, c10d.Work)]
    if not works:
        LOG.completed(entry)
        return
    entry.pending = len(works)
    for work in works:
        LOG.await_(work, entry)


def _timed_work_wait(wait):
    def timed(self, *args, **kwargs):
        LOG.enter()
        try:
            return wait(self, *args, **kwargs)
        finally:
            LOG.leave()
            LOG.waited_on(self)

    return timed


def _timed_wait_tensor(wait_tensor):
    def timed(tensor):
        if torch.compiler.is_compiling():
            return wait_tensor(tensor)
        LOG.enter()
        try:
            return wait_tensor(tensor)
        finally:
            LOG.leave()
            LOG.waited_on(tensor)

    return timed


# ---------------------------------------------------------------- what a call communicates with


def _arguments(fn):
    """(args, kwargs, op) -> (group ranks, shapes, p2p peers) for ``fn``, its arguments read by position: a per-call
    ``inspect.signature(...).bind`` would cost more than the rest of the recording."""
    params = list(inspect.signature(fn).parameters)
    group_at = params.index("group") if "group" in params else None
    peer_at = next((params.index(p) for p in ("dst", "src") if p in params), None)

    def group_of(args, kwargs, op):
        if op == "batch_isend_irecv":
            return _p2p_batch(args[0] if args else kwargs["p2p_op_list"])
        group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
        ranks = _group_ranks(group)
        if op in _P2P:
            peer = kwargs.get(params[peer_at], args[peer_at] if len(args) > peer_at else None)
            return ranks, _tensors(args[:1]), f"{'send to' if op in ('send', 'isend') else 'recv from'} {peer}"
        return ranks, _tensors(args[:2] or list(kwargs.values())[:2]), ""

    return group_of


def _p2p_batch(ops) -> tuple[tuple[int, ...], str, str]:
    moves = [f"{'send to' if 'send' in op.op.__name__ else 'recv from'} {op.peer}" for op in ops]
    group = _group_ranks(ops[0].group) if ops else ()
    return group, _tensors([op.tensor for op in ops[:1]]), ", ".join(moves)


def _group_ranks(group) -> tuple[int, ...]:
    """Global ranks of a ProcessGroup, (DeviceMesh, dim), DeviceMesh or group name; cached."""
    key = id(group) if not isinstance(group, tuple) else (id(group[0]), group[1])
    ranks = _ranks_cache.get(key)
    if ranks is None:
        ranks = tuple(dist.get_process_group_ranks(_process_group(group)))
        _ranks_cache[key] = ranks
    return ranks


def _process_group(group):
    from torch.distributed.device_mesh import DeviceMesh

    if group is None:
        return default_group()
    if isinstance(group, tuple):
        return group[0].get_group(group[1])
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if isinstance(group, str):
        return resolve_group(group)
    return group


def _tensors(values) -> tuple:
    tensors = [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]
    return tuple((tuple(t.shape), t.dtype) for t in tensors[:2])


def _tensors_text(tensors: tuple) -> str:
    if not tensors:
        return ""
    return " ".join(str(list(shape)) for shape, _ in tensors) + f" {str(tensors[0][1]).removeprefix('torch.')}"


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}-{ranks[-1]}]"
    return "[" + ",".join(map(str, ranks)) + "]"


__all__ = ["LOG", "LOG_SIZE", "CollectiveLog", "Entry", "install", "uninstall"]
