"""Where a transformers causal LM keeps the pieces that pp and cp need.

A stand-in for the general discovery (``hf_parts``, same fields) of models laid out as
``model.model.{embed_tokens, layers, norm, rotary_emb}`` and ``model.lm_head``. After pipeline
pruning (:mod:`meshtron.hf.pipeline`) ``blocks`` is an ``nn.ModuleDict`` keyed by the global layer
index and the pieces another stage runs are None.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from meshtron.config import ConfigError


@dataclass
class HFParts:
    decoder: nn.Module
    blocks: nn.ModuleList | nn.ModuleDict
    blocks_path: str
    embed: nn.Module | None
    head: nn.Module | None
    norm: nn.Module | None
    rotary: nn.Module | None


def hf_parts(model: nn.Module) -> HFParts:
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
        raise ConfigError(
            f"parallelize_hf_model expects a decoder-only *ForCausalLM (model.model.layers, model.lm_head); "
            f"got {type(model).__name__}."
        )
    return HFParts(decoder, decoder.layers, "model.layers", decoder.embed_tokens, model.lm_head, decoder.norm,
                   getattr(decoder, "rotary_emb", None))


def block_list(parts: HFParts) -> list[tuple[int, nn.Module]]:
    """(global layer index, block) of every block this rank holds, in model order."""
    if isinstance(parts.blocks, nn.ModuleDict):
        return [(int(i), block) for i, block in parts.blocks.items()]
    return list(enumerate(parts.blocks))
