"""FP8 training (``[train] fp8``): the blocks' attention and MLP linears as torchao ``Float8Linear``.

Each GEMM of a converted linear (forward, input gradient, and for every recipe but
``rowwise_with_gw_hp`` the weight gradient) casts its operands to float8 with scales computed on the
fly and runs ``torch._scaled_mm``; the parameters, the optimizer state and everything outside the
converted linears stay in the training dtype, as torchtitan and Megatron-Core do: the embedding, the
LM head, the MoE router and the routed experts (their grouped GEMM is a later slice), norms.

Recipes (torchao's names, ``torchao.float8.Float8LinearConfig.from_recipe_name``):

- ``tensorwise``: one scale per tensor. Under FSDP the weights are all-gathered in float8 (half the
  bf16 bytes); the weight's scale is the amax over all shards (an all-reduce inside the gather), so it
  is the unsharded weight's. Activation and gradient scales are the amax of the tokens a rank holds.
- ``rowwise``: one scale per row of each operand (power-of-two scales); the weight-gradient GEMM
  scales along the tokens, so it depends on which tokens a rank holds.
- ``rowwise_with_gw_hp``: per-token activation and gradient scales, per-output-row weight scales, the
  weight gradient in high precision: no scale spans tokens, so splitting the batch (dp) leaves every
  scale as on one rank.

A GEMM in float8 needs both of its dims to be multiples of 16 (``torch._scaled_mm``); a linear with
another shape stays in the training dtype (:func:`high_precision_linears` names them).

Applied first in :func:`meshtron.parallel.compose.compose` (the model's own settings): the tensor
and data parallel plans then wrap the converted linears as they wrap ``nn.Linear``. gloo has no float8
type ("Invalid scalar type" for an all-gather of float8 alone), but no FSDP unit gathers float8 alone:
every block unit also holds its norms (and biases) in the training dtype, and FSDP2 gathers a unit
whose inputs mix dtypes as one ``uint8`` buffer of their bytes, bit-exact on gloo and NCCL alike
(``tests/test_float8.py`` counts those bytes).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from meshtron.config import FP8_RECIPES, ConfigError, ModelConfig
from meshtron.extras import MissingExtra, require
from meshtron.models import build_model
from meshtron.models.moe import MoE

# torch._scaled_mm's constraint on both dims of the weight (the GEMM's K and N).
FP8_DIM_MULTIPLE = 16
# The recipe whose FSDP all-gather can carry float8 weights (torchao supports tensorwise weight scales only).
FP8_ALL_GATHER_RECIPES = ("tensorwise",)


# Loggers that torchao's import writes to on a CPU build of torch: a warning per CUDA kernel library it cannot
# load (none is used here) and torch's deprecation note on how torchao registers an enum with pytree.
_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def torchao_float8(module: str = "torchao.float8"):
    """``module`` of torchao, or :class:`ConfigError` naming the extra; its import's warnings that say
    nothing about training (``_IMPORT_NOISE``) are silenced."""
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        return require(module, "[train] fp8")
    except MissingExtra as err:
        raise ConfigError(str(err)) from None
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def fp8_linear_names(block: nn.Module) -> list[str]:
    """The names (relative to ``block``) of a decoder block's linears that FP8 may take: attention and MLP
    projections, the MoE's shared expert; not the MoE's gates (the router is no ``nn.Linear``, the shared
    expert's gate is a one-column scalar gate: routing decisions stay in the training dtype)."""
    gates = {f"{name}.shared_expert_gate".lstrip(".") for name, m in block.named_modules() if isinstance(m, MoE)}
    return [name for name, module in block.named_modules() if isinstance(module, nn.Linear) and name not in gates]


def fits_fp8(linear: nn.Linear) -> bool:
    return linear.in_features % FP8_DIM_MULTIPLE == 0 and linear.out_features % FP8_DIM_MULTIPLE == 0


def _candidates(model: nn.Module):
    for key, block in model.layers.items():
        for name in fp8_linear_names(block):
            yield f"layers.{key}.{name}", block.get_submodule(name)


def high_precision_linears(model: nn.Module) -> list[str]:
    """The block linears FP8 would take but whose shape it cannot (a dim not a multiple of 16), one
    entry per distinct name and shape: ``layers.*.self_attn.k_proj [64 -> 8]``."""
    seen: dict[str, None] = {}
    for name, linear in _candidates(model):
        if not fits_fp8(linear):
            parts = name.split(".")
            pattern = ".".join(["layers", "*", *parts[2:]])
            seen[f"{pattern} [{linear.in_features} -> {linear.out_features}]"] = None
    return list(seen)


def high_precision_note(cfg: ModelConfig, recipe: str) -> str | None:
    """The start-up line naming the block linears ``recipe`` leaves in the training dtype, if any."""
    if recipe == "none":
        return None
    with torch.device("meta"):
        names = high_precision_linears(build_model(cfg))
    if not names:
        return None
    return (f"meshtron: fp8 = '{recipe}' leaves {len(names)} block linear(s) in the training dtype "
            f"(dims not multiples of {FP8_DIM_MULTIPLE}): {', '.join(names)}")


def float8_config(recipe: str):
    """torchao's config for ``recipe``, with the float8 FSDP all-gather where the recipe allows it."""
    if recipe not in FP8_RECIPES[1:]:
        raise ValueError(f"no FP8 recipe '{recipe}'; one of {', '.join(FP8_RECIPES[1:])}")
    config = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=recipe in FP8_ALL_GATHER_RECIPES)


def apply_float8(model: nn.Module, recipe: str) -> nn.Module:
    """Swap the FP8-capable block linears of ``model`` (a meshtron ``Transformer`` or a pipeline stage,
    meta or real) for ``Float8Linear`` in place; ``recipe`` "none" leaves the model as it is. The
    parameters keep their names, values and dtype."""
    if recipe == "none":
        return model
    config = float8_config(recipe)
    Float8Linear = torchao_float8("torchao.float8.float8_linear").Float8Linear
    for name, linear in list(_candidates(model)):
        if fits_fp8(linear) and type(linear) is nn.Linear:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, Float8Linear.from_float(linear, config=config))
    return model


__all__ = [
    "FP8_ALL_GATHER_RECIPES",
    "FP8_DIM_MULTIPLE",
    "apply_float8",
    "float8_config",
    "fp8_linear_names",
    "high_precision_linears",
    "high_precision_note",
    "torchao_float8",
]
