"""MXFP8 training (``[train] fp8 = "mxfp8"``): the OCP microscaling format, as torchao's ``MXTensor`` casts it.

One power-of-two scale per 32 elements along each GEMM's contraction dim, so no scale needs a collective on
any layout: :class:`MXLinear` for the block linears, :class:`MXGroupedMatmul` for the routed experts, both
emulated where the device has no MX GEMM (:func:`runs_mx_kernel`). See docs/fp8.md#mxfp8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.models.moe import grouped_matmul
from meshtron.parallel.fp8_base import (
    MX_BLOCK,
    aligned_rows,
    float8_split_linear,
    placed_rows,
    torchao_float8,
    training_dtype_gemms,
)

# The compute capability (major) whose tensor cores run MX block-scaled GEMMs (Blackwell).
MX_KERNEL_MAJOR = 10


# torchao's MX tensor, its scale rounding for training and its kernel choices: loaded by the first MX module
# (:func:`_load_torchao`), before torch.compile traces a block, which cannot trace an import.
_TORCHAO: dict[str, object] = {}


def _load_torchao() -> None:
    if not _TORCHAO:
        _TORCHAO.update(
            MXTensor=torchao_float8("torchao.prototype.mx_formats.mx_tensor").MXTensor,
            RCEIL=torchao_float8("torchao.prototype.mx_formats.config").ScaleCalculationMode.RCEIL,
            KernelPreference=torchao_float8("torchao.quantization.quantize_.common.kernel_preference").KernelPreference,
        )


def runs_mx_kernel(device: torch.device) -> bool:
    """Whether ``device`` runs MX GEMMs on its tensor cores (else they are emulated)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= MX_KERNEL_MAJOR


def to_mx(t: torch.Tensor):
    """``t`` [R, C] (C a multiple of :data:`MX_BLOCK`) cast to MXFP8 along its last dim: a torchao ``MXTensor``,
    which the GEMMs it enters dequantize to ``t``'s dtype where the device has no MX kernel."""
    preference = _TORCHAO["KernelPreference"]
    kernel = preference.AUTO if runs_mx_kernel(t.device) else preference.EMULATED
    return _TORCHAO["MXTensor"].to_mx(t.contiguous(), torch.float8_e4m3fn, MX_BLOCK, _TORCHAO["RCEIL"], kernel)


def is_mx(t: torch.Tensor) -> bool:
    return isinstance(t, _TORCHAO["MXTensor"])


def mx_values(t: torch.Tensor) -> torch.Tensor:
    """``t`` [R, C]'s MXFP8 values along its last dim, dequantized to its dtype (the emulated GEMMs' operand)."""
    return to_mx(t).dequantize(t.dtype)


def along_tokens(t: torch.Tensor) -> torch.Tensor:
    """Rows ``t`` [T, C] transposed to [C, T] for a cast along the tokens, T zero-padded to a multiple of
    :data:`MX_BLOCK` (the zeros change no block's scale, and add nothing to the weight gradient)."""
    pad = -t.shape[0] % MX_BLOCK
    return F.pad(t.t(), (0, pad)) if pad else t.t()


class MXGemms:
    """The three GEMMs of one MXFP8 linear on the operands this rank holds (all of them on one rank, its pieces
    under tp): ``x`` [T, K], ``weight`` [N, K], ``dy`` [T, N]; the interface of
    :class:`meshtron.parallel.float8.Float8Gemms`, without a collective (every scale is a block's own)."""

    def __init__(self):
        _load_torchao()

    def cast_input(
        self, rows: torch.Tensor, for_grad_weight: bool = False, sequence_shard: bool = False
    ) -> torch.Tensor:
        """``rows`` cast for the output GEMM: along the features, per row, so a rank's rows cast before SP's
        all-gather (or a ring's) are the gathered rows' cast, and travel as MX bytes (1 + 1/32 bytes an element).
        For the weight gradient as they are: that GEMM casts along the tokens it contracts."""
        return rows if for_grad_weight else to_mx(rows)

    def weight_for_output(self, weight: torch.Tensor):
        """``weight`` [N, K] cast along K, once for every GEMM on pieces of the input."""
        return weight if is_mx(weight) else to_mx(weight)

    def weight_for_grad_input(self, weight: torch.Tensor):
        """``weight`` [N, K] cast along N (as [K, N], transposed back)."""
        return weight if is_mx(weight) else to_mx(weight.t()).t()

    def output(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.t()``; ``x`` in the training dtype or from :meth:`cast_input`."""
        return torch.mm(x if is_mx(x) else to_mx(x), self.weight_for_output(weight).t())

    def cast_grad_output(
        self, dy: torch.Tensor, for_input: bool, for_weight: bool, sequence_shard: bool = False
    ) -> tuple:
        """``dy`` as it is, for each GEMM that runs: each casts it along its own contraction dim."""
        return dy if for_input else None, dy if for_weight else None

    def casts_grad_output_per_row(self) -> bool:
        """True: the input gradient's cast is per row (blocks along N), and the weight gradient's is made by the
        GEMM that contracts those rows (a ring chunk's), so a ring sends the training dtype."""
        return True

    def grad_input(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.mm(to_mx(dy), self.weight_for_grad_input(weight))

    def grad_weight(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(to_mx(along_tokens(dy)), to_mx(along_tokens(x)).t())


class MXLinear(nn.Linear):
    """A block linear under ``mxfp8``: its three GEMMs through :class:`MXGemms`, the bias added in the output
    dtype. Its parameters are the ``nn.Linear``'s own (:meth:`from_linear`)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> MXLinear:
        """``linear`` itself, its class swapped: parameters, hooks and device (meta too) kept."""
        linear.__class__ = cls
        linear.gemms = MXGemms()
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_split_linear(x, self.weight, self.bias, self.gemms)


def _experts_along(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Stacked expert weights ``w`` [G, K, N] with MX values cast along ``dim`` (1: K, 2: N) per expert."""
    moved = w.movedim(dim, -1)
    return mx_values(moved.reshape(-1, moved.shape[-1])).view(moved.shape).movedim(-1, dim)


def _grouped_weight_gradient(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each expert's ``x``.T @ ``dy`` over its own rows, both cast along the tokens in blocks of the expert's
    tokens only: every group padded with zero rows to a multiple of :data:`MX_BLOCK` (:func:`aligned_rows`)."""
    groups = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts, output_size=x.shape[0])
    dest, ends, size = aligned_rows(counts, groups, MX_BLOCK)
    return F.grouped_mm(
        mx_values(placed_rows(x, dest, size).t()), mx_values(placed_rows(dy, dest, size).t()).t(), offs=ends
    )


class _MXGroupedMM(torch.autograd.Function):
    """``grouped_matmul`` with the operands of its three GEMMs cast to MXFP8 along each GEMM's contraction dim,
    emulated: the MX values in the training dtype through ``grouped_matmul``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, counts)
        return grouped_matmul(mx_values(x), _experts_along(w, 1), counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, counts = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_matmul(mx_values(grad), _experts_along(w, 2).transpose(1, 2), counts)
        if ctx.needs_input_grad[1]:
            grad_w = _grouped_weight_gradient(x, grad, counts)
        return grad_x, grad_w, None


class MXGroupedMatmul:
    """The routed experts' grouped GEMM (``meshtron.models.moe.grouped_matmul``) under ``mxfp8``: the forward casts
    the rows and each expert's weight along K, the input gradient along N, the weight gradient each expert's
    tokens along themselves. No scale spans more than a block, so an expert split over etp (in multiples of
    :data:`MX_BLOCK`) casts its slice as the whole expert casts it: the same GEMM serves every slice. Emulated
    on every device: torchao's MX grouped kernels take bfloat16 operands only."""

    def __init__(self):
        _load_torchao()

    def __call__(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if training_dtype_gemms():
            return grouped_matmul(x, w, counts)
        return _MXGroupedMM.apply(x, w, counts)


__all__ = [
    "MX_KERNEL_MAJOR",
    "MXGemms",
    "MXGroupedMatmul",
    "MXLinear",
    "along_tokens",
    "is_mx",
    "mx_values",
    "runs_mx_kernel",
    "to_mx",
]
