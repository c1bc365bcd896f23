"""Tensor and sequence parallelism (Megatron's TP/SP) as DTensor ``parallelize_module`` plans.

Only the ``tp`` mesh dimension is touched. Layout per decoder block (Megatron-LM, Shoeybi et al. 2019;
sequence parallelism from Korthikanti et al. 2022):

* attention: q/k/v colwise (weights and biases split by head), o_proj rowwise; MLP gate/up colwise,
  down rowwise. The block input enters attention and the MLP once as a replicated DTensor, so the
  input gradients of q, k and v (gate and up) add up as partial sums and are reduced once.
* KV heads: split over tp when ``kv_heads % tp == 0``. When tp is a multiple of them (Qwen2.5-1.5B/3B
  have 2 KV heads), k_proj/v_proj stay replicated and each rank computes only the KV head its query
  heads read (:class:`ReplicatedKVHeads`); the replicas' weight gradients are summed over tp.
* embedding split over the vocabulary (:class:`VocabParallelEmbedding`: local lookups, one all-reduce,
  or reduce-scatter under SP, and a weight gradient for the local rows only), lm_head colwise
  (:class:`~meshtron.parallel.vocab_loss.VocabParallelHead`); in training the head and the loss are
  fused and chunked over tokens (no rank holds a micro-batch's logits); for inference logits stay
  vocab-sharded and :func:`~meshtron.parallel.vocab_loss.parallel_token_loss_sum` computes the loss
  from the shards (full logits are never gathered). Both live in ``parallel/vocab_loss.py``.
  Tied embeddings share one ``Shard(0)`` parameter.
* ``sp=True``: norms and the residual stream are split along the sequence; the all-reduce after
  o_proj/down_proj becomes a reduce-scatter and the one before q/k/v (gate/up) an all-gather.
  As in Megatron, q/k/v (gate/up) keep only the sequence shard of their input for backward and
  gather it again there (:class:`SequenceParallelColwise`), so every activation a dense block saves
  is split over tp.
* ``[train] fp8``: a float8 linear (torchao ``Float8Linear``) keeps its placement; :class:`Colwise`,
  :class:`Rowwise` and :class:`SequenceParallelColwise` (:class:`PackedProjections`) run its GEMMs on the
  local shards with the scales of the whole tensors (``meshtron.parallel.float8.Float8Gemms``: an amax
  all-reduce over tp where a scale spans a split dim); under SP the packed projections' input is gathered
  in float8. KV heads replicated over tp are refused with FP8 (no rank holds their whole output gradient).
* MoE: the block routes the tokens its rank holds (under SP its sequence shard, never gathered);
  the router is replicated and the shared expert follows the dense MLP plan. The routed experts and
  the router statistics are left to :func:`meshtron.parallel.expert.apply_expert_parallel` (apply
  it after this plan, also at ep = 1), which splits the experts' tokens over tp.

Collectives per dense layer: 2 all-reduces (no SP) or 2 all-gathers + 2 reduce-scatters (SP) in
forward, the same again in backward, as Megatron; under SP backward adds the 2 all-gathers that
re-gather the q/k/v and gate/up inputs. Replicated KV heads add 4 small all-reduces in backward
(k/v weight and bias gradients). With ``overlap`` (``[parallel] tp_overlap``, SP only) each of those
SP gathers and reduce-scatters is a ring of tp - 1 point-to-point exchanges of one sequence shard
overlapped with its GEMM (``tensor_overlap.py``): 4 rings forward, 6 backward, the same bytes, and no
all-gather or reduce-scatter left in the block. The tests count all of these; the MoE layer's counts
(shared expert, router, expert dispatch) are in ``benchmarks/results/moe_tp.md``.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshtron.config import ConfigError
from meshtron.parallel.float8 import float8_split_linear, is_float8_linear, split_gemms
from meshtron.parallel.tp_gradient import TpGradient, local_view, name_tp_gradients
from meshtron.parallel.vocab_loss import VocabParallelHead, shard_start
from meshtron.models.moe import MoE
from meshtron.torch_private import engine_will_execute, float8_from_parts, float8_parts, funcol, own_parameters

# Error messages list valid tp values up to one 8-GPU node (or tp itself when larger).
_SUGGEST_UP_TO = 8


def kv_heads_split(kv_heads: int, tp: int) -> bool:
    """Whether tp splits the KV heads (it divides them); if not, each rank computes one, replicated over
    tp / kv_heads ranks (:class:`ReplicatedKVHeads`). The rule's one owner: the native and HF tp plans,
    context parallelism and the planner call it."""
    return kv_heads % tp == 0


def local_kv_heads(kv_heads: int, tp: int) -> int:
    """KV heads each tp rank computes: its share, or one when they are replicated."""
    return kv_heads // tp if kv_heads_split(kv_heads, tp) else 1


def local_heads(heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    """Attention heads and KV heads per tp rank."""
    return heads // tp, local_kv_heads(kv_heads, tp)


def tp_fits(heads: int, kv_heads: int, tp: int) -> bool:
    """Query heads split evenly; KV heads split evenly or each replicated over tp / kv_heads ranks."""
    return heads % tp == 0 and (kv_heads_split(kv_heads, tp) or tp % kv_heads == 0)


def check_tensor_parallel(heads: int, kv_heads: int, tp: int) -> None:
    """Raise :class:`ConfigError` (before any collective) when the heads cannot be split over ``tp``."""
    if tp_fits(heads, kv_heads, tp):
        return
    limit = max(_SUGGEST_UP_TO, tp)
    valid = ", ".join(str(v) for v in range(1, limit + 1) if tp_fits(heads, kv_heads, v))
    if heads % tp:
        problem = f"tp = {tp} does not divide num_attention_heads = {heads}"
    else:
        problem = f"tp = {tp} and num_key_value_heads = {kv_heads} do not divide one another"
    raise ConfigError(f"[parallel] {problem}. Valid tp up to {limit} for this model: {valid}.")


_PARTIAL = TpGradient("partial")


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placement: Placement, src_data_rank: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


def _local_linear(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    return _split_linear(self, x, *_local_linear(self))


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
        _distribute_params(module, device_mesh, Replicate(), self.src_data_rank)
        # The replica weight gradients are summed over tp in backward (one all-reduce per tensor).
        module.tp_mesh = device_mesh
        module.tp_rows = (head * self.head_dim, (head + 1) * self.head_dim)
        if is_float8_linear(module):
            raise ConfigError(
                f"[train] fp8 with tp = {tp} > num_key_value_heads = {self.kv_heads}: the ranks that share a KV head "
                "each hold part of its projection's output gradient, which no rank can cast with the whole tensor's "
                f"scale. Use a tp that divides {self.kv_heads} or fp8 = 'none'.")

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
    return DTensor.from_local(part, self.weight.device_mesh, [Partial()], run_check=False)


class Rowwise(RowwiseParallel):
    """``RowwiseParallel``; a float8 linear (``[train] fp8``) computes its partial product from the local
    shards through :func:`meshtron.parallel.float8.float8_split_linear` (its scales those of the whole
    tensors), then reduces as ``RowwiseParallel`` does. meshtron's blocks have no bias there."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        gemms = split_gemms(module, device_mesh, "in", tuple(module.weight.to_local().shape))
        if gemms is not None:
            if module.bias is not None:
                raise TypeError(f"Rowwise computes a float8 linear without bias, got {module}")
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
            module, names, lambda name, p: local_view(p, module.tp_gradients[name]))
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
                raise ConfigError(f"tp = {device_mesh.size()} does not divide the {param.shape[0]} heads of "
                                  f"{type(module).__name__}.{name}; use a tp that divides them.")
            dist_param = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            owner.register_parameter(leaf, nn.Parameter(dist_param, requires_grad=param.requires_grad))
        module.forward = _forward_on_local_params(
            module, self.params, lambda _, p: p.to_local(grad_placements=[Shard(0)]))
        return module


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


def _pass_wants(ctx) -> tuple[bool, bool]:
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


def save_packed_projections(ctx, shard: torch.Tensor, mesh: DeviceMesh, projections: PackedProjections,
                            weights_and_biases: tuple) -> tuple[tuple, tuple]:
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
        rows = self.gemms[0].cast_sequence_shard(shard.flatten(0, -2), for_grad_weight) if self.float8_input else shard
        parts = float8_parts(rows)
        if parts is None:  # the training dtype (the recipe keeps this GEMM's input in it)
            gathering = _start_sequence_gather(shard, mesh)
            return lambda: _in_sequence_order(_waited(gathering), tp).flatten(0, -2)
        data, scale = parts
        data_gathering = _start_sequence_gather(data.view(shard.shape), mesh)
        per_token = scale.dim() > 0 and scale.shape[0] == data.shape[0] and scale.numel() > 1
        scale_gathering = _start_sequence_gather(scale.view(*shard.shape[:-1], 1), mesh) if per_token else None

        def finish() -> torch.Tensor:
            full = _in_sequence_order(_waited(data_gathering), tp).flatten(0, -2)
            full_scale = _in_sequence_order(_waited(scale_gathering), tp).flatten(0, -2) if per_token else scale
            return float8_from_parts(rows, full, full_scale)

        return finish

    def output(self, rows: torch.Tensor, lead: torch.Size, weights: tuple, biases: tuple) -> torch.Tensor:
        """The packed projections of the [tokens, in] ``rows`` (float8 or not), shaped ``lead`` + [packed]."""
        bias = torch.cat(biases) if biases[0] is not None else None
        if self.packed:
            return F.linear(rows, torch.cat(weights), bias).unflatten(0, lead)
        out = torch.cat([g.output(rows, w) if g else rows @ w.t() for g, w in zip(self.gemms, weights)], -1)
        out = out.unflatten(0, lead)
        return out if bias is None else out + bias.to(out.dtype)

    def grad_outputs(self, grad_packed: torch.Tensor, widths: list[int], for_input: bool, for_weight: bool):
        """Per projection its [tokens, width] output gradient for the input- and the weight-gradient GEMM (a
        float8 one cast once where both scale it alike); None where one packed GEMM serves them all."""
        if self.packed:
            return None
        dys = grad_packed.flatten(0, -2).split(widths, -1)
        return [g.cast_grad_output(dy.contiguous(), for_input, for_weight) if g else (dy, dy)
                for g, dy in zip(self.gemms, dys)]

    def grad_input(self, grad_packed: torch.Tensor, weights: list[torch.Tensor], dys) -> torch.Tensor:
        """The summed input gradient of the projections (this rank's columns: a partial sum over tp); ``dys``
        from :meth:`grad_outputs`."""
        if self.packed:
            return grad_packed @ torch.cat(weights)
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
    backward gets only the half it wants (:func:`_pass_wants`). The GEMMs are ``projections``'.
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, mesh: DeviceMesh, projections: PackedProjections,
                *weights_and_biases: torch.Tensor | None):
        weights, biases = save_packed_projections(ctx, shard, mesh, projections, weights_and_biases)
        full = projections.start_input_gather(shard, mesh)()
        lead = (shard.shape[0], shard.shape[1] * mesh.size(), *shard.shape[2:-1])
        return projections.output(full, torch.Size(lead), weights, biases)

    @staticmethod
    def backward(ctx, grad_packed: torch.Tensor):
        shard, *weights = ctx.saved_tensors
        count = len(weights)
        want_input, want_params = _pass_wants(ctx)
        gathered = ctx.projections.start_input_gather(shard, ctx.mesh, for_grad_weight=True) if want_params else None
        dys = ctx.projections.grad_outputs(grad_packed, ctx.widths, want_input, want_params)
        grad_shard = None
        if want_input:
            grad_full = ctx.projections.grad_input(grad_packed, weights, dys)
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
            _distribute_params(linear, mesh, Shard(0), self.src_data_rank)
            linear.tp_gemms = split_gemms(linear, mesh, "out", tuple(linear.weight.to_local().shape))
        else:
            raise TypeError(f"SequenceParallelColwise splits weights like ColwiseParallel or ReplicatedKVHeads, "
                            f"got {type(style).__name__}")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        linears = [module.get_submodule(name) for name in self.projections]
        if len({linear.bias is None for linear in linears}) > 1:
            raise ValueError(f"SequenceParallelColwise needs biases on all or none of {list(self.projections)}")
        start = 0
        for linear, style in zip(linears, self.projections.values()):
            self._split_weights(linear, style, device_mesh)
            width = _local_linear(linear)[0].shape[0]
            linear.tp_columns = (start, start + width)
            linear.forward = types.MethodType(_packed_columns_forward, linear)
            start += width
        projections = PackedProjections(linears)

        def project(_module, args):
            shard = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
            weights, biases = zip(*(_local_linear(linear) for linear in linears))
            packed = self.function.apply(shard, device_mesh, projections, *weights, *biases)
            return (packed, *args[1:])

        module.register_forward_pre_hook(project)
        return module


def residual_layout(sp: bool) -> Placement:
    """Layout of the residual stream between blocks over tp: sequence-sharded under SP, else replicated."""
    return Shard(1) if sp else Replicate()


def _colwise_group_plan(prefix: str, projections: dict[str, ParallelStyle], sp: bool,
                        inputs: int) -> dict[str, ParallelStyle]:
    """Column-parallel projections reading the first of the ``inputs`` inputs of module ``prefix``.

    Without SP one replicated DTensor feeds them all, so their input gradients add up as partial
    sums and are reduced once; under SP :class:`SequenceParallelColwise` does the same from the shard.
    """
    if sp:
        return {prefix: SequenceParallelColwise(projections)}
    layouts = (Replicate(),) + (None,) * (inputs - 1)
    return {
        prefix: PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts, use_local_output=False),
        **{f"{prefix}.{name}": style for name, style in projections.items()},
    }


def _mlp_plan(prefix: str, sp: bool) -> dict[str, ParallelStyle]:
    projections = {"gate_proj": Colwise(), "up_proj": Colwise()}
    return {
        **_colwise_group_plan(prefix, projections, sp, inputs=1),
        f"{prefix}.down_proj": Rowwise(output_layouts=residual_layout(sp)),
    }


def _moe_plan(prefix: str, moe: MoE, sp: bool) -> dict[str, ParallelStyle]:
    """The MoE block works on the tokens this tp rank holds: its sequence shard under SP (routed
    without gathering; the router statistics are made global by expert parallelism), else all of
    them (expert parallelism then dispatches 1/tp of them per rank). The shared expert is a dense
    MLP with the dense plan: under SP one all-gather in, one reduce-scatter out."""
    plan: dict[str, ParallelStyle] = {f"{prefix}.gate": ReplicateParallel(grad="partial" if sp else "replicate")}
    if sp:
        plan[prefix] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
    if moe.shared_expert is not None:
        plan.update(_mlp_plan(f"{prefix}.shared_expert", sp))
        plan[f"{prefix}.shared_expert_gate"] = ReplicateParallel(grad="partial" if sp else "replicate")
    return plan


def _block_plan(block: nn.Module, kv_heads: int, head_dim: int, tp: int, sp: bool) -> dict[str, ParallelStyle]:
    kv_style = Colwise() if kv_heads_split(kv_heads, tp) else ReplicatedKVHeads(kv_heads, head_dim)
    projections = {"q_proj": Colwise(), "k_proj": kv_style, "v_proj": kv_style}
    plan = _colwise_group_plan("self_attn", projections, sp, inputs=2)  # (hidden states, rope)
    plan["self_attn.o_proj"] = Rowwise(output_layouts=residual_layout(sp))
    if sp:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
    if isinstance(block.mlp, MoE):
        plan.update(_moe_plan("mlp", block.mlp, sp))
    else:
        plan.update(_mlp_plan("mlp", sp))
    return plan


def _default_positions_hook(tp: int):
    """Under SP the hidden states entering a later pipeline stage hold S / tp positions; fill in
    ``position_ids`` for the full (local-to-CP) sequence so RoPE covers every position."""

    def hook(model, args, kwargs):
        if len(args) > 1 or kwargs.get("position_ids") is not None:
            return None
        tokens = args[0] if args else kwargs["tokens"]
        seq = tokens.shape[1] if model.embed_tokens is not None else tokens.shape[1] * tp
        if seq % tp:
            raise ConfigError(
                f"sequence parallelism splits the sequence over tp = {tp}, but the sequence has {seq} "
                f"tokens. Use a seq_len divisible by {tp} or set [parallel] sp = false."
            )
        kwargs["position_ids"] = torch.arange(seq, device=tokens.device).expand(tokens.shape[0], -1)
        return args[:1], kwargs

    return hook


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sp: bool = False,
                          restyle: Callable[[dict[str, ParallelStyle]], dict[str, ParallelStyle]] | None = None
                          ) -> nn.Module:
    """Shard ``model`` (a meshtron ``Transformer`` or a pipeline stage of one) over ``tp_mesh``.

    Works on meta-device models (then ``to_empty``, ``tie_weights`` and fill, e.g. with
    ``meshtron.checkpoint.fill_local_slices`` as ``materialize_sharded`` does) and on materialised
    ones (the full weights are split; the first tp rank's copy wins). The model's logits come out as a vocab-sharded DTensor
    (``Shard(-1)``); compute the loss with :func:`~meshtron.parallel.vocab_loss.parallel_token_loss_sum`. ``restyle`` rewrites each
    block's plan (``meshtron.parallel.tensor_overlap.apply_overlapped_tensor_parallel`` overlaps the SP
    collectives with their GEMMs).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel expects the 1-D tp mesh (mesh['tp']), got {tp_mesh.ndim} dims")
    cfg = model.config
    tp = tp_mesh.size()
    check_tensor_parallel(cfg.num_attention_heads, cfg.kv_heads, tp)
    if tp == 1:
        return model
    if model.embed_tokens is not None:
        parallelize_module(model.embed_tokens, tp_mesh, VocabParallelEmbedding(residual_layout(sp)))
    for block in model.layers.values():
        plan = _block_plan(block, cfg.kv_heads, cfg.head_size, tp, sp)
        parallelize_module(block, tp_mesh, restyle(plan) if restyle else plan)
    if model.norm is not None and sp:
        parallelize_module(model.norm, tp_mesh, SequenceParallel())
    if model.lm_head is not None:
        parallelize_module(model.lm_head, tp_mesh, VocabParallelHead(residual_layout(sp)))
    # Both now hold a Shard(0) copy of the shared weight; make them one Parameter again.
    model.tie_weights()
    name_tp_gradients(model)
    if sp:
        model.register_forward_pre_hook(_default_positions_hook(tp), with_kwargs=True)
    return model


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
            raise ConfigError(f"tensor parallelism splits the embedding over the vocabulary; {type(module).__name__} "
                              "with max_norm, scale_grad_by_freq or sparse gradients is not supported.")
        _distribute_params(module, device_mesh, Shard(0), self.src_data_rank)
        module.output_layout = self.output_layout
        module.forward = types.MethodType(_vocab_parallel_embedding_forward, module)
        return module


__all__ = [
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "kv_heads_split",
    "local_heads",
    "local_kv_heads",
    "residual_layout",
    "tp_fits",
    "ReplicatedKVHeads",
    "ReplicateParallel",
    "SequenceParallelColwise",
    "SplitParams",
    "VocabParallelEmbedding",
    "owned",
    "Colwise",
    "PackedProjections",
    "Rowwise",
]
