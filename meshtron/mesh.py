"""The 5-D device mesh (pp, dp, cp, ep, tp) and its derived flattened meshes.

Ranks are laid out row-major, tp innermost (closest devices) and pp outermost (slowest links); :func:`build_mesh`
flattens ``dp_ep`` (the batch split) and ``dp_ep_cp`` (the dense parameters' data mesh) once, and
:func:`expert_meshes` splits each stage's ranks into the experts' (edp, ep, etp). Layout rules live above, in
``meshtron.parallel.layout``. See docs/training.md, 'The mesh', and docs/expert_parallel.md.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import sys
from datetime import timedelta
from typing import NamedTuple, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtron import env
from meshtron.config import Config, ConfigError
from meshtron.torch_private import concatenate_meshes, flatten_mesh, unflatten_mesh
from meshtron.watch.report import launch_store

DIMS = ("pp", "dp", "cp", "ep", "tp")

# Flattened name -> the mesh dimensions it spans, in mesh order.
DERIVED = {
    "dp_ep": ("dp", "ep"),
    "dp_ep_cp": ("dp", "cp", "ep"),
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
        store, rank, world_size = launch_store(timeout or timedelta(minutes=10))
        dist.init_process_group(
            env.backend(), store=store, rank=rank, world_size=world_size, device_id=device_id, timeout=timeout
        )
    else:  # a plain `python script.py`: one rank, no rendezvous needed
        dist.init_process_group(
            env.backend(), store=dist.HashStore(), rank=0, world_size=1, device_id=device_id, timeout=timeout
        )


def exit_process(code: int) -> NoReturn:
    """End a process that used process groups: run the ``atexit`` handlers, flush, then exit without
    the interpreter's finalization (as multiprocessing's children end).

    Why: a backend's worker thread may still be releasing the last collective's work, whose tensors
    hold Python objects, when the main thread has returned. Releasing them takes the GIL; a thread
    taking it during finalization is ended by ``pthread_exit``, whose unwinding through gloo's
    ``noexcept`` work destructor calls ``std::terminate``, and a finished job aborts with SIGABRT
    ("terminate called without an active exception"; how often: docs/failures.md).
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ExpertSplit(NamedTuple):
    """How experts split a stage's ranks: ``ep`` groups of experts, each expert over ``etp`` ranks,
    ``fold``: ep drawn from the dense ranks (the mesh's ep dimension is then 1)."""

    ep: int = 1
    etp: int = 1
    fold: bool = False


class ExpertMeshes(NamedTuple):
    model: DeviceMesh  # (ep, etp): experts split over ep, each expert's matrices over etp
    data: DeviceMesh  # edp: the ranks holding the same expert slices; their gradients are summed here


def check_expert_split(sizes: dict[str, int], split: ExpertSplit, where: str) -> None:
    """etp divides tp; folded, ep x etp divides the stage's ranks dp x cp x tp."""
    tp = sizes["tp"]
    if not isinstance(split.etp, int) or split.etp < 1 or tp % split.etp:
        valid = ", ".join(str(v) for v in range(1, tp + 1) if tp % v == 0)
        raise ConfigError(
            f"{where}etp = {split.etp} must divide tp = {tp} (each expert is split over tp ranks); valid etp: {valid}."
        )
    stage = sizes["dp"] * sizes["cp"] * tp
    if split.fold and stage % (split.ep * split.etp):
        valid = ", ".join(str(v) for v in range(1, stage + 1) if stage % (v * split.etp) == 0)
        raise ConfigError(
            f"{where}fold_ep = true needs ep x etp = {split.ep} x {split.etp} to divide a stage's ranks "
            f"dp x cp x tp = {sizes['dp']} x {sizes['cp']} x {tp} = {stage}; valid ep with etp = {split.etp}: {valid}."
        )


def build_mesh(
    pp: int = 1,
    dp: int = 1,
    cp: int = 1,
    ep: int = 1,
    tp: int = 1,
    device_type: str | None = None,
    timeout: timedelta | None = None,
    etp: int = 1,
    fold_ep: bool = False,
) -> DeviceMesh:
    """The (pp, dp, cp, ep, tp) DeviceMesh with ``dp_ep`` and ``dp_ep_cp`` flattened.

    ``etp`` and ``fold_ep`` split the experts (:func:`expert_meshes`); with ``fold_ep`` the mesh's ep
    dimension is 1 and ``ep`` counts expert groups among the other ranks.
    Initialises the default process group when needed (so it works straight under torchrun), with
    ``timeout`` for every collective (None: torch's default); a collective waiting longer raises.
    Sizes are checked against the world size before any process group or collective is touched.
    """
    sizes = dict(pp=pp, dp=dp, cp=cp, ep=1 if fold_ep else ep, tp=tp)
    check_sizes(sizes, _world_size_before_init(), "build_mesh: ")
    split = ExpertSplit(ep, etp, fold_ep)
    check_expert_split(sizes, split, "build_mesh: ")
    init_default_group(timeout)
    mesh = init_device_mesh(device_type or env.device_type(), tuple(sizes.values()), mesh_dim_names=DIMS)
    for name, dims in DERIVED.items():
        flatten_mesh(mesh[dims], name)
    mesh.meshtron_expert_split = split  # read by expert_meshes; DeviceMesh has no place for it
    return mesh


def recipe_mesh(cfg: Config, timeout: timedelta | None = None):
    """The DeviceMesh of the recipe's ``[parallel]`` sizes (collective: every rank calls it)."""
    p = cfg.parallel
    return build_mesh(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, tp=p.tp, timeout=timeout, etp=p.etp, fold_ep=p.fold_ep)


def _derived(mesh: DeviceMesh, name: str) -> DeviceMesh:
    # Flattening again is a lookup (same layout, same name); unlike mesh[name], torch does not warn.
    return flatten_mesh(mesh[DERIVED[name]], name)


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """dp x ep: ranks that read different samples."""
    return _derived(mesh, "dp_ep")


def dense_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """dp x ep x cp: where dense parameters are replicated/sharded and their gradients reduced."""
    return _derived(mesh, "dp_ep_cp")


def expert_split(mesh: DeviceMesh) -> ExpertSplit:
    """The split ``build_mesh`` was given (a mesh built otherwise: the mesh's ep, etp 1, unfolded)."""
    return getattr(mesh, "meshtron_expert_split", None) or ExpertSplit(mesh["ep"].size())


def expert_meshes(mesh: DeviceMesh) -> ExpertMeshes:
    """The experts' (ep, etp) and edp meshes of this rank's stage (docs/expert_parallel.md); built once per
    mesh (collective the first time: every rank calls it)."""
    cached = getattr(mesh, "meshtron_expert_meshes", None)
    if cached is None:
        cached = mesh.meshtron_expert_meshes = _build_expert_meshes(mesh, expert_split(mesh))
    return cached


def _build_expert_meshes(mesh: DeviceMesh, split: ExpertSplit) -> ExpertMeshes:
    if split.fold:
        stage = flatten_mesh(mesh[("dp", "cp", "ep", "tp")], "stage")
        edp = stage.size() // (split.ep * split.etp)
        experts = unflatten_mesh(stage, 0, (edp, split.ep, split.etp), ("edp", "ep", "etp"))
        return ExpertMeshes(experts[("ep", "etp")], experts["edp"])
    tp = mesh["tp"].size()
    parts = unflatten_mesh(mesh, "tp", (tp // split.etp, split.etp), ("tp_rest", "etp"))
    model = concatenate_meshes([parts["ep"], parts["etp"]])
    return ExpertMeshes(model, flatten_mesh(parts[("dp", "cp", "tp_rest")], "edp"))


def expert_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """edp: where expert parameters are replicated/sharded and their gradients reduced."""
    return expert_meshes(mesh).data


def expert_hsdp_shards(sizes: dict[str, int], split: ExpertSplit) -> int:
    """The experts' HSDP shard group: their edp ranks inside one dp slice (``sizes``: the mesh's)."""
    in_slice = sizes["cp"] * sizes["ep"] * sizes["tp"]  # a dp slice's ranks
    group = split.ep * split.etp  # ranks holding different expert slices
    if in_slice % group == 0:
        return in_slice // group
    if group % in_slice == 0:
        return 1  # an expert group spans whole dp slices: HSDP replicates only
    raise ConfigError(
        f"[parallel] data_parallel = 'hsdp' needs ep x etp = {group} and a dp slice's ranks cp x ep x tp = "
        f"{in_slice} to divide one another (experts shard inside a dp slice); use data_parallel = 'fsdp'."
    )


def expert_hsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """edp as (replicate, shard) for HSDP: shard inside a dp slice, replicate across dp slices."""
    edp = expert_data_mesh(mesh)
    shard = expert_hsdp_shards({d: mesh[d].size() for d in DIMS}, expert_split(mesh))
    return unflatten_mesh(edp, 0, (edp.size() // shard, shard), ("edp_replicate", "edp_shard"))


def group_names(mesh: DeviceMesh) -> dict[tuple[int, ...], str]:
    """{global ranks of a group: the mesh dimension(s) it spans} for naming collectives in reports: every
    group of the root mesh's dimensions and their combinations ("dp,cp"; size-1 dimensions left out,
    so a group has the name of the fewest dimensions it spans), then the groups of this rank's expert
    meshes once built that span no such set ("ep", "etp", "edp": part of a dimension)."""
    names: dict[tuple[int, ...], str] = {}
    grid = mesh.mesh
    dims = [i for i, size in enumerate(grid.shape) if size > 1]
    for count in range(1, len(dims) + 1):
        for subset in itertools.combinations(dims, count):
            _name_groups(names, grid, subset)
    experts = getattr(mesh, "meshtron_expert_meshes", None)
    for sub in (experts.model, experts.data) if experts is not None else ():
        for name in sub.mesh_dim_names:
            if sub[name].size() > 1:
                names.setdefault(tuple(sub[name].mesh.flatten().tolist()), name)
    return names


def _name_groups(names: dict[tuple[int, ...], str], grid: torch.Tensor, subset: tuple[int, ...]) -> None:
    rest = [i for i in range(grid.dim()) if i not in subset]
    rows = grid.permute(*rest, *subset).reshape(-1, math.prod(grid.shape[i] for i in subset))
    for row in rows.tolist():
        names.setdefault(tuple(row), ",".join(DIMS[i] for i in subset))
