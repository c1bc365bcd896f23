"""The tp styles (``ParallelStyle`` s) that split meshtron's linears, embeddings and bare parameters over tp.

Applied by the native plan (``parallel/tensor.py``) and the HF plan (``hf/tp_plan.py``), which choose which
module gets which style; kept apart from them so that a style's weight split and forward are read in one
place. See docs/training.md#tensor-and-sequence-parallelism.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from meshtron.config import ConfigError
from meshtron.parallel.float8 import float8_split_linear, is_float8_linear, split_gemms
from meshtron.parallel.tp_gradient import TpGradient, local_view
from meshtron.parallel.vocab_loss import shard_start
from meshtron.torch_private import own_parameters

_PARTIAL = TpGradient("partial")


def distribute_params(module: nn.Module, mesh: DeviceMesh, placement: Placement, src_data_rank: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


def local_linear(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's output rows of a column-split linear (weight, bias), differentiable into the DTensor
    parameters: a ``Shard(0)`` split, or the rows of the KV head a :class:`ReplicatedKVHeads` rank computes."""
    if hasattr(linear, "tp_rows"):
        rows = slice(*linear.tp_rows)
        weight = local_view(linear.weight, _PARTIAL)[rows]
        return weight, local_view(linear.bias, _PARTIAL)[rows] if linear.bias is not None else None
    return linear.weight.to_local(), linear.bias.to_local() if linear.bias is not None else None


def _split_linear(linear: nn.Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` on this rank's pieces: in float8 with whole-tensor scales where FP8 converted it
    (``linear.tp_gemms``, :func:`meshtron.parallel.float8.split_gemms`), else ``F.linear``."""
    gemms = getattr(linear, "tp_gemms", None)
    return F.linear(x, weight, bias) if gemms is None else float8_split_linear(x, weight, bias, gemms)


def _local_colwise_forward(self: nn.Linear, x: torch.Tensor | DTensor) -> torch.Tensor:
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, self.tp_mesh, [Replicate()])
    # This rank's input gradient covers only its heads; labelling it partial lets DTensor sum it
    # with the other projections' partial gradients before the single reduction.
    x = x.to_local(grad_placements=[Partial()])
    return _split_linear(self, x, *local_linear(self))


class ReplicatedKVHeads(ParallelStyle):
    """k_proj/v_proj when tp is a multiple of the KV head count: replicate each KV head over
    ``tp // kv_heads`` ranks.

    The weight stays a full Replicate parameter (checkpoints and optimizers see the usual shape);
    rank r computes only KV head ``r // (tp // kv_heads)``, the one its query heads attend with.
    """

    def __init__(self, kv_heads: int, head_dim: int):
        super().__init__()
        self.kv_heads = kv_heads
        self.head_dim = head_dim

    def split_weights(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        """Replicate the parameters and record which rows (KV head) this rank computes."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ReplicatedKVHeads expects nn.Linear, got {type(module).__name__}")
        tp = device_mesh.size()
        head = device_mesh.get_local_rank() // (tp // self.kv_heads)
        distribute_params(module, device_mesh, Replicate(), self.src_data_rank)
        # The replica weight gradients are summed over tp in backward (one all-reduce per tensor).
        module.tp_mesh = device_mesh
        module.tp_rows = (head * self.head_dim, (head + 1) * self.head_dim)
        if is_float8_linear(module):
            raise ConfigError(
                f"[train] fp8 with tp = {tp} > num_key_value_heads = {self.kv_heads}: the ranks that share a KV head "
                "each hold part of its projection's output gradient, which no rank can cast with the whole tensor's "
                f"scale. Use a tp that divides {self.kv_heads} or fp8 = 'none'."
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.split_weights(module, device_mesh)
        module.forward = types.MethodType(_local_colwise_forward, module)
        return module


def _float8_colwise_forward(self: nn.Linear, x: DTensor) -> DTensor:
    return DTensor.from_local(_local_colwise_forward(self, x), self.tp_mesh, [Shard(-1)], run_check=False)


class Colwise(ColwiseParallel):
    """``ColwiseParallel``; a float8 linear (``[train] fp8``) computes on the local shards through
    :func:`meshtron.parallel.float8.float8_split_linear` (its scales those of the whole tensors)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        gemms = split_gemms(module, device_mesh, "out", tuple(module.weight.to_local().shape))
        if gemms is not None:
            module.tp_mesh, module.tp_gemms = device_mesh, gemms
            module.forward = types.MethodType(_float8_colwise_forward, module)
        return module


def _float8_rowwise_forward(self: nn.Linear, x: DTensor) -> DTensor:
    part = float8_split_linear(x.to_local(), self.weight.to_local(), None, self.tp_gemms)
    out = DTensor.from_local(part, self.weight.device_mesh, [Partial()], run_check=False)
    # A replicated bias joins the partial sums once (DTensor adds it on one rank), in the output dtype as
    # Float8Linear adds it; its gradient is the whole output gradient's.
    return out if self.bias is None else out + self.bias.to(out.dtype)


class Rowwise(RowwiseParallel):
    """``RowwiseParallel``; a float8 linear (``[train] fp8``) computes its partial product from the local
    shards through :func:`meshtron.parallel.float8.float8_split_linear` (its scales those of the whole
    tensors), adds its bias, if any, once, then reduces as ``RowwiseParallel`` does."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        gemms = split_gemms(module, device_mesh, "in", tuple(module.weight.to_local().shape))
        if gemms is not None:
            module.tp_gemms = gemms
            module.forward = types.MethodType(_float8_rowwise_forward, module)
        return module


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over tp, run on plain local tensors (the MoE router and shared-expert gate,
    and parameters no HF plan names).

    The parameters become Replicate DTensors, like the norms under SP, so the gradient-norm and
    checkpoint code see them as tp-replicated rather than as per-rank tensors. The forward computes
    with their local views (DTensor math would refuse the router's plain ``expert_bias`` buffer).
    ``grad`` is their :class:`TpGradient` mode: ``"partial"`` where the tp ranks feed different
    tokens (sequence parallelism) or features, ``"replicate"`` where they compute the same thing
    (verified on the first backward), ``"infer"`` where nothing says which. ``params``: the names,
    relative to the module, of the parameters its forward (and everything it calls) reads as local
    views; default its own. A decoder block takes all its unplanned ones, so a module that reads a
    child's weight directly (a convolution kernel handed to a fused kernel) sees the local view too.
    """

    def __init__(self, grad: str = "replicate", params: list[str] | None = None):
        super().__init__()
        TpGradient(grad)  # validates the mode
        self.grad, self.params = grad, params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = self.params if self.params is not None else [n for n, _ in module.named_parameters(recurse=False)]
        for name in names:
            owner, leaf = _owner(module, name)
            param = own_parameters(owner)[leaf]
            dist_param = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(dist_param, requires_grad=param.requires_grad))
        module.tp_gradients = {name: TpGradient(self.grad, name) for name in names}
        module.forward = _forward_on_local_params(
            module, names, lambda name, p: local_view(p, module.tp_gradients[name])
        )
        return module


class SplitParams(ParallelStyle):
    """Bare parameters of a module split over tp along dim 0, one value per head (HY-V4's learned
    attention sinks), run on plain local shards: the module's heads are split by its projections, so
    this rank's shard is the values of its own heads. Each rank's gradient is its own heads' whole, so
    the shard's gradient is nothing more (no communication)."""

    def __init__(self, params: list[str]):
        super().__init__()
        self.params = params

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.params:
            owner, leaf = _owner(module, name)
            param = own_parameters(owner)[leaf]
            if param.shape[0] % device_mesh.size():
                raise ConfigError(
                    f"tp = {device_mesh.size()} does not divide the {param.shape[0]} heads of "
                    f"{type(module).__name__}.{name}; use a tp that divides them."
                )
            dist_param = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(dist_param, requires_grad=param.requires_grad))
        module.forward = _forward_on_local_params(
            module, self.params, lambda _, p: p.to_local(grad_placements=[Shard(0)])
        )
        return module


class PartialSum(ParallelStyle):
    """transformers' ``all_reduce`` style: a module whose bare parameters are split over tp (``splits``: name ->
    dim) so that each rank computes a part of its output, summed once over tp (Inkling's shared experts:
    gate / up split on their intermediate features, down on its input). It reads its inputs whole on every
    rank, so their gradients, each rank's a part, are summed over tp; its parameters' gradients are their
    shards' (no communication). Tokens must be the same on every tp rank (not SP's slices)."""

    def __init__(self, splits: dict[str, int]):
        super().__init__()
        self.splits = splits

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, dim in self.splits.items():
            owner, leaf = _owner(module, name)
            param = own_parameters(owner)[leaf]
            if param.shape[dim] % device_mesh.size():
                raise ConfigError(
                    f"tp = {device_mesh.size()} does not divide dim {dim} ({param.shape[dim]}) of "
                    f"{type(module).__name__}.{name}; use a tp that divides it."
                )
            dist_param = distribute_tensor(param, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(dist_param, requires_grad=param.requires_grad))
        local = _forward_on_local_params(
            module, list(self.splits), lambda name, p: p.to_local(grad_placements=[Shard(self.splits[name])])
        )

        def forward(*args, **kwargs):
            args = [_read_whole(a, device_mesh) for a in args]
            kwargs = {k: _read_whole(v, device_mesh) for k, v in kwargs.items()}
            part = local(*args, **kwargs)
            return DTensor.from_local(part, device_mesh, [Partial()], run_check=False).full_tensor()

        module.forward = forward
        return module


def _read_whole(value, mesh: DeviceMesh):
    """A floating tensor every tp rank reads whole: unchanged, its gradient (a part on each rank) summed."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or not value.is_floating_point():
        return value
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(the submodule holding parameter ``name``, its own name for it)."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _forward_on_local_params(module: nn.Module, names: list[str], view: Callable[[str, DTensor], torch.Tensor]):
    """``module``'s forward with each parameter of ``names`` swapped for ``view(name, parameter)``."""
    run = module.forward
    owners = [(name, *_owner(module, name)) for name in names]

    def forward(*args, **kwargs):
        # Swapped only for this call: FSDP may install other parameter objects between calls.
        held = [(owner, leaf, own_parameters(owner)[leaf]) for _, owner, leaf in owners]
        for (name, owner, leaf), (_, _, param) in zip(owners, held):
            if param is not None:
                own_parameters(owner)[leaf] = view(name, param)
        try:
            return run(*args, **kwargs)
        finally:
            for owner, leaf, param in held:
                own_parameters(owner)[leaf] = param

    return forward


class _VocabShardLookup(torch.autograd.Function):
    """This rank's rows of a vocabulary-split embedding: ids outside ``[start, start + rows)`` look up
    zeros (the other ranks' rows hold them). The weight gradient is computed for the local rows only,
    [V / tp, H]: DTensor's own embedding backward on a ``Shard(0)`` weight builds the whole [V, H]
    gradient on every rank (Replicate) and slices it afterwards (1.0 GiB bf16 at the 7B vocabulary,
    2.3 GiB at 72B's hidden size, and twice that in fp32 where FSDP accumulates micro-batches)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, start: int, padding_idx: int | None):
        outside = (ids < start) | (ids >= start + weight.shape[0])
        local_ids = (ids - start).masked_fill(outside, 0)
        ctx.save_for_backward(local_ids, outside)
        ctx.rows = weight.shape[0]
        local_padding = padding_idx - start if padding_idx is not None else -1
        ctx.padding_idx = local_padding if 0 <= local_padding < weight.shape[0] else -1
        return F.embedding(local_ids, weight).masked_fill(outside.unsqueeze(-1), 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        local_ids, outside = ctx.saved_tensors
        grad = grad.masked_fill(outside.unsqueeze(-1), 0)
        weight_grad = torch.ops.aten.embedding_dense_backward(grad, local_ids, ctx.rows, ctx.padding_idx, False)
        return None, weight_grad, None, None


class _Owned(torch.autograd.Function):
    """The same storage, no longer an autograd view. DTensor's ``to_local`` output is a view of the DTensor,
    which autograd forbids modifying in place and FSDP2 warns about as a module output (an in-place op on
    a view would drop its pre-backward hook). Nothing downstream saves the DTensor, and the version
    counter is shared, so an op that saved the output still catches an in-place edit; no copy is made."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def owned(local: torch.Tensor) -> torch.Tensor:
    """``local`` (a ``to_local`` result) as a tensor its consumers may edit in place (:class:`_Owned`)."""
    return _Owned.apply(local)


def _vocab_parallel_embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    mesh = self.weight.device_mesh
    ids = ids.to_local() if isinstance(ids, DTensor) else ids
    start = shard_start(self.weight.shape[0], mesh)
    part = _VocabShardLookup.apply(ids, self.weight.to_local(), start, self.padding_idx)
    # Each rank holds its vocabulary rows' share: summed over tp (reduce-scattered along the sequence under SP).
    out = DTensor.from_local(part, mesh, [Partial()], run_check=False).redistribute(mesh, [self.output_layout])
    return owned(out.to_local())  # FSDP wraps the embedding: no view as a unit's output


class VocabParallelEmbedding(ParallelStyle):
    """The input embedding split over the vocabulary (weight ``Shard(0)``, as ``RowwiseParallel``), ids
    replicated over tp, output ``output_layout`` as a local tensor (the residual stream: replicated, or
    sequence-split under SP). Forward: local lookup of this rank's rows, then one all-reduce (or
    reduce-scatter); backward: the output gradient (gathered under SP) turned into the local rows'
    weight gradient only, as Megatron's VocabParallelEmbedding."""

    def __init__(self, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding expects nn.Embedding, got {type(module).__name__}")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ConfigError(
                f"tensor parallelism splits the embedding over the vocabulary; {type(module).__name__} "
                "with max_norm, scale_grad_by_freq or sparse gradients is not supported."
            )
        distribute_params(module, device_mesh, Shard(0), self.src_data_rank)
        module.output_layout = self.output_layout
        module.forward = types.MethodType(_vocab_parallel_embedding_forward, module)
        return module


__all__ = [
    "Colwise",
    "PartialSum",
    "ReplicateParallel",
    "ReplicatedKVHeads",
    "Rowwise",
    "SplitParams",
    "VocabParallelEmbedding",
    "distribute_params",
    "local_linear",
    "owned",
]
