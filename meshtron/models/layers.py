"""Building blocks shared by the dense and MoE decoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like transformers so bf16 runs match its numerics.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions; nothing stored, so meta-device models need no fix-up."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, device=position_ids.device, dtype=torch.float64)
        inv_freq = (1.0 / self.theta ** (exponents / self.head_dim)).float()
        freqs = position_ids.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def document_causal_mask(positions: torch.Tensor, query_index: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
    """Visibility ``[B, Sq, Sk]`` (True: attend) of packed documents under a causal mask.

    ``positions`` ``[B, Sq]`` are the queries' positions inside their documents (restarting at 0
    at every document, as transformers' packed ``position_ids``); ``query_index`` ``[Sq]`` and
    ``key_index`` ``[Sk]`` are the tokens' indices in the packed window. A query at index ``i`` with
    position ``p`` belongs to the document that starts at ``i - p``, so it sees keys ``i - p .. i``.
    """
    start = (query_index - positions).unsqueeze(-1)
    key, query = key_index.view(1, 1, -1), query_index.view(1, -1, 1)
    return (key <= query) & (key >= start)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, D]; cos/sin: [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
