"""Sequence parallelism's collectives overlapped with their GEMMs (collective matmul): ``[parallel] tp_overlap``.

:class:`OverlappedColwise` (all-gather + matmul) and :class:`OverlappedRowwise` (matmul + reduce-scatter) turn
each SP collective into a ring of point-to-point sequence chunks, forward and backward; :class:`RowPayload`
carries float8 rows under ``[train] fp8``. See docs/training.md#tensor-and-sequence-parallelism
('Overlapped SP collectives').
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from meshtron.config import ConfigError
from meshtron.parallel.context.comm import RingExchange
from meshtron.parallel.float8 import Float8Gemms, is_float8_linear, scaled_per_row, split_gemms
from meshtron.parallel.sp_projections import (
    PackedProjections,
    SequenceParallelColwise,
    pass_wants,
    save_packed_projections,
)
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.torch_private import float8_from_parts, float8_parts

_TAG = 0  # one exchange of a ring is in flight at a time, and rings run one after another


def _ring(mesh: DeviceMesh) -> RingExchange:
    return RingExchange(mesh.get_group())


def _rows(x: torch.Tensor, chunk: int, chunks: int) -> torch.Tensor:
    """Sequence chunk ``chunk`` of ``chunks`` of a [B, S, ...] tensor (dim 1, torch.chunk layout)."""
    size = x.shape[1] // chunks
    return x[:, chunk * size : (chunk + 1) * size]


def _sequence_rows(t: torch.Tensor | None, batch: int, chunk: int, chunks: int) -> torch.Tensor | None:
    """Sequence chunk ``chunk`` of ``chunks`` of [B * S, C] rows (:func:`_rows` of them as [B, S, C]); of a
    float8 cast the rows of its data and, where it scales per row, of its scales."""
    if t is None:
        return None

    def rows(u: torch.Tensor) -> torch.Tensor:
        return _rows(u.unflatten(0, (batch, -1)), chunk, chunks).flatten(0, 1)

    parts = float8_parts(t)
    if parts is None:
        return rows(t)
    data, scale = parts
    return float8_from_parts(t, rows(data), rows(scale) if scaled_per_row(data, scale) else scale)


class RowPayload:
    """Row-aligned tensors [T, ...] (a float8 cast: its bytes and per-row scales) sent around a ring as one
    ``uint8`` [T, bytes] tensor: one exchange per step whatever they are, and float8 over gloo, which has no
    float8 type (one tensor in the training dtype goes as it is). A float8 cast's scale that is not per row
    (tensorwise, per column: already the whole tensor's on every rank) stays here and joins the received
    bytes again."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.likes, pieces = [], []
        for t in tensors:
            parts = float8_parts(t)
            data, scale = parts if parts is not None else (t, None)
            per_row = scale is not None and scaled_per_row(data, scale)
            self.likes.append((t, scale, per_row))
            pieces += [data, scale] if per_row else [data]
        self.specs = [(piece.dtype, piece.shape[1:]) for piece in pieces]
        self.plain = len(tensors) == 1 and float8_parts(tensors[0]) is None  # sent as it is
        rows = [piece.contiguous().view(torch.uint8).flatten(1) for piece in pieces]
        self.payload = pieces[0].contiguous() if self.plain else rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)

    def unpack(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """The tensors of a received ``payload`` (another rank's rows, packed alike)."""
        if self.plain:
            return [payload]
        pieces, start = [], 0
        for dtype, shape in self.specs:
            width = shape.numel() * dtype.itemsize
            pieces.append(payload[:, start : start + width].contiguous().view(dtype).view(payload.shape[0], *shape))
            start += width
        out = []
        for like, scale, per_row in self.likes:
            data = pieces.pop(0)
            if float8_parts(like) is None:
                out.append(data)
            else:
                out.append(float8_from_parts(like, data, pieces.pop(0) if per_row else scale))
        return out


def ring_gather_rows(
    tensors: list[torch.Tensor], ring: RingExchange, use: Callable[[list[torch.Tensor], int], None]
) -> None:
    """:func:`ring_gather` of row-aligned ``tensors`` (float8 casts included) as one :class:`RowPayload`."""
    payload = RowPayload(tensors)
    ring_gather(payload.payload, ring, lambda chunk, source: use(payload.unpack(chunk), source))


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
    gathers and the reduce-scatter done as rings overlapped with the GEMMs, chunk by chunk; the GEMMs are
    ``projections``' (float8 ones on float8 chunks of operands cast whole)."""

    @staticmethod
    def forward(
        ctx,
        shard: torch.Tensor,
        mesh: DeviceMesh,
        projections: PackedProjections,
        *weights_and_biases: torch.Tensor | None,
    ):
        weights, biases = save_packed_projections(ctx, shard, mesh, projections, weights_and_biases)
        weights = projections.output_weights(weights)  # once for the ring's chunks
        blocks: list[torch.Tensor | None] = [None] * mesh.size()

        def project(chunk: list[torch.Tensor], source: int) -> None:
            blocks[source] = projections.output(chunk[0], shard.shape[:-1], weights, biases)

        ring_gather_rows([projections.input_rows(shard)], _ring(mesh), project)
        return torch.cat(blocks, dim=1)

    @staticmethod
    def backward(ctx, grad_packed: torch.Tensor):
        shard, *weights = ctx.saved_tensors
        count, tp, batch = len(weights), ctx.mesh.size(), shard.shape[0]
        projections = ctx.projections
        want_input, want_params = pass_wants(ctx)
        ring = _ring(ctx.mesh)
        # Each projection's output gradient cast once, whole (None where one packed GEMM serves them all).
        dys = projections.grad_outputs(grad_packed, ctx.widths, want_input, want_params)

        def chunk_of(dest: int):
            if dys is None:
                return None
            return [tuple(_sequence_rows(dy, batch, dest, tp) for dy in pair) for pair in dys]

        grad_weights = grad_biases = (None,) * count
        if want_params:
            sums = [torch.zeros_like(w) for w in weights]

            def accumulate(chunk: list[torch.Tensor], source: int) -> None:
                rows = _rows(grad_packed, source, tp).flatten(0, -2)
                for total, part in zip(sums, projections.grad_weights(rows, chunk[0], ctx.widths, chunk_of(source))):
                    total += part

            ring_gather_rows([projections.input_rows(shard, for_grad_weight=True)], ring, accumulate)
            grad_weights = tuple(sums)
            if ctx.has_bias:
                grad_biases = grad_packed.flatten(0, -2).sum(0).split(ctx.widths)
        grad_shard = None
        if want_input:
            # This rank's columns only: a partial sum over tp, summed around the ring.
            cast = projections.grad_input_weights(weights)
            grad_shard = ring_reduce_scatter(
                lambda dest: projections.grad_input(_rows(grad_packed, dest, tp), cast, chunk_of(dest)), ring
            )
        return grad_shard, None, None, *grad_weights, *grad_biases


class OverlappedColwise(SequenceParallelColwise):
    """:class:`~meshtron.parallel.sp_projections.SequenceParallelColwise` with its gathers and reduce-scatter
    overlapped with the projections' GEMMs (:class:`_RingGatherLinears`)."""

    function = _RingGatherLinears

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.sends_p2p = True  # torch.compile cannot trace the ring: compiled with graph breaks
        module = super()._apply(module, device_mesh)
        float8 = {name: is_float8_linear(module.get_submodule(name)) for name in self.projections}
        if len(set(float8.values())) > 1:
            raise ConfigError(
                f"[parallel] tp_overlap = true with [train] fp8: the ring casts the input of {list(float8)} once for "
                f"all of them, but {[n for n, f in float8.items() if not f]} stay in the training dtype (dims the "
                "recipe's float8 GEMM cannot take); use tp_overlap = false, or a model whose projections all take "
                "float8."
            )
        return module


class _MatmulReduceScatter(torch.autograd.Function):
    """A row-parallel linear's local product reduce-scattered along the sequence, as a ring overlapped
    with the GEMMs: [B, S, K / tp] x [N, K / tp] -> [B, S / tp, N] summed over tp. Backward takes the
    output-gradient shards around the ring once for both gradients. ``gemms``: the linear's float8 GEMMs
    (``linear.tp_gemms``) or None."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, mesh: DeviceMesh, weight: torch.Tensor, gemms: Float8Gemms | None
    ) -> torch.Tensor:
        ctx.mesh, ctx.gemms = mesh, gemms
        ctx.save_for_backward(x, weight)
        tp, batch = mesh.size(), x.shape[0]
        if gemms is None:
            return ring_reduce_scatter(lambda dest: F.linear(_rows(x, dest, tp), weight), _ring(mesh))
        # Whole, once for the ring's chunks: the input's per-token scales span the split K.
        rows, cast = gemms.cast_input(x.flatten(0, -2)), gemms.weight_for_output(weight)
        return ring_reduce_scatter(
            lambda dest: gemms.output(_sequence_rows(rows, batch, dest, tp), cast).unflatten(0, (batch, -1)),
            _ring(mesh),
        )

    @staticmethod
    def backward(ctx, grad_shard: torch.Tensor):
        x, weight = ctx.saved_tensors
        tp, batch, gemms = ctx.mesh.size(), x.shape[0], ctx.gemms
        want_input, want_params = pass_wants(ctx)
        blocks: list[torch.Tensor | None] = [None] * tp
        grad_weight = torch.zeros_like(weight) if want_params else None
        inputs = x.flatten(0, -2)
        if want_params and gemms is not None:
            inputs = gemms.cast_input(inputs, for_grad_weight=True)  # whole: scaled along all its tokens
        cast = gemms.weight_for_grad_input(weight) if want_input and gemms is not None else None  # once
        # The B pass of a split backward keeps the gathered gradient for its W pass (so does the
        # unoverlapped path: its gathered output gradient waits for W), which then sends nothing.
        gathered = ctx.__dict__.pop("gathered", None)
        keep = [None] * tp if want_input and not want_params else None

        def use(chunk: tuple, source: int) -> None:
            dy_input, dy_weight = chunk
            if want_input:
                rows = dy_input @ weight if gemms is None else gemms.grad_input(dy_input, cast)
                blocks[source] = rows.unflatten(0, (batch, -1))
            if want_params:
                x_rows = _sequence_rows(inputs, batch, source, tp)
                grad_weight.add_(dy_weight.t() @ x_rows if gemms is None else gemms.grad_weight(dy_weight, x_rows))
            if keep is not None:
                keep[source] = chunk

        if gathered is None:
            dy = grad_shard.flatten(0, -2)
            # Cast once per GEMM role, with the whole sequence's scales (its tokens are split over tp); a B pass
            # casts for its W pass too, which then reads the kept chunks. Where every cast is per token row the
            # ring sends the training dtype, which the GEMMs cast chunk by chunk: the float8 input-gradient
            # operand and the high-precision weight-gradient one would travel twice.
            for_weight = want_params or keep is not None
            pair = (
                (dy, dy)
                if gemms is None or gemms.casts_grad_output_per_row()
                else gemms.cast_grad_output(dy, want_input, for_weight, sequence_shard=True)
            )
            sent = _distinct(pair)
            ring_gather_rows(sent, _ring(ctx.mesh), lambda got, source: use(_as_pair(got, sent, pair), source))
        else:
            for source, chunk in enumerate(gathered):
                use(chunk, source)
        if keep is not None:
            ctx.gathered = keep
        return torch.cat(blocks, dim=1) if want_input else None, None, grad_weight, None


def _distinct(pair: tuple) -> list[torch.Tensor]:
    """The tensors of the (input-gradient, weight-gradient) operands ``pair`` a ring sends: each once (one
    cast serves both GEMMs where they scale alike), none for a GEMM that does not run (None)."""
    return [t for i, t in enumerate(pair) if t is not None and all(t is not u for u in pair[:i])]


def _as_pair(got: list[torch.Tensor], sent: list[torch.Tensor], pair: tuple) -> tuple:
    """A received chunk's operands in ``pair``'s places (``got`` holds the chunks of ``sent``)."""
    return tuple(None if t is None else got[next(i for i, u in enumerate(sent) if u is t)] for t in pair)


def _overlapped_rowwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    local = x.to_local() if isinstance(x, DTensor) else x
    return _MatmulReduceScatter.apply(local, self.weight.device_mesh, self.weight.to_local(), self.tp_gemms)


class OverlappedRowwise(ParallelStyle):
    """o_proj / down_proj under SP (``RowwiseParallel(output_layouts=Shard(1))``, the same ``Shard(1)``
    weight): local-feature input, sequence-sharded local output, the reduce-scatter done as a ring
    overlapped with the GEMM (:class:`_MatmulReduceScatter`). meshtron's blocks have no bias there."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear) or module.bias is not None:
            raise TypeError(f"OverlappedRowwise expects nn.Linear without bias, got {module}")
        split = distribute_tensor(module.weight, device_mesh, [Shard(1)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(split, requires_grad=module.weight.requires_grad))
        module.tp_gemms = split_gemms(module, device_mesh, "in", tuple(split.to_local().shape))
        module.forward = types.MethodType(_overlapped_rowwise_forward, module)
        module.sends_p2p = True
        return module


def apply_overlapped_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> nn.Module:
    """:func:`~meshtron.parallel.tensor.apply_tensor_parallel` with every block's SP collectives overlapped
    (:func:`overlap_plan`); ``[parallel] tp_overlap``."""
    if not sp:
        raise ConfigError("[parallel] tp_overlap = true overlaps sequence parallelism's collectives; set sp = true.")
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


__all__ = [
    "OverlappedColwise",
    "OverlappedRowwise",
    "RowPayload",
    "apply_overlapped_tensor_parallel",
    "overlap_plan",
    "ring_gather",
    "ring_gather_rows",
    "ring_reduce_scatter",
]
