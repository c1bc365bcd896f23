"""FP8 training (``[train] fp8``): the blocks' attention and MLP linears as torchao ``Float8Linear``, the
routed experts' grouped GEMMs through :class:`Float8GroupedMatmul` (``torch._scaled_grouped_mm`` where the
GPU has it, :func:`runs_float8_kernel`; emulated elsewhere), and under tensor parallelism each split linear's
GEMMs cast with the scales of the whole operands (:class:`Float8Gemms`). ``mxfp8`` is
``meshtron.parallel.mxfp8``'s; what both share is ``meshtron.parallel.fp8_base``. See docs/fp8.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshtron.config import FP8_RECIPES, ConfigError, ModelConfig
from meshtron.models import build_model
from meshtron.models.moe import GroupedExperts, grouped_matmul
from meshtron.parallel.fp8_base import (
    FP8_DIM_MULTIPLE,
    MX_BLOCK,
    TOKEN_GROUP_ALIGN,
    aligned_rows,
    fits_fp8,
    float8_split_linear,
    fp8_dim_multiple,
    placed_rows,
    torchao_float8,
    training_dtype,
    training_dtype_gemms,
)
from meshtron.parallel.mxfp8 import MXGroupedMatmul, MXLinear
from meshtron.torch_private import scaled_grouped_mm

# The recipe whose FSDP all-gather can carry float8 weights (torchao supports tensorwise weight scales only).
FP8_ALL_GATHER_RECIPES = ("tensorwise",)
# The compute capability (major) torch builds its float8 grouped GEMM for (CUTLASS, rowwise float32 scales).
FLOAT8_GROUPED_KERNEL_MAJOR = 9


def runs_float8_kernel(device: torch.device) -> bool:
    """Whether the experts' float8 grouped GEMMs on ``device`` run ``torch._scaled_grouped_mm`` (a CUDA
    device of compute capability 9.x) rather than the emulation (:class:`Float8GroupedMatmul`)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == FLOAT8_GROUPED_KERNEL_MAJOR


def fp8_linear_names(block: nn.Module) -> list[str]:
    """The names (relative to ``block``) of a decoder block's linears that FP8 may take: attention and MLP
    projections, a MoE's shared expert; not the linears of a MoE block itself (any module holding routed
    ``experts``: meshtron's ``MoE``, a transformers sparse block), its router and the shared expert's
    one-column gate: routing decisions stay in the training dtype."""
    routing = {
        f"{name}.{child}".lstrip(".")
        for name, module in block.named_modules()
        if _holds_experts(module)
        for child, linear in module.named_children()
        if isinstance(linear, nn.Linear)
    }
    return [name for name, module in block.named_modules() if isinstance(module, nn.Linear) and name not in routing]


def _holds_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.Module)


# A model's decoder blocks as (key, block) pairs: meshtron's ``model.layers.items()`` by default, a
# transformers model's from ``meshtron.hf.discover`` (``HFParts.block_items``).
Blocks = Iterable[tuple[object, nn.Module]]


def _blocks(model: nn.Module, blocks: Blocks | None) -> Blocks:
    return model.layers.items() if blocks is None else blocks


def _candidates(blocks: Blocks, prefix: str):
    """(name, block, name in the block, linear) of every linear FP8 may take."""
    for key, block in blocks:
        for name in fp8_linear_names(block):
            yield f"{prefix}.{key}.{name}", block, name, block.get_submodule(name)


def _routed_experts(blocks: Blocks, prefix: str):
    for key, block in blocks:
        for name, module in block.named_modules():
            if isinstance(module, GroupedExperts):
                yield f"{prefix}.{key}.{name}", module


def _expert_dims(experts: GroupedExperts) -> tuple[int, int]:
    """(hidden, intermediate): the K and N of the gate and up GEMMs, the N and K of the down one."""
    return tuple(experts.gate_proj.shape[1:])


def high_precision_linears(
    model: nn.Module, recipe: str, blocks: Blocks | None = None, prefix: str = "layers"
) -> list[str]:
    """The block linears (and routed experts) FP8 would take but whose shape ``recipe`` cannot (a dim not a
    multiple of :func:`fp8_dim_multiple`), one entry per distinct name and shape: ``layers.*.self_attn.k_proj
    [64 -> 8]``. ``blocks`` (default ``model.layers``) and ``prefix``, the path of the blocks, as
    :func:`apply_float8` takes them."""
    blocks = list(_blocks(model, blocks))
    shapes = [(name, (linear.in_features, linear.out_features)) for name, _, _, linear in _candidates(blocks, prefix)]
    shapes += [(name, _expert_dims(experts)) for name, experts in _routed_experts(blocks, prefix)]
    depth = len(prefix.split("."))
    seen: dict[str, None] = {}
    for name, dims in shapes:
        if not fits_fp8(dims, recipe):
            pattern = ".".join([prefix, "*", *name.split(".")[depth + 1 :]])
            seen[f"{pattern} [{dims[0]} -> {dims[1]}]"] = None
    return list(seen)


def fp8_note(recipe: str, names: list[str]) -> str | None:
    """The start-up line naming the block linears (:func:`high_precision_linears`) ``recipe`` leaves in the
    training dtype, if any."""
    if recipe == "none" or not names:
        return None
    return (
        f"meshtron: fp8 = '{recipe}' leaves {len(names)} block linear(s) in the training dtype "
        f"(dims not multiples of {fp8_dim_multiple(recipe)}): {', '.join(names)}"
    )


def high_precision_note(cfg: ModelConfig, recipe: str) -> str | None:
    """:func:`fp8_note` of meshtron's own model of ``cfg``."""
    if recipe == "none":
        return None
    with torch.device("meta"):
        return fp8_note(recipe, high_precision_linears(build_model(cfg), recipe))


def float8_all_gather(recipe: str, tp: int, data_ranks: int, offload: bool = False) -> bool:
    """Whether FSDP all-gathers the float8 weights of ``recipe`` in float8: torchao's gather scales a weight
    over the FSDP shards, which under tp hold only a tp slice of it (the scale would depend on tp). Not on
    one data rank (``data_ranks``: the ranks FSDP spans): there the gather moves no bytes, and the weight's
    cast would run eagerly in FSDP's pre-forward hook, outside a compiled block, a handful of kernels per
    weight in forward and again in backward; without it ``Float8Linear`` casts the weight inside the block's
    graph, the same values (the amax of the same whole weight). Nor with the shards on the host
    (``offload``: ``[parallel] offload = "optimizer"``): the gather's scale would all-reduce host tensors over
    the device's collectives; the training dtype's gather then gives ``Float8Linear`` the same whole weight."""
    return recipe in FP8_ALL_GATHER_RECIPES and tp == 1 and data_ranks > 1 and not offload


def float8_config(recipe: str, tp: int = 1, data_ranks: int = 1, offload: bool = False):
    """torchao's config for ``recipe``, with the float8 FSDP all-gather where :func:`float8_all_gather` allows it."""
    recipes = [r for r in FP8_RECIPES if r not in ("none", "mxfp8")]  # torchao's Float8Linear recipes
    if recipe not in recipes:
        raise ValueError(f"no Float8Linear recipe '{recipe}'; one of {', '.join(recipes)}")
    config = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    gather = float8_all_gather(recipe, tp, data_ranks, offload)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=gather)


def apply_float8(
    model: nn.Module, recipe: str, tp: int = 1, data_ranks: int = 1, offload: bool = False, blocks: Blocks | None = None
) -> nn.Module:
    """Swap the FP8-capable block linears of ``model`` (a meshtron ``Transformer`` or a pipeline stage, or
    with ``blocks`` any model's decoder blocks, meta or real) for ``Float8Linear`` (``MXLinear`` under
    ``mxfp8``) in place, and set the routed experts' grouped GEMM (:func:`grouped_matmul_for`); ``recipe``
    "none" leaves the model as it is. The parameters keep their names, values and dtype. ``tp``: the
    tensor-parallel size the model is split over next; ``data_ranks``, ``offload``: the ranks data
    parallelism then spans and whether it keeps the shards on the host (:func:`float8_all_gather`)."""
    if recipe == "none":
        return model
    convert = _linear_converter(recipe, tp, data_ranks, offload)
    blocks = list(_blocks(model, blocks))
    for _, block, name, linear in list(_candidates(blocks, "")):
        if fits_fp8((linear.in_features, linear.out_features), recipe) and type(linear) is nn.Linear:
            owner, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(owner), leaf, convert(linear))
    fitting = [experts for _, experts in _routed_experts(blocks, "") if fits_fp8(_expert_dims(experts), recipe)]
    if fitting:
        matmul = grouped_matmul_for(recipe)
        for experts in fitting:
            experts.matmul = matmul
    return model


def _linear_converter(recipe: str, tp: int, data_ranks: int, offload: bool):
    """``nn.Linear`` -> its FP8 form under ``recipe``."""
    if recipe == "mxfp8":
        return MXLinear.from_linear
    config = float8_config(recipe, tp, data_ranks, offload)
    Float8Linear = torchao_float8("torchao.float8.float8_linear").Float8Linear
    return functools.partial(Float8Linear.from_float, config=config)


def grouped_matmul_for(recipe: str):
    """The routed experts' grouped GEMM under ``recipe``: :class:`Float8GroupedMatmul`, or under ``mxfp8``
    ``meshtron.parallel.mxfp8.MXGroupedMatmul``."""
    if recipe == "mxfp8":
        return MXGroupedMatmul()
    return Float8GroupedMatmul(recipe)


class Scaled(NamedTuple):
    """An operand cast to float8: ``data`` (float8) x ``scale`` (fp32, broadcast against it: per row [T, 1],
    per (group, column) along the tokens [G, C], per expert [G, 1 | K, 1 | N]) is the operand, saturated;
    ``data`` is the operand itself and ``scale`` None where the recipe keeps that GEMM's operand in high
    precision. ``groups``: each row's group, for a per-group scale."""

    data: torch.Tensor
    scale: torch.Tensor | None
    groups: torch.Tensor | None = None

    def values(self) -> torch.Tensor:
        """The float8 values in float32 (the operand, for a high-precision one)."""
        if self.scale is None:
            return self.data.float().contiguous()
        scale = self.scale if self.groups is None else self.scale[self.groups]
        return self.data.float() / scale


class Float8GroupedMatmul:
    """The routed experts' grouped GEMM (``meshtron.models.moe.grouped_matmul``: rows [T, K] sorted into
    groups of ``counts`` rows, stacked weights [G, K, N]) in float8 under ``recipe``. Per the recipe's cast
    configs, as ``Float8Linear`` casts a linear's operands, with an expert's group in place of the tensor:
    a rowwise scale along a GEMM's contraction dim is per token row and per (expert, column) of its weight, a
    weight-gradient operand's along the tokens is per (expert group, column) (torchao's
    ``_Float8GroupedMM``), and a tensorwise scale is per expert group (tokens) or per expert (weights): a
    loop of ``Float8Linear`` over the experts computes the same (``tests/test_float8.py``). A GEMM with a
    rowwise-scaled operand comes out in bfloat16, as torch's rowwise kernels give it.

    Where :func:`runs_float8_kernel` says so the GEMMs run ``torch._scaled_grouped_mm`` on the float8
    operands (every scale is per row or column of a group, the tensorwise ones repeated along them);
    elsewhere the float8 values, dequantized in float32 (:meth:`Scaled.values`), go through ``F.grouped_mm``,
    since the CPU has no float8 grouped kernel."""

    def __init__(self, recipe: str, group=None, split: str | None = None):
        """``group``, ``split``: with expert tensor parallelism, the etp group and the feature dim of the
        weights [G, K, N] it splits (:data:`TP_SPLITS`: ``out`` N, gate/up; ``in`` K, down): a scale that spans
        that dim is computed over the whole expert (:meth:`_whole`)."""
        if split not in (None, *TP_SPLITS):
            raise ValueError(f"split must be one of {TP_SPLITS}, got {split!r}")
        self.recipe, self.group, self.split = recipe, group, split
        self.config = float8_config(recipe)
        utils = torchao_float8("torchao.float8.float8_utils")
        self.amax_to_scale = utils.amax_to_scale
        self.ao_config = torchao_float8("torchao.float8.config")

    def split_over(self, group, split: str) -> Float8GroupedMatmul:
        """This GEMM on an expert slice that etp's ``group`` splits along ``split``."""
        return Float8GroupedMatmul(self.recipe, group, split)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if training_dtype_gemms():
            return grouped_matmul(x, w, counts)
        return _Float8GroupedMM.apply(x, w, counts, self)

    def _whole(self, amax: torch.Tensor, operand_split: str) -> torch.Tensor:
        """``amax`` over the whole expert where etp splits the dim it reduced (``operand_split``: the split
        that cuts it, :data:`TP_SPLITS`): MAX over the etp ranks, each holding the same rows (the slice's
        gathered tokens), so every element gets the scale, and the float8 value, it has at etp 1."""
        if self.group is not None and self.split == operand_split:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return amax

    def _rowwise(self, cast) -> bool:
        return cast.scaling_granularity is self.ao_config.ScalingGranularity.AXISWISE

    def _off(self, cast) -> bool:
        return cast.scaling_type is self.ao_config.ScalingType.DISABLED

    def _cast(self, t: torch.Tensor, amax: torch.Tensor, cast, groups: torch.Tensor | None = None) -> Scaled:
        """``t`` in float8, scaled by ``amax``'s scale (per row of ``groups`` where given), saturated, through
        one float32 buffer (torchao's ``to_fp8_saturated`` makes three). Where the kernel runs, in
        float8_e4m3fn whatever the recipe says: torch's grouped kernel takes no other, so the tensorwise
        recipe's float8_e5m2 gradients become e4m3 there (three mantissa bits instead of two, as torchao's own
        MoE training casts them)."""
        dtype = torch.float8_e4m3fn if runs_float8_kernel(t.device) else cast.target_dtype
        scale = self.amax_to_scale(amax, dtype, self.config.round_scales_to_power_of_2)
        rows = scale if groups is None else scale[groups]
        limit = torch.finfo(dtype).max
        data = t.detach().to(torch.float32, copy=True).mul_(rows).clamp_(-limit, limit).to(dtype)
        return Scaled(data, scale, groups)

    def _token_amax(self, t: torch.Tensor, cast, counts: torch.Tensor, along_tokens: bool, split: str):
        """(amax, each row's group or None) of rows ``t`` for :meth:`tokens`, the magnitudes in ``t``'s dtype
        (an amax is one of them: exact) and freed before the cast."""
        magnitude = t.detach().abs()
        if self._rowwise(cast) and not along_tokens:
            return self._whole(magnitude.amax(-1, keepdim=True).float(), split), None
        if not self._rowwise(cast):
            magnitude = self._whole(magnitude.amax(-1, keepdim=True).float(), split)
        groups = torch.repeat_interleave(torch.arange(counts.numel(), device=t.device), counts, output_size=t.shape[0])
        rows = groups.unsqueeze(-1).expand_as(magnitude)
        amax = magnitude.new_zeros((counts.numel(), magnitude.shape[1])).scatter_reduce_(0, rows, magnitude, "amax")
        return amax.float(), groups

    def tokens(self, t: torch.Tensor, cast, counts: torch.Tensor, along_tokens: bool, split: str) -> Scaled:
        """Rows ``t`` [T, C] in groups of ``counts`` rows in float8: scaled per row along C, or
        ``along_tokens`` per (group, column); tensorwise per group. ``split``: the etp split that cuts C."""
        if self._off(cast):
            return Scaled(t, None)
        amax, groups = self._token_amax(t, cast, counts, along_tokens, split)
        return self._cast(t, amax, cast, groups)

    def weights(self, w: torch.Tensor, cast, dim: int) -> Scaled:
        """Stacked weights ``w`` [G, K, N] in float8: rowwise scaled along ``dim`` per expert, tensorwise
        one scale per expert."""
        dims = (dim,) if self._rowwise(cast) else (1, 2)
        amax = w.detach().abs().amax(dims, keepdim=True).float()
        for reduced in dims:  # etp splits N (out) or K (in)
            amax = self._whole(amax, "out" if reduced == 2 else "in")
        return self._cast(w, amax, cast)

    def result(self, out: torch.Tensor, casts: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A GEMM's result in ``dtype``, through bfloat16 where either operand is rowwise-scaled (torchao then
        runs the rowwise kernel, whose output is bfloat16, the tensorwise scale repeated along the axis)."""
        if not any(self._off(c) for c in casts) and any(self._rowwise(c) for c in casts):
            out = out.to(torch.bfloat16)
        return out.to(dtype)


def _column_scales(w: Scaled, dim: int) -> torch.Tensor:
    """The scales of weights ``w`` [G, K, N] cast along ``dim`` per (expert, column of the GEMM they enter):
    [G, N] for the output GEMM (dim 1), [G, K] for the input gradient's (dim 2, the weights transposed)."""
    G, K, N = w.data.shape
    return w.scale.squeeze(dim).expand(G, N if dim == 1 else K)


def _scaled_rows_by_experts(
    a: Scaled, weights: torch.Tensor, columns: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` of float8 rows ``a`` [T, K] (scaled per row) in groups ending at ``offs``
    and float8 ``weights`` [G, K, N] scaled per (expert, column) by ``columns`` [G, N]: bfloat16 [T, N]. The
    kernel takes the rows row-major, the weights column-major, and the reciprocal scales."""
    rows = a.scale if a.groups is None else a.scale[a.groups]
    if not (weights.stride(-2) == 1 and weights.stride(-1) > 1):
        weights = weights.transpose(1, 2).contiguous().transpose(1, 2)
    return scaled_grouped_mm(
        a.data, weights, (1 / rows).reshape(-1), (1 / columns).contiguous(), offs=offs, out_dtype=torch.bfloat16
    )


def _scaled_weight_gradient(x: Scaled, grad: Scaled, counts: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` of each expert's rows of ``x`` [T, K] and ``grad`` [T, N], both scaled per
    (group, column) along the tokens, contracted over its tokens: bfloat16 [G, K, N]. The kernel reads each
    group's tokens from an aligned start (one layout for both operands, :func:`aligned_rows`), ``x``
    transposed row-major, ``grad`` column-major; a high-precision pair (``rowwise_with_gw_hp``) goes through
    ``F.grouped_mm``."""
    if x.scale is None or grad.scale is None:
        return F.grouped_mm(x.data.t(), grad.data, offs=torch.cumsum(counts, 0, dtype=torch.int32))
    dest, ends, size = aligned_rows(counts, x.groups)
    rows, grads = placed_rows(x.data, dest, size), placed_rows(grad.data, dest, size)
    experts, k, n = counts.numel(), rows.shape[1], grads.shape[1]
    return scaled_grouped_mm(
        rows.t().contiguous(),
        grads.t().contiguous().t(),
        (1 / x.scale).expand(experts, k).reshape(-1),
        (1 / grad.scale).expand(experts, n).reshape(-1),
        offs=ends,
        out_dtype=torch.bfloat16,
    )


class _Float8GroupedMM(torch.autograd.Function):
    """``grouped_matmul`` with every operand of its three GEMMs cast per :class:`Float8GroupedMatmul`: the
    float8 kernel where :func:`runs_float8_kernel`, else the float8 values in float32 through ``F.grouped_mm``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, mm: Float8GroupedMatmul):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        ctx.save_for_backward(x, w, counts, offs)
        ctx.mm = mm
        casts = (mm.config.cast_config_input, mm.config.cast_config_weight)
        rows, weights = mm.tokens(x, casts[0], counts, False, "in"), mm.weights(w, casts[1], 1)
        if runs_float8_kernel(x.device):
            out = _scaled_rows_by_experts(rows, weights.data, _column_scales(weights, 1), offs)
        else:
            out = F.grouped_mm(rows.values(), weights.values(), offs=offs)
        return mm.result(out, casts, x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, counts, offs = ctx.saved_tensors
        mm, c = ctx.mm, ctx.mm.config
        kernel = runs_float8_kernel(x.device)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            casts = (c.cast_config_grad_output, c.cast_config_weight_for_grad_input)
            rows, weights = mm.tokens(grad, casts[0], counts, False, "out"), mm.weights(w, casts[1], 2)
            if kernel:
                grad_x = _scaled_rows_by_experts(rows, weights.data.transpose(1, 2), _column_scales(weights, 2), offs)
            else:
                grad_x = F.grouped_mm(rows.values(), weights.values().transpose(1, 2), offs=offs)
            grad_x = mm.result(grad_x, casts, x.dtype)
        if ctx.needs_input_grad[1]:
            casts = (c.cast_config_input_for_grad_weight, c.cast_config_grad_output_for_grad_weight)
            rows, grads = mm.tokens(x, casts[0], counts, True, "in"), mm.tokens(grad, casts[1], counts, True, "out")
            if kernel:
                grad_w = _scaled_weight_gradient(rows, grads, counts)
            else:
                grad_w = F.grouped_mm(rows.values().t(), grads.values(), offs=offs)
            grad_w = mm.result(grad_w, casts, w.dtype)
        return grad_x, grad_w, None, None


# A linear's feature dim tensor parallelism splits: "out" (column-parallel: the weight's rows, the output's
# features) or "in" (row-parallel: the weight's columns, the input's features).
TP_SPLITS = ("out", "in")


class Float8Gemms:
    """The three GEMMs of one ``Float8Linear`` split over ``mesh`` (tp) along ``split`` (:data:`TP_SPLITS`),
    on this rank's pieces of their operands: ``x`` [T, K], ``weight`` [N, K], ``dy`` [T, N] (2-D).

    Each operand is cast as ``Float8Linear`` casts it on one rank (torchao's ``matmul_with_hp_or_float8_args``:
    the same cast configs, roles and scaled dims), with the scale of the whole operand: an operand split
    along a dim its scale spans gets its amax all-reduced (MAX) over ``mesh`` first (:meth:`_cast`).
    """

    def __init__(self, linear: nn.Linear, mesh, split: str):
        if split not in TP_SPLITS:
            raise ValueError(f"split must be one of {TP_SPLITS}, got {split!r}")
        self.config, self.mm_config = linear.config, linear.linear_mm_config
        self.mesh, self.split = mesh, split
        training_tensor = torchao_float8("torchao.float8.float8_training_tensor")
        self.roles, self.Float8Tensor = training_tensor.GemmInputRole, training_tensor.Float8TrainingTensor
        self.ao_config = torchao_float8("torchao.float8.config")
        self.convert = torchao_float8("torchao.float8.float8_scaling_utils").hp_tensor_to_float8_dynamic

    def _split_dims(self, operand: str) -> tuple[int, ...]:
        """Dims of ``operand`` (x [T, K], wt = weight.t() [K, N], dy [T, N]) split over tp."""
        return {("x", "in"): (1,), ("wt", "in"): (0,), ("wt", "out"): (1,), ("dy", "out"): (1,)}.get(
            (operand, self.split), ()
        )

    def _cast(self, t: torch.Tensor, operand: str, cast, role, axis: int, split: tuple[int, ...] | None = None):
        """``t`` in float8 per ``cast`` (scaled along ``axis`` when rowwise), or as it is if the recipe keeps
        this GEMM's operand in high precision or ``t`` is cast already (:meth:`cast_input`).
        ``split``: the dims of ``t`` split over tp, default those of ``operand``."""
        if cast.scaling_type is self.ao_config.ScalingType.DISABLED or isinstance(t, self.Float8Tensor):
            return t
        rowwise = cast.scaling_granularity is self.ao_config.ScalingGranularity.AXISWISE
        split = self._split_dims(operand) if split is None else split
        spans_split = bool(split) and (not rowwise or axis % 2 in split)
        return self.convert(
            t,
            cast.target_dtype,
            self.mm_config,
            reduce_amax=spans_split,
            gemm_input_role=role,
            device_mesh=self.mesh,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=axis if rowwise else None,
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )

    def cast_input(
        self, rows: torch.Tensor, for_grad_weight: bool = False, sequence_shard: bool = False
    ) -> torch.Tensor:
        """The [tokens, K] input ``rows`` cast for the output GEMM (or the weight-gradient one), once for all the
        GEMMs that take pieces of its rows. ``sequence_shard``: ``rows`` is this rank's 1/tp of the sequence (a
        column-parallel linear's input under SP), cast with the whole sequence's scale (the amax all-reduced over
        tp where the scale spans tokens), ready to be all-gathered in float8 (``torch_private.float8_parts``)."""
        c = self.config
        cast, axis = (c.cast_config_input_for_grad_weight, 0) if for_grad_weight else (c.cast_config_input, -1)
        return self._cast(rows, "x", cast, self.roles.INPUT, axis, split=(0,) if sequence_shard else None)

    def weight_for_output(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] cast for the output GEMM, shaped as it is: :meth:`output` takes it as cast, so
        GEMMs on pieces of the input (a ring's chunks) share one cast, and one amax all-reduce."""
        return self._cast(weight.t(), "wt", self.config.cast_config_weight, self.roles.WEIGHT, 0).t()

    def weight_for_grad_input(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` cast for the input-gradient GEMM, shaped as it is (:meth:`weight_for_output`)."""
        return self._cast(weight.t(), "wt", self.config.cast_config_weight_for_grad_input, self.roles.WEIGHT, -1).t()

    def output(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.t()``; ``weight`` in the training dtype or from :meth:`weight_for_output`."""
        return torch.mm(
            self._cast(x, "x", self.config.cast_config_input, self.roles.INPUT, -1), self.weight_for_output(weight).t()
        )

    def cast_grad_output(
        self, dy: torch.Tensor, for_input: bool, for_weight: bool, sequence_shard: bool = False
    ) -> tuple:
        """``dy`` cast for the input-gradient GEMM and for the weight-gradient GEMM (None where that GEMM
        does not run): one cast, and one amax all-reduce, where both scale it alike (one tensorwise config).
        ``sequence_shard``: ``dy`` is this rank's 1/tp of the sequence (a row-parallel linear's output gradient
        under SP), scaled as the whole sequence (:meth:`cast_input`)."""
        c, role = self.config, self.roles.GRAD_OUTPUT
        split = (0,) if sequence_shard else None
        to_input = self._cast(dy, "dy", c.cast_config_grad_output, role, -1, split) if for_input else None
        tensorwise = c.cast_config_grad_output.scaling_granularity is self.ao_config.ScalingGranularity.TENSORWISE
        if (
            to_input is not None
            and tensorwise
            and c.cast_config_grad_output == c.cast_config_grad_output_for_grad_weight
        ):
            return to_input, to_input
        to_weight = (
            self._cast(dy, "dy", c.cast_config_grad_output_for_grad_weight, role, 0, split) if for_weight else None
        )
        return to_input, to_weight

    def casts_grad_output_per_row(self) -> bool:
        """Whether every cast of the output gradient scales each token row on its own (a rowwise input gradient
        whose scales span no split dim, the weight gradient in high precision: ``rowwise_with_gw_hp`` in a
        row-parallel linear): its rows, cast apart, take the float8 values of the whole's cast."""
        c, granularity = self.config, self.ao_config.ScalingGranularity
        per_row = c.cast_config_grad_output.scaling_granularity is granularity.AXISWISE and not self._split_dims("dy")
        return per_row and c.cast_config_grad_output_for_grad_weight.scaling_type is self.ao_config.ScalingType.DISABLED

    def grad_input(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``dy @ weight``; ``weight`` in the training dtype or from :meth:`weight_for_grad_input`."""
        return torch.mm(
            self._cast(dy, "dy", self.config.cast_config_grad_output, self.roles.GRAD_OUTPUT, -1),
            self.weight_for_grad_input(weight),
        )

    def grad_weight(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        return torch.mm(
            self._cast(dy, "dy", c.cast_config_grad_output_for_grad_weight, self.roles.GRAD_OUTPUT, 0).t(),
            self._cast(x, "x", c.cast_config_input_for_grad_weight, self.roles.INPUT, 0),
        )


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def gemms_in_training_dtype():
    """While it lasts, every float8 linear (``Float8Linear``, whole or split over tp) computes ``F.linear`` on
    its weights in the training dtype, and the experts' float8 grouped GEMMs ``grouped_matmul``: the
    transformers block check (``meshtron.hf.prove``) proves how a layout splits a block, which FP8 does not
    change, and torch's rowwise float8 GEMM, returning bf16, would bury a wrong split's error in bf16 rounding.
    That the float8 casts split exactly is tested on their own."""
    converted = sys.modules.get("torchao.float8.float8_linear")
    forward = converted.Float8Linear.forward if converted is not None else None
    if converted is not None:
        converted.Float8Linear.forward = _linear_forward
    try:
        with training_dtype():
            yield
    finally:
        if converted is not None:
            converted.Float8Linear.forward = forward


def scaled_per_row(data: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether a float8 cast's ``scale`` holds one row per row of its ``data`` [T, C] (per token: [T, 1]; MXFP8's
    blocks along C: [T, C / 32]), so that a piece of its rows travels or computes with the same rows of the scale."""
    return scale.dim() == 2 and scale.shape[0] == data.shape[0] > 1


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``[train] fp8`` converted ``module``: a ``Float8Linear`` or an ``MXLinear``."""
    converted = sys.modules.get("torchao.float8.float8_linear")  # not imported: no Float8Linear exists
    return isinstance(module, MXLinear) or (converted is not None and isinstance(module, converted.Float8Linear))


def split_gemms(linear: nn.Module, mesh, split: str, local_shape: tuple[int, int]) -> Float8Gemms | None:
    """The :class:`Float8Gemms` of ``linear`` split over ``mesh`` (an ``MXLinear``'s own GEMMs, which need no
    collective), or None for a linear FP8 did not convert. ``local_shape``: the weight rows and columns this
    rank computes with, which a float8 GEMM needs in multiples of :func:`fp8_dim_multiple` (:class:`ConfigError`
    naming the linear otherwise, before any collective)."""
    if not is_float8_linear(linear):
        return None
    mx = isinstance(linear, MXLinear)
    multiple = MX_BLOCK if mx else FP8_DIM_MULTIPLE
    if any(dim % multiple for dim in local_shape):
        raise ConfigError(
            f"[train] fp8: a {linear.out_features} x {linear.in_features} block linear split over tp = {mesh.size()} "
            f"holds a {local_shape[0]} x {local_shape[1]} weight per rank; a{'n MX' if mx else ''} float8 "
            f"GEMM needs both dims in multiples of {multiple}. Use a smaller tp or fp8 = 'none'."
        )
    return linear.gemms if mx else Float8Gemms(linear, mesh, split)


__all__ = [
    "FLOAT8_GROUPED_KERNEL_MAJOR",
    "FP8_ALL_GATHER_RECIPES",
    "FP8_DIM_MULTIPLE",
    "MX_BLOCK",
    "TOKEN_GROUP_ALIGN",
    "TP_SPLITS",
    "aligned_rows",
    "Float8Gemms",
    "Float8GroupedMatmul",
    "Scaled",
    "apply_float8",
    "float8_all_gather",
    "float8_split_linear",
    "float8_config",
    "fp8_dim_multiple",
    "grouped_matmul_for",
    "fp8_linear_names",
    "fp8_note",
    "gemms_in_training_dtype",
    "high_precision_linears",
    "high_precision_note",
    "is_float8_linear",
    "runs_float8_kernel",
    "scaled_per_row",
    "split_gemms",
    "torchao_float8",
    "training_dtype_gemms",
]
