"""What a model sees of context parallelism: :class:`RingAttention` in place of its
``core_attention``, the cp process groups of each communication type, and the model transform.

Here the communication type is chosen once, at build time; the forward then only routes the
tensors through ``comm.py``'s collectives around ``blocks.py``'s engine.
See docs/context_parallel.md, 'Ring attention'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.parallel.context.blocks import _from_documents, _kernel_name
from meshtron.parallel.context.comm import (
    RingExchange,
    RingStats,
    _gather_sequence,
    _GatheredAttentionFn,
    _RingAttentionFn,
    _SequenceHeadAllToAll,
)
from meshtron.parallel.context.sharding import (
    _cp_group,
    _held_chunks,
    _mesh_cp,
    check_context_parallel,
    chunk_ids,
    cp_comm,
    cp_ranks_per_node,
)
from meshtron.parallel.tensor import local_heads
from meshtron.torch_private import unflatten_mesh


def _repeat_kv_heads(t: torch.Tensor, ranks: int) -> torch.Tensor:
    """K/V heads fewer than the all-to-all ranks: repeat each so every rank gets the head its
    query heads read (as tensor parallelism replicates KV heads; autograd sums the copies)."""
    heads = t.shape[1]
    return t if heads % ranks == 0 else t.repeat_interleave(ranks // heads, dim=1)


class RingAttention(nn.Module):
    """Drop-in for a model's ``core_attention``: ``forward(q, k, v, documents=None)`` with the local
    (sharded) sequence.

    q ``[B, H, S_local, D]``, k/v ``[B, Hkv, S_local, D]`` (GQA, not expanded), tokens laid out
    by :func:`shard_sequence`; ``documents``: the queries' packed positions ``[B, S_local]``
    (``[data] document_mask``). Returns the causal attention output ``[B, H, S_local, D]`` of the
    local queries over the whole (global) sequence.

    ``cp`` is the ring's group (None: a ring of one). ``a2a``: the group whose ranks first trade
    sequence shards for head shards (``a2a`` / ``a2a+p2p``); ``allgather``: K/V gathered over
    ``cp`` instead of passed around the ring.
    """

    def __init__(
        self,
        cp: DeviceMesh | dist.ProcessGroup | None,
        balanced: bool = True,
        kernel: str = "auto",
        a2a: DeviceMesh | dist.ProcessGroup | None = None,
        allgather: bool = False,
    ):
        super().__init__()
        _kernel_name(torch.empty(0), kernel)  # validate early
        # Ranks and peers looked up once, not in every forward and backward.
        self.ring = RingExchange(_cp_group(cp) if cp is not None else None)
        self.a2a = _cp_group(a2a) if a2a is not None else None
        a2a_size = dist.get_world_size(self.a2a) if self.a2a is not None else 1
        self.held = _held_chunks(self.ring.size, a2a_size, balanced)
        self.allgather = allgather
        self.balanced = balanced
        self.kernel = kernel
        self.stats: RingStats | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        if q.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
            raise ValueError(
                f"Expected q [B,H,S,D] and k, v [B,Hkv,S,D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
            )
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"Query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}.")
        n_local = len(chunk_ids(0, 1, self.balanced))
        if q.shape[2] % n_local:
            cp = self.ring.size * (dist.get_world_size(self.a2a) if self.a2a is not None else 1)
            raise ValueError(
                f"Local sequence length {q.shape[2]} is not a multiple of the {n_local} chunks per cp rank; "
                f"shard the batch with shard_batch/shard_sequence (global seq_len a multiple of {n_local * cp})."
            )
        if self.a2a is None:
            return self._attend(q, k, v, documents)
        ranks = dist.get_world_size(self.a2a)
        k, v = _repeat_kv_heads(k, ranks), _repeat_kv_heads(v, ranks)
        q, k, v = (_SequenceHeadAllToAll.apply(t, self.a2a, 1, 2) for t in (q, k, v))
        positions = None
        if documents is not None:
            positions = _from_documents(documents, ("a2a", self.a2a), lambda: _gather_sequence(documents, self.a2a))
        return _SequenceHeadAllToAll.apply(self._attend(q, k, v, positions), self.a2a, 2, 1)

    def _attend(self, q, k, v, positions):
        if self.allgather:
            return _GatheredAttentionFn.apply(q, k, v, self.ring.group, self.held, self.kernel, self.stats, positions)
        return _RingAttentionFn.apply(q, k, v, self.ring, self.held, self.kernel, self.stats, positions)


def cp_groups(mesh: DeviceMesh, comm_type: str = "p2p", a2a_size: int = 0, heads: int = 1, kv_heads: int = 1):
    """``(ring, a2a)`` groups of ``comm_type`` over ``mesh['cp']`` (None: not used), for
    :class:`RingAttention`; ``heads`` / ``kv_heads`` per tp rank. Validates first, then (a2a+p2p)
    splits cp into the ring and the all-to-all groups (collective over the mesh)."""
    cp = _mesh_cp(mesh)
    size = cp.size()
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    a = check_context_parallel(
        comm_type,
        size,
        heads,
        kv_heads,
        None,
        a2a_size,
        None,
        cp_ranks_per_node(sizes.get("tp", 1), sizes.get("ep", 1)),
    )
    if a == 1:  # p2p, allgather (or an a2a+p2p group of one)
        return cp, None
    if a == size:
        return None, cp
    split = unflatten_mesh(cp, 0, (size // a, a), ("cp_ring", "cp_a2a"))
    return split["cp_ring"], split["cp_a2a"]


def apply_context_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    balanced: bool = True,
    kernel: str = "auto",
    comm_type: str = "p2p",
    a2a_size: int = 0,
) -> nn.Module:
    """Swap every ``core_attention`` submodule for :class:`RingAttention` over ``mesh['cp']`` (in place).

    ``comm_type`` is ``[parallel] cp_comm_type`` (``p2p``, ``a2a``, ``allgather``, ``a2a+p2p``);
    ``a2a_size`` the a2a+p2p group size (0: :func:`a2a_group_size`'s rule). With cp == 1 the model
    is returned unchanged. Inputs must then be sharded with :func:`shard_batch` (tokens, shifted
    labels and global or packed position ids).
    """
    heads = kv_heads = 1  # only the all-to-all types split heads
    kind = cp_comm(comm_type)
    if kind.a2a != "none":
        tp = mesh["tp"].size() if "tp" in (mesh.mesh_dim_names or ()) else 1
        heads, kv_heads = local_heads(model.config.num_attention_heads, model.config.kv_heads, tp)
    if _mesh_cp(mesh).size() == 1:
        check_context_parallel(comm_type, 1, heads, kv_heads)
        return model
    parents = [m for m in model.modules() if isinstance(getattr(m, "core_attention", None), nn.Module)]
    if not parents:
        raise ValueError("apply_context_parallel found no module with a 'core_attention' child to replace.")
    ring, a2a = cp_groups(mesh, comm_type, a2a_size, heads, kv_heads)
    for parent in parents:
        parent.core_attention = RingAttention(ring, balanced=balanced, kernel=kernel, a2a=a2a, allgather=kind.allgather)
    return model
