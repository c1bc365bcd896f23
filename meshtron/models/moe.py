"""Qwen2-MoE block: softmax top-k router, grouped-GEMM routed experts, gated shared expert.

The load-balancing loss is Switch's, per layer and averaged over layers (equal to transformers' pooled loss for
one layer, and it lets a pipeline stage own its layers' losses); it and the optional z-loss enter through their
gradient (:class:`_AttachAuxLoss`). The aux-free bias and the capacity factor, off by default, act on the global
micro-batch, so every layout routes alike. See docs/expert_parallel.md, 'The MoE block and its router losses'.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig
from meshtron.models.layers import MLP

# A float64 vector of per-rank statistics -> its sum over every rank that holds other tokens.
StatsReducer = Callable[[torch.Tensor], torch.Tensor]
# Chosen experts [B, S, k] of this rank's tokens -> (for each copy, how many copies of the same expert
# other ranks hold earlier in the batch's token order [B, S, k]; the batch's token count, 0-d).
CapacityRanker = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Routing(NamedTuple):
    probs: torch.Tensor  # [T, E] fp32
    weights: torch.Tensor  # [T, k] combine weights in the input dtype
    experts: torch.Tensor  # [T, k] chosen expert ids
    logits: torch.Tensor  # [T, E] fp32


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # Persistent so checkpoints resume the balancing; only present when the feature is on.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts) if cfg.moe_aux_free_bias_rate else None)

    def forward(self, x: torch.Tensor) -> Routing:
        """x: [T, H] -> :class:`Routing`; the bias (if any) steers the choice, never the weights."""
        logits = F.linear(x, self.weight).float()
        probs = F.softmax(logits, dim=-1)
        if self.expert_bias is None:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            experts = torch.topk(probs.detach() + self.expert_bias, self.top_k, dim=-1).indices
            weights = probs.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(probs, weights.to(x.dtype), experts, logits)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: grouped_mm rejects expanded grads."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[-1] % multiple
    return F.pad(t, (0, extra)) if extra else t


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` [T, K] grouped by ``counts`` [G] times ``w`` [G, K, N] -> [T, N], one kernel.

    grouped_mm needs 16-byte-aligned strides, so odd K or N are zero-padded (exact: padded columns
    contribute zeros and padded outputs are sliced off).
    """
    align = max(1, 16 // x.element_size())
    n = w.shape[-1]
    xp = _pad_last(x, align)
    wp = _pad_last(w.transpose(1, 2), align).transpose(1, 2)  # pad K
    wp = _pad_last(wp, align)  # pad N
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    out = F.grouped_mm(_ContiguousGrad.apply(xp), wp, offs=offs)
    return _ContiguousGrad.apply(out[:, :n] if out.shape[-1] != n else out)


# (rows [T, K], stacked weights [G, K, N], rows per group [G]) -> [T, N]: grouped_matmul, or its FP8
# form (``meshtron.parallel.float8.Float8GroupedMatmul``) on a model that ``[train] fp8`` converted.
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    matmul: GroupedMatmul = grouped_matmul,
    down_matmul: GroupedMatmul | None = None,
):
    """SwiGLU experts on tokens already sorted by expert: ``counts[g]`` rows go to expert g. ``down_matmul``
    (default ``matmul``): the down projection's, where a split expert scales it otherwise than gate/up."""
    h = F.silu(matmul(x, gate, counts)) * matmul(x, up, counts)
    return (down_matmul or matmul)(h, down, counts)


def count_ids(ids: torch.Tensor, groups: int) -> torch.Tensor:
    """How often each of ``groups`` ids occurs (bincount without its device-to-host sync on GPUs)."""
    return torch.zeros(groups, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def sort_by_group(ids: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order that sorts 1-D ``ids`` into ``groups`` buckets, and the bucket sizes."""
    return torch.argsort(ids, stable=True), count_ids(ids, groups)


def unsort(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse of ``y = x[order]`` along dim 0."""
    return torch.empty_like(y).index_copy(0, order, y)


def permute_tokens(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """Copy each token once per chosen expert and sort the copies by expert.

    Returns (sorted copies [T*k, H], order [T*k] mapping sorted position -> flat (token, slot),
    counts [E]).
    """
    order, counts = sort_by_group(experts.flatten(), num_experts)
    return x[order // experts.shape[1]], order, counts


def unpermute_tokens(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_tokens`, combining each token's k expert outputs with its weights."""
    tokens, k = weights.shape
    return (unsort(y, order).view(tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def capacity_mask(
    experts: torch.Tensor, num_experts: int, factor: float, ranker: CapacityRanker | None = None
) -> torch.Tensor:
    """Chosen experts [..., k] (tokens in order, e.g. [B, S, k]) -> bool mask of the copies that fit
    in their expert's capacity, first come first served in token order, then slot order. With a
    ``ranker`` the tokens are this rank's part of a larger batch: capacity counts that batch's
    tokens and the copies that come before ours in it."""
    k = experts.shape[-1]
    flat = experts.flatten()
    order, counts = sort_by_group(flat, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[flat[order]]
    rank_in_expert = unsort(rank_in_expert, order).view(experts.shape)
    if ranker is None:
        return rank_in_expert < math.ceil(factor * (flat.numel() // k) * k / num_experts)
    earlier, total = ranker(experts)
    # On the device, so the global token count costs no host sync (same rounding as above).
    return rank_in_expert + earlier < torch.ceil(total.double() * factor * k / num_experts)


SharedWork = Callable[[], torch.Tensor]


class _Replay:
    active = False


@contextlib.contextmanager
def replaying():
    """Marks forwards that replay earlier ones (activation checkpointing's recomputation in backward):
    MoE layers compute as usual but record no statistics, so the load behind the aux-free bias and
    the ``last_*`` values count each training forward once."""
    outer, _Replay.active = _Replay.active, True
    try:
        yield
    finally:
        _Replay.active = outer


class GroupedExperts(nn.Module):
    """All routed experts as stacked weights ([E, in, out], the layout grouped_mm multiplies)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_proj = nn.Parameter(torch.empty(e, h, i))
        self.up_proj = nn.Parameter(torch.empty(e, h, i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.matmul: GroupedMatmul = grouped_matmul

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, shared: SharedWork | None = None
    ) -> torch.Tensor:
        """Weighted sum of each token's experts, plus ``shared()`` (work that does not depend on the
        routed experts; an expert-parallel replacement runs it while tokens are in flight)."""
        sorted_x, order, counts = permute_tokens(x, experts, self.num_experts)
        y = grouped_swiglu(sorted_x, counts, self.gate_proj, self.up_proj, self.down_proj, self.matmul)
        out = unpermute_tokens(y, order, weights)
        return out + shared() if shared is not None else out


class _AttachAuxLoss(torch.autograd.Function):
    """Returns ``out`` unchanged; in backward also sends gradient 1 to ``aux`` (already weighted), so
    the router loss is minimised by the same backward pass as the main loss."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def router_stats_size(num_experts: int) -> int:
    """Numbers in a MoE call's router statistics (``MoE._router_losses``): counts and probability sums per
    expert, the z-loss sum and the token count."""
    return 2 * num_experts + 2


def load_balancing_loss(counts: torch.Tensor, prob_sums: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Switch loss with transformers' normalisation: E * sum_e (counts_e / T) * (prob_sums_e / T)."""
    return counts.numel() * torch.sum(counts.float() / tokens * (prob_sums / tokens))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.gate = Router(cfg)
        self.experts = GroupedExperts(cfg)
        self.shared_expert = (
            MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
        )
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if self.shared_expert else None
        moe_layers = max(sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)), 1)
        # Gradient weights of this layer's aux and z losses, per micro-batch of ``microbatches`` (set
        # by the runner: a step's router loss is the mean over its micro-batches).
        self.aux_loss_scale = cfg.router_aux_loss_coef / moe_layers
        self.z_loss_scale = cfg.router_z_loss_coef / moe_layers
        self.microbatches = 1
        self.capacity_factor = cfg.moe_capacity_factor
        self.bias_rate = cfg.moe_aux_free_bias_rate
        # Set by data/expert parallelism so f and P cover the global batch, not this rank's slice.
        self.stats_reducer: StatsReducer | None = None
        # Set by expert parallelism so capacity covers the global micro-batch, not this rank's slice.
        self.capacity_ranker: CapacityRanker | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.last_dropped_fraction: torch.Tensor | None = None
        # Global token counts since the last update_expert_bias (training forwards only).
        self.load_since_update: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        route = self.gate(flat)
        weights = route.weights
        if self.capacity_factor:
            rows = shape[:-1] if len(shape) > 2 else (1, shape[0])  # [T, H] input: one row of tokens
            experts = route.experts.view(*rows, -1)
            keep = capacity_mask(experts, self.num_experts, self.capacity_factor, self.capacity_ranker).view_as(weights)
            if not _Replay.active:
                self.last_dropped_fraction = 1.0 - keep.float().mean().detach()
            weights = weights * keep.to(weights.dtype)
        # The shared expert sees the input's own [B, S, H] shape, so tensor parallelism can treat it as a dense MLP.
        shared = (lambda: self._shared(x).reshape(flat.shape)) if self.shared_expert is not None else None
        out = self.experts(flat, weights, route.experts, shared)
        reg = self._router_losses(route)
        if self.training and torch.is_grad_enabled() and (self.aux_loss_scale or self.z_loss_scale):
            out = _AttachAuxLoss.apply(out, reg)
        return out.view(shape)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _router_losses(self, route: Routing) -> torch.Tensor:
        """Weighted aux + z loss whose gradient is exact for this rank's tokens once gradients are
        summed over ranks; also records the global statistics for logging.

        With a reducer, f (counts), P and the token count are global; only the local probabilities
        and logits carry gradient, and d loss / d local probs is the same as for the global loss
        (the z-loss is a sum over tokens divided by the global count, so the same holds).
        """
        e = self.num_experts
        counts = count_ids(route.experts.flatten(), e)
        prob_sums = route.probs.sum(dim=0)
        z_sum = torch.logsumexp(route.logits, dim=-1).square().sum() if self.z_loss_scale else prob_sums.new_zeros(())
        local = torch.cat(
            [
                counts.double(),
                prob_sums.detach().double(),
                z_sum.detach().double().view(1),
                prob_sums.new_full((1,), route.probs.shape[0], dtype=torch.float64),
            ]
        )
        total = self.stats_reducer(local) if self.stats_reducer is not None else local
        g_counts, g_sums, g_z, tokens = total[:e].float(), total[e : 2 * e].float(), total[2 * e], total[2 * e + 1]
        tokens = tokens.float()
        if not _Replay.active:
            self._record(
                total[:e].long(),
                load_balancing_loss(g_counts, g_sums, tokens),
                (g_z.float() / tokens) if self.z_loss_scale else None,
            )
        aux = load_balancing_loss(g_counts, prob_sums, tokens)
        return (self.aux_loss_scale * aux + self.z_loss_scale * z_sum / tokens) / self.microbatches

    def _record(self, tokens_per_expert: torch.Tensor, aux_loss: torch.Tensor, z_loss: torch.Tensor | None) -> None:
        self.last_tokens_per_expert, self.last_aux_loss, self.last_z_loss = tokens_per_expert, aux_loss, z_loss
        if self.bias_rate and self.training:
            load = self.load_since_update
            self.load_since_update = tokens_per_expert if load is None else load + tokens_per_expert

    @torch.no_grad()
    def update_expert_bias(self, skip: torch.Tensor | None = None) -> None:
        """DeepSeek-V3 bias step: under-loaded experts become more likely to be chosen, over-loaded less.

        ``skip``: a device flag (non-zero: the optimizer skipped this step), read on the device so a
        skipped step leaves the bias as it was without a host sync; its load is discarded either way.
        """
        if self.gate.expert_bias is None or self.load_since_update is None:
            return
        load = self.load_since_update.float()
        step = torch.sign(load.mean() - load) * self.bias_rate
        if skip is not None:
            step = torch.where(skip.bool(), torch.zeros_like(step), step)
        self.gate.expert_bias.add_(step)
        self.load_since_update = None


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def update_expert_bias(model: nn.Module, skip: torch.Tensor | None = None) -> None:
    """Call after each optimizer step when ``moe_aux_free_bias_rate`` > 0 (no-op otherwise); ``skip``
    as in :meth:`MoE.update_expert_bias`.

    Every rank must see the same (global) counts to keep the biases identical: expert and data
    parallelism install a global ``stats_reducer``.
    """
    for m in moe_layers(model):
        m.update_expert_bias(skip)


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Mean over MoE layers of the last forward's load-balancing loss (for logging and parity)."""
    losses = [m.last_aux_loss for m in moe_layers(model) if m.last_aux_loss is not None]
    return torch.stack(losses).mean() if losses else None
