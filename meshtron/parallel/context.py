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

Documents. With ``[data] document_mask`` the attention also receives the queries' packed
positions (restarting at 0 at every document): a query at global index ``i`` with position ``p``
sees keys ``i - p .. i``. A (query chunk, key chunk) pair whose keys all lie before every query's
document start is skipped, one whose keys all lie inside every query's document is computed
unmasked, and only the rest builds an explicit mask (:func:`document_blocks`).

Communication types (``[parallel] cp_comm_type``, Megatron's names), one block engine for all:

* ``p2p``: the ring above.
* ``a2a`` (Ulysses): an all-to-all turns this rank's sequence shard of all heads into all tokens of
  ``heads / cp`` heads; attention then runs locally (a ring of one) and a second all-to-all turns the
  output back. KV heads fewer than cp are repeated first, as tensor parallelism replicates them.
* ``allgather``: K/V are all-gathered once (backward: their gradients reduce-scattered); queries
  keep the load-balanced layout and visit the gathered blocks in the ring's order.
* ``a2a+p2p``: cp ranks form groups of ``a`` consecutive ranks (:func:`a2a_group_size`); an
  all-to-all inside each group, then a ring across the groups, each ring member holding the
  chunks of its whole group.

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
import os
import time
import weakref
from dataclasses import dataclass
from itertools import chain

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.config import ConfigError
from meshtron.models.layers import document_causal_mask

__all__ = [
    "CP_COMM_TYPES",
    "RingAttention",
    "RingExchange",
    "RingStats",
    "apply_context_parallel",
    "attention_block",
    "attention_block_backward",
    "block_plan",
    "a2a_group_size",
    "causal_score_elements",
    "check_context_parallel",
    "chunk_ids",
    "cp_groups",
    "document_blocks",
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


def document_blocks(
    plan: list[tuple[int, int, bool]],
    q_chunks: tuple[int, ...],
    kv_chunks: tuple[int, ...],
    chunk_len: int,
    first_start: list[int],
    last_start: list[int],
) -> list[tuple[int, int, bool, bool]]:
    """``(i, j, causal, masked)`` for the pairs of ``plan`` that some query can see under document masks.

    ``first_start[i]`` / ``last_start[i]`` are the earliest / latest document start (global index)
    of the queries of local chunk ``i``. A key chunk that ends before ``first_start`` is invisible
    to all of them (skipped); one that begins at or after ``last_start`` and precedes the query
    chunk is visible to all of them (computed unmasked); the rest needs the explicit mask.
    """
    blocks = []
    for i, j, causal in plan:
        key_first, key_end = kv_chunks[j] * chunk_len, (kv_chunks[j] + 1) * chunk_len
        if key_end <= first_start[i]:
            continue
        masked = last_start[i] > key_first
        blocks.append((i, j, causal and not masked, masked))
    return blocks


CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def a2a_group_size(comm_type: str, cp: int, a2a_size: int = 0, heads: int = 0, ranks_per_node: int = 0) -> int:
    """cp ranks that trade sequence shards for head shards: 1 for p2p / allgather, cp for a2a.

    For a2a+p2p it is ``a2a_size`` when given; else (0) the largest divisor of cp below cp that
    fits on one node (``ranks_per_node``, the cp ranks of a node) and divides the local heads, so
    the all-to-all stays inside a node and the ring crosses nodes.
    """
    if comm_type in ("p2p", "allgather"):
        return 1
    if comm_type == "a2a":
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
    if comm_type not in CP_COMM_TYPES:
        raise ConfigError(f"[parallel] cp_comm_type = {comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}.")
    if cp == 1:
        return 1
    if sliding_window:
        raise ConfigError(
            f"context parallelism (cp = {cp}) runs full causal attention, but the model uses a sliding window "
            f"of {sliding_window} tokens; set cp = 1 or use a model without sliding windows."
        )
    if seq_len is not None and seq_len % (2 * cp):
        raise ConfigError(
            f"[train] seq_len = {seq_len} must be a multiple of 2 x cp = {2 * cp}: context parallelism cuts "
            f"the sequence into 2 x cp chunks for load balance."
        )
    a = a2a_group_size(comm_type, cp, a2a_size, heads, ranks_per_node)
    if a2a_size and comm_type != "a2a+p2p":
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


def _math_probs(qf, kf, causal: bool, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    if mask is not None:  # [B, Sq, Sk] visibility against s [B, Hkv, G, Sq, Sk]
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that sees no key of the block) as 0, so exp(s - lse) is 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1).contiguous()


def attention_block(q, k, v, causal: bool, scale: float, kernel: str = "auto", mask: torch.Tensor | None = None):
    """Attention of a q block over a k/v block: ``(out fp32 [B,H,Sq,D], lse fp32 [B,H,Sq])``.

    ``causal`` applies the diagonal mask (q and k blocks cover the same positions); ``mask``
    (``[B, Sq, Sk]``, True: visible) a document mask, computed by the math kernel. A row that sees
    no key gets out 0 and lse -inf.
    """
    b, h, sq, d = q.shape
    if mask is not None or _kernel_name(q, kernel) == "math":
        qf, kf, vf = _grouped(q, k, v)
        s = _math_probs(qf, kf, causal, scale, mask)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.exp(s - _finite(lse).unsqueeze(-1)) @ vf
        return out.reshape(b, h, sq, d), lse.reshape(b, h, sq)
    q, k, v = q.contiguous(), _expand_kv(k, h), _expand_kv(v, h)
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out.float(), lse.float()


def attention_block_backward(
    dout, q, k, v, out, lse, causal: bool, scale: float, kernel: str = "auto", mask: torch.Tensor | None = None
):
    """Gradients ``(dq, dk, dv)`` (fp32, dk/dv with k's head count) of one block.

    ``out`` and ``lse`` are the *final* (ring-merged) output and log-sum-exp of the q rows: with
    them each block's softmax probabilities and the row term ``sum(dout * out)`` are exact, so
    per-block gradients simply add up.
    """
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if mask is not None or _kernel_name(q, kernel) == "math":
        qf, kf, vf = _grouped(q, k, v)
        g = h // hkv
        p = torch.exp(_math_probs(qf, kf, causal, scale, mask) - lse.float().reshape(b, hkv, g, sq, 1))
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


def _chunk(t: torch.Tensor, i: int, c: int, dim: int = 2) -> torch.Tensor:
    return t.narrow(dim, i * c, c)


def _chunk_index(chunks: tuple[int, ...], c: int, device) -> torch.Tensor:
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device) for a in chunks])


# Packed positions are one tensor per micro-batch that every layer's attention receives: what is
# derived from them (the all-to-all group's positions: a collective; the per-chunk document-start
# bounds: a host read) is derived once per micro-batch, not once per layer. Keyed by the tensor's
# identity and dropped with it.
_FROM_DOCUMENTS: dict[int, dict] = {}


def _from_documents(documents: torch.Tensor, key, derive):
    """``derive()``, computed once per ``documents`` tensor and ``key`` (every rank calls alike)."""
    cache = _FROM_DOCUMENTS.get(id(documents))
    if cache is None:
        cache = _FROM_DOCUMENTS[id(documents)] = {}
        weakref.finalize(documents, _FROM_DOCUMENTS.pop, id(documents), None)
    if key not in cache:
        cache[key] = derive()
    return cache[key]


def _start_bounds(positions: torch.Tensor, mine: tuple[int, ...], c: int) -> list[list[int]]:
    """[earliest, latest] document start (global index) of the queries of each local chunk."""
    starts = (_chunk_index(mine, c, positions.device) - positions).reshape(positions.shape[0], len(mine), c)
    return torch.stack([starts.amin(dim=(0, 2)), starts.amax(dim=(0, 2))]).tolist()


class _Blocks:
    """The block engine of one attention call: this ring member's query chunks (``held[rank]``),
    the chunks every member holds, and (with documents) the queries' packed positions.

    ``plan(src)`` lists the blocks to compute against member ``src``'s keys; ``forward`` /
    ``backward`` run them, so the ring, the gathered K/V and the all-to-all share one code path.
    """

    def __init__(self, q: torch.Tensor, held, rank: int, kernel: str, stats, positions):
        self.held, self.mine, self.kernel, self.stats = held, held[rank], kernel, stats
        self.c = q.shape[2] // len(self.mine)
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        self.positions = positions
        if positions is not None:
            # The per-chunk bounds decide which blocks run at all (one host read per micro-batch).
            self.first_start, self.last_start = _from_documents(
                positions, ("bounds", self.mine, self.c), lambda: _start_bounds(positions, self.mine, self.c)
            )

    def plan(self, src: int) -> list[tuple[int, int, bool, bool]]:
        theirs = self.held[src]
        plan = block_plan(self.mine, theirs)
        if self.positions is None:
            return [(i, j, causal, False) for i, j, causal in plan]
        return document_blocks(plan, self.mine, theirs, self.c, self.first_start, self.last_start)

    def _mask(self, i: int, kv_chunk: int) -> torch.Tensor:
        c, device = self.c, self.positions.device
        query = torch.arange(self.mine[i] * c, (self.mine[i] + 1) * c, device=device)
        key = torch.arange(kv_chunk * c, (kv_chunk + 1) * c, device=device)
        return document_causal_mask(_chunk(self.positions, i, c, dim=1), query, key)

    def _count(self, causal: bool, mask: torch.Tensor | None) -> int:
        if mask is not None:
            return int(mask.sum()) // mask.shape[0]
        return self.c * (self.c + 1) // 2 if causal else self.c * self.c

    def forward(self, q, kv, src: int, out, lse) -> None:
        c, t0 = self.c, time.perf_counter()
        for i, j, causal, masked in self.plan(src):
            mask = self._mask(i, self.held[src][j]) if masked else None
            o, l = attention_block(
                _chunk(q, i, c), _chunk(kv[0], j, c), _chunk(kv[1], j, c), causal, self.scale, self.kernel, mask
            )
            _merge(_chunk(out, i, c), _chunk(lse, i, c), o, l)
            if self.stats is not None:
                self.stats.score_elements += self._count(causal, mask)
        if self.stats is not None:
            self.stats.compute_s += time.perf_counter() - t0
            self.stats.steps += 1

    def backward(self, dout, q, kv, src: int, out, lse, dq, dkv) -> None:
        c, t0 = self.c, time.perf_counter()
        for i, j, causal, masked in self.plan(src):
            mask = self._mask(i, self.held[src][j]) if masked else None
            dqi, dki, dvi = attention_block_backward(
                _chunk(dout, i, c), _chunk(q, i, c), _chunk(kv[0], j, c), _chunk(kv[1], j, c),
                _chunk(out, i, c), _chunk(lse, i, c), causal, self.scale, self.kernel, mask,
            )
            _chunk(dq, i, c).add_(dqi)
            _chunk(dkv[0], j, c).add_(dki)
            _chunk(dkv[1], j, c).add_(dvi)
        if self.stats is not None:
            self.stats.compute_s += time.perf_counter() - t0


def _empty_result(q: torch.Tensor):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return out, torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)


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


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block's (out, lse) into the running (out, lse), in place, fp32.

    A row that has seen no visible key yet keeps lse -inf and out 0."""
    new = torch.logaddexp(lse, block_lse)
    shift = _finite(new)
    out.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - shift).unsqueeze(-1))
    lse.copy_(new)


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


class _AllToAll(torch.autograd.Function):
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


def _repeat_kv_heads(t: torch.Tensor, ranks: int) -> torch.Tensor:
    """K/V heads fewer than the all-to-all ranks: repeat each so every rank gets the head its
    query heads read (as tensor parallelism replicates KV heads; autograd sums the copies)."""
    heads = t.shape[1]
    return t if heads % ranks == 0 else t.repeat_interleave(ranks // heads, dim=1)


# --------------------------------------------------------------------------------------------
# Module and model transform
# --------------------------------------------------------------------------------------------


def _held_chunks(ring_size: int, a2a_size: int, balanced: bool) -> tuple[tuple[int, ...], ...]:
    """Chunk ids each ring member holds: the chunks of its ``a2a_size`` consecutive cp ranks, in
    their rank order (what the all-to-all concatenates)."""
    cp = ring_size * a2a_size
    return tuple(
        tuple(chain.from_iterable(chunk_ids(g * a2a_size + m, cp, balanced) for m in range(a2a_size)))
        for g in range(ring_size)
    )


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
        q, k, v = (_AllToAll.apply(t, self.a2a, 1, 2) for t in (q, k, v))
        positions = None
        if documents is not None:
            positions = _from_documents(documents, ("a2a", self.a2a), lambda: _gather_sequence(documents, self.a2a))
        return _AllToAll.apply(self._attend(q, k, v, positions), self.a2a, 2, 1)

    def _attend(self, q, k, v, positions):
        if self.allgather:
            return _GatheredAttentionFn.apply(
                q, k, v, self.ring.group, self.held, self.kernel, self.stats, positions
            )
        return _RingAttentionFn.apply(q, k, v, self.ring, self.held, self.kernel, self.stats, positions)


def local_heads(heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    """Attention heads and KV heads per tp rank (KV heads fewer than tp: one per rank, replicated)."""
    return heads // tp, kv_heads // tp if kv_heads % tp == 0 else 1


def cp_ranks_per_node(tp: int, ep: int) -> int:
    """cp ranks on one node: cp is outside ep and tp in the mesh, so a node of ``LOCAL_WORLD_SIZE``
    ranks holds that many divided by ep x tp consecutive cp ranks (0 when unknown)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) // (tp * ep)


def cp_groups(mesh: DeviceMesh, comm_type: str = "p2p", a2a_size: int = 0, heads: int = 1, kv_heads: int = 1):
    """``(ring, a2a)`` groups of ``comm_type`` over ``mesh['cp']`` (None: not used), for
    :class:`RingAttention`; ``heads`` / ``kv_heads`` per tp rank. Validates first, then (a2a+p2p)
    splits cp into the ring and the all-to-all groups (collective over the mesh)."""
    cp = _mesh_cp(mesh)
    size = cp.size()
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    a = check_context_parallel(
        comm_type, size, heads, kv_heads, None, a2a_size, None, cp_ranks_per_node(sizes.get("tp", 1), sizes.get("ep", 1))
    )
    if a == 1:  # p2p, allgather (or an a2a+p2p group of one)
        return cp, None
    if a == size:
        return None, cp
    split = cp._unflatten(0, (size // a, a), ("cp_ring", "cp_a2a"))
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
    if comm_type in ("a2a", "a2a+p2p"):
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
        parent.core_attention = RingAttention(
            ring, balanced=balanced, kernel=kernel, a2a=a2a, allgather=comm_type == "allgather"
        )
    return model
