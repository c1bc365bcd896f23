"""Device and backend chosen from the environment, never hard-coded."""

from __future__ import annotations

import contextlib
import os

import torch


def device_type() -> str:
    """``cuda`` when a GPU is visible (and not disabled by MESHTRON_DEVICE=cpu), else ``cpu``."""
    forced = os.environ.get("MESHTRON_DEVICE")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend() -> str:
    return "nccl" if device_type() == "cuda" else "gloo"


def local_device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` on GPUs, ``cpu`` otherwise."""
    if device_type() == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def fused_attention_only(device: torch.device):
    """On CUDA, SDPA may only pick a fused kernel (flash, memory-efficient, cuDNN): a silent fallback
    to the math kernel, which materialises the score matrix, raises instead. Elsewhere no limit."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])
