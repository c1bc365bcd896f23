"""Token cross-entropy that never holds a whole micro-batch's logits in fp32.

:func:`linear_cross_entropy_sum` (training) fuses the LM head and the loss: logits are made ``chunk`` tokens at a
time, each chunk's gradients computed at once and its logits dropped, so the extra memory is O(chunk x V) for
the same matmul work; :func:`cross_entropy_sum` does the same given logits. Vocabulary-parallel callers pass a
``reduce`` over the shards, so the model holds no communication. See docs/training.md, 'The fused LM head and loss'.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# reduce(tensor, op) -> tensor: in-place max ("max") or sum ("sum") over the vocabulary shards.
VocabReducer = Callable[[torch.Tensor, str], torch.Tensor]

DEFAULT_CHUNK_TOKENS = 1024


def _no_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    return tensor


class _Targets:
    """Where each label's logit lives in this shard: column index, and whether the shard owns it."""

    def __init__(self, labels: torch.Tensor, vocab_start: int, vocab_local: int, ignore_index: int):
        local = labels - vocab_start
        self.mine = (local >= 0) & (local < vocab_local)
        self.index = local.clamp(0, vocab_local - 1).unsqueeze(-1)
        self.counted = labels != ignore_index


def _exp_and_log_sum_exp_(logits: torch.Tensor, t: _Targets, reduce: VocabReducer):
    """Per token of fp32 ``logits`` [n, V_local], which become exp(logits - row max) in place (one
    chunk-sized buffer, no second one): (log-sum-exp over the full vocabulary, target logit, exp-sum).

    Two reductions over the shards: the row maxima, then the exp-sums with the target logits.
    """
    row_max = reduce(logits.max(dim=-1).values, "max")
    target = (logits.gather(-1, t.index).squeeze(-1) - row_max) * t.mine
    exp_sum = logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)
    sums = reduce(torch.stack([exp_sum, target]), "sum")
    return sums[0].log() + row_max, sums[1] + row_max, sums[0]


def _loss_sum(lse: torch.Tensor, target: torch.Tensor, t: _Targets) -> torch.Tensor:
    return ((lse - target) * t.counted).sum()


def _logit_gradient_(probs: torch.Tensor, t: _Targets, row_scale: torch.Tensor, scale=1.0) -> torch.Tensor:
    """``scale`` x d(summed loss)/d logits, in place, from ``probs`` that ``row_scale`` [n] turns into the
    softmax times ``scale`` (zero for ignored tokens): minus ``scale`` at each counted target.

    Folding the normalisation, the ignored-token mask and the incoming gradient into one row scale
    makes this one pass over the chunk x V buffer instead of one per factor."""
    probs.mul_(row_scale.unsqueeze(-1))
    return probs.scatter_add_(-1, t.index, -((t.mine & t.counted) * scale).to(probs.dtype).unsqueeze(-1))


def _softcap_(logits: torch.Tensor, cap: float, slope: bool) -> torch.Tensor | None:
    """``cap * tanh(logits / cap)`` in place; returns d(capped)/d(logits) when ``slope`` (gradients
    wanted), which the in-place softmax that follows could no longer give back."""
    t = logits.div_(cap).tanh_()
    grad = t.square().neg_().add_(1) if slope else None  # 1 - tanh², one buffer
    t.mul_(cap)
    return grad


def _chunks(n: int, chunk: int):
    if chunk < 1:
        raise ValueError(f"[train] loss_chunk_tokens must be >= 1, got {chunk}.")
    return (slice(s, min(s + chunk, n)) for s in range(0, n, chunk))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, vocab_start, reduce, ignore_index, softcap):
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in _chunks(hidden.shape[0], chunk):
            h = hidden[rows]
            logits = (h @ weight.t()).float()
            slope = _softcap_(logits, softcap, want_h or want_w) if softcap else None
            t = _Targets(labels[rows], vocab_start, weight.shape[0], ignore_index)
            lse, target, exp_sum = _exp_and_log_sum_exp_(logits, t, reduce)
            total += _loss_sum(lse, target, t)
            if want_h or want_w:
                g = _logit_gradient_(logits, t, t.counted / exp_sum)
                if slope is not None:
                    g = g.mul_(slope)
                g = g.to(hidden.dtype)
                if want_h:
                    torch.matmul(g, weight, out=grad_h[rows])
                if want_w:
                    _accumulate_(grad_w, g.t(), h)
                del g  # else it lives on while the next chunk's logits are computed (chunk x V more)
            del logits, slope
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = grad_h * grad.to(grad_h.dtype) if grad_h is not None else None
        grad_w = _scaled(grad_w, grad, ctx.weight_dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None, None


def _accumulate_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``, accumulated over chunks in fp32; in fp32 without a weight-sized temporary."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)  # the compute-dtype product, as the unfused head's weight gradient rounds it


def _scaled(acc: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int = 4096) -> torch.Tensor:
    """``(acc * scale).to(dtype)`` a slice of rows at a time, rounded once as the whole product would be.

    At the start of the backward, when every activation is still held, a whole fp32 product next to its
    cast would be 1.5 x the fp32 weight gradient more (2.2 GB for a 7B vocabulary at tp 1)."""
    if dtype == acc.dtype:
        return acc * scale
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    for r in _chunks(acc.shape[0], rows):
        torch.mul(acc[r], scale, out=out[r])
    return out


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int = DEFAULT_CHUNK_TOKENS,
    vocab_start: int = 0,
    reduce: VocabReducer = _no_reduce,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` (soft-capped at ``softcap`` when given) against
    ``labels`` without materialising the logits.

    hidden: [..., H]; weight: [V_local, H] (vocabulary rows ``vocab_start ...``); labels: [...] with
    ``ignore_index`` for tokens that do not count. Returns an fp32 scalar (docs/training.md#the-fused-lm-head-and-loss).
    """
    return _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        chunk,
        vocab_start,
        reduce,
        ignore_index,
        softcap,
    )


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk, vocab_start, reduce, ignore_index):
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for rows in _chunks(logits.shape[0], chunk):
            t = _Targets(labels[rows], vocab_start, logits.shape[-1], ignore_index)
            chunk_logits = logits[rows].to(torch.float32, copy=True)  # the caller's logits stay intact
            lse[rows], target, _ = _exp_and_log_sum_exp_(chunk_logits, t, reduce)
            total += _loss_sum(lse[rows], target, t)
        ctx.save_for_backward(logits, labels, lse)
        ctx.args = chunk, vocab_start, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad):
        logits, labels, lse = ctx.saved_tensors
        chunk, vocab_start, ignore_index = ctx.args
        grad_logits = torch.empty_like(logits)
        for rows in _chunks(logits.shape[0], chunk):
            t = _Targets(labels[rows], vocab_start, logits.shape[-1], ignore_index)
            probs = logits[rows].to(torch.float32, copy=True).sub_(lse[rows].unsqueeze(-1)).exp_()
            grad_logits[rows] = _logit_gradient_(probs, t, t.counted * grad, grad)
        return grad_logits, None, None, None, None, None


def cross_entropy_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk: int = DEFAULT_CHUNK_TOKENS,
    vocab_start: int = 0,
    reduce: VocabReducer = _no_reduce,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Summed cross-entropy of (possibly vocabulary-sharded) ``logits`` [..., V_local] against ``labels``.

    Temporaries are one chunk of fp32 logits; the saved state is one fp32 value per token.
    """
    return _CrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), chunk, vocab_start, reduce, ignore_index
    )


__all__ = ["DEFAULT_CHUNK_TOKENS", "VocabReducer", "cross_entropy_sum", "linear_cross_entropy_sum"]
