"""Tensor and sequence parallelism (Megatron's TP/SP) as DTensor ``parallelize_module`` plans.

Owns the native plan (which module gets which style; the styles are in ``tp_styles.py`` and
``sp_projections.py``), the rule on heads vs tp and :func:`apply_tensor_parallel`. See
docs/training.md#tensor-and-sequence-parallelism for the layout per block and its collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, SequenceParallel, parallelize_module

from meshtron.config import ConfigError
from meshtron.models.moe import MoE
from meshtron.models.qwen2 import MTPBlock
from meshtron.parallel.sp_projections import SequenceParallelColwise
from meshtron.parallel.tp_gradient import name_tp_gradients
from meshtron.parallel.tp_styles import Colwise, ReplicatedKVHeads, ReplicateParallel, Rowwise, VocabParallelEmbedding
from meshtron.parallel.vocab_loss import VocabParallelHead

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


def residual_layout(sp: bool) -> Placement:
    """Layout of the residual stream between blocks over tp: sequence-sharded under SP, else replicated."""
    return Shard(1) if sp else Replicate()


def _colwise_group_plan(
    prefix: str, projections: dict[str, ParallelStyle], sp: bool, inputs: int
) -> dict[str, ParallelStyle]:
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


def _block_tp_plan(block: nn.Module, kv_heads: int, head_dim: int, tp: int, sp: bool) -> dict[str, ParallelStyle]:
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
    if isinstance(block, MTPBlock):
        plan.update(_mtp_plan(sp))
    return plan


def _mtp_plan(sp: bool) -> dict[str, ParallelStyle]:
    """An MTP module's own parts around its block: ``eh_proj`` maps the whole hidden width, so it is replicated
    over tp and works on the tokens this rank holds (under SP its shard: partial weight gradients); the norms
    are the block's norms' (SP: on the shard)."""
    plan: dict[str, ParallelStyle] = {"eh_proj": ReplicateParallel(grad="partial" if sp else "replicate")}
    if sp:  # eh_proj computes on local tensors
        plan["enorm"] = SequenceParallel(use_local_output=True)
        plan["hnorm"] = SequenceParallel(use_local_output=True)
        plan["norm"] = SequenceParallel()
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


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    sp: bool = False,
    restyle: Callable[[dict[str, ParallelStyle]], dict[str, ParallelStyle]] | None = None,
) -> nn.Module:
    """Shard ``model`` (a meshtron ``Transformer`` or a pipeline stage of one) over ``tp_mesh``.

    Works on meta-device models (then ``to_empty``, ``tie_weights`` and fill, e.g. with
    ``meshtron.checkpoint.fill_local_slices`` as ``materialize_sharded`` does) and on materialised
    ones (the full weights are split; the first tp rank's copy wins). The model's logits come out as a vocab-sharded
    DTensor (``Shard(-1)``); compute the loss with :func:`~meshtron.parallel.vocab_loss.parallel_token_loss_sum`.
    ``restyle`` rewrites each block's plan (``meshtron.parallel.tensor_overlap.apply_overlapped_tensor_parallel``
    overlaps the SP collectives with their GEMMs).
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
        plan = _block_tp_plan(block, cfg.kv_heads, cfg.head_size, tp, sp)
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


__all__ = [
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "kv_heads_split",
    "local_heads",
    "local_kv_heads",
    "residual_layout",
    "tp_fits",
]
