"""Context parallelism: ring attention over the ``cp`` mesh dimension with load-balanced sharding.

Layout. The sequence is cut into ``2 * cp`` equal chunks and cp rank ``i`` holds chunks ``i`` and
``2*cp - 1 - i`` (in that order). Under a causal mask a late chunk attends to many more keys than an
early one, so pairing the i-th earliest with the i-th latest chunk gives every rank the same work.

Ring. Each rank keeps its queries; key/value blocks (with their own, possibly smaller, GQA head
count) travel one hop around the cp ring per step with async send/recv, so the next block is in
flight while the current one is computed. From the chunk ids of the query and the visiting key
block every (query chunk, key chunk) pair is either fully visible, diagonal (causal inside the
chunk) or fully masked; masked pairs are never computed. Partial results are merged with their
log-sum-exp in fp32 (online softmax). The backward recomputes every block from the saved
log-sum-exp and sends the dK/dV accumulators around the ring with the key/value blocks, so that
after ``cp`` hops each rank holds the gradient of its own keys and values. Nothing ever gathers
the full sequence: per-rank memory is O(seq / cp).

Loss. With the sequence sharded, each cp rank sees only its tokens. The training loop must sum
the per-token losses of its local tokens and divide by the *global* token count (all-reduced over
cp, and over the data-parallel ranks of the same global batch), and the gradients of the dense
parameters must be *summed* over cp (not averaged): with a gradient reduction that averages over
``dp x ep x cp`` (FSDP/DDP default), multiply the local loss by the number of ranks in that
reduction. Labels must be shifted to next-token targets *before* sharding, because a chunk's last
target lives on another rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "RingAttention",
    "RingExchange",
    "RingStats",
    "apply_context_parallel",
    "attention_block",
    "attention_block_backward",
    "block_plan",
    "causal_score_elements",
    "chunk_ids",
    "ring_schedule",
    "sequence_index",
    "shard_batch",
    "shard_sequence",
    "unshard_sequence",
]


# --------------------------------------------------------------------------------------------
# Layout: which chunks of the global sequence each cp rank holds
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Block schedule: which (query chunk, key chunk) pairs are computed, and how
# --------------------------------------------------------------------------------------------


def block_plan(q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """``(local q chunk, local kv chunk, causal)`` for every pair that is not fully masked.

    A key chunk earlier than the query chunk is fully visible, the same chunk is diagonal
    (causal), a later one is skipped.
    """
    return [(i, j, a == b) for i, a in enumerate(q_chunks) for j, b in enumerate(kv_chunks) if b <= a]


def ring_schedule(cp_rank: int, cp_size: int, balanced: bool = True) -> list[list[tuple[int, int, bool]]]:
    """The block plan of every ring step: at step ``s`` the visiting key/value block is rank ``rank - s``'s."""
    mine = chunk_ids(cp_rank, cp_size, balanced)
    return [block_plan(mine, chunk_ids((cp_rank - s) % cp_size, cp_size, balanced)) for s in range(cp_size)]


def causal_score_elements(chunk_len: int, plan: list[tuple[int, int, bool]]) -> int:
    """Unmasked query-key pairs computed by a plan (a diagonal chunk counts its lower triangle)."""
    return sum(chunk_len * (chunk_len + 1) // 2 if causal else chunk_len * chunk_len for _, _, causal in plan)


# --------------------------------------------------------------------------------------------
# Block kernels: (out, logsumexp) for one (q block, kv block) pair, and its backward
# --------------------------------------------------------------------------------------------


def _kernel_name(q: torch.Tensor, kernel: str) -> str:
    """``aten`` (fused flash kernel) on CUDA for half types and supported head dims, else ``math``."""
    if kernel != "auto":
        if kernel not in ("aten", "math"):
            raise ValueError(f"kernel must be 'auto', 'aten' or 'math', got {kernel!r}.")
        return kernel
    fused = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
    return "aten" if fused else "math"


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """fp32 views for GQA without expanding K/V: q [B, Hkv, G, Sq, D], k/v [B, Hkv, 1, Sk, D]."""
    b, h, sq, d = q.shape
    hkv = k.shape[1]
    return q.float().reshape(b, hkv, h // hkv, sq, d), k.float().unsqueeze(2), v.float().unsqueeze(2)


def _math_probs(qf, kf, causal: bool, scale: float) -> torch.Tensor:
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    return s


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1).contiguous()


def attention_block(q, k, v, causal: bool, scale: float, kernel: str = "auto"):
    """Attention of a q block over a k/v block: ``(out fp32 [B,H,Sq,D], lse fp32 [B,H,Sq])``.

    ``causal`` applies the diagonal mask (q and k blocks cover the same positions).
    """
    b, h, sq, d = q.shape
    if _kernel_name(q, kernel) == "math":
        qf, kf, vf = _grouped(q, k, v)
        s = _math_probs(qf, kf, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.exp(s - lse.unsqueeze(-1)) @ vf
        return out.reshape(b, h, sq, d), lse.reshape(b, h, sq)
    q, k, v = q.contiguous(), _expand_kv(k, h), _expand_kv(v, h)
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out.float(), lse.float()


def attention_block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kernel: str = "auto"):
    """Gradients ``(dq, dk, dv)`` (fp32, dk/dv with k's head count) of one block.

    ``out`` and ``lse`` are the *final* (ring-merged) output and log-sum-exp of the q rows: with
    them each block's softmax probabilities and the row term ``sum(dout * out)`` are exact, so
    per-block gradients simply add up.
    """
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if _kernel_name(q, kernel) == "math":
        qf, kf, vf = _grouped(q, k, v)
        g = h // hkv
        p = torch.exp(_math_probs(qf, kf, causal, scale) - lse.float().reshape(b, hkv, g, sq, 1))
        do = dout.float().reshape(b, hkv, g, sq, d)
        delta = (do * out.float().reshape(b, hkv, g, sq, d)).sum(-1, keepdim=True)
        ds = p * (do @ vf.transpose(-1, -2) - delta)
        dq = (ds @ kf) * scale
        dk = (ds.transpose(-1, -2) @ qf).sum(2) * scale
        dv = (p.transpose(-1, -2) @ do).sum(2)
        return dq.reshape(b, h, sq, d), dk, dv
    args = [t.contiguous() for t in (dout.to(q.dtype), q, _expand_kv(k, h), _expand_kv(v, h), out.to(q.dtype))]
    lse = lse.float().contiguous()
    if q.is_cuda:
        # Undefined cumulative lengths select the dense (not varlen) kernel, as the forward
        # returns them; without dropout the RNG state is never read.
        rng = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            *args, lse, None, None, sq, sk, 0.0, causal, rng, rng, scale=scale
        )
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *args, lse, 0.0, causal, scale=scale
        )
    fold = lambda t: t.float().reshape(b, hkv, h // hkv, sk, d).sum(2)  # noqa: E731 - GQA: sum each group
    return dq.float(), fold(dk), fold(dv)


# --------------------------------------------------------------------------------------------
# Ring communication
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
    """Async exchange with the next/previous rank of the cp ring (send to rank+1, receive from rank-1)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
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


def _chunk(t: torch.Tensor, i: int, c: int) -> torch.Tensor:
    return t[:, :, i * c : (i + 1) * c]


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: RingExchange, balanced: bool, kernel: str, stats: RingStats | None):
        schedule = ring_schedule(ring.rank, ring.size, balanced)
        c = q.shape[2] // len(chunk_ids(ring.rank, ring.size, balanced))
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step, plan in enumerate(schedule):
            pending = ring.start(kv, _KV_TAG) if step + 1 < ring.size else None
            t0 = time.perf_counter()
            for i, j, causal in plan:
                o, l = attention_block(_chunk(q, i, c), _chunk(kv[0], j, c), _chunk(kv[1], j, c), causal, scale, kernel)
                _merge(_chunk(out, i, c), _chunk(lse, i, c), o, l)
            if stats is not None:
                stats.compute_s += time.perf_counter() - t0
                stats.score_elements += causal_score_elements(c, plan)
                stats.steps += 1
            if pending is not None:
                kv, reqs = pending
                ring.wait(reqs, stats)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.balanced, ctx.kernel, ctx.c, ctx.scale, ctx.stats = ring, balanced, kernel, c, scale, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, c, scale, stats = ctx.ring, ctx.c, ctx.scale, ctx.stats
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_pending = None
        for step, plan in enumerate(ring_schedule(ring.rank, ring.size, ctx.balanced)):
            kv_pending = ring.start(kv, _KV_TAG) if step + 1 < ring.size else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            t0 = time.perf_counter()
            for i, j, causal in plan:
                dqi, dki, dvi = attention_block_backward(
                    _chunk(dout, i, c), _chunk(q, i, c), _chunk(kv[0], j, c), _chunk(kv[1], j, c),
                    _chunk(out, i, c), _chunk(lse, i, c), causal, scale, ctx.kernel,
                )
                _chunk(dq, i, c).add_(dqi)
                _chunk(dkv[0], j, c).add_(dki)
                _chunk(dkv[1], j, c).add_(dvi)
            if stats is not None:
                stats.compute_s += time.perf_counter() - t0
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
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block's (out, lse) into the running (out, lse), in place, fp32."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


# --------------------------------------------------------------------------------------------
# Module and model transform
# --------------------------------------------------------------------------------------------


class RingAttention(nn.Module):
    """Drop-in for a model's ``core_attention``: ``forward(q, k, v)`` with the local (sharded) sequence.

    q ``[B, H, S_local, D]``, k/v ``[B, Hkv, S_local, D]`` (GQA, not expanded), tokens laid out
    by :func:`shard_sequence`; returns the causal attention output ``[B, H, S_local, D]`` of the
    local queries over the whole (global) sequence.
    """

    def __init__(self, cp: DeviceMesh | dist.ProcessGroup, balanced: bool = True, kernel: str = "auto"):
        super().__init__()
        _kernel_name(torch.empty(0), kernel)  # validate early
        # Ranks and peers looked up once, not in every forward and backward.
        self.ring = RingExchange(_cp_group(cp))
        self.balanced = balanced
        self.kernel = kernel
        self.stats: RingStats | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
            raise ValueError(
                f"Expected q [B,H,S,D] and k, v [B,Hkv,S,D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
            )
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"Query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}.")
        size = self.ring.size
        n_local = len(chunk_ids(0, size, self.balanced))
        if q.shape[2] % n_local:
            raise ValueError(
                f"Local sequence length {q.shape[2]} is not a multiple of the {n_local} chunks per cp rank; "
                f"shard the batch with shard_batch/shard_sequence (global seq_len a multiple of {n_local * size})."
            )
        return _RingAttentionFn.apply(q, k, v, self.ring, self.balanced, self.kernel, self.stats)


def apply_context_parallel(
    model: nn.Module, mesh: DeviceMesh, balanced: bool = True, kernel: str = "auto"
) -> nn.Module:
    """Swap every ``core_attention`` submodule for :class:`RingAttention` over ``mesh['cp']`` (in place).

    With cp == 1 the model is returned unchanged. Inputs must then be sharded with
    :func:`shard_batch` (tokens, shifted labels and global position ids).
    """
    cp = _mesh_cp(mesh)
    if cp.size() == 1:
        return model
    parents = [m for m in model.modules() if isinstance(getattr(m, "core_attention", None), nn.Module)]
    if not parents:
        raise ValueError("apply_context_parallel found no module with a 'core_attention' child to replace.")
    for parent in parents:
        parent.core_attention = RingAttention(cp, balanced=balanced, kernel=kernel)
    return model
