"""Global gradient norm and clipping over gradients that live on different meshes.

``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms, which DTensor refuses across meshes, so the norm is
summed here per (mesh, sharded dims) group over the sharded dims only (replicated dims hold copies), then over the
groups and the pipeline stages: every rank gets the single-process norm. See docs/training.md, 'The gradient norm'.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshtron import env
from meshtron.host import copy_to
from meshtron.torch_private import dtensor_local, foreach_mul_, foreach_norm

_GroupKey = tuple[DeviceMesh | None, tuple[int, ...]]


@functools.lru_cache(maxsize=1024)
def _sharded_dims(mesh: DeviceMesh, placements: tuple) -> tuple[int, ...]:
    """The mesh dims whose ranks hold disjoint pieces of a gradient with ``placements``; cached, as every
    step's gradients repeat the parameters' few (mesh, placements) pairs."""
    dims = []
    for dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise ValueError(
                f"a gradient is a Partial DTensor on {mesh}; reduce it (e.g. redistribute to "
                "Replicate) before taking the norm: partial sums cannot be squared locally."
            )
        if not isinstance(placement, Replicate) and mesh.size(dim) > 1:
            dims.append(dim)  # Shard or _StridedShard: the ranks hold disjoint pieces (one rank: all of it)
    return tuple(dims)


def _local_pieces(grads: list[torch.Tensor]) -> dict[_GroupKey, list[torch.Tensor]]:
    groups: dict[_GroupKey, list[torch.Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            key = (mesh, _sharded_dims(mesh, grad.placements))
            grad = dtensor_local(grad)
        else:
            key = (None, ())
        groups.setdefault(key, []).append(grad)
    return groups


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split into lists of one device and dtype each: what one foreach kernel takes."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _power_sum(pieces: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """sum |x|^p (or max |x| for p = inf) over local pieces, in fp32.

    One foreach norm per device and dtype rather than a norm per tensor: on one GPU the per-tensor
    kernels and their dispatch were a visible share of the step (benchmarks/results/mfu_profile.txt).
    Uneven FSDP sharding leaves some ranks empty pieces; they add nothing (and have no inf-norm).
    """
    zero = torch.zeros((), device=pieces[0].device)
    norms = [zero]
    for same in _by_device_and_dtype([t for t in pieces if t.numel()]):
        norms.extend(foreach_norm(same, norm_type, dtype=torch.float32))
    stacked = torch.stack(norms)
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def global_grad_norm(params, norm_type: float = 2.0, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """The p-norm of all gradients of ``params`` over every mesh dimension (same value on all ranks).

    ``pp_mesh``: the pipeline dimension (``mesh["pp"]``) when stages hold different parameters.
    Every rank of a data/model-parallel group must pass the same parameter structure (true for
    ranks of one stage), so they issue the same collectives in the same order.
    """
    return _norm_of_pieces(_local_pieces([p.grad for p in params if p.grad is not None]), norm_type, pp_mesh)


def _norm_of_pieces(groups: dict[_GroupKey, list[torch.Tensor]], norm_type: float, pp_mesh) -> torch.Tensor:
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type}.")
    is_max = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
    # The collectives' device: host-offloaded gradients ([parallel] offload) sum on the host first.
    device = env.local_device()
    total = torch.zeros((), device=device, dtype=torch.float32)
    for (mesh, dims), pieces in groups.items():
        part = copy_to(_power_sum(pieces, norm_type), device)
        for dim in dims:
            dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        total = torch.maximum(total, part) if is_max else total + part
    if pp_mesh is not None and pp_mesh.size() > 1:
        dist.all_reduce(total, op=op, group=pp_mesh.get_group())
    return total if is_max else total.pow(1.0 / norm_type)


@torch.no_grad()
def scale_grads_(params, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place so that a global norm of ``total_norm`` becomes at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_`` (coefficient max_norm / (norm + 1e-6), capped
    at 1), applied to the local shards. A non-finite norm leaves the gradients untouched (scaled by
    exactly 1), so the caller can still tell which gradient is NaN/Inf; deciding that on the device
    keeps clipping free of host syncs.
    """
    grads = [p.grad for p in params if p.grad is not None]
    _scale_pieces_([dtensor_local(g) if isinstance(g, DTensor) else g for g in grads], max_norm, total_norm)


def _scale_pieces_(pieces: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(total_norm), coef, torch.ones_like(coef))
    # One copy of the coefficient per device and dtype, not per gradient: with host-offloaded gradients each
    # copy to the host waits for the device, which per gradient would be once per parameter; one foreach
    # multiply per group, as one launch.
    for same in _by_device_and_dtype(pieces):
        foreach_mul_(same, copy_to(coef, same[0].device).to(same[0].dtype))


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm before. Each
    gradient's local tensor is taken once, for the norm and the scaling."""
    groups = _local_pieces([p.grad for p in params if p.grad is not None])
    total = _norm_of_pieces(groups, norm_type, pp_mesh)
    _scale_pieces_([t for pieces in groups.values() for t in pieces], max_norm, total)
    return total
