"""The 5-D device mesh (pp, dp, cp, ep, tp), its derived flattened meshes, and layout validation.

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

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtron import env
from meshtron.parallel.tensor import check_tensor_parallel
from meshtron.config import Config, ConfigError

DIMS = ("pp", "dp", "cp", "ep", "tp")

# Flattened name -> the mesh dimensions it spans, in mesh order.
DERIVED = {
    "dp_ep": ("dp", "ep"),
    "dp_ep_cp": ("dp", "cp", "ep"),
    "dp_cp": ("dp", "cp"),
}

# Error messages list valid tp/ep choices up to one 8-GPU node, or the world size if larger.
_SUGGEST_UP_TO = 8


def _check_sizes(sizes: dict[str, int], world_size: int, where: str) -> None:
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


def _init_default_group() -> None:
    device = env.local_device()
    # Binding the accelerator lets DeviceMesh split NCCL communicators instead of creating each one.
    device_id = device if device.index is not None else None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(env.backend(), device_id=device_id)
    else:  # a plain `python script.py`: one rank, no rendezvous needed
        dist.init_process_group(env.backend(), store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)


def build_mesh(
    pp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1, tp: int = 1, device_type: str | None = None
) -> DeviceMesh:
    """The (pp, dp, cp, ep, tp) DeviceMesh with ``dp_ep``, ``dp_ep_cp`` and ``dp_cp`` flattened.

    Initialises the default process group when needed (so it works straight under torchrun).
    Sizes are checked against the world size before any process group or collective is touched.
    """
    sizes = dict(pp=pp, dp=dp, cp=cp, ep=ep, tp=tp)
    _check_sizes(sizes, _world_size_before_init(), "build_mesh: ")
    if not dist.is_initialized():
        _init_default_group()
    mesh = init_device_mesh(device_type or env.device_type(), tuple(sizes.values()), mesh_dim_names=DIMS)
    for name, dims in DERIVED.items():
        mesh[dims]._flatten(name)
    return mesh


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


def _options(ok, limit: int, shown: int = 12) -> str:
    """The first ``shown`` values in 1..limit that satisfy ``ok`` (bounded: limit may be huge)."""
    found = []
    for v in range(1, limit + 1):
        if ok(v):
            found.append(str(v))
            if len(found) == shown:
                return ", ".join(found) + ", ..."
        if v > 4096 and found:
            break
    return ", ".join(found)


def validate_layout(cfg: Config, world_size: int) -> None:
    """Check that the parallel layout fits the world size, the model and the batch; no process group needed.

    Raises :class:`ConfigError` naming the values and a fix. ``sp`` with ``tp = 1`` is allowed and
    does nothing (there is no tp group to split the sequence over). Schedule-specific checks of
    microbatches against stages come from the pipeline module (``check_pipeline``).
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _check_sizes(dict(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, tp=p.tp), world_size, "[parallel] ")
    limit = max(_SUGGEST_UP_TO, world_size)
    check_tensor_parallel(m.num_attention_heads, m.kv_heads, p.tp)
    if m.is_moe and m.num_experts % p.ep:
        raise ConfigError(
            f"[parallel] ep = {p.ep} does not divide [model] num_experts = {m.num_experts}. "
            f"Valid ep up to {limit}: {_options(lambda v: m.num_experts % v == 0, limit)}."
        )
    if p.schedule == "interleaved" and (p.pp < 2 or p.virtual_stages < 2):
        raise ConfigError(
            f"[parallel] schedule = 'interleaved' needs pp >= 2 and virtual_stages >= 2, got pp = {p.pp}, "
            f"virtual_stages = {p.virtual_stages}. Raise them or use schedule = '1f1b'."
        )
    stages = p.pp * p.virtual_stages
    if m.num_hidden_layers < stages:
        raise ConfigError(
            f"[model] num_hidden_layers = {m.num_hidden_layers} is fewer than pp x virtual_stages = "
            f"{p.pp} x {p.virtual_stages} = {stages} stages; every stage needs a layer. Lower pp or virtual_stages."
        )
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise ConfigError(
            f"[train] seq_len = {t.seq_len} must be a multiple of 2 x cp = {2 * p.cp}: context parallelism "
            f"cuts the sequence into 2 x cp chunks for load balance. Use seq_len = "
            f"{_round_up(t.seq_len, 2 * p.cp)} or change cp."
        )
    if p.sp and p.tp > 1 and t.seq_len % (p.cp * p.tp):
        # Each cp rank holds seq_len / cp tokens, which sequence parallelism splits over tp.
        raise ConfigError(
            f"[train] seq_len = {t.seq_len} must be a multiple of cp x tp = {p.cp * p.tp} with sp = true. "
            f"Use seq_len = {_round_up(t.seq_len, p.cp * p.tp)} or set sp = false."
        )
    readers = p.dp * p.ep
    if t.global_batch_size % readers:
        raise ConfigError(
            f"[train] global_batch_size = {t.global_batch_size} must be a multiple of dp x ep = {readers} "
            f"(the batch is split over dp and ep). Use global_batch_size = {_round_up(t.global_batch_size, readers)}."
        )
    local = t.global_batch_size // readers
    if local % p.microbatches:
        raise ConfigError(
            f"[parallel] microbatches = {p.microbatches} does not divide the per-rank batch "
            f"global_batch_size / (dp x ep) = {t.global_batch_size} / {readers} = {local}. "
            f"Valid microbatches: {_options(lambda v: local % v == 0, local)}."
        )
    if p.pp > 1:
        from meshtron.parallel.pipeline.stage import check_pipeline  # the schedule's own rules

        check_pipeline(cfg)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
