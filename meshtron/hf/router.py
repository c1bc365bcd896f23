"""transformers' MoE load-balancing loss (``output_router_logits``) counted over ranks and pipeline stages.

transformers pools the router statistics of all MoE layers before multiplying them, so one layer's aux gradient
needs every layer's counts. Without a pipeline :func:`aux_loss_share` sums this rank's statistics over the data
ranks; under pp :class:`PipelineRouterLoss` relays the running totals with the boundary tensors, forward and
back. See docs/hf.md, 'cp and pp for HF models'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config import ConfigError
from meshtron.models.moe import load_balancing_loss
from meshtron.parallel.expert import router_stats_reducer
from meshtron.parallel.pipeline.schedules import RECV_F, SEND_F


def router_statistics(
    router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k counts [E], summed router probabilities [E], routed rows [1]) of ``router_logits`` (one
    [rows, E] tensor per MoE layer), pooled over the layers as transformers does; rows weighted by
    ``mask`` (the attention mask) when given. Only the probability sums carry gradient."""
    experts = router_logits[0].shape[-1]
    counts = router_logits[0].new_zeros(experts, dtype=torch.float32)
    prob_sums = torch.zeros_like(counts)
    rows = torch.zeros_like(counts[:1])
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        weight = probs.new_ones(probs.shape[0]) if mask is None else mask.reshape(-1).to(probs)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = counts.index_add(0, chosen.flatten(), weight.repeat_interleave(top_k))
        prob_sums = prob_sums + (probs * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    return counts, prob_sums, rows


def aux_loss_share(router_logits: Sequence[torch.Tensor], top_k: int, mask: torch.Tensor | None, group) -> torch.Tensor:
    """This rank's term of transformers' load-balancing loss over the global batch (no pipeline): counts
    and rows summed over ``group`` as the native MoE sums its statistics
    (:func:`~meshtron.parallel.expert.router_stats_reducer`); the local probabilities carry the
    gradient, so the terms add up over ranks to the global loss, and so do their gradients."""
    counts, prob_sums, rows = router_statistics(router_logits, top_k, mask)
    totals = router_stats_reducer(group)(torch.cat([counts, rows]))
    return load_balancing_loss(totals[:-1], prob_sums, totals[-1])


def router_modules(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(module, output index) of every router whose logits transformers collects for the aux loss: the
    modules its ``_can_record_outputs["router_logits"]`` names (a class, or an ``OutputRecorder``
    with a class, a class-name suffix or a module name)."""
    spec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        return []
    target = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
    suffix, layer, index = (getattr(spec, key, None) for key in ("class_name", "layer_name", "index"))

    def named(name: str, module: nn.Module) -> bool:
        return (
            (target is None or isinstance(module, target))
            and (not suffix or type(module).__name__.endswith(suffix))
            and (not layer or layer in name)
        )

    if target is None and not suffix and not layer:
        return []
    return [(module, index or 0) for name, module in model.named_modules() if named(name, module)]


class _AttachRouterGrad(torch.autograd.Function):
    """Returns ``out`` unchanged; in backward also sends ``weight()`` (read then: the micro-batch's
    totals arrive with the output gradient) to the chunk's router probability sums."""

    @staticmethod
    def forward(ctx, out, prob_sums, weight: Callable[[], torch.Tensor]):
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, ctx.weight(), None


class PipelineRouterLoss:
    """transformers' aux loss of a pipelined MoE model, once per micro-batch as its causal LM adds it
    (module doc); the :class:`~meshtron.parallel.pipeline.executor.Relay` of the pipeline's executor.

    Messages are float64 ``[counts (E), probability sums (E), rows]``, global over ``data_group``:
    forward, the sum over this and the earlier stages; backward, the micro-batch's totals.
    """

    def __init__(self, model: nn.Module, data_group, device: torch.device):
        self.experts, self.top_k = model.num_experts, model.num_experts_per_tok
        self.coef = float(model.router_aux_loss_coef)
        self.data_group, self.device = data_group, device
        self.shape, self.dtype = (2 * self.experts + 1,), torch.float64
        self._logits: list[torch.Tensor] | None = None  # set while a training chunk forward records
        for module, index in router_modules(model):
            module.register_forward_hook(self._hook(index))
        self.start()

    def _hook(self, index: int):
        def record(_module, _args, out):
            # Only inside a training chunk forward: not in evaluation, nor in activation
            # checkpointing's recomputation during backward (its counts were taken in forward).
            if self._logits is not None:
                self._logits.append(out[index] if isinstance(out, (tuple, list)) else out)

        return record

    def start(self) -> None:
        """Forget the last step's statistics (before each step's run)."""
        self._sums: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb) -> through that stage
        self._totals: dict[int, torch.Tensor] = {}  # mb -> every stage's

    @contextmanager
    def recording(self):
        """Collects the router logits of the forward run inside (one chunk's MoE layers)."""
        self._logits = []
        try:
            yield self._logits
        finally:
            self._logits = None

    def attach(self, out: torch.Tensor, logits: list[torch.Tensor], stage: int, mb: int, last: bool) -> torch.Tensor:
        """``out`` of chunk ``stage`` on micro-batch ``mb``, carrying the gradient of the aux loss
        w.r.t. the chunk's routers; its statistics join the ones the earlier stages sent."""
        before = self._sums.pop((stage, mb), None)
        total = before if before is not None else torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        prob_sums = None
        if logits:
            counts, prob_sums, rows = router_statistics(logits, self.top_k)
            mine = torch.cat([counts, prob_sums.detach(), rows]).to(self.dtype)
            dist.all_reduce(mine, group=self.data_group)  # identical tokens over tp: not summed there
            total = total + mine
        if last:
            self._totals[mb] = total
        else:
            self._sums[(stage, mb)] = total
        if prob_sums is None:
            return out
        return _AttachRouterGrad.apply(out, prob_sums, lambda: self._gradient(mb))

    def _gradient(self, mb: int) -> torch.Tensor:
        """d (coef x aux) / d (this rank's probability sums) = coef * E * f / R^2, from the totals."""
        totals = self._totals[mb].float()
        counts, rows = totals[: self.experts], totals[-1]
        return self.coef * self.experts * (counts / rows) / rows

    def message(self, kind: str, stage: int, mb: int) -> torch.Tensor:
        return self._sums.pop((stage, mb)) if kind == SEND_F else self._totals[mb]

    def arrived(self, kind: str, stage: int, mb: int, message: torch.Tensor) -> None:
        if kind == RECV_F:
            self._sums[(stage, mb)] = message
        else:
            self._totals[mb] = message

    def step_loss(self) -> torch.Tensor:
        """``coef`` x the sum over the step's micro-batches of their aux losses (on every rank: each
        has every micro-batch's totals after the run)."""
        total = torch.zeros((), device=self.device)
        for mb in sorted(self._totals):
            totals = self._totals[mb].float()
            e = self.experts
            total = total + load_balancing_loss(totals[:e], totals[e : 2 * e], totals[-1])
        return self.coef * total


def check_router_loss(model: nn.Module) -> None:
    """``output_router_logits`` under pp needs what :class:`PipelineRouterLoss` reads from the model."""
    missing = [a for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef") if not hasattr(model, a)]
    if missing or not router_modules(model):
        what = f"attributes {missing}" if missing else "routers named by _can_record_outputs['router_logits']"
        raise ConfigError(
            f"parallelize_hf_model: pp > 1 with config.output_router_logits needs {type(model).__name__}'s "
            f"{what}; it has none. Set output_router_logits = false or use pp = 1."
        )


__all__ = ["PipelineRouterLoss", "aux_loss_share", "check_router_loss", "router_modules", "router_statistics"]
