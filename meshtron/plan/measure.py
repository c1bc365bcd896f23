"""Measurements the planner is checked against (CPU is fine): bytes autograd saves for backward, the
matmul FLOPs a pass runs."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from meshtron.parallel.recompute import ATTENTION, MATMULS
from meshtron.torch_private import TorchDispatchMode, pytree

_ADDMM = (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)  # the reduced width is their 2nd argument's


def saved_tensor_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs, leaving out ``exclude``
    (parameters: they are saved by reference, not copied). Views of one storage count once."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def kept_tensor_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the storages that ops create while ``fn()`` runs and that are still alive once it has
    returned, besides its result's and ``exclude``'s: what the autograd graph keeps for backward,
    whoever keeps it (autograd's saved tensors, or a selective checkpoint's cache of op outputs, which
    ``saved_tensor_bytes`` cannot see: the checkpoint's own hooks take those tensors first)."""
    created: list[tuple[StorageWeakRef, int, int]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    created.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
            return out

    with Record():
        result = fn()
    skip = {
        t.untyped_storage().data_ptr() for t in [*pytree.tree_leaves(result), *exclude] if isinstance(t, torch.Tensor)
    }
    gc.collect()
    alive = {ptr: size for ref, ptr, size in created if not ref.expired() and ptr not in skip}
    return sum(alive.values())


class MatmulFlops(TorchDispatchMode):
    """The FLOPs of the matmuls (``recompute.MATMULS``) run while entered: 2 x output elements x the
    reduced width; and the calls of attention's forward kernels (``recompute.ATTENTION``)."""

    def __init__(self):
        super().__init__()
        self.flops = 0.0
        self.attention_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            self.flops += 2 * out.numel() * (args[1] if func in _ADDMM else args[0]).shape[-1]
        self.attention_calls += func in ATTENTION
        return out
