"""Tensor and sequence parallelism (Megatron's TP/SP) as DTensor ``parallelize_module`` plans.

Only the ``tp`` mesh dimension is touched. Layout per decoder block (Megatron-LM, Shoeybi et al. 2019;
sequence parallelism from Korthikanti et al. 2022):

* attention: q/k/v colwise (weights and biases split by head), o_proj rowwise; MLP gate/up colwise,
  down rowwise. The block input enters attention and the MLP once as a replicated DTensor, so the
  input gradients of q, k and v (gate and up) add up as partial sums and are reduced once.
* KV heads: split over tp when ``kv_heads % tp == 0``. When tp is a multiple of them (Qwen2.5-1.5B/3B
  have 2 KV heads), k_proj/v_proj stay replicated and each rank computes only the KV head its query
  heads read (:class:`ReplicatedKVHeads`); the replicas' weight gradients are summed over tp.
* embedding rowwise over the vocabulary, lm_head colwise; logits stay vocab-sharded and
  :func:`parallel_token_loss_sum` computes the loss from the shards (full logits are never gathered).
  Tied embeddings share one ``Shard(0)`` parameter.
* ``sp=True``: norms and the residual stream are split along the sequence; the all-reduce after
  o_proj/down_proj becomes a reduce-scatter and the one before q/k/v (gate/up) an all-gather.
* MoE: routed experts are left to expert parallelism. Every tp rank runs them on the same (gathered)
  tokens, so routing, expert outputs and router statistics are identical replicas; the router is a
  replicated DTensor and the shared expert follows the dense MLP plan.

Collectives per dense layer: 2 all-reduces (no SP) or 2 all-gathers + 2 reduce-scatters (SP) in
forward, the same again in backward, as Megatron. Replicated KV heads add 4 small all-reduces in
backward (k/v weight and bias gradients); a MoE layer under SP all-reduces its shared expert's output
where a dense MLP reduce-scatters. The tests count all of these.
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
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshtron.config import ConfigError
from meshtron.models.moe import MoE
from meshtron.models.qwen2 import token_loss_sum

# Error messages list valid tp values up to one 8-GPU node (or tp itself when larger).
_SUGGEST_UP_TO = 8


def tp_fits(heads: int, kv_heads: int, tp: int) -> bool:
    """Query heads split evenly; KV heads split evenly or each replicated over tp / kv_heads ranks."""
    return heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)


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


class _SumGradOverMesh(torch.autograd.Function):
    """Local view of a replicated DTensor whose gradient is summed over the mesh in backward.

    Each rank's gradient is its partial contribution (it used only part of the weight); the sum is
    the true gradient, stored as a Replicate DTensor like the parameter.
    """

    @staticmethod
    def forward(ctx, param: DTensor) -> torch.Tensor:
        ctx.mesh = param.device_mesh
        local = param.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> DTensor:
        return DTensor.from_local(grad, ctx.mesh, [Partial()]).redistribute(ctx.mesh, [Replicate()])


def _replicate_params(module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = distribute_tensor(param, mesh, [Replicate()], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


def _replicated_head_forward(self: nn.Linear, x: torch.Tensor | DTensor) -> torch.Tensor:
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, self.tp_mesh, [Replicate()])
    # This rank's input gradient covers only its heads; labelling it partial lets DTensor sum it
    # with the other projections' partial gradients before the single reduction.
    x = x.to_local(grad_placements=[Partial()])
    rows = slice(*self.tp_rows)
    weight = _SumGradOverMesh.apply(self.weight)[rows]
    bias = _SumGradOverMesh.apply(self.bias)[rows] if self.bias is not None else None
    return F.linear(x, weight, bias)


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

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ReplicatedKVHeads expects nn.Linear, got {type(module).__name__}")
        tp = device_mesh.size()
        head = device_mesh.get_local_rank() // (tp // self.kv_heads)
        _replicate_params(module, device_mesh, self.src_data_rank)
        # The replica weight gradients are summed over tp in backward (one all-reduce per tensor).
        module.tp_mesh = device_mesh
        module.tp_rows = (head * self.head_dim, (head + 1) * self.head_dim)
        module.forward = types.MethodType(_replicated_head_forward, module)
        return module


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over tp, computed redundantly on identical inputs (the MoE router).

    Plain tensors in and out. The parameters become Replicate DTensors, like the norms under SP, so
    the gradient-norm and checkpoint code see them as tp-replicated rather than as per-rank tensors.
    Their gradients are already identical on every tp rank (same inputs, same output gradients).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_module, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [Replicate()]) if isinstance(t, torch.Tensor) else t
                         for t in inputs)

        def to_local(_module, outputs, _mesh):
            if isinstance(outputs, DTensor):
                return outputs.to_local()
            local = [o.to_local() if isinstance(o, DTensor) else o for o in outputs]
            return type(outputs)(*local) if hasattr(outputs, "_fields") else type(outputs)(local)  # namedtuples

        return distribute_module(
            module,
            device_mesh,
            lambda _name, mod, mesh: _replicate_params(mod, mesh, self.src_data_rank),
            input_fn=to_dtensor,
            output_fn=to_local,
        )


def residual_layout(sp: bool) -> Placement:
    """Layout of the residual stream between blocks over tp: sequence-sharded under SP, else replicated."""
    return Shard(1) if sp else Replicate()


def _mlp_plan(prefix: str, sp: bool) -> dict[str, ParallelStyle]:
    return {
        # One replicated DTensor feeds gate and up, so their input gradients are reduced once.
        prefix: PrepareModuleInput(
            input_layouts=(residual_layout(sp),), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        f"{prefix}.gate_proj": ColwiseParallel(),
        f"{prefix}.up_proj": ColwiseParallel(),
        f"{prefix}.down_proj": RowwiseParallel(output_layouts=residual_layout(sp)),
    }


def _moe_plan(prefix: str, moe: MoE, sp: bool) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {f"{prefix}.gate": ReplicateParallel()}
    if sp:
        # Routing needs every token: gather the sequence, run the (replicated) MoE on all of it and
        # keep this rank's slice of the output (no communication: every rank holds the full output).
        plan[prefix] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            input_kwarg_layouts=None,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_input=True,
        )
    if moe.shared_expert is not None:
        # Inside the MoE every rank holds all tokens, so the shared expert runs without SP.
        plan.update(_mlp_plan(f"{prefix}.shared_expert", sp=False))
        plan[f"{prefix}.shared_expert_gate"] = ReplicateParallel()
    return plan


def _block_plan(block: nn.Module, kv_heads: int, head_dim: int, tp: int, sp: bool) -> dict[str, ParallelStyle]:
    kv_style = ColwiseParallel() if kv_heads % tp == 0 else ReplicatedKVHeads(kv_heads, head_dim)
    plan: dict[str, ParallelStyle] = {
        "self_attn": PrepareModuleInput(
            input_layouts=(residual_layout(sp), None), desired_input_layouts=(Replicate(), None), use_local_output=False
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": kv_style,
        "self_attn.v_proj": kv_style,
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual_layout(sp)),
    }
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


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sp: bool = False) -> nn.Module:
    """Shard ``model`` (a meshtron ``Transformer`` or a pipeline stage of one) over ``tp_mesh``.

    Works on meta-device models (then ``to_empty``, ``tie_weights`` and fill, e.g. with
    ``meshtron.checkpoint.fill_local_slices`` as ``materialize_sharded`` does) and on materialised
    ones (the full weights are split; the first tp rank's copy wins). The model's logits come out as a vocab-sharded DTensor
    (``Shard(-1)``); compute the loss with :func:`parallel_token_loss_sum`.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel expects the 1-D tp mesh (mesh['tp']), got {tp_mesh.ndim} dims")
    cfg = model.config
    tp = tp_mesh.size()
    check_tensor_parallel(cfg.num_attention_heads, cfg.kv_heads, tp)
    if tp == 1:
        return model
    if model.embed_tokens is not None:
        parallelize_module(
            model.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=residual_layout(sp))
        )
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, cfg.kv_heads, cfg.head_size, tp, sp))
    if model.norm is not None and sp:
        parallelize_module(model.norm, tp_mesh, SequenceParallel())
    if model.lm_head is not None:
        parallelize_module(
            model.lm_head,
            tp_mesh,
            ColwiseParallel(input_layouts=residual_layout(sp), output_layouts=Shard(-1), use_local_output=False),
        )
    # Both now hold a Shard(0) copy of the shared weight; make them one Parameter again.
    model.tie_weights()
    if sp:
        model.register_forward_pre_hook(_default_positions_hook(tp), with_kwargs=True)
    return model


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of vocab-sharded logits: two small all-reduces of per-token values.

    logits: [N, V_local] (this rank's vocabulary columns ``[start, start + V_local)``), labels: [N].
    """

    @staticmethod
    def forward(ctx, logits, labels, start: int, group, ignore_index: int):
        with torch.no_grad():
            row_max = logits.max(dim=-1).values
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            exp = (logits - row_max.unsqueeze(-1)).exp_()
            local = labels - start
            mine = (local >= 0) & (local < logits.shape[-1])
            index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
            target = (logits.gather(-1, index).squeeze(-1) - row_max) * mine
            sums = torch.stack([exp.sum(dim=-1), target])
            dist.all_reduce(sums, group=group)
            counted = labels != ignore_index
            loss = ((sums[0].log() - sums[1]) * counted).sum()
            exp.div_(sums[0].unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, index, mine & counted, counted)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine, counted = ctx.saved_tensors
        grad_logits = softmax * counted.unsqueeze(-1)
        grad_logits.scatter_add_(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        return grad_logits * grad, None, None, None, None


def _vocab_shard(logits: DTensor) -> tuple[int, DeviceMesh] | None:
    """(start column, mesh) when ``logits`` is split only along its last dim on a 1-D mesh."""
    (placement,) = logits.placements if logits.device_mesh.ndim == 1 else (None,)
    if not (isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1)):
        return None
    mesh = logits.device_mesh
    chunk = math.ceil(logits.shape[-1] / mesh.size())  # torch.chunk layout, as DTensor uses
    return min(mesh.get_local_rank() * chunk, logits.shape[-1]), mesh


def parallel_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """:func:`meshtron.models.token_loss_sum` for plain or vocab-sharded (``Shard(-1)`` DTensor) logits.

    With sharded logits only per-token maxima, exp-sums and target logits are all-reduced over tp;
    the result is a plain scalar, identical on every tp rank. Backward needs no communication.
    """
    if not isinstance(logits, DTensor):
        return token_loss_sum(logits, labels, ignore_index)
    shard = _vocab_shard(logits)
    if shard is None:
        raise ValueError(f"parallel_token_loss_sum expects logits sharded on the vocab dim, got {logits.placements}")
    start, mesh = shard
    local = logits.to_local().flatten(0, -2).float()
    labels = labels.flatten().to(local.device)
    return _VocabParallelCrossEntropy.apply(local, labels, start, mesh.get_group(), ignore_index)


__all__ = [
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "parallel_token_loss_sum",
    "residual_layout",
    "tp_fits",
    "ReplicatedKVHeads",
    "ReplicateParallel",
]
