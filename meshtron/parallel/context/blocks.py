"""The compute every cp communication type shares: which (query chunk, key chunk) blocks run, the
kernels that run one block, and the engine that merges them by log-sum-exp.

No collective lives here, so the schedule and the numerics can be read, tested and benchmarked
without a process group; ``comm.py`` feeds this engine whatever key/value blocks it moved.
See docs/context_parallel.md, 'Ring attention'.
"""

from __future__ import annotations

import math
import time
import weakref

import torch

from meshtron.host import document_starts
from meshtron.models.layers import document_causal_mask
from meshtron.parallel.context.sharding import chunk_ids
from meshtron.torch_private import (
    FLASH_ATTENTION,
    FLASH_ATTENTION_BACKWARD,
    FLASH_ATTENTION_CPU,
    FLASH_ATTENTION_CPU_BACKWARD,
)

# --------------------------------------------------------------------------------------------
# Block schedule: which (query chunk, key chunk) pairs are computed, and how
# --------------------------------------------------------------------------------------------


def visible_blocks(q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """``(local q chunk, local kv chunk, causal)`` for every pair that is not fully masked.

    A key chunk earlier than the query chunk is fully visible, the same chunk is diagonal
    (causal), a later one is skipped.
    """
    return [(i, j, a == b) for i, a in enumerate(q_chunks) for j, b in enumerate(kv_chunks) if b <= a]


def ring_schedule(cp_rank: int, cp_size: int, balanced: bool = True) -> list[list[tuple[int, int, bool]]]:
    """The visible blocks of every ring step: at step ``s`` the visiting key/value block is rank ``rank - s``'s."""
    mine = chunk_ids(cp_rank, cp_size, balanced)
    return [visible_blocks(mine, chunk_ids((cp_rank - s) % cp_size, cp_size, balanced)) for s in range(cp_size)]


def causal_score_elements(chunk_len: int, blocks: list[tuple[int, int, bool]]) -> int:
    """Unmasked query-key pairs computed by ``blocks`` (a diagonal chunk counts its lower triangle)."""
    return sum(chunk_len * (chunk_len + 1) // 2 if causal else chunk_len * chunk_len for _, _, causal in blocks)


def document_blocks(
    blocks: list[tuple[int, int, bool]],
    q_chunks: tuple[int, ...],
    kv_chunks: tuple[int, ...],
    chunk_len: int,
    first_start: list[int],
    last_start: list[int],
) -> list[tuple[int, int, bool, bool]]:
    """``(i, j, causal, masked)`` for the pairs of ``blocks`` that some query can see under document masks.

    ``first_start[i]`` / ``last_start[i]`` are the earliest / latest document start (global index)
    of the queries of local chunk ``i``. A key chunk that ends before ``first_start`` is invisible
    to all of them (skipped); one that begins at or after ``last_start`` and precedes the query
    chunk is visible to all of them (computed unmasked); the rest needs the explicit mask.
    """
    seen = []
    for i, j, causal in blocks:
        key_first, key_end = kv_chunks[j] * chunk_len, (kv_chunks[j] + 1) * chunk_len
        if key_end <= first_start[i]:
            continue
        masked = last_start[i] > key_first
        seen.append((i, j, causal and not masked, masked))
    return seen


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
        out, lse, *_ = FLASH_ATTENTION(q, k, v, 0.0, causal, False, scale=scale)
    else:
        out, lse = FLASH_ATTENTION_CPU(q, k, v, 0.0, causal, scale=scale)
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
        dq, dk, dv = FLASH_ATTENTION_BACKWARD(*args, lse, None, None, sq, sk, 0.0, causal, rng, rng, scale=scale)
    else:
        dq, dk, dv = FLASH_ATTENTION_CPU_BACKWARD(*args, lse, 0.0, causal, scale=scale)
    fold = lambda t: t.float().reshape(b, hkv, h // hkv, sk, d).sum(2)  # noqa: E731 - GQA: sum each group
    return dq.float(), fold(dk), fold(dv)


# --------------------------------------------------------------------------------------------
# Block engine: the blocks of one attention call, run against one visiting key/value block
# --------------------------------------------------------------------------------------------


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
    return document_starts(torch.stack([starts.amin(dim=(0, 2)), starts.amax(dim=(0, 2))]))


class _Blocks:
    """The block engine of one attention call: this ring member's query chunks (``held[rank]``),
    the chunks every member holds, and (with documents) the queries' packed positions.

    ``blocks_against(src)`` lists the blocks to compute against member ``src``'s keys; ``forward`` /
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

    def blocks_against(self, src: int) -> list[tuple[int, int, bool, bool]]:
        theirs = self.held[src]
        visible = visible_blocks(self.mine, theirs)
        if self.positions is None:
            return [(i, j, causal, False) for i, j, causal in visible]
        return document_blocks(visible, self.mine, theirs, self.c, self.first_start, self.last_start)

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
        for i, j, causal, masked in self.blocks_against(src):
            mask = self._mask(i, self.held[src][j]) if masked else None
            o, block_lse = attention_block(
                _chunk(q, i, c), _chunk(kv[0], j, c), _chunk(kv[1], j, c), causal, self.scale, self.kernel, mask
            )
            _merge(_chunk(out, i, c), _chunk(lse, i, c), o, block_lse)
            if self.stats is not None:
                self.stats.score_elements += self._count(causal, mask)
        if self.stats is not None:
            self.stats.compute_s += time.perf_counter() - t0
            self.stats.steps += 1

    def backward(self, dout, q, kv, src: int, out, lse, dq, dkv) -> None:
        c, t0 = self.c, time.perf_counter()
        for i, j, causal, masked in self.blocks_against(src):
            mask = self._mask(i, self.held[src][j]) if masked else None
            dqi, dki, dvi = attention_block_backward(
                _chunk(dout, i, c),
                _chunk(q, i, c),
                _chunk(kv[0], j, c),
                _chunk(kv[1], j, c),
                _chunk(out, i, c),
                _chunk(lse, i, c),
                causal,
                self.scale,
                self.kernel,
                mask,
            )
            _chunk(dq, i, c).add_(dqi)
            _chunk(dkv[0], j, c).add_(dki)
            _chunk(dkv[1], j, c).add_(dvi)
        if self.stats is not None:
            self.stats.compute_s += time.perf_counter() - t0


def _empty_result(q: torch.Tensor):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return out, torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block's (out, lse) into the running (out, lse), in place, fp32.

    A row that has seen no visible key yet keeps lse -inf and out 0."""
    new = torch.logaddexp(lse, block_lse)
    shift = _finite(new)
    out.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - shift).unsqueeze(-1))
    lse.copy_(new)
