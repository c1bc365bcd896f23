"""Name and layout conversion between meshtron and transformers' Qwen2 / Qwen2-MoE state dicts.

Keys map by the ``model.`` prefix except the routed experts, which meshtron stacks ``[experts, in, out]`` (what
grouped_mm multiplies) and checkpoints hold per expert (``published``) or fused (transformers 5 in memory).
Conversions are transposes, concatenations and splits, so round trips are bit-exact; a trained router bias has
no transformers counterpart and is refused on export. See docs/hf.md, 'meshtron's own models and HF checkpoints'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from meshtron.config import ConfigError, ModelConfig

_EXPERT_KEY = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_BIAS = "mlp.gate.expert_bias"


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def layer_of(name: str) -> int | None:
    """The decoder layer index of a meshtron parameter name (``layers.<i>.…``), else None."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def _meshtron_name(name: str) -> str:
    return name.removeprefix("model.")


def to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, layout: str = "published") -> dict[str, torch.Tensor]:
    """meshtron state dict -> transformers names (``layout``: ``published`` or ``fused``)."""
    if layout not in ("published", "fused"):
        raise ValueError(f"layout must be 'published' or 'fused', got '{layout}'")
    out: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # transformers re-ties lm_head to the embedding on load
        if name.endswith(_EXPERT_BIAS):
            _check_bias_exportable(name, tensor, cfg)
            continue
        prefix, _, proj = name.rpartition(".")
        if prefix.endswith("mlp.experts") and proj in _PROJECTIONS:
            stacked.setdefault(prefix, {})[proj] = tensor
        else:
            out[hf_name(name)] = tensor
    for prefix, w in stacked.items():
        if layout == "published":
            for proj, tensor in w.items():
                for e in range(tensor.shape[0]):
                    out[hf_name(f"{prefix}.{e}.{proj}.weight")] = tensor[e].t().contiguous()
        else:
            gate_up = torch.cat([w["gate_proj"], w["up_proj"]], dim=2)
            out[hf_name(f"{prefix}.gate_up_proj")] = gate_up.transpose(1, 2).contiguous()
            out[hf_name(f"{prefix}.down_proj")] = w["down_proj"].transpose(1, 2).contiguous()
    return out


def _check_bias_exportable(name: str, bias: torch.Tensor, cfg: ModelConfig) -> None:
    if bias.abs().max() > 0:
        raise ConfigError(
            f"HF export: '{name}' is a trained router bias ([model] moe_aux_free_bias_rate = "
            f"{cfg.moe_aux_free_bias_rate}), but transformers' Qwen2-MoE router has no expert bias, so the "
            "exported model would route tokens differently. Keep the meshtron checkpoint ([checkpoint]) for "
            "this model, or train with [model] moe_aux_free_bias_rate = 0 to export it to HF."
        )


def from_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers state dict (either expert layout) -> meshtron names and layouts."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for hf_name, tensor in state.items():
        name = _meshtron_name(hf_name)
        if name.endswith("rotary_emb.inv_freq"):
            continue  # older checkpoints store the RoPE table; it is recomputed from rope_theta
        match = _EXPERT_KEY.match(name)
        if match:
            prefix, index, proj = match.groups()
            per_expert.setdefault(prefix, {}).setdefault(proj, {})[int(index)] = tensor
        elif name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            gate, up = tensor.transpose(1, 2).chunk(2, dim=2)
            out[f"{prefix}.gate_proj"], out[f"{prefix}.up_proj"] = gate.contiguous(), up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            out[name] = tensor.transpose(1, 2).contiguous()
        else:
            out[name] = tensor
    for prefix, projections in per_expert.items():
        for proj, experts in projections.items():
            missing = sorted(set(range(cfg.num_experts)) - set(experts))
            if missing:
                raise KeyError(
                    f"checkpoint lacks {prefix}.{missing[0]}.{proj}.weight (and {len(missing) - 1} more experts)"
                )
            out[f"{prefix}.{proj}"] = torch.stack([experts[e].t() for e in range(cfg.num_experts)])
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def model_config_from_hf(hf: Mapping) -> ModelConfig:
    """ModelConfig from a transformers ``config.json`` mapping (Qwen2 or Qwen2-MoE).

    Keys meshtron does not model (generation and inference metadata) are ignored.
    """
    if hf.get("use_sliding_window"):
        raise ValueError("config.json has use_sliding_window = true; meshtron trains full attention only")
    fields = set(ModelConfig.__dataclass_fields__)
    values = {k: v for k, v in hf.items() if k in fields and v is not None}
    rope = hf.get("rope_parameters") or {}
    if "rope_theta" in rope:
        values["rope_theta"] = float(rope["rope_theta"])
    if hf.get("model_type") == "qwen2_moe" or "qkv_bias" in hf:
        values["attention_bias"] = bool(hf.get("qkv_bias", True))
    return ModelConfig(**values)


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A transformers ``config.json`` for ``cfg`` (Qwen2ForCausalLM or Qwen2MoeForCausalLM)."""
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act,
        "initializer_range": cfg.initializer_range,
        "use_sliding_window": False,
        "torch_dtype": "float32",
    }
    if cfg.head_dim:
        common["head_dim"] = cfg.head_dim
    if not cfg.is_moe:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common}
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        **common,
        "qkv_bias": cfg.attention_bias,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }
