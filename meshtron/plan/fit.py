"""Pre-flight memory check of ``meshtron.train``: refuse a layout predicted not to fit, before anything
is allocated or any collective runs.

Each rank compares the prediction with its own budget (CUDA: the device's total memory; CPU: ``MemAvailable``
over the host's ranks) and the node's host bytes with the host's, before any process group exists.
See docs/planner.md, 'Pre-flight'.
"""

from __future__ import annotations

import os
import sys

from meshtron.config import Config, ConfigError
from meshtron.plan.memory import GIB, Assumptions, predict_memory
from meshtron.plan.search import fitting_layout, rank_layouts
from meshtron.plan.speed import Hardware

# CPU ranks have no CUDA context or communicator buffers: only the allocator slack remains; their own
# process memory is already out of MemAvailable.
CPU_ASSUMPTIONS = Assumptions(reserved_gib=0.0, host_reserved_gib=0.0)


def host_available_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (free pages where the kernel does not report it)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def local_ranks() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def available_per_rank(device_type: str) -> tuple[float, str]:
    """(bytes one rank may use, how that was measured)."""
    if device_type == "cuda":
        import torch

        index = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(index).total_memory
        return total, f"total memory of cuda:{index}"
    ranks = local_ranks()
    host = host_available_bytes()
    return host / ranks, f"{host / GIB:.1f} GiB of available host RAM shared by {ranks} local ranks"


def _suggestion(
    cfg: Config, world_size: int, available: float, device_type: str, gpus_per_node: int, host: float
) -> str:
    """A concrete layout that fits, from the planner, or what to change when none does (``host``: the
    node's host memory in bytes)."""
    hw = Hardware(gpus_per_node=min(gpus_per_node, world_size), memory_gib=available / GIB, host_memory_gib=host / GIB)
    assumptions = CPU_ASSUMPTIONS if device_type == "cpu" else Assumptions()
    plan = fitting_layout(cfg, world_size, hw, assumptions)
    if plan is not None:
        return (
            f"A layout predicted to fit ({plan.memory.total / GIB:.1f} GiB per rank, `python -m meshtron.plan` "
            f"ranks them all): {plan.overrides()}."
        )
    smallest = min(rank_layouts(cfg, world_size, hw, assumptions), key=lambda p: p.memory.total, default=None)
    least = f" (the smallest needs {smallest.memory.total / GIB:.1f} GiB per rank)" if smallest else ""
    return (
        f"No layout of {world_size} ranks fits{least}: use more or larger devices, or lower [train] "
        "seq_len / global_batch_size."
    )


def _host_shortfall(per_rank: float, ranks: int, available: float) -> str | None:
    """Why a node's ``ranks`` cannot hold ``per_rank`` host bytes each in ``available``; None if they can."""
    if per_rank * ranks <= available:
        return None
    return (
        f"this layout needs a predicted {per_rank / GIB:.1f} GiB of host memory per rank, {per_rank * ranks / GIB:.1f} "
        f"GiB for the node's {ranks} ranks, but {available / GIB:.1f} GiB of host memory is available "
        "(MemAvailable); lower [parallel] offload / offload_activations or use more nodes."
    )


def check_memory(
    cfg: Config,
    world_size: int,
    device_type: str,
    available: tuple[float, str] | None = None,
    gpus_per_node: int | None = None,
    host_available: float | None = None,
) -> None:
    """Raise :class:`ConfigError` (``memory_check = "error"``) or print a warning (``"warn"``, rank 0)
    when the planner's per-rank prediction exceeds the available memory: this machine's
    (:func:`available_per_rank`), or ``available`` = (bytes, where that figure comes from); on CUDA also
    when the node's ranks need more host memory than it has (``host_available`` bytes, default
    ``MemAvailable``)."""
    mode = cfg.train.memory_check
    if mode == "off":
        return
    assumptions = CPU_ASSUMPTIONS if device_type == "cpu" else Assumptions()
    predicted = predict_memory(cfg, assumptions)
    available, source = available or available_per_rank(device_type)
    host = host_available_bytes() if host_available is None else host_available
    needed = predicted.total + (predicted.host_total if device_type == "cpu" else 0.0)
    problem = None
    if needed > available:
        dominant = predicted.dominant
        offloaded = (
            f" and {predicted.host_total / GIB:.1f} GiB offloaded"
            if device_type == "cpu" and predicted.host_total
            else ""
        )
        problem = (
            f"this layout needs a predicted {predicted.total / GIB:.1f} GiB per rank{offloaded} (largest term: "
            f"{dominant} {predicted.terms[dominant] / GIB:.1f} GiB) but {available / GIB:.1f} GiB is available "
            f"({source})."
        )
    elif device_type == "cuda":
        problem = _host_shortfall(predicted.host_total, local_ranks(), host)
    if problem is None:
        return
    message = (
        f"{problem} {_suggestion(cfg, world_size, available, device_type, gpus_per_node or local_ranks(), host)} To "
        "start "
        'anyway set [train] memory_check = "warn" or "off".'
    )
    if mode == "error":
        raise ConfigError(message)
    if os.environ.get("RANK", "0") == "0":
        print(f"meshtron: warning: {message}", file=sys.stderr, flush=True)
