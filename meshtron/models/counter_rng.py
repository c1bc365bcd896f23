"""Counter-based normal random numbers: any slice of a tensor, computed on its own.

Element ``i`` of the tensor with key ``key`` is a pure function of ``(key, i)`` (a splitmix64 hash, Box-Muller),
so a rank fills just its shard, on its own device, with exactly the values of the full tensor, and the initial
weights do not depend on the layout. See docs/training.md, 'How the parallelisms compose'.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch

_CHUNK_ELEMENTS = 1 << 21


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value``."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (unsigned 64-bit)."""
    mask = (1 << 64) - 1
    x &= mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def tensor_key(seed: int, name: str) -> int:
    """The key of the tensor called ``name`` under ``seed`` (an int64)."""
    return _signed(_mix_int(_mix_int(seed) ^ zlib.crc32(name.encode())))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on an int64 tensor."""
    x ^= _shift_right(x, 30)
    x *= _MUL1
    x ^= _shift_right(x, 27)
    x *= _MUL2
    x ^= _shift_right(x, 31)
    return x


def _normals(index: torch.Tensor, key: int, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values for the flat indices ``index`` (int64) of the tensor with ``key``."""
    bits = _mix_(index.mul_(_GOLDEN).add_(key))
    scale = 2.0**-24
    u1 = _shift_right(bits, 40).to(torch.float32).add_(0.5).mul_(scale)  # in (0, 1): log is finite
    u2 = ((bits >> 16) & 0xFFFFFF).to(torch.float32).mul_(2 * math.pi * scale)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_()).to(dtype)


def _strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


@torch.no_grad()
def normal_slice_(
    out: torch.Tensor, key: int, full_shape: Sequence[int], offsets: Sequence[int], std: float
) -> torch.Tensor:
    """Fill ``out``, the block of a ``full_shape`` tensor starting at ``offsets``, with N(0, std).

    The values equal the same block of the full tensor filled with the same ``key``, for any
    block, on any device.
    """
    if out.ndim != len(full_shape) or len(offsets) != len(full_shape):
        raise ValueError(f"a {out.ndim}-d block {tuple(out.shape)} at {tuple(offsets)} of a {tuple(full_shape)} tensor")
    if any(o < 0 or o + n > full for o, n, full in zip(offsets, out.shape, full_shape)):
        raise ValueError(f"block {tuple(out.shape)} at {tuple(offsets)} lies outside the {tuple(full_shape)} tensor")
    if out.numel() == 0:
        return out
    if out.ndim == 0:
        return out.copy_(_normals(torch.zeros((), dtype=torch.int64, device=out.device), key, out.dtype) * std)
    strides = _strides(full_shape)
    # Flat index of every element of one dim-0 row of the block, relative to the row's start.
    inner = torch.zeros((), dtype=torch.int64, device=out.device)
    for dim in range(1, out.ndim):
        positions = torch.arange(offsets[dim], offsets[dim] + out.shape[dim], device=out.device) * strides[dim]
        inner = inner.unsqueeze(-1) + positions
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, inner.numel()))
    for start in range(0, out.shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, out.shape[0])
        rows = torch.arange(offsets[0] + start, offsets[0] + stop, device=out.device) * strides[0]
        index = rows.view(-1, *([1] * (out.ndim - 1))) + inner
        out[start:stop] = _normals(index, key, out.dtype).mul_(std)
    return out
