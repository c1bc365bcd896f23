"""The loss over a vocabulary split by tensor parallelism: the LM head fused with its loss
(:class:`VocabParallelHead`, training) and the loss of vocab-sharded logits (:func:`parallel_token_loss_sum`,
inference and transformers models). Each rank holds ``V / tp`` vocabulary rows; the only communication
is per-token maxima and sums over tp, never the logits themselves.

Kept apart from the tp plan of ``parallel/tensor.py``, which applies this head with the rest of the plan.
See docs/training.md, 'The fused LM head and loss'.
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from meshtron.models.chunked_loss import cross_entropy_sum, linear_cross_entropy_sum


def shard_start(size: int, mesh: DeviceMesh) -> int:
    """First index of this rank's ``Shard`` of a dim of ``size`` (torch.chunk layout, as DTensor uses)."""
    chunk = math.ceil(size / mesh.size())
    return min(mesh.get_local_rank() * chunk, size)


def _vocab_reducer(mesh: DeviceMesh):
    """Per-token max / sum over the vocabulary shards: the loss's only communication."""
    ops = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    group = mesh.get_group()

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(tensor, op=ops[op], group=group)
        return tensor

    return reduce


def _vocab_parallel_head_forward(
    self: nn.Linear, h: DTensor, labels: torch.Tensor | None = None, softcap: float | None = None
):
    if labels is None:
        return F.linear(h, self.weight)  # vocab-sharded logits, Shard(-1)
    # This rank's hidden-state gradient covers only its vocabulary columns: a partial sum, reduced
    # (or reduce-scattered under SP) once by DTensor in backward.
    local = h.to_local(grad_placements=[Partial()])
    weight = self.weight.to_local()
    start = shard_start(self.weight.shape[0], self.weight.device_mesh)
    return linear_cross_entropy_sum(local, weight, labels, self.chunk_tokens, start, self.vocab_reduce, softcap=softcap)


class VocabParallelHead(ParallelStyle):
    """The LM head split over the vocabulary (weight ``Shard(0)``, as ``ColwiseParallel``).

    ``head(h)`` returns vocab-sharded logits (a ``Shard(-1)`` DTensor); ``head(h, labels)`` the summed
    token loss from the fused, chunked lm_head + cross-entropy (``meshtron.models.chunked_loss``): each rank
    computes its vocabulary columns chunk by chunk and all-reduces two per-token values per chunk, so
    no rank ever holds a whole micro-batch's logits. The input (the residual stream, sequence-sharded
    under SP) is gathered once.
    """

    def __init__(self, input_layout: Placement):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not hasattr(module, "chunk_tokens"):
            raise TypeError(f"VocabParallelHead expects meshtron's LMHead, got {type(module).__name__}")

        def shard_rows(_name, mod, mesh):
            for name, param in list(mod.named_parameters(recurse=False)):
                dist_param = distribute_tensor(param, mesh, [Shard(0)], src_data_rank=self.src_data_rank)
                mod.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))

        def gather_input(_mod, inputs, mesh):
            h, *rest = inputs
            if not isinstance(h, DTensor):
                h = DTensor.from_local(h, mesh, [self.input_layout], run_check=False)
            return (h.redistribute(mesh, [Replicate()]), *rest)

        distribute_module(module, device_mesh, shard_rows, input_fn=gather_input)
        module.vocab_reduce = _vocab_reducer(device_mesh)
        module.forward = types.MethodType(_vocab_parallel_head_forward, module)
        return module


def parallel_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed token cross-entropy of plain or vocab-sharded (``Shard(-1)`` DTensor) logits.

    With sharded logits only per-token maxima, exp-sums and target logits are all-reduced over tp;
    the result is a plain scalar, identical on every tp rank. Backward needs no communication. The
    computation goes chunk by chunk of tokens (:func:`meshtron.models.chunked_loss.cross_entropy_sum`), so no
    fp32 copy of the logits is made. Training uses the fused head instead and never has logits.
    """
    if not isinstance(logits, DTensor):
        return cross_entropy_sum(logits, labels, ignore_index=ignore_index)
    (placement,) = logits.placements if logits.device_mesh.ndim == 1 else (None,)
    if not (isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1)):
        raise ValueError(f"parallel_token_loss_sum expects logits sharded on the vocab dim, got {logits.placements}")
    mesh = logits.device_mesh
    local = logits.to_local()
    start = shard_start(logits.shape[-1], mesh)
    return cross_entropy_sum(
        local, labels.to(local.device), vocab_start=start, reduce=_vocab_reducer(mesh), ignore_index=ignore_index
    )


__all__ = ["VocabParallelHead", "parallel_token_loss_sum", "shard_start"]
