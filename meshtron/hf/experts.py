"""transformers' fused MoE experts run by meshtron's expert parallelism (all-to-all dispatch, grouped_mm).

transformers 5 keeps each MoE's routed experts fused in one module: ``gate_up_proj`` [E, 2I, H] (the
gate rows, then the up rows, of every expert) and ``down_proj`` [E, H, I]; the config's
``base_model_ep_plan`` marks that module ``ep_dispatch_experts`` and the two weights ``grouped_gemm``.
:func:`apply_hf_expert_parallel` replaces every such module by :class:`FusedExpertParallel`:

* same parameter names and logical shapes, so ``state_dict``, sliced loading and HF export see the
  model's own tensors; with ep > 1 each weight is a ``Shard(0)`` DTensor over ep (rank r holds
  experts ``r * E/ep`` to ``(r + 1) * E/ep - 1``), with ep = 1 it stays a plain tensor;
* tokens go through :class:`meshtron.parallel.expert.ExpertDispatch`: each tp rank takes 1/tp of the
  (tp-replicated) tokens, the all-to-all brings every token copy to the rank holding its expert, one
  grouped_mm per projection runs the local experts, and the results travel back. The local weights
  enter grouped_mm as transposed views of the fused blocks (no copies); expert gradients are summed
  over the ep group's tokens by the all-to-all backward and over tp inside the dispatch.

So with tp > 1 no rank repeats another's expert work even at ep = 1. Expert gradients still need
summing over the expert data mesh (dp x cp), which the data-parallel wrapping does.
"""

from __future__ import annotations

import re
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.config import ConfigError
from meshtron.hf.discover import hf_parts
from meshtron.parallel.expert import ExpertDispatch, check_expert_divisible

_FUSED = ("gate_up_proj", "down_proj")
# Attributes transformers' ``use_experts_implementation`` sets, with the values grouped_swiglu computes:
# concatenated [gate; up] rows, [out, in] blocks, no biases, no norm after the experts.
_LAYOUT = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
           "has_post_expert_norm": False}
_EP_STYLES = ("ep_dispatch_experts", "grouped_gemm")


class FusedExpertParallel(ExpertDispatch):
    """Drop-in for a transformers fused experts module (forward(hidden_states, top_k_index, top_k_weights))."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh):
        super().__init__(experts.num_experts, ep_mesh, tp_mesh, split_tokens_over_tp=True)
        for name in _FUSED:
            setattr(self, name, self.own(getattr(experts, name)))

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gate, up = self.local(self.gate_up_proj).transpose(1, 2).chunk(2, dim=2)
        return gate, up, self.local(self.down_proj).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self.dispatch(hidden_states, top_k_weights.to(hidden_states.dtype), top_k_index)


def _pattern(plan_key: str) -> re.Pattern:
    return re.compile(re.escape(plan_key).replace(r"\*", r"\d+") + "$")


def _layout_mismatch(name: str, experts: nn.Module) -> str | None:
    """Why ``experts`` are not in the layout :class:`FusedExpertParallel` computes, or None."""
    wrong = {k: getattr(experts, k, "missing") for k, v in _LAYOUT.items() if getattr(experts, k, "missing") != v}
    act = getattr(getattr(experts, "config", None), "hidden_act", None)
    shapes = [tuple(getattr(experts, n).shape) if isinstance(getattr(experts, n, None), torch.Tensor) else None
              for n in _FUSED]
    if wrong or act not in ("silu", "swish") or any(s is None or len(s) != 3 for s in shapes):
        return (f"experts '{name}' ({type(experts).__name__}) are not in the layout meshtron's expert parallelism "
                f"computes (found {wrong or ''} hidden_act={act!r}, {dict(zip(_FUSED, shapes))}); supported: SiLU-gated "
                "experts with gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I], no biases")
    return None


def hf_expert_modules(model: nn.Module, ep: int) -> dict[str, nn.Module]:
    """Full name -> experts module, for the modules the config's ``base_model_ep_plan`` marks
    ``ep_dispatch_experts``, checked (no communication) to be in the layout :class:`FusedExpertParallel`
    computes and divisible over ``ep``. Experts in another layout (gpt-oss: interleaved gate/up
    ``[E, H, 2I]`` with biases and a clamped activation) are refused at ep > 1; at ep = 1 they are left
    out with a warning and run as transformers' own module, whole and identical on every tp rank. A model with stacked 3-D expert weights outside such a plan
    raises :class:`ConfigError`."""
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    unknown = {k: s for k, s in plan.items() if s not in _EP_STYLES}
    if unknown:
        key, style = next(iter(unknown.items()))
        raise ConfigError(f"parallelize_hf_model: ep plan style '{style}' (for '{key}') is not supported; "
                          f"supported: {', '.join(_EP_STYLES)}.")
    decoder = hf_parts(model).decoder_path  # ep-plan patterns are relative to the decoder
    patterns = [_pattern(f"{decoder}.{k}") for k, s in plan.items() if s == "ep_dispatch_experts"]
    found = {n: m for n, m in model.named_modules() if any(p.match(n) for p in patterns)}
    stacked = [n for n, m in model.named_modules()
               if n not in found and any(p.dim() == 3 for p in m.parameters(recurse=False))]
    if stacked:
        raise ConfigError(
            f"parallelize_hf_model: '{stacked[0]}' holds stacked expert weights but {type(model).__name__}'s "
            "config has no base_model_ep_plan entry ('ep_dispatch_experts') for it, so how to dispatch its "
            "tokens is unknown. Use ep = 1 and tp = 1, or a model whose config defines base_model_ep_plan."
        )
    mismatches = {name: why for name, experts in found.items() if (why := _layout_mismatch(name, experts))}
    if mismatches and ep > 1:
        raise ConfigError(f"parallelize_hf_model: ep = {ep}: {next(iter(mismatches.values()))}. Use ep = 1 (those "
                          "experts then run whole, replicated over tp).")
    if mismatches:
        warnings.warn(f"parallelize_hf_model: {len(mismatches)} experts modules stay whole on every tp rank (FSDP "
                      f"still shards them): {next(iter(mismatches.values()))}.", stacklevel=3)
    for name, experts in found.items():
        check_expert_divisible(experts.num_experts, ep)
    return {name: experts for name, experts in found.items() if name not in mismatches}


def apply_hf_expert_parallel(model: nn.Module, mesh: DeviceMesh, modules: dict[str, nn.Module]) -> list[FusedExpertParallel]:
    """Replace ``modules`` (from :func:`hf_expert_modules`) by :class:`FusedExpertParallel` over ``mesh['ep']``
    and ``mesh['tp']``, in place (meta or materialised; on a materialised model every rank must hold the
    same full weights). Returns the new modules."""
    replaced = []
    for name, experts in modules.items():
        parent, _, attr = name.rpartition(".")
        new = FusedExpertParallel(experts, mesh["ep"], mesh["tp"])
        setattr(model.get_submodule(parent), attr, new)
        replaced.append(new)
    return replaced


__all__ = ["FusedExpertParallel", "apply_hf_expert_parallel", "hf_expert_modules"]
