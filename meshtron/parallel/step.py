"""The runner interface the trainer drives, what both runners share, and one training step.

A runner owns one rank's parallelized model and runs forward and backward of a whole global-batch step:
:class:`meshtron.parallel.runner.NoPipelineRunner` without a pipeline, :class:`meshtron.parallel.pipeline.
pipelined_runner.PipelineRunner` with one. Both split the rank's batch into the same micro-batches, divide
each micro-batch's summed token loss by the step's global token count (the same loss and gradients on every
layout) and scale the MoE router losses alike. See docs/training.md, 'The step clock and host reads'.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.checkpoint import gather_full_state_dict
from meshtron.data.sampler import IGNORE_INDEX
from meshtron.host import copy_to
from meshtron.models import moe_layers
from meshtron.models.moe import MoE
from meshtron.models.mtp import tokens_ahead
from meshtron.parallel.context import shard_batch
from meshtron.parallel.grad_norm import clip_grad_norm_


class Runner(Protocol):
    """What the trainer needs of a runner, on every layout."""

    module: nn.Module  # this rank's parallelized model (a pipeline rank: its stages); the optimizer's
    moes: list[MoE]  # the MoE layers this rank runs, found once (for expert-bias updates)

    def forward_backward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gradients of one global-batch step accumulated into ``.grad``; the global loss as a device
        scalar on every rank (reading it is the caller's one host sync). ``position_ids``: packed
        document positions (``[data] document_mask``); default ``0 .. seq_len - 1``."""

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss, counted tokens) of one global batch without gradients, as global
        device scalars on every rank; parameters, gradients and MoE statistics are left as they were."""

    def aux_loss(self) -> torch.Tensor | None:
        """The last step's MoE load-balancing loss (mean over layers and micro-batches), or None."""

    def mtp_losses(self) -> torch.Tensor | None:
        """The last step's loss of each multi-token prediction module (``[depth]``), or None without MTP."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient of the model in place; the global norm before clipping (device scalar)."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's full CPU tensors on global rank 0, None elsewhere (collective)."""


class WholeModelRunner:
    """What the runners holding the whole model on their rank share (no pipeline, meshtron's model or a
    transformers one): clipping over all its parameters and the full state dict."""

    module: nn.Module

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip in place; returns the global norm before clipping as a device scalar."""
        return clip_grad_norm_(self.parameters, max_norm)

    @functools.cached_property
    def parameters(self) -> list[nn.Parameter]:
        """The model's parameters, listed once (FSDP2 registers the same sharded Parameters again after every
        gather, as the optimizer holding them assumes): walking the modules each step is host work."""
        return list(self.module.parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return full_state_dict(self.module)


def training_step(
    runner,
    optimizer: torch.optim.Optimizer,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    max_grad_norm: float,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward, backward, clipping and the optimizer update, queued without any host sync
    (``tests/test_syncs.py`` counts them); returns the global loss and gradient norm as device scalars.

    The non-finite guard runs on the device: fused AdamW skips the whole update (and its step
    count) when ``found_inf`` is set, so a NaN/Inf step leaves parameters and optimizer state as
    they were without the host looking at the loss first.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = runner.forward_backward(input_ids, labels, position_ids)
    grad_norm = runner.clip_grad_norm(max_grad_norm)
    skip = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()
    optimizer.found_inf = copy_to(skip, _parameter_device(optimizer))  # the host's with [parallel] offload
    optimizer.step()
    for moe in runner.moes:  # aux-loss-free balancing (a no-op unless configured), skipped with the update
        moe.update_expert_bias(skip=skip)
    return loss, grad_norm


def _parameter_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """Where the optimizer's parameters (so its fused kernel) live: the host when offloaded."""
    param = optimizer.param_groups[0]["params"][0]
    return (param.to_local() if isinstance(param, DTensor) else param).device


def split_microbatches(
    input_ids: torch.Tensor, labels: torch.Tensor, mesh, micro: int, positions=None, mtp_depth: int = 0
) -> list[tuple]:
    """[(ids, labels, position_ids)] per micro-batch: this rank's cp slice of the sequence (with its
    global, or given packed-document, positions), split along the batch dimension; with ``mtp_depth``
    each also holds the MTP modules' ``[B, S, depth]`` inputs and targets (``meshtron.models.mtp``), shifted on
    the whole sequence before the cp split."""
    documents = positions
    if positions is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    batch = (input_ids, labels, positions)
    if mtp_depth:
        batch += tokens_ahead(input_ids, labels, mtp_depth, documents)
    return list(zip(*(part.chunk(micro) for part in shard_batch(batch, mesh))))


def global_token_count(micro: list, data_group) -> torch.Tensor:
    """Counted tokens of the whole step over the ranks that hold different tokens (dp x ep x cp); with MTP
    targets one count per loss, ``[next-token, depth 1, ...]``."""
    counts = torch.stack([_counted_targets(mb) for mb in micro]).sum(0).to(torch.float32)
    dist.all_reduce(counts, group=data_group)
    return counts[0] if counts.numel() == 1 else counts


def _counted_targets(mb: tuple) -> torch.Tensor:
    """A micro-batch's counted labels, then (with MTP targets, ``mb[4]``) each depth's."""
    counted = (mb[1] != IGNORE_INDEX).sum().reshape(1)
    if len(mb) == 3:
        return counted
    return torch.cat([counted, (mb[4] != IGNORE_INDEX).sum(dim=(0, 1))])


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over ``group``; backward: the gradient unchanged (each rank owns its term)."""

    @staticmethod
    def forward(ctx, value, group):
        total = value.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_over_ranks(value: torch.Tensor, group) -> torch.Tensor:
    """``value`` summed over ``group`` (a loss every rank reports whole) whose backward sends each rank's
    gradient to its own term only: gradients summed over the data ranks are then the global loss's."""
    return _SumOverRanks.apply(value, group)


def average_router_losses_over_microbatches(module: nn.Module, micro: int) -> None:
    """One router loss per micro-batch, averaged over them (idempotent: a second runner on the same
    model sets the same count)."""
    for moe in moe_layers(module):
        moe.microbatches = micro


def _full_cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's parameters on CPU, on every rank (collective over each DTensor's mesh).

    ``gather_full_state_dict`` keeps the result on global rank 0 only, which lacks the other stages.
    """
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in module.state_dict().items()
    }


def full_state_dict(module: nn.Module, pp_group=None) -> dict[str, torch.Tensor] | None:
    """The whole model as full CPU tensors on global rank 0, None elsewhere (collective over every
    DTensor's mesh; ``pp_group`` gathers the stages of rank 0's pipeline)."""
    if pp_group is None:
        state = gather_full_state_dict(module)  # collective; only rank 0 gets the tensors
        return state if dist.get_rank() == 0 else None
    state = _full_cpu_state(module)
    if 0 not in dist.get_process_group_ranks(pp_group):
        return None  # the other pipelines hold copies
    stages = [None] * dist.get_world_size(pp_group) if dist.get_rank() == 0 else None
    dist.gather_object(state, stages, dst=0, group=pp_group)
    return {k: v for stage in stages for k, v in stage.items()} if stages else None
