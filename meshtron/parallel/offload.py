"""Activation offload (``[parallel] offload_activations``): each block's saved-for-backward tensors in
host memory between its forward and its backward (a memory/transfer trade, not a mesh dimension).

While a block's forward runs, ``torch.autograd.graph.saved_tensors_hooks`` hands every tensor autograd
saves to :meth:`BlockOffload.pack`, which copies it to the host (once per tensor, however many ops save
it) and keeps only the copy; in backward
:meth:`BlockOffload.unpack` copies it back. The hooks are entered by the block's forward pre-hook and
left by its forward hook, so only that block's tensors move: the embedding, the final norm and the
fused loss keep theirs on the device.

- On CUDA the device-to-host copy runs on a side stream, after the tensor is produced, into pinned
  memory, so it overlaps the rest of the forward; the device tensor is freed once the copy is done
  (``record_stream``). The host-to-device copy runs on the compute stream when backward needs the
  tensor, after the side stream's copy (an event): it is exposed, as ``meshtron.plan`` models it.
- On CPU the "host copy" is a copy in the same memory: no saving, the same code path (tests).
- Parameters (leaves that require grad: FSDP's gathered weights, which it frees and gathers again
  for backward) stay where they are; a DTensor moves its local tensor and keeps its placements.
- Blocks that activation checkpointing recomputes save only their input (on the device) and are not
  offloaded: recomputation already frees their tensors. Apply after checkpointing, before FSDP.

Copies change no value: losses and gradients are bit-identical to a run without offload.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from meshtron.parallel.recompute import is_checkpointed
from meshtron.torch_private import dtensor_local


class BlockOffload:
    """The pack/unpack hooks of one block and the side stream its copies run on (CUDA)."""

    def __init__(self, block: nn.Module):
        self.context = None
        # What this forward has packed, by tensor identity: a tensor several ops save (a norm's output read
        # by two linears, an activation's input) is copied to the host once, as autograd keeps it once.
        self.packed = WeakIdKeyDictionary()
        block.register_forward_pre_hook(self._enter)
        block.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module: nn.Module, args) -> None:
        self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.context.__enter__()

    def _leave(self, module: nn.Module, args, output) -> None:
        self.packed.clear()
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.is_leaf and tensor.requires_grad:  # a parameter: FSDP re-gathers it for backward
            return tensor
        if tensor in self.packed:
            return self.packed[tensor]
        if isinstance(tensor, DTensor):
            layout = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            packed = (layout, *_to_host(dtensor_local(tensor)))
        else:
            packed = (None, *_to_host(tensor))
        self.packed[tensor] = packed
        return packed

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        layout, device, host, copied = packed
        if copied is not None:  # the side stream's copy must be complete before the host copy is read
            torch.cuda.current_stream().wait_event(copied)
        local = host.to(device, non_blocking=True)
        if layout is None:
            return local
        mesh, placements, shape, stride = layout
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


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
    tensor.record_stream(stream)  # its memory is reused only after the copy
    return tensor.device, host, copied


def apply_activation_offload(model: nn.Module) -> list[int]:
    """Offload the saved tensors of every block of ``model.layers`` that checkpointing does not
    recompute; returns their global indices."""
    chosen = [int(key) for key, block in model.layers.items() if not is_checkpointed(block)]
    for index in chosen:
        BlockOffload(model.layers[str(index)])
    return chosen
