"""The runner without a pipeline, and the choice of a built model's runner for its layout (both kinds of
model; the recipe's model and its runner: ``meshtron.runner.build_runner``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config import Config
from meshtron.mesh import dense_data_mesh
from meshtron.models import moe_layers
from meshtron.models.moe import replaying
from meshtron.models.mtp import mtp_loss_weights
from meshtron.parallel.compose import materialize_sharded, parallelize
from meshtron.parallel.data_parallel import MicrobatchSync
from meshtron.parallel.pipeline.pipelined_runner import PipelineRunner
from meshtron.parallel.step import (
    Runner,
    WholeModelRunner,
    average_router_losses_over_microbatches,
    global_token_count,
    split_microbatches,
)


class NoPipelineRunner(WholeModelRunner):
    """Forward and backward of one global-batch step on this rank (no pipeline: pp == 1).

    The local batch is split into ``parallel.microbatches`` micro-batches whose gradients accumulate;
    each micro-batch's loss is divided by the global token count of the whole step, so the summed
    gradient is that of the global mean loss.
    """

    def __init__(self, model: nn.Module, mesh, cfg: Config, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.module = parallelize(model, mesh, cfg)
        materialize_sharded(self.module, device, cfg)
        self.data_group = dense_data_mesh(mesh).get_group()
        self.cp_mesh = mesh["cp"]  # sliced once: slicing a DeviceMesh is host work on its rank tensor
        self.moes = moe_layers(self.module)  # found once: a module-tree walk per micro-batch is host work
        average_router_losses_over_microbatches(self.module, cfg.parallel.microbatches)
        self.sync = MicrobatchSync(self.module, cfg.parallel)
        self._aux: list[torch.Tensor] = []
        self.mtp_depth = cfg.model.num_nextn_predict_layers
        self.loss_weights = mtp_loss_weights(cfg.model, device)
        self._mtp: torch.Tensor | None = None

    def forward_backward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The step's global loss as a device scalar (reading it is the caller's one host sync); with MTP the
        next-token loss, while the gradients are those of the weighted sum with the modules' losses."""
        p = self.cfg.parallel
        micro = split_microbatches(input_ids, labels, self.cp_mesh, p.microbatches, position_ids, self.mtp_depth)
        tokens = global_token_count(micro, self.data_group)
        if self.mtp_depth:  # a module with no target left (short SFT answers) adds nothing rather than 0 / 0
            tokens = torch.cat([tokens[:1], tokens[1:].clamp(min=1)])
        total = torch.zeros_like(tokens)
        self._aux = []
        for i, (ids, lab, pos, *ahead) in enumerate(micro):
            self.sync.forward(i, len(micro))
            losses = self._losses(ids, pos, lab, ahead) / tokens
            self.sync.backward(i, len(micro))
            (losses @ self.loss_weights if self.mtp_depth else losses).backward()
            total += losses.detach()
            self._aux.extend(m.last_aux_loss for m in self.moes if m.last_aux_loss is not None)
        dist.all_reduce(total, group=self.data_group)
        if not self.mtp_depth:
            return total
        self._mtp = total[1:]
        return total[0]

    def _losses(self, ids: torch.Tensor, pos: torch.Tensor, lab: torch.Tensor, ahead: list) -> torch.Tensor:
        """The micro-batch's summed token loss; with MTP targets (``ahead``) the stacked losses of every depth."""
        if not ahead:
            return self.module(ids, pos, labels=lab)
        return self.module(ids, pos, labels=lab, mtp_tokens=ahead[0], mtp_labels=ahead[1])

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss, counted tokens) of the global batch, without gradients, on every rank."""
        micro = split_microbatches(input_ids, labels, self.cp_mesh, self.cfg.parallel.microbatches)
        tokens = global_token_count(micro, self.data_group)
        total = torch.zeros((), device=self.device)
        with replaying():  # the MoE statistics stay those of the last training step
            for ids, lab, pos in micro:
                total += self.module(ids, pos, labels=lab)
        dist.all_reduce(total, group=self.data_group)
        return total, tokens

    def aux_loss(self) -> torch.Tensor | None:
        return torch.stack(self._aux).mean() if self._aux else None

    def mtp_losses(self) -> torch.Tensor | None:
        return self._mtp


@dataclass(frozen=True)
class Runners:
    """How one kind of model becomes a runner, each called as (model, mesh, cfg, device):
    ``no_pipeline`` without a pipeline, ``pipeline`` with one."""

    no_pipeline: Callable[..., Runner]
    pipeline: Callable[..., Runner]


# meshtron's own models; transformers models: meshtron.hf.runner.HF_RUNNERS.
NATIVE_RUNNERS = Runners(no_pipeline=NoPipelineRunner, pipeline=PipelineRunner)


def build_model_runner(
    model: nn.Module, mesh, cfg: Config, device: torch.device, runners: Runners = NATIVE_RUNNERS
) -> Runner:
    """The runner for this layout: pipelined when ``parallel.pp > 1``; ``runners`` are the model kind's."""
    build = runners.pipeline if cfg.parallel.pp > 1 else runners.no_pipeline
    return build(model, mesh, cfg, device)
