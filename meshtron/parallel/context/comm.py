"""Every collective of context parallelism, with the autograd functions that pair each forward
collective with its backward one: the ring's send/recv, the all-gather of K/V, the all-to-all,
the gathers of positions and of the whole sequence.

One file so that a reader (or a benchmark counting bytes) finds all of cp's communication here;
the blocks they feed are computed by ``blocks.py``. See docs/context_parallel.md, 'Ring attention'.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshtron.parallel.context.blocks import _Blocks, _empty_result
from meshtron.parallel.context.sharding import _cp_group, chunk_ids

# --------------------------------------------------------------------------------------------
# Ring (p2p) and all-gather of K/V
# --------------------------------------------------------------------------------------------


@dataclass
class RingStats:
    """Ring measurements on this rank, accumulated until :meth:`reset` (set ``RingAttention.stats``).

    The forward and the backward of a call both add their compute and receive-wait times; score
    elements and steps are counted by the forward. Times are host wall-clock: exact on CPU, launch
    times on CUDA (synchronise or use the profiler there).
    """

    compute_s: float = 0.0
    wait_s: float = 0.0
    score_elements: int = 0
    steps: int = 0

    def reset(self) -> None:
        self.compute_s = self.wait_s = 0.0
        self.score_elements = self.steps = 0


class RingExchange:
    """Async exchange with the next/previous rank of the cp ring (send to rank+1, receive from rank-1).

    ``group=None`` is a ring of one rank (``a2a``: every block is already local)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1
        if group is not None:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: torch.Tensor, tag: int):
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(reqs, stats: RingStats | None) -> None:
        t0 = time.perf_counter()
        for r in reqs:
            r.wait()
        if stats is not None:
            stats.wait_s += time.perf_counter() - t0


_KV_TAG, _DKV_TAG = 0, 1


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: RingExchange, held, kernel: str, stats: RingStats | None, positions):
        blocks = _Blocks(q, held, ring.rank, kernel, stats, positions)
        out, lse = _empty_result(q)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            pending = ring.start(kv, _KV_TAG) if step + 1 < ring.size else None
            blocks.forward(q, kv, (ring.rank - step) % ring.size, out, lse)
            if pending is not None:
                kv, reqs = pending
                ring.wait(reqs, stats)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.blocks = ring, blocks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, blocks, stats = ctx.ring, ctx.blocks, ctx.blocks.stats
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_pending = None
        for step in range(ring.size):
            kv_pending = ring.start(kv, _KV_TAG) if step + 1 < ring.size else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            blocks.backward(dout, q, kv, (ring.rank - step) % ring.size, out, lse, dq, dkv)
            if dkv_pending is not None:
                # The accumulator for this key block arrives from the previous rank, which
                # computed its share one step earlier.
                received, reqs, _sent = dkv_pending
                ring.wait(reqs, stats)
                dkv.add_(received)
            # After the last step this hop brings each accumulator home to the keys' owner. The
            # sent buffer is kept referenced until its send has completed.
            dkv_pending = (*ring.start(dkv, _DKV_TAG), dkv) if ring.size > 1 else (dkv, [], dkv)
            if kv_pending is not None:
                kv, reqs = kv_pending
                ring.wait(reqs, stats)
        dkv, reqs, _sent = dkv_pending
        ring.wait(reqs, stats)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


class _GatheredAttentionFn(torch.autograd.Function):
    """``allgather``: every rank's K/V gathered once; backward reduce-scatters their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, group: dist.ProcessGroup, held, kernel: str, stats: RingStats | None, positions):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        blocks = _Blocks(q, held, rank, kernel, stats, positions)
        kv_all = _all_gather_kv(torch.stack([k, v]), group, stats)
        out, lse = _empty_result(q)
        for step in range(size):  # the ring's order, so the merge adds blocks in the same sequence
            src = (rank - step) % size
            blocks.forward(q, kv_all[src], src, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, kv_all)
        ctx.group, ctx.blocks, ctx.kv_dtype = group, blocks, k.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, kv_all = ctx.saved_tensors
        blocks, group = ctx.blocks, ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv_all = torch.zeros(kv_all.shape, dtype=torch.float32, device=q.device)
        for step in range(size):
            src = (rank - step) % size
            blocks.backward(dout, q, kv_all[src], src, out, lse, dq, dkv_all[src])
        dkv = torch.empty(kv_all.shape[1:], dtype=torch.float32, device=q.device)
        dist.reduce_scatter_single(dkv, dkv_all.flatten(0, 1), group=group)  # each rank's K/V gradient, summed
        return dq.to(q.dtype), dkv[0].to(ctx.kv_dtype), dkv[1].to(ctx.kv_dtype), None, None, None, None, None


def _all_gather_kv(kv: torch.Tensor, group: dist.ProcessGroup, stats: RingStats | None) -> torch.Tensor:
    size = dist.get_world_size(group)
    gathered = torch.empty((size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    t0 = time.perf_counter()
    dist.all_gather_single(gathered, kv.contiguous(), group=group)
    if stats is not None:
        stats.wait_s += time.perf_counter() - t0
    return gathered.view(size, *kv.shape)


# --------------------------------------------------------------------------------------------
# All-to-all (Ulysses): sequence shards <-> head shards
# --------------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Piece ``r`` of ``x`` along ``scatter_dim`` goes to rank ``r``; received pieces are
    concatenated along ``gather_dim`` in rank order."""
    send = torch.stack(x.chunk(dist.get_world_size(group), dim=scatter_dim))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _SequenceHeadAllToAll(torch.autograd.Function):
    """The all-to-all under autograd: its gradient takes the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _gather_sequence(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Packed positions ``[B, S_local]`` of the group's ranks, concatenated in rank order (no grad)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


# --------------------------------------------------------------------------------------------
# The whole sequence gathered back (the inverse of sharding.shard_sequence)
# --------------------------------------------------------------------------------------------


def unshard_sequence(
    local: torch.Tensor, cp: DeviceMesh | dist.ProcessGroup, dim: int = 1, balanced: bool = True
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the shards over ``cp`` and restore global order."""
    group = _cp_group(cp)
    size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    n_local = len(chunk_ids(0, size, balanced))
    chunks: dict[int, torch.Tensor] = {}
    for rank, part in enumerate(parts):
        for cid, piece in zip(chunk_ids(rank, size, balanced), part.chunk(n_local, dim=dim)):
            chunks[cid] = piece
    return torch.cat([chunks[i] for i in range(len(chunks))], dim=dim)
