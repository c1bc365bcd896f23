"""transformers' fused MoE experts run by meshtron's expert parallelism (all-to-all dispatch, grouped_mm).

One :class:`FusedExpertParallel` subclass per recognised layout (recognised from transformers' layout
attributes, the weights' ranks and the activation, never the class name), and
:func:`apply_hf_expert_parallel`, which swaps them in keeping transformers' parameter names and shapes.
See docs/hf.md ('The fused expert classes').
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.config import ConfigError
from meshtron.hf.discover import hf_parts
from meshtron.mesh import expert_meshes, expert_split
from meshtron.models.moe import grouped_swiglu
from meshtron.parallel.expert import ExpertDispatch, check_expert_divisible
from meshtron.parallel.float8 import fits_fp8, grouped_matmul_for
from meshtron.torch_private import CONV_BASE

_FUSED = ("gate_up_proj", "down_proj")
_FUSED_BIASED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_EP_STYLES = ("ep_dispatch_experts", "grouped_gemm")


def clamped_glu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation on interleaved [gate0, up0, gate1, up1, ...] columns: both halves clamped
    (the gate from above only), ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def swiglu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' default activation of concatenated [gate; up] columns: ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gate_matches(experts: nn.Module, gate: Callable[[torch.Tensor], torch.Tensor] | None) -> bool:
    """Whether the module's own ``_apply_gate`` agrees with ``gate`` on probe values, small and large
    (beyond any clamp limit): the layout attributes alone do not name the activation."""
    probe = torch.cat([torch.linspace(-3.0, 3.0, 24), torch.linspace(-300.0, 300.0, 24)]).view(4, 12)
    apply_gate = getattr(experts, "_apply_gate", None)
    if gate is None or apply_gate is None:
        return False
    with torch.no_grad():
        theirs = apply_gate(probe)
    return theirs.shape == (4, 6) and torch.allclose(theirs, gate(probe))


def _shapes(experts: nn.Module, names: tuple[str, ...]) -> dict[str, tuple | None]:
    return {n: tuple(t.shape) if isinstance(t := getattr(experts, n, None), torch.Tensor) else None for n in names}


class FusedExpertParallel(ExpertDispatch):
    """Drop-in for a transformers fused experts module (forward(hidden_states, top_k_index, top_k_weights))
    in the SwiGLU layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I], no biases."""

    # The attributes transformers' ``use_experts_implementation`` sets, as this class computes them.
    LAYOUT: ClassVar[dict[str, bool]] = {
        "has_gate": True,
        "is_concatenated": True,
        "is_transposed": False,
        "has_bias": False,
        "has_post_expert_norm": False,
    }
    PARAMS = _FUSED
    DESCRIPTION = "SiLU-gated experts with gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I], no biases"

    # Whether the routing weights scale the experts' inputs (the dispatch's ``scale_inputs``).
    SCALE_INPUTS: ClassVar[bool] = False

    def __init__(self, experts: nn.Module, mesh: DeviceMesh, tp_mesh: DeviceMesh):
        super().__init__(experts.num_experts, mesh, tp_mesh, split_tokens_over_tp=True, scale_inputs=self.SCALE_INPUTS)
        for name in self.PARAMS:
            setattr(self, name, self.own(getattr(experts, name)))

    @classmethod
    def computes(cls, experts: nn.Module) -> bool:
        """Whether ``experts`` (real or meta weights) are in the layout this class computes: the layout
        attributes, the weights' ranks and the activation."""
        flags = all(getattr(experts, k, "missing") == v for k, v in cls.LAYOUT.items())
        dims = [len(s) if s else None for s in _shapes(experts, cls.PARAMS).values()]
        ranks = dims == [3 if n.endswith("proj") else 2 for n in cls.PARAMS]
        return flags and ranks and _gate_matches(experts, cls.gate_of(experts))

    @staticmethod
    def gate_of(experts: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The activation this class applies to ``experts``' gate_up output (None: it has none)."""
        return swiglu_gate

    def local_weights(self) -> tuple[torch.Tensor, ...]:
        gate, up = self.local(self.gate_up_proj).transpose(1, 2).chunk(2, dim=2)
        return gate, up, self.local(self.down_proj).transpose(1, 2)

    @classmethod
    def dims(cls, experts: nn.Module) -> tuple[int, int]:
        """(hidden, intermediate) of ``experts`` (transformers' module or this one, logical shapes): the K and N
        of the gate and up GEMMs, the N and K of the down one."""
        _, rows, columns = experts.down_proj.shape
        return (columns, rows) if cls.LAYOUT["is_transposed"] else (rows, columns)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self.dispatch(hidden_states, top_k_weights.to(hidden_states.dtype), top_k_index)


class TransposedExpertParallel(FusedExpertParallel):
    """The same drop-in for SiLU experts stored as grouped_mm multiplies them (Aria): gate_up_proj
    [E, H, 2I] (gate columns first), down_proj [E, I, H], no biases."""

    LAYOUT: ClassVar[dict[str, bool]] = dict(FusedExpertParallel.LAYOUT, is_transposed=True)
    DESCRIPTION = (
        "SiLU-gated experts with gate_up_proj [E, H, 2I] (gate columns first) and down_proj [E, I, H], no biases"
    )

    def local_weights(self) -> tuple[torch.Tensor, ...]:
        gate, up = self.local(self.gate_up_proj).chunk(2, dim=2)
        return gate, up, self.local(self.down_proj)


class ClampedExpertParallel(FusedExpertParallel):
    """The same drop-in for gpt-oss's layout: gate_up_proj [E, H, 2I] with interleaved gate/up columns
    and gate_up_proj_bias [E, 2I], down_proj [E, I, H] and down_proj_bias [E, H], activation
    :func:`clamped_glu` with the module's ``alpha`` and ``limit``. The weights are already the
    [E, in, out] blocks grouped_mm multiplies; the biases are split over ep like them, and each row
    gets its expert's bias."""

    LAYOUT: ClassVar[dict[str, bool]] = dict(
        FusedExpertParallel.LAYOUT, is_concatenated=False, is_transposed=True, has_bias=True
    )
    PARAMS = _FUSED_BIASED
    DESCRIPTION = (
        "clamped GLU experts (alpha, limit) with interleaved gate/up gate_up_proj [E, H, 2I], "
        "down_proj [E, I, H] and their biases (gpt-oss)"
    )

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        self.alpha, self.limit = float(experts.alpha), float(experts.limit)

    @staticmethod
    def gate_of(experts: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
        if not (isinstance(alpha, (int, float)) and isinstance(limit, (int, float))):
            return None
        return functools.partial(clamped_glu, alpha=alpha, limit=limit)

    def local_weights(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.local(getattr(self, name)) for name in self.PARAMS)

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, gate_up_bias, down, down_bias = self.local_weights()
        rows = x.shape[0]
        h = self.matmul(x, gate_up, counts) + gate_up_bias.repeat_interleave(counts, dim=0, output_size=rows)
        h = clamped_glu(h, self.alpha, self.limit)
        return self.down_matmul(h, down, counts) + down_bias.repeat_interleave(counts, dim=0, output_size=rows)


_LAYOUTS = (FusedExpertParallel, TransposedExpertParallel, ClampedExpertParallel)


class ScaledInputExpertParallel(TransposedExpertParallel):
    """Llama 4's experts: weights as Aria's (gate_up_proj [E, H, 2I] gate columns first, down_proj
    [E, I, H], SiLU), but transformers calls them on every token once per expert, each copy already
    multiplied by its router score (0 for unchosen experts), and sums the outputs. Here they get the
    router's choice from :class:`RouterScaledMoE` and the dispatch scales the copies it sends
    (``scale_inputs``), so only the chosen copies are computed."""

    SCALE_INPUTS = True
    DESCRIPTION = (
        "SiLU-gated experts with gate_up_proj [E, H, 2I] (gate columns first) and down_proj [E, I, H], "
        "called on expert-major rows [E * T, H] (Llama 4)"
    )

    @classmethod
    def computes(cls, experts: nn.Module) -> bool:
        """Whether ``experts``' own forward, run on small probe weights (its own may be on the meta device)
        and expert-major probe rows, computes what this class does."""
        shapes = _shapes(experts, _FUSED)
        if (
            any(s is None or len(s) != 3 for s in shapes.values())
            or len(inspect.signature(experts.forward).parameters) != 1
        ):
            return False
        hidden = shapes["gate_up_proj"][1]
        gen = torch.Generator().manual_seed(0)
        gate_up, down = torch.randn(2, hidden, 6, generator=gen), torch.randn(2, 3, hidden, generator=gen)
        rows = torch.randn(2 * 4, hidden, generator=gen)
        with torch.no_grad():
            theirs = torch.func.functional_call(experts, {"gate_up_proj": gate_up, "down_proj": down}, (rows,))
            ours = grouped_swiglu(rows, torch.tensor([4, 4]), *gate_up.chunk(2, dim=2), down)
        return theirs.shape == ours.shape and torch.allclose(theirs, ours, atol=1e-5)


def _pattern(plan_key: str) -> re.Pattern:
    return re.compile(re.escape(plan_key).replace(r"\*", r"\d+") + "$")


def _expert_class(name: str, experts: nn.Module) -> type[FusedExpertParallel] | str:
    """The class of :data:`_LAYOUTS` that computes ``experts``, or why none does."""
    for cls in _LAYOUTS:
        if cls.computes(experts):
            return cls
    found = {k: getattr(experts, k, "missing") for k in FusedExpertParallel.LAYOUT}
    extra = {k: getattr(experts, k) for k in ("alpha", "limit") if hasattr(experts, k)}
    return (
        f"experts '{name}' ({type(experts).__name__}) are not in a layout meshtron's expert parallelism "
        f"computes (found {found}, {extra}, {_shapes(experts, _FUSED_BIASED)}; the activation is compared through its "
        "_apply_gate); supported: " + "; ".join(cls.DESCRIPTION for cls in _LAYOUTS)
    )


# Config keys transformers families use for the number of routed experts.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _holds_stacked_experts(module: nn.Module, config) -> bool:
    """A 3-D parameter whose first dim is the config's expert count, in a model whose config has experts: a
    convolution's 3-D kernel (Qwen3-Next's linear attention, Lfm2's short convolutions) is not, nor are
    recurrent or gating weights [heads, d, d] of a model without experts."""
    if isinstance(module, CONV_BASE):
        return False
    counts = {n for key in _EXPERT_COUNT_KEYS if isinstance(n := getattr(config, key, None), int) and n > 0}
    return any(p.dim() == 3 and p.shape[0] in counts for p in module.parameters(recurse=False))


# The children a MoE block whose router scores scale its experts' inputs holds (Llama 4's).
_SCALED_BLOCK_PARTS = ("router", "experts", "shared_expert")


class _ProbeRouter(nn.Module):
    """Stands in for a router: returns fixed (scores [T, E], logits)."""

    def __init__(self, scores: torch.Tensor):
        super().__init__()
        self.scores, self.logits = scores, scores - 1

    def forward(self, _hidden):
        return self.scores, self.logits


class _ProbeExperts(nn.Module):
    """Stands in for experts called on expert-major rows [E * T, H]: expert e maps a row r to (e + 1) * r**2,
    nonlinear (scaling before or after differ) and per expert (the row order matters)."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, rows):
        factor = torch.arange(1.0, self.num_experts + 1).view(-1, 1, 1)
        return (rows.view(self.num_experts, -1, rows.shape[-1]) ** 2 * factor).view_as(rows)


class _ProbeShared(nn.Module):
    def forward(self, x):
        return 3 * x


def _scales_router_inputs(block: nn.Module) -> bool:
    """Whether ``block``'s forward feeds its experts every token once per expert, expert-major and scaled by
    that expert's router score, and returns (shared expert's output + the expert outputs summed, router
    logits), as Llama 4's MoE does: its forward run on probe values with stand-ins for its router, experts
    and shared expert (its own weights, meta ones included, are not touched)."""
    parts = {n: getattr(block, n, None) for n in _SCALED_BLOCK_PARTS}
    if not all(isinstance(m, nn.Module) for m in parts.values()) or not isinstance(getattr(block, "top_k", None), int):
        return False
    shape = _shapes(parts["experts"], _FUSED)["gate_up_proj"]
    if shape is None or len(shape) != 3:
        return False
    (experts, hidden), tokens = shape[:2], 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, hidden, generator=gen)
    scores = torch.rand(tokens, experts, generator=gen) * (torch.rand(tokens, experts, generator=gen) < 0.6)
    stand_ins = {"router": _ProbeRouter(scores), "experts": _ProbeExperts(experts), "shared_expert": _ProbeShared()}
    try:
        for name, module in stand_ins.items():
            setattr(block, name, module)
        with torch.no_grad():
            out = block.forward(x)
    finally:
        for name, module in parts.items():
            setattr(block, name, module)
    factor = (torch.arange(1.0, experts + 1) * scores**2).sum(1, keepdim=True)
    expected = 3 * x[0] + x[0] ** 2 * factor
    return (
        isinstance(out, tuple)
        and len(out) == 2
        and out[1] is stand_ins["router"].logits
        and out[0].numel() == expected.numel()
        and torch.allclose(out[0].reshape(expected.shape), expected, atol=1e-5)
    )


class RouterScaledMoE(nn.Module):
    """A MoE block whose router scores scale its experts' inputs (Llama 4's), computed through meshtron's
    dispatch: the block's own router, experts (a :class:`ScaledInputExpertParallel` by then) and shared
    expert under the same names, the experts given the router's choice instead of every token once per
    expert. Returns (output shaped like the input, router logits): under SP the output's sequence dim is
    sliced (the decoder layer views it as its residual either way)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.router, self.experts, self.shared_expert = block.router, block.experts, block.shared_expert
        self.top_k = block.top_k

    def forward(self, hidden_states: torch.Tensor):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        scores, logits = self.router(x)
        # Scores are the router's top-k sigmoids and 0 elsewhere, so their top-k are its choice: a tie can
        # only swap an expert scored 0, whose SiLU-gated output on 0 and its gradients are all 0.
        weights, chosen = scores.topk(self.top_k, dim=-1)
        out = self.shared_expert(x) + self.experts(x, chosen, weights)
        return out.view(hidden_states.shape), logits


def _router_scaled_class(model: nn.Module, name: str) -> type[FusedExpertParallel] | str:
    """For stacked experts outside the ep plan: :class:`ScaledInputExpertParallel` when their block scales
    their inputs by router score and they compute its layout, why not (a string) when only the latter
    fails; a :class:`ConfigError` when the block is not such a MoE (how to dispatch is then unknown)."""
    block_name = name.rpartition(".")[0]
    block, experts = model.get_submodule(block_name), model.get_submodule(name)
    if not _scales_router_inputs(block):
        raise ConfigError(
            f"parallelize_hf_model: '{name}' holds stacked expert weights but {type(model).__name__}'s config has no "
            f"base_model_ep_plan entry ('ep_dispatch_experts') for it, and its block '{block_name}' "
            f"({type(block).__name__}) is not a MoE whose router scores scale the experts' inputs (children "
            f"{', '.join(_SCALED_BLOCK_PARTS)} and top_k, checked on probe values), so how to dispatch its tokens is "
            "unknown. Use ep = 1 and tp = 1, or a model whose config defines base_model_ep_plan."
        )
    if ScaledInputExpertParallel.computes(experts):
        return ScaledInputExpertParallel
    return (
        f"experts '{name}' ({type(experts).__name__}) of a router-scaled MoE are not in a layout meshtron's "
        f"expert parallelism computes (found {_shapes(experts, _FUSED)}; their forward is compared on probe "
        f"values); supported: {ScaledInputExpertParallel.DESCRIPTION}"
    )


def hf_expert_modules(model: nn.Module, ep: int) -> dict[str, tuple[nn.Module, type[FusedExpertParallel]]]:
    """Full name -> (experts module, the class that computes its layout), for the modules the config's
    ``base_model_ep_plan`` marks ``ep_dispatch_experts``, checked (no communication) to be in a layout of
    :data:`_LAYOUTS` and divisible over ``ep``. Stacked 3-D expert weights outside such a plan are taken
    when their block's router scores scale their inputs (Llama 4: :class:`ScaledInputExpertParallel`,
    the block then becomes a :class:`RouterScaledMoE`, :func:`adopt_router_scaled_blocks`); otherwise
    they raise :class:`ConfigError`. Experts in another layout are refused at ep > 1; at ep = 1 they are
    left out with a warning and run as transformers' own module, whole and identical on every tp rank."""
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    # Entries outside the experts (Gemma 4's dense MLP 'colwise') say how transformers splits the rest under
    # ep; meshtron splits it by the tp plan, whatever the layout.
    unknown = {k: s for k, s in plan.items() if s not in _EP_STYLES and "experts" in k.split(".")}
    if unknown:
        key, style = next(iter(unknown.items()))
        raise ConfigError(
            f"parallelize_hf_model: ep plan style '{style}' (for '{key}') is not supported; "
            f"supported: {', '.join(_EP_STYLES)}."
        )
    decoder = hf_parts(model).decoder_path  # ep-plan patterns are relative to the decoder
    patterns = [_pattern(f"{decoder}.{k}") for k, s in plan.items() if s == "ep_dispatch_experts"]
    found = {n: m for n, m in model.named_modules() if any(p.match(n) for p in patterns)}
    stacked = {n: m for n, m in model.named_modules() if n not in found and _holds_stacked_experts(m, model.config)}
    classes = {name: _expert_class(name, experts) for name, experts in found.items()}
    classes.update({name: _router_scaled_class(model, name) for name in stacked})
    found.update(stacked)
    mismatches = {name: why for name, why in classes.items() if isinstance(why, str)}
    if mismatches and ep > 1:
        raise ConfigError(
            f"parallelize_hf_model: ep = {ep}: {next(iter(mismatches.values()))}. Use ep = 1 (those "
            "experts then run whole, replicated over tp)."
        )
    if mismatches:
        warnings.warn(
            f"parallelize_hf_model: {len(mismatches)} experts modules stay whole on every tp rank (FSDP "
            f"still shards them): {next(iter(mismatches.values()))}.",
            stacklevel=3,
        )
    for experts in found.values():
        check_expert_divisible(experts.num_experts, ep)
    return {name: (experts, classes[name]) for name, experts in found.items() if name not in mismatches}


def adopt_router_scaled_blocks(
    model: nn.Module, modules: dict[str, tuple[nn.Module, type[FusedExpertParallel]]]
) -> None:
    """The blocks of ``modules``' input-scaled experts become :class:`RouterScaledMoE` in place (same
    children), before tensor parallelism hooks its styles onto them (SP gathers a MoE block's sequence)."""
    for name, (_, cls) in modules.items():
        if cls.SCALE_INPUTS:
            block_name = name.rpartition(".")[0]
            parent, _, attr = block_name.rpartition(".")
            setattr(model.get_submodule(parent), attr, RouterScaledMoE(model.get_submodule(block_name)))


def apply_hf_expert_parallel(
    model: nn.Module, mesh: DeviceMesh, modules: dict[str, tuple[nn.Module, type[FusedExpertParallel]]]
) -> list[FusedExpertParallel]:
    """Replace ``modules`` (from :func:`hf_expert_modules`) by their :class:`FusedExpertParallel` classes over
    the experts' (ep, etp) mesh and ``mesh['tp']``, in place (meta or materialised; on a materialised
    model every rank must hold the same full weights). Returns the new modules."""
    etp = expert_split(mesh).etp
    if modules and etp > 1:
        # gate_up_proj stacks gate and up rows: an etp slice takes a block of each, which no DTensor
        # placement that checkpoints can save describes.
        raise ConfigError(
            f"parallelize_hf_model: etp = {etp} is not supported for transformers experts yet "
            "(their gate_up_proj is one stacked matrix); use etp = 1 (fold_ep works)."
        )
    replaced = []
    experts_mesh = expert_meshes(mesh).model if modules else None
    for name, (experts, cls) in modules.items():
        parent, _, attr = name.rpartition(".")
        new = cls(experts, experts_mesh, mesh["tp"])
        setattr(model.get_submodule(parent), attr, new)
        replaced.append(new)
    return replaced


def float8_experts(experts: list[FusedExpertParallel], recipe: str) -> None:
    """``[train] fp8``: the grouped GEMMs of each of ``experts`` (from :func:`apply_hf_expert_parallel`) in
    float8 (:func:`~meshtron.parallel.float8.grouped_matmul_for`, as meshtron's own experts run them) where
    its dims fit a float8 GEMM."""
    if recipe == "none":
        return
    matmul = grouped_matmul_for(recipe)
    for module in experts:
        if fits_fp8(module.dims(module), recipe):
            module.matmul = module.down_matmul = matmul


__all__ = [
    "ClampedExpertParallel",
    "FusedExpertParallel",
    "RouterScaledMoE",
    "ScaledInputExpertParallel",
    "TransposedExpertParallel",
    "adopt_router_scaled_blocks",
    "apply_hf_expert_parallel",
    "clamped_glu",
    "float8_experts",
    "hf_expert_modules",
    "swiglu_gate",
]
