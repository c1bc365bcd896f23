"""What both FP8 forms (``meshtron.parallel.float8``: torchao's ``Float8Linear``, ``meshtron.parallel.mxfp8``:
MXFP8) share: torchao's import, which dims a recipe's GEMMs take, a split linear computed through a
recipe's GEMMs, and the switch that runs every FP8 GEMM in the training dtype (the transformers block check).

See docs/fp8.md, 'Recipes', 'Transformers models' and 'MXFP8'.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F

from meshtron.config import ConfigError
from meshtron.extras import MissingExtra, require

# torch._scaled_mm's constraint on both dims of the weight (the GEMM's K and N).
FP8_DIM_MULTIPLE = 16
# MXFP8's block: elements per shared scale along a contraction dim, so both weight dims are multiples of it.
MX_BLOCK = 32
# Where the grouped GEMM contracts over tokens (the weight gradient) each expert's group of rows must start
# 16 bytes (float8 values) apart: the groups are laid out padded to it (aligned_rows).
TOKEN_GROUP_ALIGN = 16


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


def fp8_dim_multiple(recipe: str) -> int:
    """What every dim of a GEMM ``recipe`` takes must be a multiple of."""
    return MX_BLOCK if recipe == "mxfp8" else FP8_DIM_MULTIPLE


def fits_fp8(dims: tuple[int, ...], recipe: str) -> bool:
    return not any(dim % fp8_dim_multiple(recipe) for dim in dims)


def aligned_rows(
    counts: torch.Tensor, groups: torch.Tensor, align: int = TOKEN_GROUP_ALIGN
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of T rows in groups of ``counts`` (``groups``: each row's) goes when every group starts at a
    multiple of ``align`` rows, zero rows between: (row destinations, the padded groups' end offsets, the
    buffer's rows), the buffer sized without reading ``counts`` (T rounded up, one alignment more per group)."""
    tokens = groups.shape[0]
    padded = (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0, dtype=torch.int32)
    first = torch.cumsum(counts, 0) - counts
    dest = (ends - padded)[groups] + torch.arange(tokens, device=groups.device) - first[groups]
    return dest, ends, -(-tokens // align) * align + counts.numel() * align


def placed_rows(data: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows ``data`` [T, C] moved to ``dest`` in a zeroed buffer of ``rows`` (:func:`aligned_rows`), the bytes
    moved as ``uint8`` (index_copy_ has no float8 kernel), so any dtype, float8 included, is placed alike."""
    data = data.contiguous()
    raw = data.view(torch.uint8)
    out = torch.zeros((rows, raw.shape[1]), dtype=torch.uint8, device=data.device)
    return out.index_copy_(0, dest, raw).view(data.dtype)


class _Float8SplitLinear(torch.autograd.Function):
    """``x @ weight.t()`` through a recipe's GEMMs (``meshtron.parallel.float8.Float8Gemms``,
    ``meshtron.parallel.mxfp8.MXGemms``): local pieces in, this rank's output piece out."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, gemms) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.gemms = gemms
        return gemms.output(x.reshape(-1, x.shape[-1]), weight).unflatten(0, x.shape[:-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        want_input, want_weight = ctx.needs_input_grad[:2]
        dy_input, dy_weight = ctx.gemms.cast_grad_output(grad.reshape(-1, grad.shape[-1]), want_input, want_weight)
        grad_x = grad_weight = None
        if want_input:
            grad_x = ctx.gemms.grad_input(dy_input, weight).unflatten(0, x.shape[:-1])
        if want_weight:
            grad_weight = ctx.gemms.grad_weight(dy_weight, x.reshape(-1, x.shape[-1]))
        return grad_x, grad_weight, None


def float8_split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemms) -> torch.Tensor:
    """This rank's piece of a float8 linear's output through ``gemms`` (a partial sum for a row-parallel one);
    the bias is added in the output dtype, as ``Float8Linear`` adds it. In the training dtype while
    :func:`training_dtype` lasts."""
    if _TRAINING_DTYPE_GEMMS:
        return F.linear(x, weight, bias)
    out = _Float8SplitLinear.apply(x, weight, gemms)
    return out if bias is None else out + bias.to(out.dtype)


# Set while training_dtype lasts (one probe at a time per process).
_TRAINING_DTYPE_GEMMS: list[bool] = []


@contextlib.contextmanager
def training_dtype():
    """While it lasts, the GEMMs of :func:`float8_split_linear` and of the experts' FP8 grouped GEMMs compute in
    the training dtype (``meshtron.parallel.float8.gemms_in_training_dtype``, which also covers torchao's own
    ``Float8Linear``)."""
    _TRAINING_DTYPE_GEMMS.append(True)
    try:
        yield
    finally:
        _TRAINING_DTYPE_GEMMS.pop()


def training_dtype_gemms() -> bool:
    """Whether :func:`training_dtype` lasts."""
    return bool(_TRAINING_DTYPE_GEMMS)


__all__ = [
    "FP8_DIM_MULTIPLE",
    "MX_BLOCK",
    "TOKEN_GROUP_ALIGN",
    "aligned_rows",
    "fits_fp8",
    "float8_split_linear",
    "placed_rows",
    "fp8_dim_multiple",
    "torchao_float8",
    "training_dtype",
    "training_dtype_gemms",
]
