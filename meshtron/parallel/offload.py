"""Activation offload (``[parallel] offload_activations``): each block's saved-for-backward tensors in
host memory between its forward and its backward (a memory/transfer trade, not a mesh dimension).

``saved_tensors_hooks`` hand every tensor a block's forward saves to :meth:`BlockOffload.pack`, which keeps a
host copy (one per storage, :class:`_HostCopy`); :class:`CopiesInFlight` holds the device tensors the copies
read until the next offloaded block's forward ends or a backward needs a copy back. Copies change no value.
See docs/training.md#host-memory-offload.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from meshtron.parallel.recompute import is_checkpointed
from meshtron.torch_private import dtensor_local, view_base


class CopiesInFlight:
    """The device tensors whose asynchronous copies to the host (CUDA) may still be reading them, per
    block, with the event after its last copy; shared by a model's :class:`BlockOffload` s."""

    def __init__(self):
        self.blocks: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []

    def hold(self, copied: torch.cuda.Event, tensors: list[torch.Tensor]) -> None:
        """A block's forward has ended: release the blocks before it, hold its own ``tensors``."""
        self.release()
        self.blocks.append((copied, tensors))

    def release(self) -> None:
        """Let every held tensor go once the compute stream has waited for its copy."""
        for copied, _ in self.blocks:
            torch.cuda.current_stream().wait_event(copied)
        self.blocks.clear()


class _HostCopy:
    """A span of one device storage's elements copied to the host, shared by every saved view inside it
    (a norm's output, its flattened view one projection saves and the one another saves: one copy)."""

    def __init__(
        self,
        start: int,
        end: int,
        dtype: torch.dtype,
        device: torch.device,
        host: torch.Tensor,
        copied: torch.cuda.Event | None,
    ):
        self.start, self.end, self.dtype, self.device, self.host, self.copied = start, end, dtype, device, host, copied
        self.back: weakref.ref | None = None  # its copy on the device while a backward uses one of its views

    def covers(self, start: int, end: int, dtype: torch.dtype) -> bool:
        return self.dtype == dtype and self.start <= start and end <= self.end

    def on_device(self) -> torch.Tensor:
        """The span back on the device: copied once while any of its views is in use."""
        back = self.back() if self.back is not None else None
        if back is None:
            if self.copied is not None:  # the side stream's copy must be complete before the host copy is read
                torch.cuda.current_stream().wait_event(self.copied)
            back = self.host.to(self.device, non_blocking=True)
            self.back = weakref.ref(back)
        return back


class BlockOffload:
    """The pack/unpack hooks of one block and the side stream its copies run on (CUDA)."""

    def __init__(self, block: nn.Module, in_flight: CopiesInFlight):
        self.context = None
        self.in_flight = in_flight
        # This forward's host copies by device storage: autograd saves several views of one storage (a norm's
        # output, and the 2-D view each projection's matmul makes of it), which hold its elements once.
        self.packed = WeakIdKeyDictionary()
        self.copying: list[torch.Tensor] = []  # device tensors of this forward's asynchronous copies
        self.copied: torch.cuda.Event | None = None  # the event after the last of them
        block.register_forward_pre_hook(self._enter)
        block.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: nn.Module, args) -> None:
        self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.context.__enter__()

    def _leave(self, module: nn.Module, args, output) -> None:
        self.packed.clear()
        if self.copied is not None:
            self.in_flight.hold(self.copied, self.copying)
            self.copying, self.copied = [], None
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def pack(self, tensor: torch.Tensor) -> Any:
        if _is_weight(tensor) or tensor.numel() == 0:
            return tensor
        if isinstance(tensor, DTensor):  # its local tensor moves; placements rebuild it
            layout = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            local = dtensor_local(tensor)
        else:
            local, layout = tensor, None
        start, end = _span(local)
        copies = self.packed.setdefault(local.untyped_storage(), [])
        copy = next((c for c in copies if c.covers(start, end, local.dtype)), None)
        if copy is None:
            span = local.as_strided((end - start,), (1,), start)
            copy = _HostCopy(start, end, local.dtype, *_to_host(span))
            copies.append(copy)
            if copy.copied is not None:
                self.copying.append(span)
                self.copied = copy.copied
        return layout, copy, (local.shape, local.stride(), local.storage_offset() - start)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self.in_flight.release()  # the backward has begun: no forward copy is running any more
        layout, copy, (shape, stride, offset) = packed
        local = copy.on_device().as_strided(shape, stride, offset)
        if layout is None:
            return local
        mesh, placements, shape, stride = layout
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _is_weight(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear saves its weight transposed): FSDP gathers it again for backward."""
    base = view_base(tensor)
    return base.is_leaf and base.requires_grad


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The [start, end) of the storage elements a (non-empty) view reads."""
    start = tensor.storage_offset()
    return start, start + 1 + sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride()))


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _to_host(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor, torch.cuda.Event | None]:
    """(device, host copy, the event after which the copy is complete: None when synchronous)."""
    if tensor.device.type != "cuda":
        return tensor.device, tensor.to("cpu", copy=True), None
    stream = _side_streams.setdefault(tensor.device, torch.cuda.Stream(tensor.device))
    stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        host = tensor.to("cpu", non_blocking=True)  # pinned, as non-blocking device-to-host copies are
        copied = stream.record_event()
    return tensor.device, host, copied


def apply_activation_offload(model: nn.Module) -> list[int]:
    """Offload the saved tensors of every block of ``model.layers`` that checkpointing does not
    recompute; returns their global indices."""
    return offload_blocks((int(key), block) for key, block in model.layers.items())


def offload_blocks(blocks: Iterable[tuple[int, nn.Module]]) -> list[int]:
    """Offload the saved tensors of every (index, block) that checkpointing does not recompute, their copies
    in flight held together (:class:`CopiesInFlight`); returns their indices (a transformers model's blocks
    too: ``meshtron.hf.parallelize``)."""
    chosen = [(index, block) for index, block in blocks if not is_checkpointed(block)]
    in_flight = CopiesInFlight()
    for _, block in chosen:
        BlockOffload(block, in_flight)
    return [index for index, _ in chosen]
