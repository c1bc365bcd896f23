"""transformers' tensor-parallel plan translated into DTensor ``ParallelStyle``s, and applied.

The plan is the config's ``base_model_tp_plan`` or one inferred for a config without (:mod:`meshtron.hf.infer`).
That plan is written for inference, so what training needs is added here: vocab-parallel embedding and head,
SP, replicated KV heads, MLA's shared rope key, and a gradient rule for every parameter no entry splits.
:func:`apply_hf_tensor_parallel` is the entry. See docs/hf.md (the opening and the tp-plan style table).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel, parallelize_module

from meshtron.config import ConfigError
from meshtron.hf.discover import HFParts, is_norm, layer_config, layer_heads
from meshtron.hf.infer import TransposedColwise, TransposedRowwise, infer_tp_plan, is_transposed, with_mla_attention
from meshtron.models.qwen2 import LMHead
from meshtron.parallel.tensor import check_tensor_parallel, kv_heads_split, local_heads, residual_layout
from meshtron.parallel.tp_gradient import TpGradient, local_view, name_tp_gradients
from meshtron.parallel.tp_styles import (
    Colwise,
    PartialSum,
    ReplicatedKVHeads,
    ReplicateParallel,
    Rowwise,
    SplitParams,
    VocabParallelEmbedding,
    owned,
)
from meshtron.parallel.vocab_loss import VocabParallelHead

# transformers' tp-plan styles (``transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES``, 5.23) by
# what they become here. Output features split over tp (the attention then runs on its local heads).
# unit_colwise (5.25, MiniCPM5-MoE's k / v) splits whole heads and repeats them where fewer than tp: what
# colwise k / v become here anyway (ReplicatedKVHeads when the key/value heads do not split over tp).
_COLWISE = ("colwise", "unit_colwise")
# Output features split, then all-gathered (the module's consumer needs every feature: a fused qkv or
# gate_up sliced or chunked afterwards, a norm over all heads). packed_colwise's per-part split
# (_StridedShard) then needs no permutation: a plain Shard(0) weight gathered gives the same output.
_COLWISE_GATHERED = ("colwise_gather_output", "colwise_rep", "packed_colwise")
# Input features split, output partial then all-reduced (reduce-scattered under SP) into the residual.
# unit_rowwise (5.25) is the same split by whole heads (meshtron requires the query heads to split over tp).
_ROWWISE = ("rowwise", "unit_rowwise")
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
# A module whose bare parameters have their own entries (HY-V4's ``self_attn.sinks``: "colwise", one
# learned logit per head): the module is unchanged, its 'colwise' parameters split with its heads.
_LOCAL_PARAMS = ("local_params",)
# A module whose bare parameters have 'colwise' / 'rowwise' entries computes a part of its output on each rank,
# summed once over tp (Inkling's shared experts: PartialSum).
_PARTIAL_SUM = ("all_reduce",)
_STYLES = (
    *_COLWISE,
    *_COLWISE_GATHERED,
    *_ROWWISE,
    *_ROWWISE_REPLICATED_INPUT,
    *_REPLICATED_PARTIAL_GRAD,
    *_REPLICATE,
    *_SEQUENCE,
    *_MLA_KV_A,
    *_LOCAL_PARAMS,
    *_PARTIAL_SUM,
)
# Styles transformers defines that meshtron does not translate (outside fused experts): why.
_REFUSED = {
    "embedding_rowwise": "embeddings other than the input embedding are not split; meshtron splits only the input "
    "embedding",
    "embedding_colwise": "embeddings other than the input embedding are not split; meshtron splits only the input "
    "embedding",
    "moe_tp_experts": "per-expert tp outside a fused 'experts' module is not supported",
    "moe_identity_expert": "identity (zero-compute) experts are not supported yet",
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
    arguments follow. A ``local`` result that comes back passes unchanged: activation checkpointing
    (applied after tp) saves layer 0's input as this hook made it, the slice, and replays the layer on
    it in backward, hooks included, so the replay must not slice the slice.
    """

    def __init__(
        self,
        sp: bool,
        layout: Placement | None = None,
        desired: Placement = Replicate(),  # noqa: B008 - a placement is an immutable value
        local: bool = False,
    ):
        super().__init__()
        self.layout, self.desired, self.local = layout or residual_layout(sp), desired, local

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        shared: dict[str, tuple[torch.Tensor, DTensor]] = {}

        def redistribute(x):
            if getattr(x, "redistributed_by", None) is self:  # a checkpoint's replay of the module
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.layout], run_check=False)
            x = x.redistribute(mesh, [self.desired])
            if self.local:
                local = x.to_local()
                local.redistributed_by = self
                return local
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
    (:func:`replicate_plain_params`); planned ones stay DTensors."""
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

    heads: int
    kv_heads: int
    head_dim: int
    rope_dim: int  # MLA's rope key width (qk_rope_head_dim); 0 for other attention


def _style(
    style: str, name: str, module: nn.Module, heads: _Heads, tp: int, sp: bool, direct: bool = False
) -> ParallelStyle | None:
    """One entry of transformers' plan as a training ParallelStyle (None: the module stays unchanged).
    A ``direct`` projection (a child of the block itself: OPT's and BioGPT's ``fc1`` / ``fc2``) reads and writes
    the residual stream as it is, so under SP it gathers and scatters the tokens itself, at dim -2 (OPT
    flattens [B, S, H] to [B x S, H] first); others read their parent's gathered input."""
    kv_proj = name.endswith(("k_proj", "v_proj"))
    colwise, rowwise = (TransposedColwise, TransposedRowwise) if is_transposed(module) else (Colwise, Rowwise)
    stream = (Shard(-2) if sp else Replicate()) if direct else Replicate()
    written = Shard(-2) if direct and sp else residual_layout(sp)
    if style in _COLWISE and kv_proj and not kv_heads_split(heads.kv_heads, tp):
        return ReplicatedKVHeads(heads.kv_heads, heads.head_dim)
    if style in _COLWISE:
        return colwise(input_layouts=stream)
    if style in _COLWISE_GATHERED:
        return colwise(input_layouts=stream, output_layouts=Replicate())
    if style in _ROWWISE:
        return rowwise(output_layouts=written)
    if style in _ROWWISE_REPLICATED_INPUT:
        return rowwise(input_layouts=Replicate(), output_layouts=written)
    if style in _REPLICATED_PARTIAL_GRAD:
        return ReplicateParallel(grad="infer")
    if style in _SEQUENCE:
        return SequenceParallel() if sp else None
    if style in _REPLICATE + _LOCAL_PARAMS:
        return None
    if style in _MLA_KV_A:
        return _SharedRopeKey(heads.rope_dim)
    raise AssertionError(f"unchecked tp plan style '{style}' for '{name}'")  # _base_plan validates styles


def _exists(layer: nn.Module, rel: str, parameter: bool = False) -> bool:
    """Whether ``layer`` has the submodule (with ``parameter``: the parameter) at path ``rel``."""
    try:
        (layer.get_parameter if parameter else layer.get_submodule)(rel)
    except AttributeError:
        return False
    return True


def _moe_block(layer: nn.Module) -> str | None:
    """The layer's child holding the routed ``experts`` (``mlp`` in most families, Llama 4's
    ``feed_forward``); None in a dense layer."""
    return next((name for name, child in layer.named_children() if _exists(child, "experts")), None)


def _layer_plan(
    base_plan: dict[str, str], blocks: str, layer: nn.Module, index: int, heads: _Heads, tp: int, sp: bool
) -> dict[str, ParallelStyle]:
    """tp plan entries of decoder layer ``index``, relative to the layer, plus our input/norm styles.

    Entries naming a module this layer lacks are skipped (a MoE model's dense layers have no experts,
    its sparse ones no ``mlp.gate_proj``). Fused experts are left to :mod:`meshtron.hf.experts`.
    """
    plan: dict[str, ParallelStyle] = {}
    writes_residual: dict[str, bool] = {}  # parent of split projections -> one of them is rowwise
    moe = _moe_block(layer)
    for pattern, style in base_plan.items():
        parts = pattern.split(".")
        if parts[:2] != [blocks, "*"]:
            raise ConfigError(
                f"parallelize_hf_model: tp plan entry '{pattern}' is outside '{blocks}.*'; not supported."
            )
        rel = ".".join(parts[2:])
        if "experts" in parts:
            continue
        if not _exists(layer, rel):
            if _exists(layer, rel, parameter=True) and not _split_param_entry(base_plan, pattern, style):
                raise ConfigError(
                    f"parallelize_hf_model: tp plan entry '{pattern}' ('{style}') names a parameter, "
                    "not a module; only 'colwise' parameters of a 'local_params' module and 'colwise' / "
                    "'rowwise' ones of an 'all_reduce' module are supported."
                )
            continue
        # Inside a MoE block (Aria's shared experts) the tokens are already gathered under SP.
        split_seq = sp and not (moe is not None and rel.startswith(f"{moe}."))
        if style in _PARTIAL_SUM:
            plan[rel] = PartialSum(_partial_sum_splits(base_plan, pattern, layer, split_seq))
            continue
        direct = "." not in rel
        translated = _style(style, f"{blocks}.{index}.{rel}", layer.get_submodule(rel), heads, tp, split_seq, direct)
        if translated is None:
            continue
        plan[rel] = translated
        if direct:  # the block is its parent: its input stays the residual stream
            continue
        parent = rel.rsplit(".", 1)[0]
        if style in _COLWISE + _COLWISE_GATHERED:
            plan[parent] = _HiddenStatesInput(split_seq)
        if split_seq:
            writes_residual[parent] = (
                writes_residual.get(parent, False) or style in _ROWWISE + _ROWWISE_REPLICATED_INPUT
            )
    if moe is not None and _exists(layer, f"{moe}.shared_expert.down_proj"):
        plan.update(_shared_expert_plan(f"{moe}.shared_expert"))
    if sp:
        # The block's own norms act on the (sequence-split) residual stream or on a rowwise output that
        # is then added to it (Gemma2's post-norms), so they hand back plain local tensors. Tokens are
        # the next-to-last dim: OPT flattens [B, S, H] to [B x S, H] before its MLP's norm.
        plan.update(
            {
                name: SequenceParallel(sequence_dim=-2, use_local_output=True)
                for name, child in layer.named_children()
                if is_norm(child)
            }
        )
        if moe is not None:
            # Routing needs every token: the replicated MoE block runs on the gathered sequence and
            # each rank keeps its slice of the (identical) output.
            plan[moe] = _GatheredSequence()
        # A module whose projections are all gathered (Qwen3-Next's linear attention: even its output
        # projection) returns the whole sequence on every rank: each keeps its slice, like the MoE block.
        plan.update(
            {
                parent: _GatheredSequence()
                for parent, rowwise in writes_residual.items()
                if not rowwise and isinstance(plan.get(parent), _HiddenStatesInput)
            }
        )
        plan.update({name: _GatheredSequence() for name in _left_whole(layer, plan)})
    return plan


def _split_with_heads(base_plan: dict[str, str], pattern: str, style: str) -> bool:
    """A 'colwise' entry naming a bare parameter of a 'local_params' module (HY-V4's attention sinks)."""
    return style in _COLWISE and base_plan.get(pattern.rpartition(".")[0]) in _LOCAL_PARAMS


def _split_param_entry(base_plan: dict[str, str], pattern: str, style: str) -> bool:
    """An entry naming a bare parameter that meshtron splits: with its heads, or in an 'all_reduce' module."""
    in_partial_sum = style in _COLWISE + _ROWWISE and base_plan.get(pattern.rpartition(".")[0]) in _PARTIAL_SUM
    return _split_with_heads(base_plan, pattern, style) or in_partial_sum


def _partial_sum_splits(base_plan: dict[str, str], pattern: str, layer: nn.Module, split_seq: bool) -> dict[str, int]:
    """An 'all_reduce' module's bare parameters -> the dim each is split on: 'colwise' its output features
    (``[..., out, in]``: the next-to-last), 'rowwise' its input features (the last)."""
    rel = pattern.split(".", 2)[2]
    module = pattern.replace(".*.", ".<i>.")
    if split_seq:
        raise ConfigError(
            f"parallelize_hf_model: SP does not support the 'all_reduce' module '{module}' outside a MoE block: its "
            "parts would be summed over tp ranks holding different tokens; set [parallel] sp = false."
        )
    splits, children = {}, []
    for entry, style in base_plan.items():
        owner, _, name = entry.rpartition(".")
        if owner != pattern:
            continue
        if not _exists(layer, f"{rel}.{name}", parameter=True):
            children.append(f"'{name}' ('{style}')")
            continue
        param = layer.get_parameter(f"{rel}.{name}")
        splits[name] = param.dim() - (2 if style in _COLWISE else 1)
    if children or not splits:
        raise ConfigError(
            f"parallelize_hf_model: the 'all_reduce' module '{module}' is supported when its plan entries split "
            f"its bare parameters 'colwise' / 'rowwise'; it has {', '.join(children) or 'none'}."
        )
    return splits


def _head_split_params(base_plan: dict[str, str], blocks: str, layer: nn.Module) -> dict[str, list[str]]:
    """This layer's modules (relative paths) -> their bare parameters split with the heads."""
    split: dict[str, list[str]] = {}
    for pattern, style in base_plan.items():
        rel = pattern.removeprefix(f"{blocks}.*.")
        if _split_with_heads(base_plan, pattern, style) and _exists(layer, rel, parameter=True):
            module, _, name = rel.rpartition(".")
            split.setdefault(module, []).append(name)
    return split


def _left_whole(layer: nn.Module, plan: dict[str, ParallelStyle]) -> list[str]:
    """Children of ``layer`` with parameters that no plan entry reaches (MiniMax's lightning attention in
    the layers its plan skips, an attention or mamba mixer a plan naming only the experts leaves out).
    Under SP they would see only this rank's tokens. A norm (SequenceParallel) or a bare linear layer
    (OPT's fc1 / fc2 on flattened tokens) is known to act per token; anything else may mix tokens, so it
    runs on the gathered sequence."""
    reached = {rel.split(".", 1)[0] for rel in plan}
    return [
        name
        for name, child in layer.named_children()
        if name not in reached and not _acts_per_token(child) and any(True for _ in child.parameters())
    ]


def _acts_per_token(module: nn.Module) -> bool:
    return is_norm(module) or isinstance(module, nn.Linear) or is_transposed(module)


def _shared_expert_plan(prefix: str) -> dict[str, ParallelStyle]:
    """A MoE's shared expert (SwiGLU MLP, absent from transformers' plans) split like a dense MLP; the MoE
    block holds every token of the tp group (gathered under SP), so its output is all-reduced."""
    return {
        prefix: _HiddenStatesInput(sp=False),
        f"{prefix}.gate_proj": Colwise(),
        f"{prefix}.up_proj": Colwise(),
        f"{prefix}.down_proj": Rowwise(output_layouts=Replicate()),
    }


def _base_plan(model: nn.Module, parts: HFParts) -> dict[str, str]:
    """The config's ``base_model_tp_plan``, every style checked to be translatable. An entry for the
    input embedding (transformers 5.24's ``embedding_rowwise``) is dropped: meshtron splits the input
    embedding itself, vocab-parallel, whatever the plan says of it."""
    plan = {
        pattern: style
        for pattern, style in model.config.base_model_tp_plan.items()
        if pattern != parts.plan_embed and not _refused_for_nothing(parts, pattern, style)
    }
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


def _whole_outside_blocks(model: nn.Module, parts: HFParts, plan: dict[str, str], sp: bool) -> dict[str, str]:
    """Entries for modules outside the blocks (Qwen4-Exp's ``hyper_connection_mixer``, run on the blocks'
    output in place of a final norm) are dropped: those modules run whole on every tp rank, on the stream
    that is whole there without SP (one warning). Under SP each rank holds only its tokens there, so
    they are refused naming the module."""
    outside = [pattern for pattern in plan if not pattern.startswith(f"{parts.plan_blocks}.")]
    if outside and sp:
        raise ConfigError(
            f"parallelize_hf_model: tp plan entries {outside} name modules outside '{parts.plan_blocks}', "
            "which run whole over tp on the sequence-split stream under SP; set [parallel] sp = false."
        )
    if outside:
        warnings.warn(
            f"parallelize_hf_model: {type(model).__name__}'s tp plan entries {outside} are outside "
            f"'{parts.plan_blocks}'; those modules run whole on every tp rank (FSDP still shards them).",
            stacklevel=4,
        )
    return {pattern: style for pattern, style in plan.items() if pattern not in outside}


def _refused_for_nothing(parts: HFParts, pattern: str, style: str) -> bool:
    """A style meshtron refuses, in an entry for a block part this model lacks (Qwen4-Exp's per-layer n-gram
    embeddings when the config sets no ``ple_layer_ids``): it would split nothing, so it refuses nothing.
    Fused experts follow ``base_model_ep_plan`` whatever their tp style."""
    prefix = f"{parts.plan_blocks}.*."
    if style not in _REFUSED or "experts" in pattern.split(".") or not pattern.startswith(prefix):
        return False
    rel = pattern.removeprefix(prefix)
    return not any(_exists(layer, rel) or _exists(layer, rel, parameter=True) for _, layer in parts.block_items())


def _tp_plan(model: nn.Module, parts: HFParts, tp: int, sp: bool) -> dict[str, str]:
    """The config's plan (its heads must split over tp), else one inferred from the module types (also
    when the config's names nothing inside the blocks: HunYuan's lists only the input embedding); then
    :func:`_gather_spanning_norms`."""
    own = _base_plan(model, parts) if getattr(model.config, "base_model_tp_plan", None) else {}
    own = _whole_outside_blocks(model, parts, own, sp)
    if not any(pattern.startswith(f"{parts.plan_blocks}.") for pattern in own):
        plan = infer_tp_plan(model, parts, tp)
    else:
        _check_heads(model, parts, tp)
        plan = own
    return _gather_spanning_norms(plan, parts)


def _check_heads(model: nn.Module, parts: HFParts, tp: int) -> None:
    """Every block's heads split over tp, each block's counts its own (per-layer configs differ)."""
    for i, _ in parts.block_items():
        try:
            check_tensor_parallel(*layer_heads(model.config, i), tp)
        except ConfigError as refused:
            if layer_config(model.config, i) is model.config:
                raise
            raise ConfigError(f"{refused} (decoder layer {i}, its per_layer_config)") from None


def _norm_features(norm: nn.Module) -> int | None:
    """How many features a norm module normalises over, where it says (its weight or ``normalized_shape``)."""
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.numel()
    shape = getattr(norm, "normalized_shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else None


def _has_spanning_norm(module: nn.Module, width: int) -> bool:
    """A norm inside ``module`` over all ``width`` features its rowwise projection reads (BitNet's
    ``attn_sub_norm`` before ``o_proj``, ``ffn_sub_norm`` over the MLP's intermediate features), or one
    that does not say its size. A per-head norm (Qwen3's ``q_norm``) or one on a replicated input (MLA's
    ``kv_a_layernorm``) sees its features whole however the heads are split."""
    return any(
        name and is_norm(child) and _norm_features(child) in (width, None) for name, child in module.named_modules()
    )


def _in_features(module: nn.Module) -> int:
    return module.weight.shape[0 if is_transposed(module) else 1]


def _gather_spanning_norms(plan: dict[str, str], parts: HFParts) -> dict[str, str]:
    """Split projections whose module also runs a norm over all the split features (in any block) keep
    their weights split but gather their outputs (``colwise_gather_output`` / ``rowwise_split_input``),
    so the norm sees every feature, whether the plan is the config's or inferred. MLA's projections
    (``mla_kv_a_proj``: the rope key's gradient is summed over split heads) and fused experts
    (:mod:`meshtron.hf.experts`) are left as they are."""
    gathered = {"colwise": "colwise_gather_output", "rowwise": "rowwise_split_input"}
    rowwise: dict[str, str] = {}  # parent pattern -> its rowwise projection, relative to a block
    skipped = set()
    for pattern, style in plan.items():
        parent = pattern.rpartition(".")[0]
        if style in _MLA_KV_A or "experts" in pattern.split("."):
            skipped.add(parent)
        elif style == "rowwise" and parent.count(".") >= 2:
            rowwise.setdefault(parent, pattern.split(".", 2)[2])
    spanning = {
        parent
        for parent, proj in rowwise.items()
        if parent not in skipped
        and any(
            _exists(layer, proj)
            and _has_spanning_norm(
                layer.get_submodule(proj.rpartition(".")[0]), _in_features(layer.get_submodule(proj))
            )
            for _, layer in parts.block_items()
        )
    }
    return {
        pattern: gathered[style] if pattern.rpartition(".")[0] in spanning and style in gathered else style
        for pattern, style in plan.items()
    }


def check_norm_on_embeddings(parts: HFParts, tp: int, sp: bool) -> None:
    """SP runs the final norm on sequence slices; a norm that also normalises the whole embeddings before the
    blocks (NanoChat's) runs on both as it is when it has no weights, but with weights their gradient would
    be partial from one use and whole from the other."""
    norm = parts.norm
    if sp and tp > 1 and norm is not None and norm is parts.embed_norm and any(True for _ in norm.parameters()):
        raise ConfigError(
            f"parallelize_hf_model: SP does not support the final norm '{parts.norm_path}' also normalising the "
            "embeddings with its own weights; set [parallel] sp = false."
        )


def _check_vocab(model: nn.Module, tp: int) -> None:
    if model.config.vocab_size % tp:
        raise ConfigError(
            f"parallelize_hf_model: tp = {tp} does not divide vocab_size = {model.config.vocab_size}; pad the "
            "vocabulary."
        )


def _layer_heads(model: nn.Module, index: int) -> _Heads:
    """What the attention styles need of decoder layer ``index``'s heads, from its own config."""
    own = layer_config(model.config, index)
    heads, kv_heads = layer_heads(model.config, index)
    head_dim = getattr(own, "head_dim", None) or own.hidden_size // heads
    return _Heads(heads, kv_heads, head_dim, getattr(own, "qk_rope_head_dim", None) or 0)


def _set_local_head_groups(layer: nn.Module, plan: dict[str, str], heads: int, kv_heads: int, tp: int) -> None:
    """HF attention repeats KV heads ``num_key_value_groups`` times: make that the local ratio when the
    heads are split (``colwise`` q/k/v); gathered projections keep every head on every rank."""
    local_q, local_kv = local_heads(heads, kv_heads, tp)
    for pattern, style in plan.items():
        attention, _, proj = pattern.split(".", 2)[2].rpartition(".")
        if proj == "k_proj" and style in _COLWISE and _exists(layer, attention):
            layer.get_submodule(attention).num_key_value_groups = local_q // local_kv


def _owned_output(_module, _args, out):
    """Modelling code edits split projections' outputs in place (Olmo's ``query_states.clamp_(...)`` with
    ``clip_qkv`` on a column-split q, Falcon's ``mlp_output += attention_output`` on a rowwise one)."""
    return owned(out) if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) else None


def _own_split_outputs(layer: nn.Module, plan: dict[str, str]) -> None:
    """Every split projection of a block (its plan the config's or the inferred one) hands out an output
    the model may edit in place (:func:`~meshtron.parallel.tp_styles.owned`)."""
    for pattern, style in plan.items():
        rel = pattern.split(".", 2)[2]
        if style in _COLWISE + _COLWISE_GATHERED + _ROWWISE + _ROWWISE_REPLICATED_INPUT and _exists(layer, rel):
            layer.get_submodule(rel).register_forward_hook(_owned_output)


def apply_hf_tensor_parallel(model: nn.Module, parts: HFParts, tp_mesh: DeviceMesh, sp: bool) -> None:
    tp = tp_mesh.size()
    _check_vocab(model, tp)
    base, tied = _tp_plan(model, parts, tp, sp), parts.tied
    whole_embed = parts.embed is not None and _embedding_kept_whole(parts.embed)
    if whole_embed and tied:
        raise ConfigError(
            f"parallelize_hf_model: tp does not support {type(parts.embed).__name__} '{parts.embed_path}' (its "
            "modules with weights of their own stay whole over tp) tied to the split output head; use tp = 1."
        )
    blocks = parts.block_items()  # a pipeline stage holds some blocks, and the embedding / head only at its ends
    for i, layer in blocks:
        heads = _layer_heads(model, i)
        plan = with_mla_attention(base, parts.plan_blocks, layer)
        parallelize_module(layer, tp_mesh, _layer_plan(plan, parts.plan_blocks, layer, i, heads, tp, sp))
        for rel, names in _head_split_params(plan, parts.plan_blocks, layer).items():
            parallelize_module(layer.get_submodule(rel), tp_mesh, SplitParams(names))
        _set_local_head_groups(layer, plan, heads.heads, heads.kv_heads, tp)
        _own_split_outputs(layer, plan)
    if parts.embed is not None and not whole_embed:
        # Embedding output replicated: HF computes positions and the causal mask from its length. A
        # family's own embedding class (Gemma 3 scales in its forward) keeps DTensor's rowwise split.
        style = (
            VocabParallelEmbedding(Replicate())
            if type(parts.embed) is nn.Embedding
            else Rowwise(input_layouts=Replicate(), output_layouts=Replicate())
        )
        parallelize_module(parts.embed, tp_mesh, style)
    if parts.embed is not None and sp:
        parallelize_module(blocks[0][1], tp_mesh, _HiddenStatesInput(sp, Replicate(), Shard(1), local=True))
    if parts.head is not None:
        if sp and parts.norm is not parts.embed_norm:
            parallelize_module(parts.norm, tp_mesh, SequenceParallel())
        # Vocab-sharded logits either way; meshtron's head also computes the fused loss (pipeline stages).
        style = (
            VocabParallelHead(residual_layout(sp))
            if isinstance(parts.head, LMHead)
            else Colwise(input_layouts=residual_layout(sp), output_layouts=Shard(-1), use_local_output=False)
        )
        parallelize_module(parts.head, tp_mesh, style)
    if tied:  # both now hold a Shard(0) copy of the shared weight; make them one Parameter again
        parts.head.weight = parts.embed.weight


def _embedding_kept_whole(embed: nn.Module) -> bool:
    """An embedding class holding modules with weights of their own (Inkling's ``embed_norm`` after the
    lookup): a split lookup's rows are partial sums until reduced, which such a module cannot take, so the
    embedding stays whole over tp, replicated like any part tp does not split."""
    return any(True for child in embed.children() for _ in child.parameters())


def replicate_plain_params(model: nn.Module, parts: HFParts, tp_mesh: DeviceMesh, experts: list[nn.Module]) -> None:
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
        return [
            f"{path}.{name}" if path else name
            for path, sub in module.named_modules()
            if id(sub) not in skip
            for name, p in sub.named_parameters(recurse=False)
            if not isinstance(p, DTensor)
        ]

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


__all__ = ["apply_hf_tensor_parallel", "check_norm_on_embeddings", "replicate_plain_params"]
