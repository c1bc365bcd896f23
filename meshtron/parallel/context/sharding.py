"""Where each token and head of context parallelism lives: the load-balanced chunks of every cp rank,
sharding a batch to match, the comm types (:data:`CP_COMM_TYPES`) and the layout rules checked before
any collective.

Kept apart from the attention itself because the rest of meshtron (the runner, expert parallelism, the
layout checks of ``parallel/layout.py``, the HF adapter) needs only these answers, not ring attention.
See docs/context_parallel.md, 'Ring attention'.
"""

from __future__ import annotations

import os
from itertools import chain
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshtron.config import ConfigError


def chunk_ids(cp_rank: int, cp_size: int, balanced: bool = True) -> tuple[int, ...]:
    """Chunk ids held by ``cp_rank``: ``(i, 2cp-1-i)`` of ``2cp`` chunks, or ``(i,)`` of ``cp`` (contiguous)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size}).")
    return (cp_rank, 2 * cp_size - 1 - cp_rank) if balanced else (cp_rank,)


def _num_chunks(cp_size: int, balanced: bool) -> int:
    return 2 * cp_size if balanced else cp_size


def _check_seq_len(seq_len: int, cp_size: int, balanced: bool) -> int:
    """The chunk length; a clear error (raised before any communication) when it does not divide."""
    n = _num_chunks(cp_size, balanced)
    if seq_len % n:
        layout = f"2 * cp = {n}" if balanced else f"cp = {n}"
        raise ValueError(
            f"Context parallelism needs the sequence length to be a multiple of {layout} chunks; got "
            f"seq_len={seq_len} with cp={cp_size}. Pad or choose seq_len as a multiple of {n}."
        )
    return seq_len // n


def sequence_index(seq_len: int, cp_rank: int, cp_size: int, balanced: bool = True, device=None) -> torch.Tensor:
    """Global positions (in local order) of the tokens that ``cp_rank`` holds: the index map."""
    c = _check_seq_len(seq_len, cp_size, balanced)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp_rank, cp_size, balanced)])


def shard_sequence(t: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1, balanced: bool = True) -> torch.Tensor:
    """This rank's part of ``t`` along ``dim`` (contiguous copy). The index is built on ``t``'s
    device: copying it there would be a blocking host-to-device copy inside the training step."""
    index = sequence_index(t.shape[dim], cp_rank, cp_size, balanced, t.device)
    return t.index_select(dim, index)


def _cp_group(cp: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    if isinstance(cp, DeviceMesh):
        if cp.ndim != 1:
            raise ValueError(f"Expected the 1-D cp mesh (mesh['cp']), got a {cp.ndim}-D mesh {cp.mesh_dim_names}.")
        return cp.get_group()
    return cp


def _mesh_cp(mesh: DeviceMesh) -> DeviceMesh:
    if mesh.mesh_dim_names is None or "cp" not in mesh.mesh_dim_names:
        raise ValueError(
            f"The mesh has no 'cp' dimension (dims: {mesh.mesh_dim_names}); build it with build_mesh(cp=...)."
        )
    return mesh["cp"] if mesh.ndim > 1 else mesh


def shard_batch(batch, mesh: DeviceMesh, balanced: bool = True):
    """Shard a batch's sequence dimension (dim 1) over ``mesh['cp']``.

    ``batch`` is a dict (e.g. ``input_ids``, ``labels``, ``position_ids``) or a tuple/list of
    ``[B, S]`` tensors. For a dict without ``position_ids`` the global positions are added before
    sharding, since RoPE needs each token's global position. Labels must already be shifted.
    """
    cp = _mesh_cp(mesh)
    rank, size = cp.get_local_rank(), cp.size()

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, rank, size, dim=1, balanced=balanced)

    if isinstance(batch, dict):
        batch = dict(batch)
        if "position_ids" not in batch and "input_ids" in batch:
            ids = batch["input_ids"]
            batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return {k: shard(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if isinstance(batch, torch.Tensor):
        return shard(batch)
    return type(batch)(shard(t) for t in batch)


class CpCommType(NamedTuple):
    """What one ``[parallel] cp_comm_type`` does with attention's inputs (the package docstring)."""

    a2a: str  # cp ranks trading sequence shards for head shards: "none", "cp" (all) or "group" (a2a_group_size)
    ring: bool  # K/V pass around a ring of p2p exchanges
    allgather: bool  # K/V are all-gathered once (their gradients reduce-scattered)


# The one table of cp comm types (Megatron's names): the checks below, both apply paths
# (``transform.py``, ``hf/context.py``) and the planner (``plan/``) read it.
CP_COMM_TYPES = {
    "p2p": CpCommType(a2a="none", ring=True, allgather=False),
    "a2a": CpCommType(a2a="cp", ring=False, allgather=False),
    "allgather": CpCommType(a2a="none", ring=False, allgather=True),
    "a2a+p2p": CpCommType(a2a="group", ring=True, allgather=False),
}


def cp_comm(comm_type: str) -> CpCommType:
    """``comm_type``'s row of :data:`CP_COMM_TYPES`; a :class:`ConfigError` naming the key for another name."""
    if comm_type not in CP_COMM_TYPES:
        raise ConfigError(f"[parallel] cp_comm_type = {comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}.")
    return CP_COMM_TYPES[comm_type]


def unbalanced_seq_len(seq_len: int, cp: int) -> str:
    """The rule's words when ``seq_len`` is not a multiple of ``2 x cp`` (validate_layout adds a fix)."""
    return (
        f"[train] seq_len = {seq_len} must be a multiple of 2 x cp = {2 * cp}: context parallelism cuts "
        f"the sequence into 2 x cp chunks for load balance."
    )


def a2a_group_size(comm_type: str, cp: int, a2a_size: int = 0, heads: int = 0, ranks_per_node: int = 0) -> int:
    """cp ranks that trade sequence shards for head shards: 1 for p2p / allgather, cp for a2a.

    For a2a+p2p it is ``a2a_size`` when given; else (0) the largest divisor of cp below cp that
    fits on one node (``ranks_per_node``, the cp ranks of a node) and divides the local heads, so
    the all-to-all stays inside a node and the ring crosses nodes.
    """
    a2a = cp_comm(comm_type).a2a
    if a2a == "none":
        return 1
    if a2a == "cp":
        return cp
    if a2a_size:
        return a2a_size
    per_node = ranks_per_node or cp
    fits = [a for a in range(1, cp) if cp % a == 0 and a <= per_node and (not heads or heads % a == 0)]
    return max(fits, default=1)


def check_context_parallel(
    comm_type: str,
    cp: int,
    heads: int,
    kv_heads: int,
    seq_len: int | None = None,
    a2a_size: int = 0,
    sliding_window: int | None = None,
    ranks_per_node: int = 0,
) -> int:
    """Raise :class:`ConfigError` (before any collective) for a layout the cp type cannot run;
    returns the all-to-all group size. ``heads`` / ``kv_heads`` are the per-tp-rank counts;
    ``ranks_per_node`` the cp ranks sharing a node (for the a2a+p2p rule)."""
    kind = cp_comm(comm_type)
    if cp == 1:
        return 1
    if sliding_window:
        raise ConfigError(
            f"context parallelism (cp = {cp}) runs full causal attention, but the model uses a sliding window "
            f"of {sliding_window} tokens; set cp = 1 or use a model without sliding windows."
        )
    if seq_len is not None and seq_len % (2 * cp):
        raise ConfigError(unbalanced_seq_len(seq_len, cp))
    a = a2a_group_size(comm_type, cp, a2a_size, heads, ranks_per_node)
    if a2a_size and kind.a2a != "group":
        raise ConfigError(f"[parallel] cp_a2a_size = {a2a_size} is only used with cp_comm_type = 'a2a+p2p'.")
    if cp % a:
        raise ConfigError(f"[parallel] cp_a2a_size = {a} does not divide cp = {cp}; pick a divisor of cp.")
    if heads % a:
        raise ConfigError(
            f"[parallel] cp_comm_type = {comm_type!r} splits the {heads} attention heads of each tp rank over "
            f"{a} cp ranks, which does not divide them; use cp_comm_type = 'p2p' or 'allgather', or another cp / tp."
        )
    if kv_heads % a and a % kv_heads:
        raise ConfigError(
            f"[parallel] cp_comm_type = {comm_type!r}: the {kv_heads} key/value heads of each tp rank and the "
            f"{a} cp ranks of the all-to-all do not divide one another; use 'p2p' or 'allgather'."
        )
    return a


def cp_ranks_per_node(tp: int, ep: int) -> int:
    """cp ranks on one node: cp is outside ep and tp in the mesh, so a node of ``LOCAL_WORLD_SIZE``
    ranks holds that many divided by ep x tp consecutive cp ranks (0 when unknown)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) // (tp * ep)


def _held_chunks(ring_size: int, a2a_size: int, balanced: bool) -> tuple[tuple[int, ...], ...]:
    """Chunk ids each ring member holds: the chunks of its ``a2a_size`` consecutive cp ranks, in
    their rank order (what the all-to-all concatenates)."""
    cp = ring_size * a2a_size
    return tuple(
        tuple(chain.from_iterable(chunk_ids(g * a2a_size + m, cp, balanced) for m in range(a2a_size)))
        for g in range(ring_size)
    )
