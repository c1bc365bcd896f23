"""Parallelize a HuggingFace ``*ForCausalLM`` over a meshtron mesh, and stream its weights in sharded.

:func:`parallelize_hf_model` reads the model's own tensor-parallel plan (``config.base_model_tp_plan``,
the same table transformers' ``tp_plan="auto"`` uses) and turns each style into a DTensor
``ParallelStyle``; what transformers' inference-oriented plan lacks for training is added here:

* vocab-parallel embedding and lm_head: the logits stay ``Shard(-1)`` and the model's
  ``loss_function`` is replaced by the vocab-parallel cross-entropy of :mod:`meshtron.parallel.tensor`,
  so ``model(input_ids=..., labels=...).loss`` never gathers the full logits;
* the loss is the mean over the non-ignored tokens of the GLOBAL batch (all data ranks): each rank
  back-propagates only its own share and the data-parallel wrapper sums gradients (as in the rest of
  meshtron, see :mod:`meshtron.parallel.data`), so loss and gradients equal the unparallelized model's
  on the concatenated batch, whatever the per-rank token counts;
* ``sp=True``: norms and the residual stream are split along the sequence (Megatron SP);
* KV heads replicated when tp is a multiple of ``num_key_value_heads`` (``ReplicatedKVHeads``), with
  each attention module's ``num_key_value_groups`` set to its local ratio;
* activation checkpointing of decoder layers and FSDP2 / replicate over the dense data mesh.

MoE models with fused 3-D experts (Qwen2-MoE: ``experts.gate_up_proj`` [E, 2I, H]): the experts, router
and shared expert run replicated on every tp rank (identical inputs, so identical outputs and
gradients; a warning says so), FSDP-sharded over dp like everything else. Expert parallelism through
meshtron's all-to-all is not wired for HF modules yet.

:func:`load_hf_checkpoint` builds a model on the meta device, parallelizes it and reads from the
safetensors files only the slice of every tensor that this rank holds.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshtron import env
from meshtron.checkpoint import gather_full_state_dict
from meshtron.config import ConfigError
from meshtron.hf.io import write_safetensors_folder
from meshtron.hf.slices import load_sharded_weights
from meshtron.mesh import dense_data_mesh
from meshtron.parallel.checkpointing import checkpointed_layers
from meshtron.parallel.data import data_meshes, mixed_precision, wrap_data_parallel
from meshtron.parallel.tensor import ReplicatedKVHeads, check_tensor_parallel, parallel_token_loss_sum


_STYLES = ("colwise", "rowwise")


def _seq(sp: bool) -> Placement:
    return Shard(1) if sp else Replicate()


class _HiddenStatesInput(ParallelStyle):
    """The block input (positional or ``hidden_states=``) as one replicated DTensor.

    q, k and v (gate and up) then read the same DTensor, so their input gradients are summed as
    partials and reduced once; under SP this is the all-gather of the sequence.
    """

    def __init__(self, sp: bool):
        super().__init__()
        self.sp = sp

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def to_replicated(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [_seq(self.sp)], run_check=False)
            return x.redistribute(mesh, [Replicate()])

        def hook(_module, args, kwargs):
            if args:
                return (to_replicated(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": to_replicated(kwargs["hidden_states"])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _style(style: str, name: str, kv_heads: int, head_dim: int, tp: int, sp: bool) -> ParallelStyle:
    """One entry of transformers' plan as a training ParallelStyle."""
    kv_proj = name.endswith(("k_proj", "v_proj"))
    if style == "colwise" and kv_proj and kv_heads % tp:
        return ReplicatedKVHeads(kv_heads, head_dim)
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=_seq(sp))
    raise AssertionError(f"unchecked tp plan style '{style}' for '{name}'")  # _base_plan validates styles


def _exists(layer: nn.Module, rel: str) -> bool:
    try:
        layer.get_submodule(rel)
    except AttributeError:
        return False
    return True


def _layer_plan(base_plan: dict[str, str], layer: nn.Module, index: int, kv_heads: int, head_dim: int, tp: int,
                sp: bool) -> dict[str, ParallelStyle]:
    """Plan entries of decoder layer ``index``, relative to the layer, plus our input/norm styles.

    Entries naming a module this layer lacks are skipped (a MoE model's dense layers have no experts,
    its sparse ones no ``mlp.gate_proj``). Fused experts stay replicated over tp (see the module doc).
    """
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in base_plan.items():
        parts = pattern.split(".")
        if parts[:2] != ["layers", "*"]:
            raise ConfigError(f"parallelize_hf_model: tp plan entry '{pattern}' is outside 'layers.*'; not supported.")
        rel = ".".join(parts[2:])
        if "experts" in parts:
            continue
        if not _exists(layer, rel):
            continue
        plan[rel] = _style(style, f"layers.{index}.{rel}", kv_heads, head_dim, tp, sp)
        if style == "colwise":
            plan[rel.rsplit(".", 1)[0]] = _HiddenStatesInput(sp)
    if sp:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
        if _exists(layer, "mlp.experts"):
            # Routing needs every token: the replicated MoE block runs on the gathered sequence and
            # each rank keeps its slice of the (identical) output.
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
            )
    return plan


def _warn_replicated_experts(model: nn.Module, tp: int) -> None:
    if any(name.endswith("mlp.experts") for name, _ in model.named_modules()):
        warnings.warn(
            f"parallelize_hf_model: the fused MoE experts, router and shared expert of {type(model).__name__} run "
            f"replicated on each of the tp = {tp} ranks (correct, but not split); expert parallelism through "
            "meshtron's all-to-all is not wired for HF models yet.",
            stacklevel=3,
        )


def _base_plan(model: nn.Module) -> dict[str, str]:
    plan = getattr(model.config, "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(
            f"parallelize_hf_model: {type(model).__name__}'s config has no base_model_tp_plan, so the split of its "
            "layers is unknown. Use a model whose transformers config defines one (Llama, Qwen2, Mistral, ...) "
            "or set config.base_model_tp_plan (e.g. {'layers.*.self_attn.q_proj': 'colwise', ...})."
        )
    unknown = {p: s for p, s in plan.items() if s not in _STYLES and "experts" not in p.split(".")}
    if unknown:
        pattern, style = next(iter(unknown.items()))
        raise ConfigError(
            f"parallelize_hf_model: tp plan style '{style}' (for '{pattern}') is not supported; supported: "
            f"{', '.join(_STYLES)} (fused MoE experts, whatever their style, run replicated over tp)."
        )
    return plan


def _check_shape(model: nn.Module, tp: int) -> tuple[int, int]:
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    check_tensor_parallel(heads, kv_heads, tp)
    if cfg.vocab_size % tp:
        raise ConfigError(f"parallelize_hf_model: tp = {tp} does not divide vocab_size = {cfg.vocab_size}; pad the vocabulary.")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return kv_heads, head_dim


def _set_local_head_groups(layers, heads: int, kv_heads: int, tp: int) -> None:
    """HF attention repeats KV heads ``num_key_value_groups`` times: make that the local ratio."""
    local_kv = max(kv_heads // tp, 1)
    for layer in layers:
        layer.self_attn.num_key_value_groups = heads // tp // local_kv


def _apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    tp = tp_mesh.size()
    kv_heads, head_dim = _check_shape(model, tp)
    base, inner = _base_plan(model), model.model
    tied = model.lm_head.weight is inner.embed_tokens.weight
    plans = [_layer_plan(base, layer, i, kv_heads, head_dim, tp, sp) for i, layer in enumerate(inner.layers)]
    _warn_replicated_experts(model, tp)
    # Embedding output replicated: HF computes positions and the causal mask from its length.
    parallelize_module(inner.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    for layer, plan in zip(inner.layers, plans):
        parallelize_module(layer, tp_mesh, plan)
    _set_local_head_groups(inner.layers, model.config.num_attention_heads, kv_heads, tp)
    if sp:
        # Keep this rank's part of the sequence (a slice; its backward all-gathers the gradient).
        parallelize_module(inner.layers[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
        parallelize_module(inner.norm, tp_mesh, SequenceParallel())
    parallelize_module(
        model.lm_head, tp_mesh, ColwiseParallel(input_layouts=_seq(sp), output_layouts=Shard(-1), use_local_output=False)
    )
    if tied:  # both now hold a Shard(0) copy of the shared weight; make them one Parameter again
        model.lm_head.weight = inner.embed_tokens.weight


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over ``group``; backward: the gradient unchanged (each rank owns its term)."""

    @staticmethod
    def forward(ctx, value, group):
        total = value.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _loss_function(data_mesh: DeviceMesh):
    """HF's causal-LM loss (shifted labels, mean over non-ignored tokens) on vocab-sharded logits,
    averaged over the tokens of all data ranks. ``num_items_in_batch``, when given (gradient
    accumulation), is the global token count of the whole step and replaces the counted one."""

    def loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_):
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        total = parallel_token_loss_sum(logits, shift_labels, ignore_index)
        count = (shift_labels != ignore_index).sum().to(total.dtype)
        if data_mesh.size() > 1:
            group = data_mesh.get_group()
            total = _SumOverRanks.apply(total, group)
            if num_items_in_batch is None:
                dist.all_reduce(count, group=group)
        if num_items_in_batch is not None:  # the caller's global count (gradient accumulation)
            count = torch.as_tensor(num_items_in_batch, dtype=total.dtype, device=total.device)
        return total / count

    return loss


def _apply_ac(layers, mode: str, every: int) -> None:
    for index in checkpointed_layers(list(range(len(layers))), mode, every):
        checkpoint(layers[index])


def _apply_dp(model: nn.Module, mesh: DeviceMesh, mode: str, dtype: str) -> None:
    policy = mixed_precision(dtype)
    dense_mesh, _ = data_meshes(mesh, mode)
    inner = model.model
    for layer in inner.layers:
        wrap_data_parallel(layer, dense_mesh, mode, policy)
    if model.lm_head.weight is not inner.embed_tokens.weight:  # one parameter needs one unit
        for m in (inner.embed_tokens, model.lm_head):
            wrap_data_parallel(m, dense_mesh, mode, policy)
    wrap_data_parallel(model, dense_mesh, mode, policy)


def parallelize_hf_model(
    model: nn.Module,
    mesh: DeviceMesh,
    sp: bool = False,
    data_parallel: str = "fsdp",
    ac: str = "none",
    ac_every: int = 2,
    dtype: str = "float32",
) -> nn.Module:
    """Parallelize a transformers decoder-only ``*ForCausalLM`` in place over ``mesh`` (from ``build_mesh``).

    tp shards the layers by the model's ``base_model_tp_plan`` (plus vocab-parallel embedding/lm_head
    and optional SP); the batch is split over the dense data mesh (dp x ep x cp), where parameters are
    FSDP-sharded (``data_parallel="fsdp"``), replicated or HSDP-sharded. ``ac`` is ``none``, ``full`` or
    ``selective`` (every ``ac_every``-th layer); ``dtype="bfloat16"`` makes the data-parallel wrapper
    compute in bf16 with fp32 master weights (only when the data mesh has more than one rank). Works
    on meta-device models (then ``to_empty`` and :func:`meshtron.hf.load_sharded_weights`, as
    :func:`load_hf_checkpoint` does). Each data rank passes its
    own part of the batch; ``.loss`` is the global mean and ``.logits`` a vocab-sharded DTensor.
    Only tp and the data meshes are used: pp, cp and ep must be 1.
    """
    for dim in ("pp", "cp", "ep"):
        if mesh[dim].size() > 1:
            raise ConfigError(f"parallelize_hf_model: {dim} = {mesh[dim].size()} is not supported for HF models; use 1.")
    if not hasattr(model, "model") or not hasattr(model.model, "layers") or not hasattr(model, "lm_head"):
        raise ConfigError(
            f"parallelize_hf_model expects a decoder-only *ForCausalLM (model.model.layers, model.lm_head); "
            f"got {type(model).__name__}."
        )
    # Checkpointing first: its hook must see layer 0's full input, before SP's slicing hook, so the
    # recomputation slices it again rather than slicing the slice.
    _apply_ac(model.model.layers, ac, ac_every)
    tp_mesh = mesh["tp"]
    if tp_mesh.size() > 1:
        _apply_tp(model, tp_mesh, sp)
    data_mesh = dense_data_mesh(mesh)
    model.loss_function = _loss_function(data_mesh)
    if data_mesh.size() > 1:
        _apply_dp(model, mesh, data_parallel, dtype)
    return model


def _reset_rotary(model: nn.Module) -> None:
    """Non-persistent buffers (RoPE frequencies) are not in checkpoints: rebuild them after to_empty."""
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)


def load_hf_checkpoint(folder: str | Path, mesh: DeviceMesh, **options) -> tuple[nn.Module, int]:
    """Build the folder's model on the meta device, parallelize it (``options`` as
    :func:`parallelize_hf_model`) and stream this rank's slices in. Returns (model, bytes read here).

    Per-rank peak memory is about the rank's share of the weights, never the whole model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parallelize_hf_model(model, mesh, **options)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    model.to_empty(device=env.local_device())
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        _reset_rotary(model)
    return model, load_sharded_weights(model, folder)


def save_hf_checkpoint(model: nn.Module, folder: str | Path, max_shard_bytes: int = 2 << 30) -> None:
    """Gather the full weights (collective) and let rank 0 write an HF folder ``from_pretrained`` reads."""
    full = gather_full_state_dict(model)
    if model.lm_head.weight is model.model.embed_tokens.weight:
        full.pop("lm_head.weight", None)
    if dist.get_rank() == 0:
        write_safetensors_folder(full, json.loads(model.config.to_json_string()), folder, max_shard_bytes)
    dist.barrier()


__all__ = ["load_hf_checkpoint", "parallelize_hf_model", "save_hf_checkpoint"]
