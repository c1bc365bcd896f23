"""The CUDA checks (``benchmarks/gpu_check.sh`` runs them on a lent GPU).

Without CUDA they still run here on the CPU at small sizes, so they cannot rot between GPU sessions:
what only a GPU can show (kernel choice, host syncs, allocator peaks, the 7B vocabulary) is skipped
with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshtron import env
from meshtron.mesh import init_default_group


@pytest.fixture(scope="session")
def device() -> torch.device:
    return env.local_device()


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank process group (the training step's collectives run on it), torn down after the module."""
    if dist.is_initialized():
        yield
        return
    init_default_group()
    try:
        yield
    finally:
        dist.destroy_process_group()
