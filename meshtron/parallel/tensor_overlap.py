"""Sequence parallelism's collectives overlapped with their GEMMs (collective matmul): ``[parallel] tp_overlap``.

Under SP every dense block gathers its sequence-sharded input before q/k/v (gate/up) and reduce-scatters
the output of o_proj (down_proj). Here each of those becomes a ring over the tp ranks, one sequence chunk
per step, sent and received point-to-point while the GEMM of the chunk already in hand runs (Wang et al.
2022, "Overlap communication with dependent computation via decomposition"; Megatron's tp-comm-overlap and
torch's async TP do the same with symmetric memory). Plain ``batch_isend_irecv`` on the tp group, so it
runs on NCCL and gloo alike.

* all-gather + matmul (:class:`OverlappedColwise`, q/k/v and gate/up packed as
  :class:`~meshtron.parallel.sp_projections.SequenceParallelColwise` packs them): step s multiplies the shard
  of rank r - s while the next one travels; tp - 1 exchanges of one shard each.
* matmul + reduce-scatter (:class:`OverlappedRowwise`, o_proj and down_proj): step s computes this
  rank's partial product of the chunk that ends on rank r - s - 1 and adds it to the running sum
  received from rank r - 1; the sum moves on while the next partial is computed; after tp - 1
  exchanges each rank holds its chunk summed over tp (the sum in ring order: equal to the
  reduce-scatter up to float reassociation).
* backward pairs them the other way round: the colwise input gradient is a matmul + reduce-scatter,
  its weight gradient takes the input shards around the ring again (only the shard is saved, as
  without overlap) and accumulates chunk by chunk; the rowwise input and weight gradients both come
  from one ring of the output-gradient shards (a zero-bubble split's ``B`` runs it and keeps the
  gathered shards for its ``W``, as the unoverlapped path keeps the gathered gradient).

Bytes moved equal the unoverlapped collectives' ((tp - 1) / tp of the gathered tensor per ring); what
no GEMM hides is the first chunk of a gather and the last of a reduce-scatter (``meshtron/plan/speed.py``).
"""

from __future__ import annotations

import types
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from meshtron.parallel.context.comm import RingExchange
from meshtron.config import ConfigError
from meshtron.parallel.float8 import is_float8_linear
from meshtron.parallel.sp_projections import (
    PackedProjections,
    SequenceParallelColwise,
    pass_wants,
    save_packed_projections,
)
from meshtron.parallel.tensor import apply_tensor_parallel

_TAG = 0  # one exchange of a ring is in flight at a time, and rings run one after another


def _ring(mesh: DeviceMesh) -> RingExchange:
    return RingExchange(mesh.get_group())


def _rows(x: torch.Tensor, chunk: int, chunks: int) -> torch.Tensor:
    """Sequence chunk ``chunk`` of ``chunks`` of a [B, S, ...] tensor (dim 1, torch.chunk layout)."""
    size = x.shape[1] // chunks
    return x[:, chunk * size:(chunk + 1) * size]


def ring_gather(shard: torch.Tensor, ring: RingExchange, use: Callable[[torch.Tensor, int], None]) -> None:
    """Call ``use(chunk, source)`` on every tp rank's shard (this rank's first), the next shard in
    flight from the previous rank while ``use`` runs: an all-gather in tp - 1 exchanges."""
    chunk = shard.contiguous()
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:
            incoming, reqs = ring.start(chunk, _TAG)
        use(chunk, (ring.rank - step) % ring.size)
        if not last:
            RingExchange.wait(reqs, None)
            chunk = incoming


def ring_reduce_scatter(part: Callable[[int], torch.Tensor], ring: RingExchange) -> torch.Tensor:
    """The sum over tp ranks of their ``part(this rank)``: each rank computes ``part(dest)`` (a fresh
    tensor) for every destination, one per step, adding it to the running sum that arrives from the
    previous rank, and passes the sum on while it computes the next: a reduce-scatter in tp - 1 exchanges."""
    reqs = sent = incoming = None
    for step in range(ring.size):
        total = part((ring.rank - step - 1) % ring.size)
        if reqs is not None:
            RingExchange.wait(reqs, None)
            total.add_(incoming)
        if step == ring.size - 1:
            return total
        sent = total  # the send reads it until the wait
        incoming, reqs = ring.start(sent, _TAG)
    raise AssertionError("unreachable: a ring has at least one step")


class _RingGatherLinears(torch.autograd.Function):
    """:class:`~meshtron.parallel.sp_projections._SequenceParallelLinears` (same inputs and output) with the
    gathers and the reduce-scatter done as rings overlapped with the GEMMs, chunk by chunk."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, mesh: DeviceMesh, projections: PackedProjections,
                *weights_and_biases: torch.Tensor | None):
        weights, biases = save_packed_projections(ctx, shard, mesh, projections, weights_and_biases)
        weight, bias = torch.cat(weights), torch.cat(biases) if ctx.has_bias else None
        blocks: list[torch.Tensor | None] = [None] * mesh.size()

        def project(chunk: torch.Tensor, source: int) -> None:
            blocks[source] = F.linear(chunk, weight, bias)

        ring_gather(shard, _ring(mesh), project)
        return torch.cat(blocks, dim=1)

    @staticmethod
    def backward(ctx, grad_packed: torch.Tensor):
        shard, *weights = ctx.saved_tensors
        count, tp = len(weights), ctx.mesh.size()
        want_input, want_params = pass_wants(ctx)
        ring = _ring(ctx.mesh)
        grad_weights = grad_biases = (None,) * count
        if want_params:
            widths = grad_packed.shape[-1]
            grad_weight = torch.zeros(widths, shard.shape[-1], dtype=grad_packed.dtype, device=grad_packed.device)

            def accumulate(chunk: torch.Tensor, source: int) -> None:
                rows = _rows(grad_packed, source, tp).reshape(-1, widths)
                grad_weight.addmm_(rows.t(), chunk.reshape(-1, chunk.shape[-1]))

            ring_gather(shard, ring, accumulate)
            grad_weights = grad_weight.split(ctx.widths)
            if ctx.has_bias:
                grad_biases = grad_packed.flatten(0, -2).sum(0).split(ctx.widths)
        grad_shard = None
        if want_input:
            weight = torch.cat(weights)
            # This rank's columns only: a partial sum over tp, summed around the ring.
            grad_shard = ring_reduce_scatter(lambda dest: _rows(grad_packed, dest, tp) @ weight, ring)
        return grad_shard, None, None, *grad_weights, *grad_biases


class OverlappedColwise(SequenceParallelColwise):
    """:class:`~meshtron.parallel.sp_projections.SequenceParallelColwise` with its gathers and reduce-scatter
    overlapped with the projections' GEMMs (:class:`_RingGatherLinears`)."""

    function = _RingGatherLinears

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.sends_p2p = True  # torch.compile cannot trace the ring: compiled with graph breaks
        return super()._apply(module, device_mesh)


class _MatmulReduceScatter(torch.autograd.Function):
    """A row-parallel linear's local product reduce-scattered along the sequence, as a ring overlapped
    with the GEMMs: [B, S, K / tp] x [N, K / tp] -> [B, S / tp, N] summed over tp. Backward takes the
    output-gradient shards around the ring once for both gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, weight: torch.Tensor) -> torch.Tensor:
        ctx.mesh = mesh
        ctx.save_for_backward(x, weight)
        tp = mesh.size()
        return ring_reduce_scatter(lambda dest: F.linear(_rows(x, dest, tp), weight), _ring(mesh))

    @staticmethod
    def backward(ctx, grad_shard: torch.Tensor):
        x, weight = ctx.saved_tensors
        tp = ctx.mesh.size()
        want_input, want_params = pass_wants(ctx)
        blocks: list[torch.Tensor | None] = [None] * tp
        grad_weight = torch.zeros_like(weight) if want_params else None
        # The B pass of a split backward keeps the gathered gradient for its W pass (so does the
        # unoverlapped path: its gathered output gradient waits for W), which then sends nothing.
        gathered = ctx.__dict__.pop("gathered", None)
        keep = [None] * tp if want_input and not want_params else None

        def use(chunk: torch.Tensor, source: int) -> None:
            if want_input:
                blocks[source] = chunk @ weight
            if want_params:
                grad_weight.addmm_(chunk.reshape(-1, chunk.shape[-1]).t(), _rows(x, source, tp).reshape(-1, x.shape[-1]))
            if keep is not None:
                keep[source] = chunk

        if gathered is None:
            ring_gather(grad_shard, _ring(ctx.mesh), use)
        else:
            for source, chunk in enumerate(gathered):
                use(chunk, source)
        if keep is not None:
            ctx.gathered = keep
        return torch.cat(blocks, dim=1) if want_input else None, None, grad_weight


def _overlapped_rowwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    local = x.to_local() if isinstance(x, DTensor) else x
    return _MatmulReduceScatter.apply(local, self.weight.device_mesh, self.weight.to_local())


class OverlappedRowwise(ParallelStyle):
    """o_proj / down_proj under SP (``RowwiseParallel(output_layouts=Shard(1))``, the same ``Shard(1)``
    weight): local-feature input, sequence-sharded local output, the reduce-scatter done as a ring
    overlapped with the GEMM (:class:`_MatmulReduceScatter`). meshtron's blocks have no bias there."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear) or module.bias is not None:
            raise TypeError(f"OverlappedRowwise expects nn.Linear without bias, got {module}")
        split = distribute_tensor(module.weight, device_mesh, [Shard(1)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(split, requires_grad=module.weight.requires_grad))
        module.forward = types.MethodType(_overlapped_rowwise_forward, module)
        module.sends_p2p = True
        return module


def apply_overlapped_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> nn.Module:
    """:func:`~meshtron.parallel.tensor.apply_tensor_parallel` with every block's SP collectives overlapped
    (:func:`overlap_plan`); ``[parallel] tp_overlap``."""
    if not sp:
        raise ConfigError("[parallel] tp_overlap = true overlaps sequence parallelism's collectives; set sp = true.")
    if any(map(is_float8_linear, model.modules())):
        raise ConfigError("[parallel] tp_overlap = true computes its rings' GEMMs in the training dtype, not in "
                          "float8; set tp_overlap = false or [train] fp8 = 'none'.")
    return apply_tensor_parallel(model, tp_mesh, sp, restyle=overlap_plan)


def overlap_plan(plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """A block's SP plan (``meshtron.parallel.tensor``) with its sequence-parallel projections
    overlapped: every :class:`SequenceParallelColwise` and every rowwise projection whose output is
    the sequence-sharded residual."""
    out = {}
    for name, style in plan.items():
        if type(style) is SequenceParallelColwise:
            style = OverlappedColwise(style.projections)
        elif isinstance(style, RowwiseParallel) and style.output_layouts == (Shard(1),):
            style = OverlappedRowwise()
        out[name] = style
    return out


__all__ = ["OverlappedColwise", "OverlappedRowwise", "apply_overlapped_tensor_parallel", "overlap_plan", "ring_gather", "ring_reduce_scatter"]
