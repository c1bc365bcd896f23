"""A tp plan for transformers models whose config has none (GPT-2, Falcon, Bloom, GPT-J, OPT, StableLM, ...).

:func:`infer_tp_plan` reads the module types of each kind of decoder block and writes the plan in transformers'
own style names, so it goes through the same translation as a config's plan. An attention it cannot prove
head-local gets gathered outputs (right for every head layout); a part it cannot split stays whole, for FSDP
alone, with one warning. See docs/hf.md, 'Models without a plan'.
"""

from __future__ import annotations

import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshtron.hf.discover import HFParts, layer_heads
from meshtron.parallel.tensor import tp_fits
from meshtron.torch_private import style_io

_ATTENTION_NAMES = ("attn", "attention")
_MLP_NAMES = ("mlp", "feed_forward", "ffn")
_OUTPUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "wo")
_SEPARATE_QKV = ({"q_proj", "k_proj", "v_proj"}, {"query", "key", "value"})
# An attention module keeping one of these reshapes by the model's full head count (StableLM's
# ``view(bsz, q_len, self.num_heads, ...)``): its heads cannot be split without editing it.
_FULL_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head")


def is_transposed(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 family): a linear layer whose weight is stored ``[in, out]``."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, list], src_data_rank) -> None:
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if param is not None:
            module.register_parameter(
                name,
                nn.Parameter(
                    distribute_tensor(param, mesh, placement, src_data_rank=src_data_rank),
                    requires_grad=param.requires_grad,
                ),
            )


class TransposedColwise(ColwiseParallel):
    """ColwiseParallel for a ``[in, out]`` weight: the output features are its dim 1 (bias: dim 0)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name, mod, mesh):
            if mod is module:
                _distribute_params(mod, mesh, {"weight": [Shard(1)], "bias": [Shard(0)]}, self.src_data_rank)

        return distribute_module(module, device_mesh, partition, *style_io(self))


class TransposedRowwise(RowwiseParallel):
    """RowwiseParallel for a ``[in, out]`` weight: the input features are its dim 0 (bias replicated)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(_name, mod, mesh):
            if mod is module:
                _distribute_params(mod, mesh, {"weight": [Shard(0)], "bias": [Replicate()]}, self.src_data_rank)

        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, partition, *style_io(self))


def _features(module: nn.Module) -> tuple[int, int] | None:
    """(input, output) features of a linear-like module; None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_transposed(module):
        return tuple(module.weight.shape)
    return None


def _projections(module: nn.Module) -> dict[str, tuple[int, int]]:
    return {name: f for name, m in module.named_modules() if name and (f := _features(m)) is not None}


def _child(block: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    found = [(n, m) for n, m in block.named_children() if any(k in n for k in names) and _projections(m)]
    return found[0] if len(found) == 1 else None


def _divides(tp: int, projections: dict[str, tuple[int, int]], split_dim: dict[str, int]) -> str | None:
    """The first projection whose split dimension tp does not divide, or None."""
    return next((n for n, d in split_dim.items() if projections[n][d] % tp), None)


# DeepSeek-V2's base_model_tp_plan for its MLA attention, relative to the attention module: the up
# projections split by heads, the output projection rowwise, the down projections (and their norms)
# replicated; q_proj replaces q_a_proj / q_b_proj when q_lora_rank is None.
_MLA = {
    "q_proj": "colwise",
    "q_b_proj": "colwise",
    "kv_a_proj_with_mqa": "mla_kv_a_proj",
    "kv_b_proj": "colwise",
    "o_proj": "rowwise",
}


def _is_mla(attn: nn.Module) -> bool:
    """Multi-head latent attention in transformers' DeepSeek-V2 form (and the families copying it)."""
    return all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))


def _mla_attention_plan(name: str, attn: nn.Module) -> dict[str, str]:
    """The MLA entries for the attention module at ``name`` (the projections it has)."""
    return {f"{name}.{proj}": style for proj, style in _MLA.items() if getattr(attn, proj, None) is not None}


def with_mla_attention(plan: dict[str, str], blocks: str, layer: nn.Module) -> dict[str, str]:
    """``plan`` plus the MLA entries of ``layer``'s attention when that is MLA and the plan splits nothing of
    it: left out, the attention would run whole on every tp rank. Decided layer by layer, since MLA may be in
    some layers only (Kimi Linear's full-attention layers, delta attention with its own q_proj / o_proj in
    the others, under one decoder-layer class), and applied to this layer only."""
    child = _child(layer, _ATTENTION_NAMES)
    if child is None or not _is_mla(child[1]):
        return plan
    name, attn = child
    prefix = f"{blocks}.*.{name}."
    if any(pattern.startswith(prefix) and _reaches(attn, pattern.removeprefix(prefix)) for pattern in plan):
        return plan
    return {**plan, **_mla_attention_plan(f"{blocks}.*.{name}", attn)}


def _reaches(module: nn.Module, rel: str) -> bool:
    try:
        module.get_submodule(rel)
    except AttributeError:
        return False
    return True


def _attention_plan(
    name: str, attn: nn.Module, hidden: int, heads: int, kv_heads: int, tp: int
) -> tuple[dict[str, str], str | None]:
    if _is_mla(attn):
        return (
            (_mla_attention_plan(name, attn), None)
            if heads % tp == 0
            else ({}, f"tp = {tp} does not divide its {heads} heads")
        )
    projections = _projections(attn)
    outputs = [n for n in projections if n.rsplit(".", 1)[-1] in _OUTPUT_NAMES]
    inputs = [n for n in projections if n not in outputs and projections[n][0] == hidden]
    if len(outputs) != 1 or not inputs or len(inputs) + 1 != len(projections):
        return {}, f"projections {sorted(projections)} are not input projections plus one output projection"
    (out,) = outputs
    if heads % tp:
        return {}, f"tp = {tp} does not divide its {heads} heads"
    split = {**{n: 1 for n in inputs}, out: 0}
    bad = _divides(tp, projections, split)
    if bad:
        return {}, f"tp = {tp} does not divide the features of '{bad}' {projections[bad]}"
    by_heads = (
        {n.rsplit(".", 1)[-1] for n in inputs} in _SEPARATE_QKV
        and hasattr(attn, "num_key_value_groups")
        and not any(hasattr(attn, a) for a in _FULL_HEAD_COUNTS)
        and not any(True for _ in attn.parameters(recurse=False))
        and tp_fits(heads, kv_heads, tp)
    )
    col, row = ("colwise", "rowwise") if by_heads else ("colwise_gather_output", "rowwise_split_input")
    return {**{f"{name}.{n}": col for n in inputs}, f"{name}.{out}": row}, None


def _loose_projections(block: nn.Module) -> dict[str, tuple[int, int]]:
    """The linear-like direct children of a block: OPT's and BioGPT's MLP (``fc1`` / ``fc2``) is not a module."""
    return {name: f for name, m in block.named_children() if (f := _features(m)) is not None}


def _mlp_plan(
    name: str, projections: dict[str, tuple[int, int]], hidden: int, tp: int
) -> tuple[dict[str, str], str | None]:
    """Entries for an MLP's ``projections`` (relative to ``name``: the MLP module, or '' for the block)."""
    at = f"{name}." if name else ""
    outputs = [n for n, (i, o) in projections.items() if o == hidden and i != hidden]
    inputs = [n for n, (i, _) in projections.items() if i == hidden]
    if len(outputs) != 1 or not inputs or len(inputs) + 1 != len(projections):
        return (
            {},
            f"projections {sorted(projections)} are not up/gate projections from the hidden size plus one down "
            "projection",
        )
    (down,) = outputs
    width = projections[down][0]
    bad = _divides(tp, projections, {**{n: 1 for n in inputs}, down: 0})
    if bad:
        return {}, f"tp = {tp} does not divide the features of '{bad}' {projections[bad]}"
    if all(projections[n][1] == width for n in inputs):
        return {**{f"{at}{n}": "colwise" for n in inputs}, f"{at}{down}": "rowwise"}, None
    if len(inputs) == 1 and projections[inputs[0]][1] == 2 * width:  # fused gate_up, chunked after
        return {f"{at}{inputs[0]}": "colwise_gather_output", f"{at}{down}": "rowwise_split_input"}, None
    return {}, f"its up projections' widths {[projections[n][1] for n in inputs]} do not match down's input {width}"


def _block_tp_plan(
    block: nn.Module, prefix: str, hidden: int, heads: int, kv_heads: int, tp: int
) -> tuple[dict[str, str], dict[str, str]]:
    """One block's plan entries, and for each kind (attention, MLP) it leaves unsplit, why."""
    plan, unsplit = {}, {}
    moe = any(name.rsplit(".", 1)[-1] == "experts" for name, _ in block.named_modules())
    for kind, names in (("attention", _ATTENTION_NAMES), ("MLP", _MLP_NAMES)):
        if kind == "MLP" and moe:
            continue  # routed experts: meshtron.hf.experts; the router stays replicated
        child = _child(block, names)
        loose = _loose_projections(block)
        if child is None and (kind == "attention" or not loose):
            unsplit[kind] = f"{kind}: no single submodule named like {names} holds its projections" + (
                f" (projections directly in the block: {sorted(loose)})" if loose else ""
            )
            continue
        if child is None:  # the MLP's projections directly in the block
            name, module, projections = "", block, loose
        else:
            (name, module), projections = child, _projections(child[1])
        part, why = (
            _attention_plan(name, module, hidden, heads, kv_heads, tp)
            if kind == "attention"
            else _mlp_plan(name, projections, hidden, tp)
        )
        plan.update({f"{prefix}.{k}": v for k, v in part.items()})
        if why:
            where = f"'{prefix}.{name}' ({type(module).__name__})" if name else f"in '{prefix}' {sorted(loose)}"
            unsplit[kind] = f"{kind} {where}: {why}"
    return plan, unsplit


def infer_tp_plan(model: nn.Module, parts: HFParts, tp: int) -> dict[str, str]:
    """A ``base_model_tp_plan`` for ``model`` from the module types of its blocks (relative to the
    decoder, as transformers writes plans), each kind of block (its class and its own head counts) read
    once (Bamba's attention is only in some layers); where kinds disagree on an entry, its gathered form
    (right for every head layout) is kept. Warns once, naming every part left unsplit and why. Under SP an
    unsplit part runs on the gathered sequence (:func:`meshtron.hf.tp_plan._left_whole`)."""
    cfg = model.config
    prefix = f"{parts.plan_blocks}.*"
    plan, unsplit, seen = {}, {}, set()
    for i, block in parts.block_items():
        heads, kv_heads = layer_heads(cfg, i)
        if (type(block), heads, kv_heads) in seen:
            continue
        seen.add((type(block), heads, kv_heads))
        part, why = _block_tp_plan(block, prefix, cfg.hidden_size, heads, kv_heads, tp)
        plan.update({k: v if plan.get(k, v) == v else _GATHERED.get(v, v) for k, v in part.items()})
        for kind, text in why.items():
            unsplit.setdefault(kind, []).append(text)
    # A kind some block splits is not reported for the blocks without it (Bamba's mamba layers).
    planned = {kind for kind in unsplit if any(_kind_planned(kind, pattern) for pattern in plan)}
    texts = [text for kind, found in unsplit.items() if kind not in planned for text in dict.fromkeys(found)]
    if texts:
        warnings.warn(
            f"parallelize_hf_model: {type(model).__name__} has no base_model_tp_plan; the inferred plan leaves "
            f"these parts unsplit over tp (FSDP still shards them; under SP they run on the gathered sequence): "
            f"{'; '.join(texts)}.",
            stacklevel=4,
        )
    return plan


# A projection's style split by heads -> the form that gathers (or splits) its whole output instead.
_GATHERED = {
    "colwise": "colwise_gather_output",
    "rowwise": "rowwise_split_input",
    "colwise_gather_output": "colwise_gather_output",
    "rowwise_split_input": "rowwise_split_input",
}


def _kind_planned(kind: str, pattern: str) -> bool:
    """Whether plan entry ``pattern`` splits part of a ``kind``: an attention module's, else an MLP's (its
    module's or a projection directly in the block)."""
    attention = any(k in pattern.split(".")[2] for k in _ATTENTION_NAMES)
    return attention == (kind == "attention")


__all__ = ["TransposedColwise", "TransposedRowwise", "infer_tp_plan", "is_transposed", "with_mla_attention"]
