"""Measurements the memory model is checked against (CPU is fine): bytes autograd saves for backward."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


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
