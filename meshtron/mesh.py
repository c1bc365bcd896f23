"""The 5-D device mesh (pp, dp, cp, ep, tp) and its derived flattened meshes.

Whether a layout fits a model and a batch is ``meshtron.parallel.layout.validate_layout``: those rules
belong to the parallelisms, which sit above the mesh.

Ranks are laid out row-major over ``(pp, dp, cp, ep, tp)``: tp is innermost so tensor-parallel
groups are the closest devices, pp outermost so pipeline stages cross the slowest links.

Derived meshes, flattened once in :func:`build_mesh` and then retrievable as ``mesh[name]``:

- ``dp_ep``: the batch is split over dp x ep (ep ranks are extra data parallel for dense layers);
- ``dp_ep_cp``: dense parameters are replicated / FSDP-sharded and their gradients reduced here;
- ``dp_cp``: expert parameters (already split over ep) reduce their gradients here.

DeviceMesh only flattens dimensions in mesh order, so ``dp_ep_cp`` is built from (dp, cp, ep);
the name lists the roles, the member set is the same either way.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtron import env
from meshtron.config import Config, ConfigError

DIMS = ("pp", "dp", "cp", "ep", "tp")

# Flattened name -> the mesh dimensions it spans, in mesh order.
DERIVED = {
    "dp_ep": ("dp", "ep"),
    "dp_ep_cp": ("dp", "cp", "ep"),
    "dp_cp": ("dp", "cp"),
}

def check_sizes(sizes: dict[str, int], world_size: int, where: str) -> None:
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"{where}{name} must be an integer >= 1, got {size!r}.")
    product = math.prod(sizes.values())
    if product != world_size:
        shown = " x ".join(f"{n}={s}" for n, s in sizes.items())
        raise ConfigError(
            f"{where}{shown} = {product}, but the world size is {world_size}. "
            f"Choose sizes whose product is {world_size} (e.g. dp = {world_size} with the others 1), "
            f"or launch {product} ranks."
        )


def _world_size_before_init() -> int:
    """The world size from the launcher, without touching a process group (no WORLD_SIZE: 1 process)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def init_default_group(timeout: timedelta | None = None) -> None:
    """The default process group (torchrun's env, or one local rank without it); ``timeout`` bounds
    every collective's wait (None: torch's default)."""
    if dist.is_initialized():
        return
    device = env.local_device()
    # Binding the accelerator lets DeviceMesh split NCCL communicators instead of creating each one.
    device_id = device if device.index is not None else None
    if "WORLD_SIZE" in os.environ:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout or timedelta(minutes=10)))
        # torchrun keeps its store across restarts (--max-restarts), where a restarted rank could read
        # the address a dead peer published; a per-attempt prefix keeps the attempts apart.
        store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(
            env.backend(), store=store, rank=rank, world_size=world_size, device_id=device_id, timeout=timeout
        )
    else:  # a plain `python script.py`: one rank, no rendezvous needed
        dist.init_process_group(
            env.backend(), store=dist.HashStore(), rank=0, world_size=1, device_id=device_id, timeout=timeout
        )


def build_mesh(
    pp: int = 1,
    dp: int = 1,
    cp: int = 1,
    ep: int = 1,
    tp: int = 1,
    device_type: str | None = None,
    timeout: timedelta | None = None,
) -> DeviceMesh:
    """The (pp, dp, cp, ep, tp) DeviceMesh with ``dp_ep``, ``dp_ep_cp`` and ``dp_cp`` flattened.

    Initialises the default process group when needed (so it works straight under torchrun), with
    ``timeout`` for every collective (None: torch's default); a collective waiting longer raises.
    Sizes are checked against the world size before any process group or collective is touched.
    """
    sizes = dict(pp=pp, dp=dp, cp=cp, ep=ep, tp=tp)
    check_sizes(sizes, _world_size_before_init(), "build_mesh: ")
    init_default_group(timeout)
    mesh = init_device_mesh(device_type or env.device_type(), tuple(sizes.values()), mesh_dim_names=DIMS)
    for name, dims in DERIVED.items():
        mesh[dims]._flatten(name)
    return mesh


def recipe_mesh(cfg: Config, timeout: timedelta | None = None):
    """The DeviceMesh of the recipe's ``[parallel]`` sizes (collective: every rank calls it)."""
    p = cfg.parallel
    return build_mesh(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, tp=p.tp, timeout=timeout)


def _derived(mesh: DeviceMesh, name: str) -> DeviceMesh:
    # Flattening again is a lookup (same layout, same name); unlike mesh[name], torch does not warn.
    return mesh[DERIVED[name]]._flatten(name)


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """dp x ep: ranks that read different samples."""
    return _derived(mesh, "dp_ep")


def dense_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """dp x ep x cp: where dense parameters are replicated/sharded and their gradients reduced."""
    return _derived(mesh, "dp_ep_cp")


def expert_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """dp x cp: where expert parameters are replicated/sharded and their gradients reduced."""
    return _derived(mesh, "dp_cp")
