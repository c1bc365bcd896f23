"""Sequence parallelism's column-parallel projections (Megatron-LM's SP linears, Korthikanti et al. 2022).

The q/k/v (gate/up) projections of one module all-gather their sequence-sharded input once, run as one packed
GEMM and save only the shard for backward, which gathers it again (:class:`SequenceParallelColwise`). Apart
from the plain styles because SP's collectives, the float8 gather and the zero-bubble split of a backward
(:func:`pass_wants`) meet here. See docs/training.md, 'Tensor and sequence parallelism'.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from meshtron.parallel.float8 import scaled_per_row, split_gemms
from meshtron.parallel.tp_styles import ReplicatedKVHeads, distribute_params, local_linear
from meshtron.torch_private import engine_will_execute, float8_from_parts, float8_parts, funcol


def _start_sequence_gather(shard: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """All-gather [B, S/tp, H] shards over tp, returned in flight (funcol waits on first use).

    Gathering along dim 0 needs no copy before the collective; :func:`_in_sequence_order` puts the
    rank blocks back along the sequence once the data is needed.
    """
    return funcol.all_gather_single(shard.contiguous(), 0, mesh)


def _in_sequence_order(gathered: torch.Tensor, tp: int) -> torch.Tensor:
    """[tp * B, S/tp, H] rank blocks -> [B, S, H]."""
    blocks = gathered.view(tp, -1, *gathered.shape[1:])
    return blocks.transpose(0, 1).flatten(1, 2)


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def pass_wants(ctx) -> tuple[bool, bool]:
    """Whether the running backward pass uses the gradient of a custom Function's first input, and of
    any other (the Function's tensor inputs: what it computes with, then its weights).

    A zero-bubble pipeline splits a backward in two passes over the same graph, one asking for the
    stage input's gradient only (``B``), one for the weights' (``W``); autograd drops what a Function
    returns for an edge the pass does not follow, so a Function that computes input and weight
    gradients together computes only those asked for. ``autograd.grad`` cannot say this of a leaf's
    accumulator (it raises): such a gradient is taken as wanted. A compiled block's backward is traced
    ahead of any pass (a stage holding one runs its backwards whole): both.
    """
    if torch.compiler.is_compiling():
        return True, True

    def reached(node) -> bool:
        if node is None:  # the input needs no gradient
            return False
        try:
            return engine_will_execute(node)
        except RuntimeError:
            return True

    first, *rest = (node for node, _ in ctx.next_functions)
    return reached(first), any(map(reached, rest))


def save_packed_projections(
    ctx, shard: torch.Tensor, mesh: DeviceMesh, projections: PackedProjections, weights_and_biases: tuple
) -> tuple[tuple, tuple]:
    """What the backward of packed column-parallel projections needs (the input shard, their weights and
    widths, the mesh, ``projections``), saved on ``ctx``; returns the weights and the biases."""
    count = len(projections.gemms)
    weights, biases = weights_and_biases[:count], weights_and_biases[count:]
    ctx.mesh, ctx.projections = mesh, projections
    ctx.widths = [w.shape[0] for w in weights]
    ctx.has_bias = biases[0] is not None
    ctx.save_for_backward(shard, *weights)
    return weights, biases


class PackedProjections:
    """The GEMMs of column-parallel projections of one input, packed along the output features: one GEMM
    over the packed weights in the training dtype, or, where ``[train] fp8`` converted any of them, one per
    projection (each float8 one with its own whole-tensor scales, ``linear.tp_gemms``), as on one rank.
    Where all are float8 they share one cast of the input, and under SP its all-gather carries the float8
    bytes (and per-token scales) instead of the training dtype (:meth:`start_input_gather`)."""

    def __init__(self, linears: list[nn.Module]):
        self.gemms = [getattr(linear, "tp_gemms", None) for linear in linears]
        self.packed = all(gemms is None for gemms in self.gemms)
        self.float8_input = all(gemms is not None for gemms in self.gemms)

    def start_input_gather(self, shard: torch.Tensor, mesh: DeviceMesh, for_grad_weight: bool = False):
        """Start all-gathering the [B, S/tp, in] ``shard`` over the sequence; returns the function that waits
        and gives the [B * S, in] input of the output GEMM (or the weight-gradient GEMM): float8 where every
        projection is (cast once, the scale of the whole sequence), else the training dtype."""
        tp = mesh.size()
        rows = self.input_rows(shard, for_grad_weight)
        parts = float8_parts(rows)
        if parts is None:  # the training dtype (the recipe keeps this GEMM's input in it)
            gathering = _start_sequence_gather(shard, mesh)
            return lambda: _in_sequence_order(_waited(gathering), tp).flatten(0, -2)
        data, scale = parts
        data_gathering = _start_sequence_gather(data.view(shard.shape), mesh)
        per_token = scaled_per_row(data, scale)
        scale_gathering = _start_sequence_gather(scale.view(*shard.shape[:-1], -1), mesh) if per_token else None

        def finish() -> torch.Tensor:
            full = _in_sequence_order(_waited(data_gathering), tp).flatten(0, -2)
            full_scale = _in_sequence_order(_waited(scale_gathering), tp).flatten(0, -2) if per_token else scale
            return float8_from_parts(rows, full, full_scale)

        return finish

    def input_rows(self, shard: torch.Tensor, for_grad_weight: bool = False) -> torch.Tensor:
        """The [B, S/tp, in] sequence ``shard`` as [tokens, in] rows for the output GEMM (or the weight-gradient
        GEMM): cast to float8 once with the whole sequence's scale where every projection is float8."""
        rows = shard.flatten(0, -2)
        return self.gemms[0].cast_input(rows, for_grad_weight, sequence_shard=True) if self.float8_input else rows

    def output_weights(self, weights: tuple) -> tuple:
        """``weights`` as :meth:`output` takes them, made once for every GEMM on pieces of the input: packed into
        one, or each float8 projection's cast for its output GEMM."""
        if self.packed:
            return (torch.cat(weights),)
        return tuple(g.weight_for_output(w) if g else w for g, w in zip(self.gemms, weights))

    def grad_input_weights(self, weights: tuple) -> tuple:
        """``weights`` as :meth:`grad_input` takes them (:meth:`output_weights`, for the input-gradient GEMMs)."""
        if self.packed:
            return (torch.cat(weights),)
        return tuple(g.weight_for_grad_input(w) if g else w for g, w in zip(self.gemms, weights))

    def output(self, rows: torch.Tensor, lead: torch.Size, weights: tuple, biases: tuple) -> torch.Tensor:
        """The packed projections of the [tokens, in] ``rows`` (float8 or not), shaped ``lead`` + [packed];
        ``weights`` from :meth:`output_weights`."""
        bias = torch.cat(biases) if biases[0] is not None else None
        if self.packed:
            return F.linear(rows, weights[0], bias).unflatten(0, lead)
        out = torch.cat([g.output(rows, w) if g else rows @ w.t() for g, w in zip(self.gemms, weights)], -1)
        out = out.unflatten(0, lead)
        return out if bias is None else out + bias.to(out.dtype)

    def grad_outputs(self, grad_packed: torch.Tensor, widths: list[int], for_input: bool, for_weight: bool):
        """Per projection its [tokens, width] output gradient for the input- and the weight-gradient GEMM (a
        float8 one cast once where both scale it alike); None where one packed GEMM serves them all."""
        if self.packed:
            return None
        dys = grad_packed.flatten(0, -2).split(widths, -1)
        return [
            g.cast_grad_output(dy.contiguous(), for_input, for_weight) if g else (dy, dy)
            for g, dy in zip(self.gemms, dys)
        ]

    def grad_input(self, grad_packed: torch.Tensor, weights: list[torch.Tensor], dys) -> torch.Tensor:
        """The summed input gradient of the projections (this rank's columns: a partial sum over tp); ``weights``
        from :meth:`grad_input_weights`, ``dys`` from :meth:`grad_outputs`."""
        if self.packed:
            return grad_packed @ weights[0]
        parts = [g.grad_input(dy, w) if g else dy @ w for g, (dy, _), w in zip(self.gemms, dys, weights)]
        return sum(parts[1:], parts[0]).unflatten(0, grad_packed.shape[:-1])

    def grad_weights(self, rows: torch.Tensor, inputs: torch.Tensor, widths: list[int], dys) -> tuple:
        """Each projection's weight gradient from the [tokens, packed] output gradient ``rows`` (``dys``, from
        :meth:`grad_outputs`, per projection) and the [tokens, in] ``inputs``."""
        if self.packed:
            return (rows.t() @ inputs).split(widths)
        return tuple(g.grad_weight(dy, inputs) if g else dy.t() @ inputs for g, (_, dy) in zip(self.gemms, dys))


class _SequenceParallelLinears(torch.autograd.Function):
    """Column-parallel projections of one sequence-sharded input, packed along the last dim.

    Forward all-gathers the [B, S/tp, H] shard into [B, S, H] and computes every projection from it;
    only the shard is saved. Backward re-gathers it (in flight while the input gradient is computed),
    reduce-scatters the summed input gradient of all projections (in flight while the weight
    gradients are computed), as Megatron-LM's sequence-parallel linear layers do. A pass of a split
    backward gets only the half it wants (:func:`pass_wants`). The GEMMs are ``projections``'.
    """

    @staticmethod
    def forward(
        ctx,
        shard: torch.Tensor,
        mesh: DeviceMesh,
        projections: PackedProjections,
        *weights_and_biases: torch.Tensor | None,
    ):
        weights, biases = save_packed_projections(ctx, shard, mesh, projections, weights_and_biases)
        full = projections.start_input_gather(shard, mesh)()
        lead = (shard.shape[0], shard.shape[1] * mesh.size(), *shard.shape[2:-1])
        return projections.output(full, torch.Size(lead), projections.output_weights(weights), biases)

    @staticmethod
    def backward(ctx, grad_packed: torch.Tensor):
        shard, *weights = ctx.saved_tensors
        count = len(weights)
        want_input, want_params = pass_wants(ctx)
        gathered = ctx.projections.start_input_gather(shard, ctx.mesh, for_grad_weight=True) if want_params else None
        dys = ctx.projections.grad_outputs(grad_packed, ctx.widths, want_input, want_params)
        grad_shard = None
        if want_input:
            grad_full = ctx.projections.grad_input(grad_packed, ctx.projections.grad_input_weights(weights), dys)
            grad_shard = funcol.reduce_scatter_single(grad_full, "sum", 1, ctx.mesh)
        grad_weights = grad_biases = (None,) * count
        if want_params:
            rows = grad_packed.flatten(0, -2)
            grad_weights = ctx.projections.grad_weights(rows, gathered(), ctx.widths, dys)
            if ctx.has_bias:
                grad_biases = rows.sum(0).split(ctx.widths)
        return _waited(grad_shard), None, None, *grad_weights, *grad_biases


def _packed_columns_forward(self: nn.Linear, packed: torch.Tensor) -> torch.Tensor:
    # A copy, not a view: a view saved for backward (attention saves v) would keep every
    # projection's output alive.
    return packed[..., slice(*self.tp_columns)].clone()


class SequenceParallelColwise(ParallelStyle):
    """The column-parallel projections that read one module's sequence-sharded input under SP
    (attention's q/k/v, the MLP's gate/up), applied to that module, as Megatron-LM's SP linears.

    ``projections`` maps each child linear to how its weight is split: ``ColwiseParallel()`` (rows
    ``Shard(0)``) or :class:`ReplicatedKVHeads`; parameter names and placements are those of the
    styles without SP. The module's ``Shard(1)`` input is gathered once for all projections and only
    the shard is kept for backward, so the saved activations shrink by tp (the gathered input would
    cost a full [B, S, H] per module). The module then receives the projections' outputs packed
    along the last dim in place of its input, and each projection returns a copy of its columns: the
    module may use its input only as the projections' input and for its leading (batch, sequence)
    sizes, as meshtron's attention and MLP do. ``function`` computes the packed projections (the
    overlapped variant is ``meshtron.parallel.tensor_overlap.OverlappedColwise``).
    """

    function = _SequenceParallelLinears

    def __init__(self, projections: dict[str, ColwiseParallel | ReplicatedKVHeads]):
        super().__init__()
        self.projections = projections

    def _split_weights(self, linear: nn.Module, style: ParallelStyle, mesh: DeviceMesh) -> None:
        if isinstance(style, ReplicatedKVHeads):
            style.src_data_rank = self.src_data_rank
            style.split_weights(linear, mesh)
        elif isinstance(style, ColwiseParallel):
            distribute_params(linear, mesh, Shard(0), self.src_data_rank)
            linear.tp_gemms = split_gemms(linear, mesh, "out", tuple(linear.weight.to_local().shape))
        else:
            raise TypeError(
                f"SequenceParallelColwise splits weights like ColwiseParallel or ReplicatedKVHeads, "
                f"got {type(style).__name__}"
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        linears = [module.get_submodule(name) for name in self.projections]
        if len({linear.bias is None for linear in linears}) > 1:
            raise ValueError(f"SequenceParallelColwise needs biases on all or none of {list(self.projections)}")
        start = 0
        for linear, style in zip(linears, self.projections.values()):
            self._split_weights(linear, style, device_mesh)
            width = local_linear(linear)[0].shape[0]
            linear.tp_columns = (start, start + width)
            linear.forward = types.MethodType(_packed_columns_forward, linear)
            start += width
        projections = PackedProjections(linears)

        def project(_module, args):
            shard = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
            weights, biases = zip(*(local_linear(linear) for linear in linears))
            packed = self.function.apply(shard, device_mesh, projections, *weights, *biases)
            return (packed, *args[1:])

        module.register_forward_pre_hook(project)
        return module


__all__ = [
    "PackedProjections",
    "SequenceParallelColwise",
    "pass_wants",
    "save_packed_projections",
]
