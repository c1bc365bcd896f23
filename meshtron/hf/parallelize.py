"""Parallelize a HuggingFace ``*ForCausalLM`` over a meshtron mesh, and stream its weights in sharded.

:func:`parallelize_hf_model` finds the model's parts by its own API (:mod:`meshtron.hf.discover`), reads
its tensor-parallel plan (``config.base_model_tp_plan``, the same table transformers' ``tp_plan="auto"``
uses; inferred from the module types when the config has none, :mod:`meshtron.hf.infer`) and turns each
style into a DTensor ``ParallelStyle``; what transformers' inference-oriented plan lacks for training
is added here:

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
* MLA (DeepSeek-V2/V3): the low-rank down projections and their norms replicated, the rope key's
  gradient summed over tp (``mla_kv_a_proj``, :class:`_SharedRopeKey`), the up projections split by
  heads; V3's plan, which names no attention, gets V2's entries (:func:`meshtron.hf.infer.with_mla_attention`);
* activation checkpointing of decoder layers (training forwards then run without a KV cache) and
  FSDP2 / replicate / HSDP over the data meshes.

MoE models with fused experts (Qwen2-MoE and the others whose config has ``base_model_ep_plan``, in a
layout :mod:`meshtron.hf.experts` computes: SiLU ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]
or the same transposed (Aria), or gpt-oss's interleaved, biased, clamped experts; and Llama 4's, without
an ep plan, whose router scores scale the experts' inputs), whenever ep > 1 or tp > 1:

* the experts are split ``Shard(0)`` over ep and fed by meshtron's all-to-all dispatch with grouped_mm
  (:mod:`meshtron.hf.experts`); each tp rank dispatches 1/tp of the tokens, so no expert work is
  repeated over tp even at ep = 1. Parameter names and logical shapes stay transformers', so
  ``state_dict``, :func:`load_hf_checkpoint` (each rank reads its experts only) and
  :func:`save_hf_checkpoint` work unchanged. Expert gradients are summed over the ep group's tokens by
  the dispatch and over dp by their own FSDP unit on the expert data mesh;
* the shared expert is split over tp like a dense MLP (colwise gate/up, rowwise down, output
  all-reduced); the router (E x H) and the shared-expert gate (1 x H) run replicated over tp, on
  identical tokens (their gradients then agree without communication; :class:`~meshtron.parallel.tensor.TpGradient` decides it
  on the first backward, as for every parameter no plan entry places);
* the batch is split over dp x ep (ep ranks are data parallel for everything but the experts);
* with ``output_router_logits``, ``aux_loss`` is the load-balancing loss of the global batch (router
  statistics summed over dp x ep) and ``loss`` includes ``router_aux_loss_coef`` x that, exactly as
  the unparallelized model on the concatenated batch; its gradient is each rank's share, so summed
  gradients are exact. transformers alone would add each rank's local aux loss.

:func:`load_hf_checkpoint` builds a model on the meta device, parallelizes it and reads from the
safetensors files only the slice of every tensor that this rank holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshtron import env
from meshtron.checkpoint import gather_full_state_dict
from meshtron.config import ConfigError
from meshtron.hf.discover import HFParts, hf_parts, is_norm, is_rotary, key_value_heads
from meshtron.hf.context import apply_hf_context_parallel
from meshtron.hf.experts import adopt_router_scaled_blocks, apply_hf_expert_parallel, hf_expert_modules
from meshtron.hf.infer import TransposedColwise, TransposedRowwise, infer_tp_plan, is_transposed, with_mla_attention
from meshtron.hf.io import write_safetensors_folder
from meshtron.hf.pipeline import HFPipelineRunner
from meshtron.hf.router import router_statistics
from meshtron.hf.slices import load_sharded_weights
from meshtron.mesh import dense_data_mesh, expert_data_mesh, expert_split
from meshtron.models.loss import DEFAULT_CHUNK_TOKENS
from meshtron.models.moe import load_balancing_loss
from meshtron.models.qwen2 import LMHead
from meshtron.parallel.checkpointing import checkpointed_layers
from meshtron.parallel.data import data_meshes, even_shard_dim, mixed_precision, wrap_data_parallel
from meshtron.parallel.tensor import (
    ReplicatedKVHeads,
    ReplicateParallel,
    TpGradient,
    VocabParallelEmbedding,
    VocabParallelHead,
    local_view,
    name_tp_gradients,
    check_tensor_parallel,
    parallel_token_loss_sum,
    residual_layout,
)


# transformers' tp-plan styles (``transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES``, 5.23) by
# what they become here. Output features split over tp (the attention then runs on its local heads):
_COLWISE = ("colwise",)
# Output features split, then all-gathered (the module's consumer needs every feature: a fused qkv or
# gate_up sliced or chunked afterwards, a norm over all heads). packed_colwise's per-part split
# (_StridedShard) then needs no permutation: a plain Shard(0) weight gathered gives the same output.
_COLWISE_GATHERED = ("colwise_gather_output", "colwise_rep", "packed_colwise")
# Input features split, output partial then all-reduced (reduce-scattered under SP) into the residual.
_ROWWISE = ("rowwise",)
# Same, but the input arrives replicated (after a gathered colwise) and each rank takes its slice.
_ROWWISE_REPLICATED_INPUT = ("rowwise_split_input", "rowwise_rep", "packed_rowwise")
# Replicated parameters on a tp-split activation (Qwen3's per-head q_norm / k_norm): how their gradients
# combine is decided from what the ranks compute, as for parameters no plan names (TpGradient "infer").
_REPLICATED_PARTIAL_GRAD = ("replicated_with_grad_allreduce",)
# Parameters replicated and not split: the module stays as it is (identical on every tp rank).
_REPLICATE = ("replicate",)
# Norms on the sequence-split residual: SequenceParallel under SP, unchanged otherwise.
_SEQUENCE = ("sequence_parallel",)
# MLA's kv down projection (DeepSeek-V2/V3): replicated, its rope key's gradient summed over tp.
_MLA_KV_A = ("mla_kv_a_proj",)
_STYLES = (*_COLWISE, *_COLWISE_GATHERED, *_ROWWISE, *_ROWWISE_REPLICATED_INPUT, *_REPLICATED_PARTIAL_GRAD,
           *_REPLICATE, *_SEQUENCE, *_MLA_KV_A)
# Styles transformers defines that meshtron does not translate (outside fused experts): why.
_REFUSED = {
    "embedding_rowwise": "embeddings inside decoder layers are not split; meshtron splits only the input embedding",
    "embedding_colwise": "embeddings inside decoder layers are not split; meshtron splits only the input embedding",
    "all_reduce": "partial module outputs outside fused experts are not supported yet",
    "moe_tp_experts": "per-expert tp outside a fused 'experts' module is not supported",
    "moe_identity_expert": "identity (zero-compute) experts are not supported yet",
    "local_params": "bare parameters split by their own plan entry (attention sinks) are not supported yet",
}


class _HiddenStatesInput(ParallelStyle):
    """The module's hidden-states input (first positional or ``hidden_states=``) redistributed.

    Default: the residual stream as one replicated DTensor (under SP the all-gather of the sequence)
    that every submodule called on the module's input reads, so the input gradients of q, k and v
    (gate and up) are summed as partials and reduced once. The module itself gets its local view: a
    module that computes with its input before projecting it (Qwen3-Next's linear attention masks its
    padding) stays in plain tensors, and a projection of such a derived tensor takes it on its own
    (one reduction of its own). A submodule computing with replicated parameters (run on plain local
    views: MLA's down projections) cannot take the DTensor; it gets a local view of the same input
    whose gradient, complete or a part on each rank, is decided on the first backward like those
    parameters' (:class:`TpGradient` "infer"). ``(Replicate(), Shard(1), local=True)``: keep this
    rank's part of the sequence (a slice; its backward all-gathers the gradient), whatever other
    arguments follow.
    """

    def __init__(self, sp: bool, layout: Placement | None = None, desired: Placement = Replicate(), local: bool = False):
        super().__init__()
        self.layout, self.desired, self.local = layout or residual_layout(sp), desired, local

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        shared: dict[str, tuple[torch.Tensor, DTensor]] = {}

        def redistribute(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.layout], run_check=False)
            x = x.redistribute(mesh, [self.desired])
            if self.local:
                return x.to_local()
            view = x.to_local()
            shared["input"] = (view, x)
            return view

        def hook(_module, args, kwargs):
            if args:
                return (redistribute(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": redistribute(kwargs["hidden_states"])}

        def share(child, args):
            view, whole = shared.get("input", (None, None))
            if not args or view is None or args[0] is not view:
                return None
            if _runs_on_plain_params(child):
                return (local_view(whole, child.tp_input_gradient), *args[1:])
            return (whole, *args[1:])

        def forget(*_):
            shared.clear()  # hold no activation past the module's forward

        module.register_forward_pre_hook(hook, with_kwargs=True)
        if not self.local:
            for child in module.modules():
                if child is not module:
                    child.tp_input_gradient = TpGradient("infer", what="input of")
                    child.register_forward_pre_hook(share, prepend=True)
            module.register_forward_hook(forget)
        return module


def _runs_on_plain_params(module: nn.Module) -> bool:
    """Inside a block's forward its unplanned parameters are swapped for plain local views
    (:func:`_replicate_plain_params`); planned ones stay DTensors."""
    return any(not isinstance(p, DTensor) for p in module.parameters())


class _GatheredSequence(ParallelStyle):
    """Under SP, run the module on the whole sequence (all-gathered) and keep this rank's slice of its
    (identical) output; a tuple output (gpt-oss's MoE returns its router scores too) has its first
    element sliced."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        parallelize_module(module, mesh, _HiddenStatesInput(True, Shard(1), Replicate(), local=True))

        def slice_sequence(x):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()

        def hook(_module, _args, out):
            return (slice_sequence(out[0]), *out[1:]) if isinstance(out, tuple) else slice_sequence(out)

        module.register_forward_hook(hook)
        return module


class _SharedRopeKey(ParallelStyle):
    """MLA's kv down projection (``mla_kv_a_proj``), replicated like every parameter no plan splits: its
    output is the kv latent then the rope key, ``rope_dim`` features that every head shares. The latent
    reaches the attention through the column-split ``kv_b_proj``, which all-reduces its input gradient,
    but each rank's attention reads the rope key with its own heads only: that gradient is a part, summed
    over tp here in backward (transformers' ``MlaKvAProjParallel`` does the same). The projection's
    gradients are then whole on every rank."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def hook(_module, _args, out):
            latent, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            # Forward unchanged; backward: the gradient taken as Partial and all-reduced.
            rope = DTensor.from_local(rope, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            return torch.cat([latent, rope], dim=-1)

        module.register_forward_hook(hook)
        return module


class _Heads(NamedTuple):
    """What the attention styles need to know of the model's heads."""
    kv_heads: int
    head_dim: int
    rope_dim: int  # MLA's rope key width (qk_rope_head_dim); 0 for other attention


def _style(style: str, name: str, module: nn.Module, heads: _Heads, tp: int, sp: bool) -> ParallelStyle | None:
    """One entry of transformers' plan as a training ParallelStyle (None: the module stays unchanged)."""
    kv_proj = name.endswith(("k_proj", "v_proj"))
    colwise, rowwise = (TransposedColwise, TransposedRowwise) if is_transposed(module) else (ColwiseParallel, RowwiseParallel)
    if style in _COLWISE and kv_proj and heads.kv_heads % tp:
        return ReplicatedKVHeads(heads.kv_heads, heads.head_dim)
    if style in _COLWISE:
        return colwise()
    if style in _COLWISE_GATHERED:
        return colwise(output_layouts=Replicate())
    if style in _ROWWISE:
        return rowwise(output_layouts=residual_layout(sp))
    if style in _ROWWISE_REPLICATED_INPUT:
        return rowwise(input_layouts=Replicate(), output_layouts=residual_layout(sp))
    if style in _REPLICATED_PARTIAL_GRAD:
        return ReplicateParallel(grad="infer")
    if style in _SEQUENCE:
        return SequenceParallel() if sp else None
    if style in _REPLICATE:
        return None
    if style in _MLA_KV_A:
        return _SharedRopeKey(heads.rope_dim)
    raise AssertionError(f"unchecked tp plan style '{style}' for '{name}'")  # _base_plan validates styles


def _exists(layer: nn.Module, rel: str) -> bool:
    try:
        layer.get_submodule(rel)
    except AttributeError:
        return False
    return True


def _is_parameter(layer: nn.Module, rel: str) -> bool:
    try:
        layer.get_parameter(rel)
    except AttributeError:
        return False
    return True


def _moe_block(layer: nn.Module) -> str | None:
    """The layer's child holding the routed ``experts`` (``mlp`` in most families, Llama 4's
    ``feed_forward``); None in a dense layer."""
    return next((name for name, child in layer.named_children() if _exists(child, "experts")), None)


def _layer_plan(base_plan: dict[str, str], blocks: str, layer: nn.Module, index: int, heads: _Heads,
                tp: int, sp: bool) -> dict[str, ParallelStyle]:
    """Plan entries of decoder layer ``index``, relative to the layer, plus our input/norm styles.

    Entries naming a module this layer lacks are skipped (a MoE model's dense layers have no experts,
    its sparse ones no ``mlp.gate_proj``). Fused experts are left to :mod:`meshtron.hf.experts`.
    """
    plan: dict[str, ParallelStyle] = {}
    writes_residual: dict[str, bool] = {}  # parent of split projections -> one of them is rowwise
    moe = _moe_block(layer)
    for pattern, style in base_plan.items():
        parts = pattern.split(".")
        if parts[:2] != [blocks, "*"]:
            raise ConfigError(f"parallelize_hf_model: tp plan entry '{pattern}' is outside '{blocks}.*'; not supported.")
        rel = ".".join(parts[2:])
        if "experts" in parts:
            continue
        if not _exists(layer, rel):
            if _is_parameter(layer, rel):
                raise ConfigError(f"parallelize_hf_model: tp plan entry '{pattern}' ('{style}') names a parameter, "
                                  "not a module; per-parameter plan entries are not supported.")
            continue
        # Inside a MoE block (Aria's shared experts) the tokens are already gathered under SP.
        split_seq = sp and not (moe is not None and rel.startswith(f"{moe}."))
        translated = _style(style, f"{blocks}.{index}.{rel}", layer.get_submodule(rel), heads, tp, split_seq)
        if translated is None:
            continue
        plan[rel] = translated
        parent = rel.rsplit(".", 1)[0]
        if style in _COLWISE + _COLWISE_GATHERED:
            plan[parent] = _HiddenStatesInput(split_seq)
        if split_seq:
            writes_residual[parent] = writes_residual.get(parent, False) or style in _ROWWISE + _ROWWISE_REPLICATED_INPUT
    if moe is not None and _exists(layer, f"{moe}.shared_expert.down_proj"):
        plan.update(_shared_expert_plan(f"{moe}.shared_expert"))
    if sp:
        # The block's own norms act on the (sequence-split) residual stream or on a rowwise output that
        # is then added to it (Gemma2's post-norms), so they hand back plain local tensors.
        plan.update({name: SequenceParallel(use_local_output=True) for name, child in layer.named_children()
                     if is_norm(child)})
        if moe is not None:
            # Routing needs every token: the replicated MoE block runs on the gathered sequence and
            # each rank keeps its slice of the (identical) output.
            plan[moe] = _GatheredSequence()
        # A module whose projections are all gathered (Qwen3-Next's linear attention: even its output
        # projection) returns the whole sequence on every rank: each keeps its slice, like the MoE block.
        plan.update({parent: _GatheredSequence() for parent, rowwise in writes_residual.items()
                     if not rowwise and isinstance(plan.get(parent), _HiddenStatesInput)})
    return plan


def _shared_expert_plan(prefix: str) -> dict[str, ParallelStyle]:
    """A MoE's shared expert (SwiGLU MLP, absent from transformers' plans) split like a dense MLP; the MoE
    block holds every token of the tp group (gathered under SP), so its output is all-reduced."""
    return {
        prefix: _HiddenStatesInput(sp=False),
        f"{prefix}.gate_proj": ColwiseParallel(),
        f"{prefix}.up_proj": ColwiseParallel(),
        f"{prefix}.down_proj": RowwiseParallel(output_layouts=Replicate()),
    }


def _base_plan(model: nn.Module) -> dict[str, str]:
    """The config's ``base_model_tp_plan``, every style checked to be translatable."""
    plan = model.config.base_model_tp_plan
    for pattern, style in plan.items():
        if "experts" in pattern.split(".") or style in _STYLES:
            continue
        module = pattern.replace(".*.", ".<i>.")
        if style in _REFUSED:
            raise ConfigError(
                f"parallelize_hf_model: tp plan style '{style}' (for module '{module}') is not supported: "
                f"{_REFUSED[style]}."
            )
        raise ConfigError(
            f"parallelize_hf_model: unknown tp plan style '{style}' (for module '{module}', plan entry '{pattern}'); "
            f"supported: {', '.join(_STYLES)} (fused MoE experts, whatever their style, follow base_model_ep_plan)."
        )
    return plan


def _tp_plan(model: nn.Module, parts: HFParts, tp: int, sp: bool) -> dict[str, str]:
    """The config's plan (its heads must split over tp), else one inferred from the module types."""
    if not getattr(model.config, "base_model_tp_plan", None):
        return infer_tp_plan(model, parts, tp, key_value_heads(model.config), sp)
    check_tensor_parallel(model.config.num_attention_heads, key_value_heads(model.config), tp)
    return with_mla_attention(_base_plan(model), parts)


def _check_shape(model: nn.Module, tp: int) -> _Heads:
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, key_value_heads(cfg)
    if cfg.vocab_size % tp:
        raise ConfigError(f"parallelize_hf_model: tp = {tp} does not divide vocab_size = {cfg.vocab_size}; pad the vocabulary.")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return _Heads(kv_heads, head_dim, getattr(cfg, "qk_rope_head_dim", None) or 0)


def _set_local_head_groups(parts: HFParts, base: dict[str, str], heads: int, kv_heads: int, tp: int) -> None:
    """HF attention repeats KV heads ``num_key_value_groups`` times: make that the local ratio when the
    heads are split (``colwise`` q/k/v); gathered projections keep every head on every rank."""
    local_kv = max(kv_heads // tp, 1)
    for pattern, style in base.items():
        attention, _, proj = pattern.split(".", 2)[2].rpartition(".")
        if proj != "k_proj" or style not in _COLWISE:
            continue
        for _, layer in parts.block_items():
            if _exists(layer, attention):
                layer.get_submodule(attention).num_key_value_groups = heads // tp // local_kv


def _own_rowwise_outputs(parts: HFParts, plan: dict[str, str]) -> None:
    """Older modelling code adds into a projection's output in place (Falcon's ``mlp_output +=
    attention_output``), but a rowwise output is DTensor's ``to_local`` view, which autograd forbids
    modifying in place: for inferred plans those modules return a copy."""
    for pattern, style in plan.items():
        rel = pattern.split(".", 2)[2]
        if style not in _ROWWISE + _ROWWISE_REPLICATED_INPUT:
            continue
        for _, layer in parts.block_items():
            if _exists(layer, rel):
                layer.get_submodule(rel).register_forward_hook(lambda _module, _args, out: out.clone())


def _apply_tp(model: nn.Module, parts: HFParts, tp_mesh: DeviceMesh, sp: bool) -> None:
    tp = tp_mesh.size()
    heads = _check_shape(model, tp)
    base, tied = _tp_plan(model, parts, tp, sp), parts.tied
    blocks = parts.block_items()  # a pipeline stage holds some blocks, and the embedding / head only at its ends
    for i, layer in blocks:
        parallelize_module(layer, tp_mesh, _layer_plan(base, parts.plan_blocks, layer, i, heads, tp, sp))
    _set_local_head_groups(parts, base, model.config.num_attention_heads, heads.kv_heads, tp)
    if not getattr(model.config, "base_model_tp_plan", None):
        _own_rowwise_outputs(parts, base)
    if parts.embed is not None:
        # Embedding output replicated: HF computes positions and the causal mask from its length. A
        # family's own embedding class (Gemma 3 scales in its forward) keeps DTensor's rowwise split.
        style = (VocabParallelEmbedding(Replicate()) if type(parts.embed) is nn.Embedding
                 else RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        parallelize_module(parts.embed, tp_mesh, style)
        if sp:
            parallelize_module(blocks[0][1], tp_mesh, _HiddenStatesInput(sp, Replicate(), Shard(1), local=True))
    if parts.head is not None:
        if sp:
            parallelize_module(parts.norm, tp_mesh, SequenceParallel())
        # Vocab-sharded logits either way; meshtron's head also computes the fused loss (pipeline stages).
        style = VocabParallelHead(residual_layout(sp)) if isinstance(parts.head, LMHead) else ColwiseParallel(
            input_layouts=residual_layout(sp), output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(parts.head, tp_mesh, style)
    if tied:  # both now hold a Shard(0) copy of the shared weight; make them one Parameter again
        parts.head.weight = parts.embed.weight


def _replicate_plain_params(model: nn.Module, parts: HFParts, tp_mesh: DeviceMesh, experts: list[nn.Module]) -> None:
    """Parameters tp left whole (norms without SP, ``replicate`` modules, an activation's own
    parameters, a convolution no plan splits) become Replicate DTensors run on their local views:
    inside a block for the whole block's forward (a module may read a child's weight directly, as
    Lfm2's and Qwen3-Next's convolutions hand theirs to a fused kernel), elsewhere for their module's.
    Whether a parameter reads an activation tp split (per-head norms after column-split projections,
    xIELU's parameters after a column-split up projection: each rank's gradient is a part of the sum)
    or the whole one (every rank computes the same gradient) is decided on the first backward
    (:class:`TpGradient` "infer"). Without it, a parameter group mixing them with DTensors breaks fused
    AdamW when no data-parallel wrapper makes every parameter a DTensor."""
    skip = {id(m) for e in experts for m in e.modules()}

    def plain(module: nn.Module) -> list[str]:
        return [f"{path}.{name}" if path else name for path, sub in module.named_modules() if id(sub) not in skip
                for name, p in sub.named_parameters(recurse=False) if not isinstance(p, DTensor)]

    blocks = [block for _, block in parts.block_items()]
    for block in blocks:
        if names := plain(block):
            parallelize_module(block, tp_mesh, ReplicateParallel(grad="infer", params=names))
    inside = {id(m) for block in blocks for m in block.modules()}
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own and id(module) not in skip | inside and not any(isinstance(p, DTensor) for p in own):
            parallelize_module(module, tp_mesh, ReplicateParallel(grad="infer"))
    name_tp_gradients(model)


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


def _aux_loss_share(router_logits: tuple[torch.Tensor, ...], top_k: int, mask: torch.Tensor | None, group) -> torch.Tensor:
    """This rank's term of transformers' load-balancing loss over the global batch
    (:mod:`meshtron.hf.router`): counts and rows summed over ``group``; the local probabilities carry
    the gradient, so the terms add up over ranks to the global loss, and so do their gradients."""
    counts, prob_sums, rows = router_statistics(router_logits, top_k, mask)
    totals = torch.cat([counts, rows])
    dist.all_reduce(totals, group=group)
    return load_balancing_loss(totals[:-1], prob_sums, totals[-1])


def _global_aux_loss(data_mesh: DeviceMesh):
    """Forward hook making ``aux_loss`` (``output_router_logits=True``) the global batch's, on every rank,
    and ``loss`` = global token loss + ``router_aux_loss_coef`` x global aux loss, as unparallelized.

    transformers computes both from this rank's router logits only; the hook swaps its aux term for
    the global one (value summed over the data ranks, gradient this rank's share: gradients summed
    over data ranks are then exact).
    """
    group = data_mesh.get_group()

    def hook(model, args, kwargs, out):
        if getattr(out, "aux_loss", None) is None or not isinstance(out.router_logits, tuple):
            return None
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        aux = _SumOverRanks.apply(_aux_loss_share(out.router_logits, model.num_experts_per_tok, mask, group), group)
        if out.loss is not None:
            out.loss = out.loss + model.router_aux_loss_coef * (aux - out.aux_loss)
        out.aux_loss = aux
        return out

    return hook


def _no_cache_in_training(model, args, kwargs):
    """A KV cache would take the recomputed keys a second time (the recomputation's attention then sees
    2 x S keys); like transformers' own checkpointing, training forwards run without one."""
    if model.training:
        return args, {**kwargs, "use_cache": False, "past_key_values": None}
    return None


def _apply_ac(model: nn.Module, parts: HFParts, mode: str, every: int) -> None:
    layers = dict(parts.block_items())
    for index in checkpointed_layers(list(layers), mode, every):
        checkpoint(layers[index])
    if mode != "none":
        model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)


def _apply_dp(model: nn.Module, parts: HFParts, mesh: DeviceMesh, mode: str, dtype: str,
              experts: list[nn.Module]) -> None:
    """FSDP / replicate units: ``experts`` (split over ep) on the expert data mesh, every layer, the
    untied embedding and lm_head, and the root, on the dense data mesh. With one dense data rank
    only the experts are wrapped (their edp ranks are tp ranks holding other tokens), in the
    model's own dtype like the rest."""
    dense_mesh, expert_mesh = data_meshes(mesh, mode)
    policy = mixed_precision(dtype if dense_mesh.size() > 1 else "float32")
    placement = even_shard_dim(expert_mesh.size(expert_mesh.ndim - 1))
    for module in experts:
        wrap_data_parallel(module, expert_mesh, mode, policy, placement)
    if dense_mesh.size() == 1:
        return
    for _, layer in parts.block_items():
        wrap_data_parallel(layer, dense_mesh, mode, policy)
    if not parts.tied:  # one parameter needs one unit
        for m in (parts.embed, parts.head):
            if m is not None:
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
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual_stages: int = 1,
    cp_comm_type: str = "p2p",
    cp_a2a_size: int = 0,
):
    """Parallelize a transformers decoder-only ``*ForCausalLM`` in place over ``mesh`` (from ``build_mesh``).

    tp shards the layers by the model's ``base_model_tp_plan``, or one inferred from its module types (plus vocab-parallel embedding/lm_head,
    the MoE shared expert and optional SP); MoE experts are split over ep by ``base_model_ep_plan`` and
    fed by all-to-all (:mod:`meshtron.hf.experts`); the batch is split over dp x ep, where dense
    parameters are FSDP-sharded (``data_parallel="fsdp"``), replicated or HSDP-sharded, and experts
    over dp. ``ac`` is ``none``, ``full`` or ``selective`` (every ``ac_every``-th layer);
    ``dtype="bfloat16"`` makes the data-parallel wrapper compute in bf16 with fp32 master weights (only
    when the data mesh has more than one rank). Works on meta-device models (then ``to_empty`` and
    :func:`meshtron.hf.load_sharded_weights`, as :func:`load_hf_checkpoint` does). Each rank of dp x ep
    passes its own part of the batch; ``.loss`` (and ``.aux_loss``) are the global batch's and
    ``.logits`` a vocab-sharded DTensor.

    cp > 1 (:mod:`meshtron.hf.context`): attention runs as meshtron's ring attention; each data rank
    passes whole sequences (length a multiple of 2 x cp, no ``attention_mask``) and the model keeps
    its cp share of them, so ``.logits`` holds this rank's tokens (in the load-balanced order).
    ``cp_comm_type`` (``p2p``, ``a2a``, ``allgather``, ``a2a+p2p``) and ``cp_a2a_size`` are
    ``[parallel]``'s keys of the same names.

    pp > 1 (:mod:`meshtron.hf.pipeline`): the model is pruned in place to this rank's stage(s) and an
    :class:`~meshtron.hf.pipeline.HFPipelineRunner` is returned instead (``schedule`` ``1f1b``,
    ``interleaved`` or ``gpipe``, ``microbatches``, ``virtual_stages``); its
    ``forward_backward(input_ids, next_token_labels)`` runs a step, its ``module`` is the stage model.
    """
    hf_parts(model)  # a layout we can find the pieces of

    def stage(module: nn.Module) -> nn.Module:
        return _parallelize(module, mesh, sp, data_parallel, ac, ac_every, dtype, (cp_comm_type, cp_a2a_size),
                            shard_inputs=mesh["pp"].size() == 1)

    if mesh["pp"].size() > 1:
        return HFPipelineRunner(model, mesh, stage, schedule, microbatches, virtual_stages, sp, dtype)
    return stage(model)


def _parallelize(model: nn.Module, mesh: DeviceMesh, sp: bool, data_parallel: str, ac: str, ac_every: int, dtype: str,
                 cp_comm: tuple[str, int], shard_inputs: bool) -> nn.Module:
    """Every dimension but pp, in place (a pipeline stage's model, or the whole model)."""
    parts = hf_parts(model)
    _as_meshtron_head(parts.head)
    ep, tp_mesh = expert_split(mesh).ep, mesh["tp"]
    expert_modules = hf_expert_modules(model, ep) if ep > 1 or tp_mesh.size() > 1 else {}
    if ep > 1 and not expert_modules:
        raise ConfigError(f"parallelize_hf_model: ep = {ep} needs a MoE model with fused experts; "
                          f"{type(model).__name__} has none. Use ep = 1.")
    adopt_router_scaled_blocks(model, expert_modules)
    # Checkpointing first: its hook must see layer 0's full input, before SP's slicing hook, so the
    # recomputation slices it again rather than slicing the slice.
    _apply_ac(model, parts, ac, ac_every)
    if tp_mesh.size() > 1:
        _apply_tp(model, parts, tp_mesh, sp)
    experts = apply_hf_expert_parallel(model, mesh, expert_modules)
    if tp_mesh.size() > 1:
        _replicate_plain_params(model, parts, tp_mesh, experts)
    if mesh["cp"].size() > 1:
        apply_hf_context_parallel(model, mesh, shard_inputs, *cp_comm)
    data_mesh = dense_data_mesh(mesh)
    model.loss_function = _loss_function(data_mesh)
    if data_mesh.size() > 1:
        model.register_forward_hook(_global_aux_loss(data_mesh), with_kwargs=True)
    # Experts also sum gradients over their edp ranks, which include tp ranks holding other tokens.
    if data_mesh.size() > 1 or (experts and expert_data_mesh(mesh).size() > 1):
        _apply_dp(model, parts, mesh, data_parallel, dtype, experts)
    return model


def _as_meshtron_head(head: nn.Module | None) -> None:
    """A bias-free ``nn.Linear`` head becomes meshtron's :class:`~meshtron.models.qwen2.LMHead` in place
    (same weight and name): ``head(h)`` still gives logits, ``head(h, labels)`` the fused, chunked
    token-loss sum that never holds a whole micro-batch's logits. Other heads stay as they are."""
    if type(head) is nn.Linear and head.bias is None:
        head.__class__ = LMHead
        head.chunk_tokens = DEFAULT_CHUNK_TOKENS


def _reset_rotary(model: nn.Module) -> None:
    """Non-persistent buffers (RoPE frequencies) are not in checkpoints: rebuild them after to_empty."""
    for module in model.modules():
        if is_rotary(module) and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)


def load_hf_checkpoint(folder: str | Path, mesh: DeviceMesh, **options) -> tuple[nn.Module, int]:
    """Build the folder's model on the meta device, parallelize it (``options`` as
    :func:`parallelize_hf_model`) and stream this rank's slices in. Returns (model, bytes read here).

    Per-rank peak memory is about the rank's share of the weights, never the whole model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if mesh["pp"].size() > 1:
        raise ConfigError("load_hf_checkpoint: pp > 1 is not supported yet; use from_pretrained, then parallelize_hf_model.")
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parallelize_hf_model(model, mesh, **options)
    parts = hf_parts(model)
    tied = parts.tied
    model.to_empty(device=env.local_device())
    if tied:
        parts.head.weight = parts.embed.weight
    with torch.no_grad():
        _reset_rotary(model)
    return model, load_sharded_weights(model, folder)


def save_hf_checkpoint(model: nn.Module, folder: str | Path, max_shard_bytes: int = 2 << 30) -> None:
    """Gather the full weights (collective) and let rank 0 write an HF folder ``from_pretrained`` reads."""
    full = gather_full_state_dict(model)
    parts = hf_parts(model)
    if parts.tied:
        full.pop(f"{parts.head_path}.weight", None)
    if dist.get_rank() == 0:
        write_safetensors_folder(full, json.loads(model.config.to_json_string()), folder, max_shard_bytes)
    dist.barrier()


__all__ = ["load_hf_checkpoint", "parallelize_hf_model", "save_hf_checkpoint"]
