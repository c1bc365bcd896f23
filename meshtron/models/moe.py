"""Qwen2-MoE block: softmax top-k router, grouped-GEMM routed experts, gated shared expert.

The load-balancing loss follows the Switch Transformer (per layer, E * sum_e f_e * P_e with f_e the
share of top-k assignments and P_e the mean router probability), with transformers' normalisation
(f_e = assignments_e / tokens, so sum_e f_e = top_k) so ``router_aux_loss_coef`` keeps its meaning.
transformers pools f and P over all layers before multiplying; we keep Switch's per-layer loss and
average it over MoE layers. That equals transformers for one MoE layer and, unlike pooling, lets a
pipeline stage own its layers' losses. The aux loss enters training through its gradient
(:class:`_AttachAuxLoss`), so neither the model output nor a pipeline schedule has to carry it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig
from meshtron.models.layers import MLP

# (counts[E], prob_sums[E], tokens[]) -> the same summed over every rank that holds other tokens.
StatsReducer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (probs [T, E] fp32, top-k weights [T, k] in x's dtype, top-k expert ids [T, k])."""
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), experts


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


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    """SwiGLU experts on tokens already sorted by expert: ``counts[g]`` rows go to expert g."""
    h = F.silu(grouped_matmul(x, gate, counts)) * grouped_matmul(x, up, counts)
    return grouped_matmul(h, down, counts)


def permute_tokens(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """Copy each token once per chosen expert and sort the copies by expert.

    Returns (sorted copies [T*k, H], order [T*k] mapping sorted position -> flat (token, slot),
    counts [E]).
    """
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return x[order // experts.shape[1]], order, counts


def unpermute_tokens(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_tokens`, combining each token's k expert outputs with its weights."""
    tokens, k = weights.shape
    unsorted = torch.empty_like(y).index_copy(0, order, y)
    return (unsorted.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


class GroupedExperts(nn.Module):
    """All routed experts as stacked weights ([E, in, out], the layout grouped_mm multiplies)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.gate_proj = nn.Parameter(torch.empty(e, h, i))
        self.up_proj = nn.Parameter(torch.empty(e, h, i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        sorted_x, order, counts = permute_tokens(x, experts, self.num_experts)
        y = grouped_swiglu(sorted_x, counts, self.gate_proj, self.up_proj, self.down_proj)
        return unpermute_tokens(y, order, weights)


class _AttachAuxLoss(torch.autograd.Function):
    """Returns ``out`` unchanged; in backward also sends ``scale`` as the gradient of ``aux``."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


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
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        # Gradient weight of this layer's aux loss; training divides it by the micro-batch count.
        self.aux_loss_scale = cfg.router_aux_loss_coef / max(moe_layers, 1)
        # Set by data/expert parallelism so f and P cover the global batch, not this rank's slice.
        self.stats_reducer: StatsReducer | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, weights, experts = self.gate(flat)
        out = self.experts(flat, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        aux = self._aux_loss(probs, experts)
        if self.training and torch.is_grad_enabled() and self.aux_loss_scale:
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_scale)
        return out.view(shape)

    def _aux_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Aux loss whose gradient is exact for this rank's tokens once gradients are summed over ranks.

        With a reducer, f (counts) and P are global; only the local probabilities carry gradient, and
        d loss / d local probs is the same as for the global loss.
        """
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        prob_sums = probs.sum(dim=0)
        tokens = torch.tensor(float(probs.shape[0]), device=probs.device)
        if self.stats_reducer is not None:
            counts, global_sums, tokens = self.stats_reducer(counts, prob_sums.detach(), tokens)
        else:
            global_sums = prob_sums.detach()
        self.last_tokens_per_expert = counts.detach()
        self.last_aux_loss = load_balancing_loss(counts, global_sums, tokens).detach()
        return load_balancing_loss(counts, prob_sums, tokens)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Mean over MoE layers of the last forward's load-balancing loss (for logging and parity)."""
    losses = [m.last_aux_loss for m in moe_layers(model) if m.last_aux_loss is not None]
    return torch.stack(losses).mean() if losses else None
