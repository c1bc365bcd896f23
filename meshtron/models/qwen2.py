"""Qwen2.5 decoder (dense or Qwen2-MoE) as a plain PyTorch module.

No parallel code lives here; the parallel modules rely on a few structural facts instead (layers keyed by global
index, heads read from tensor shapes, ``core_attention`` the one place that mixes positions, the experts their
own submodule). Keep them and most parallel code applies as it is. See docs/extending.md, 'A new native model'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig
from meshtron.models.chunked_loss import DEFAULT_CHUNK_TOKENS, linear_cross_entropy_sum
from meshtron.models.counter_rng import normal_slice_, tensor_key
from meshtron.models.layers import MLP, RMSNorm, RotaryEmbedding, apply_rotary, document_causal_mask
from meshtron.models.moe import MoE


class CausalAttention(nn.Module):
    """Causal softmax attention over the local sequence. q: [B, H, S, D]; k, v: [B, Hkv, S, D].

    ``documents`` (the packed positions ``[B, S]``, restarting at 0 at every document) adds a
    block-diagonal mask so that no token attends across a document boundary.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        if documents is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        index = torch.arange(q.shape[2], device=q.device)
        mask = document_causal_mask(documents, index, index).unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.head_size
        self.head_dim = d
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, cfg.hidden_size, bias=False)
        self.core_attention = CausalAttention()

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        bsz, seq = x.shape[:2]
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        # Without documents the call stays (q, k, v), the signature every core_attention accepts.
        out = self.core_attention(q, k, v) if documents is None else self.core_attention(q, k, v, documents)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, documents=documents)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPBlock(Block):
    """One multi-token prediction module (DeepSeek-V3's MTP): the previous depth's hidden states and the
    embedding of the token this depth looks ahead to, each normalized (``hnorm``, ``enorm``), joined by
    ``eh_proj`` into one decoder block; returns the block's output (the next depth's input) and that output
    under the module's own final ``norm`` (the shared LM head's input)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        embedded: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        documents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        out = super().forward(x, rope, documents)
        return out, self.norm(out)


class LMHead(nn.Linear):
    """Output projection. ``forward(h)`` gives logits; ``forward(h, labels)`` gives the summed token
    cross-entropy computed ``chunk_tokens`` tokens at a time, so training never holds the logits of a
    whole micro-batch (:func:`meshtron.models.chunked_loss.linear_cross_entropy_sum`)."""

    def __init__(self, hidden_size: int, vocab_size: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        super().__init__(hidden_size, vocab_size, bias=False)
        self.chunk_tokens = chunk_tokens

    def forward(
        self, h: torch.Tensor, labels: torch.Tensor | None = None, softcap: float | None = None
    ) -> torch.Tensor:
        """``softcap``: the loss of soft-capped logits (the caller's model caps them; ``h`` alone gives raw logits)."""
        if labels is None:
            return super().forward(h)
        return linear_cross_entropy_sum(h, self.weight, labels, self.chunk_tokens, softcap=softcap)


class Transformer(nn.Module):
    """Qwen2 causal LM. ``forward(tokens, position_ids)`` returns logits, ``forward(tokens,
    position_ids, labels=labels)`` the summed token loss without materialising the logits (training);
    a pipeline stage without ``lm_head`` returns hidden states and takes them instead of token ids.

    ``document_mask`` (off by default): ``position_ids`` are packed positions that restart at 0 at
    every document, and attention never crosses a document (transformers' packed-sequence rule).

    With ``num_nextn_predict_layers`` the :class:`MTPBlock` modules follow the decoder layers in ``layers``
    (keys ``num_hidden_layers + k - 1``, DeepSeek-V3's layout); given ``mtp_tokens`` and ``mtp_labels``
    the training forward returns the summed losses ``[next-token, depth 1, ...]``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.document_mask = False
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_size, cfg.rope_theta)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_hidden_layers)})
        self.layers.update({str(i): MTPBlock(cfg, i) for i in cfg.mtp_layers})
        self.norm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: LMHead | None = LMHead(cfg.hidden_size, cfg.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config ties them.

        Call again after ``to_empty``/``load_state_dict(assign=True)``: both replace parameters
        module by module and silently untie them.
        """
        if self.config.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        layers: range | None = None,
        labels: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``layers`` runs only that range of global layer indices (a pipeline chunk): the embedding
        applies when it starts at layer 0, the final norm and LM head when it ends at the last layer.
        ``labels`` (next-token ids, -100 ignored): return the summed token loss instead of logits.
        ``mtp_tokens`` / ``mtp_labels`` (``[B, S, depth]``, from :func:`meshtron.models.mtp.tokens_ahead`): the
        MTP modules' inputs and targets; the losses come back stacked, the next-token loss first."""
        cfg = self.config
        first = layers is None or layers.start == 0
        last = layers is None or layers.stop == cfg.num_hidden_layers
        # Without ``layers``, the decoder layers this model holds (all, or a pruned stage's), not the MTP modules.
        keys = map(str, layers) if layers is not None else (k for k in self.layers if int(k) < cfg.num_hidden_layers)
        h = self.embed_tokens(tokens) if self.embed_tokens is not None and first else tokens
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        rope = self.rotary(position_ids, h.dtype)
        documents = position_ids if self.document_mask else None
        for key in keys:
            h = self.layers[key](h, rope, documents)
        if not last:
            return h
        out = self.norm(h) if self.norm is not None else h
        if self.lm_head is None:
            return out
        loss = self.lm_head(out, labels)
        if mtp_labels is None or labels is None:
            return loss
        losses = [loss]
        for k, key in enumerate(map(str, cfg.mtp_layers)):
            h, out = self.layers[key](h, self.embed_tokens(mtp_tokens[..., k]), rope, documents)
            losses.append(self.lm_head(out, mtp_labels[..., k]))
        return torch.stack(losses)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic initialisation: every element a function of (seed, parameter name, its index).

        Because a value depends only on its name and position, a sharded model whose ranks fill just
        their own slices (:meth:`InitialWeights.fill_`) gets exactly the single-process weights,
        whatever the layout.
        """
        init = InitialWeights(self.config, seed)
        for name, tensor in self.state_dict(keep_vars=True).items():
            init.fill_(name, tensor, (0,) * tensor.ndim)


class InitialWeights:
    """The initial weights by name: normal(0, initializer_range) matrices, ones for norms, zeros for
    biases and buffers (the MoE expert bias).

    Nothing is stored: :meth:`fill_` computes any block of a tensor on the block's own device
    (``counter_rng``), so a sharded model is filled slice by slice without any rank holding a full
    tensor; ``init[name]`` gives a full tensor on the CPU (for ``load_full_state_dict``).
    """

    def __init__(self, cfg: ModelConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        with torch.device("meta"):
            model = Transformer(cfg)
        self.shapes = {name: t.shape for name, t in model.state_dict(keep_vars=True).items()}
        self.buffers = {name for name, _ in model.named_buffers()}

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        return self.fill_(name, torch.empty(shape), (0,) * len(shape))

    def fill_(self, name: str, out: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
        """Fill ``out`` with the block of parameter (or buffer) ``name`` that starts at ``offsets``."""
        if self.cfg.tie_word_embeddings and name == "lm_head.weight":
            name = "embed_tokens.weight"
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return out.fill_(1.0)
        if name.endswith(".bias") or name in self.buffers:
            return out.zero_()
        return normal_slice_(out, tensor_key(self.seed, name), shape, offsets, self.cfg.initializer_range)


def build_model(cfg: ModelConfig) -> Transformer:
    """Build the model on the current default device (use ``with torch.device("meta"):`` for big shapes)."""
    return Transformer(cfg)


def materialize(model: Transformer, device: torch.device | str, seed: int = 0) -> Transformer:
    """Allocate a meta-device (unparallelized) model on ``device``, re-tie embeddings and initialise it."""
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum of next-token cross-entropies (labels already shifted); -100 marks ignored positions.

    The caller divides by the global number of counted tokens, so the loss does not depend on how
    the batch is split over ranks or micro-batches.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index, reduction="sum")


def count_parameters(model: nn.Module) -> int:
    """Parameters counted once each (tied embeddings count once)."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (6 * active matmul params + causal attention), for MFU reports; each multi-token
    prediction module adds a block, its ``eh_proj`` and a pass through the shared LM head."""
    d, h, kv = cfg.head_size, cfg.num_attention_heads, cfg.kv_heads
    attn_params = cfg.hidden_size * d * (2 * h + 2 * kv)
    depth = cfg.num_nextn_predict_layers
    blocks = [*range(cfg.num_hidden_layers), *cfg.mtp_layers]
    per_layer = []
    for i in blocks:
        if cfg.is_moe_layer(i):
            mlp = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
            mlp += 3 * cfg.hidden_size * cfg.shared_expert_intermediate_size + cfg.hidden_size * cfg.num_experts
        else:
            mlp = 3 * cfg.hidden_size * cfg.intermediate_size
        per_layer.append(attn_params + mlp)
    heads = (1 + depth) * cfg.hidden_size * cfg.vocab_size
    matmul_params = sum(per_layer) + depth * 2 * cfg.hidden_size**2 + heads
    # Causal attention: QK^T and AV, each 2 * S * d per head per token, halved by the mask, x3 for fwd+bwd.
    attention = 3 * 2 * 2 * h * d * seq_len / 2 * len(blocks)
    return 6 * matmul_params + attention


__all__ = [
    "Transformer",
    "InitialWeights",
    "build_model",
    "materialize",
    "token_loss_sum",
    "count_parameters",
    "flops_per_token",
    "RMSNorm",
    "Attention",
    "CausalAttention",
    "MLP",
    "Block",
    "MTPBlock",
    "LMHead",
]
