"""Pipelined runner: the runner interface (``meshtron.parallel.step.Runner``) for ``parallel.pp > 1``.

Every pp-rank builds only its own chunks, parallelizes them as without a pipeline and runs its schedule
with :class:`PipelineExecutor`; numerics equal the non-pipelined runner's. See
docs/pipeline.md#the-pipelined-runner.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.config import Config, ParallelConfig
from meshtron.host import copy_to
from meshtron.mesh import dense_data_mesh
from meshtron.models import moe_layers
from meshtron.models.moe import replaying
from meshtron.parallel.compile import is_compiled
from meshtron.parallel.compose import materialize_sharded, parallelize
from meshtron.parallel.grad_norm import global_grad_norm, scale_grads_
from meshtron.parallel.pipeline.executor import PipelineExecutor
from meshtron.parallel.pipeline.schedules import V_SHAPED, build_schedule, runs_backward_whole
from meshtron.parallel.pipeline.stage import build_chunks, check_pipeline, prune_to_stage
from meshtron.parallel.recompute import is_checkpointed
from meshtron.parallel.step import (
    average_router_losses_over_microbatches,
    full_state_dict,
    global_token_count,
    split_microbatches,
)


def boundary_tensor(
    p: ParallelConfig, hidden_size: int, dtype: str, micro_batch: int, local_seq: int
) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of the hidden states between stages for ``local_seq`` tokens per sample on this rank.

    With sequence parallelism the residual stream between blocks is split over tp as well.
    """
    seq = local_seq // p.tp if p.sp and p.tp > 1 else local_seq
    return (micro_batch, seq, hidden_size), getattr(torch, dtype)


def _fsdp_units(chunk) -> list[nn.Module]:
    """FSDP2 units whose parameters a chunk uses: its modules' units and the stage root, whose hooks
    run with every chunk (it holds the final norm, and a tied embedding / LM head)."""
    from torch.distributed.fsdp import FSDPModule

    units = [sub for mod in chunk.modules() for sub in mod.modules() if isinstance(sub, FSDPModule)]
    if isinstance(chunk.model, FSDPModule):
        units.append(chunk.model)
    return units


def _fused_backward(chunk) -> bool:
    """Whether the executor runs a chunk's backwards whole (``schedules.runs_backward_whole`` asked of
    every module the chunk holds)."""
    modules = (sub for mod in chunk.modules() for sub in mod.modules())
    return runs_backward_whole(modules, is_checkpointed, is_compiled)


def _pipelines(mesh) -> list[list[int]]:
    """Global ranks of every pipeline of the mesh, one row each, in stage order."""
    pp = mesh["pp"].size()
    return [[int(r) for r in row] for row in mesh.mesh.movedim(0, -1).reshape(-1, pp)]


def _gradient_group(mesh):
    """A second communicator over this rank's pipeline for the gradients, which the V-shaped
    schedules need (``executor.py``).

    Every rank creates every pipeline's group (a collective requirement of group creation).
    """
    group, _ = dist.new_subgroups_by_enumeration(_pipelines(mesh))
    return group


def _first_last_group(mesh):
    """Group of the first and last pp-rank of this rank's pipeline (None on the ranks between).

    Every rank creates every pipeline's pair (a collective requirement of group creation).
    """
    group, _ = dist.new_subgroups_by_enumeration([[row[0], row[-1]] for row in _pipelines(mesh)])
    return group


class PipelineRunner:
    """Forward and backward of one global-batch step on this pp-rank's pipeline stage(s)."""

    def __init__(self, model: nn.Module, mesh, cfg: Config, device: torch.device):
        check_pipeline(cfg)  # before any collective
        p = cfg.parallel
        stages = prune_to_stage(model, mesh["pp"].get_local_rank(), p.pp, p.virtual_stages, p.schedule in V_SHAPED)
        module = parallelize(model, mesh, cfg)
        materialize_sharded(module, device, cfg)
        tied = (module.embed_tokens, module.lm_head) if cfg.model.tie_word_embeddings else None
        has_moe = any(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_hidden_layers))
        self._start(
            module,
            build_chunks(module, stages, p.pp * p.virtual_stages),
            mesh,
            p,
            (cfg.model.hidden_size, cfg.train.dtype),
            device,
            tied,
            has_moe,
        )

    def _start(
        self,
        module: nn.Module,
        chunks: dict,
        mesh,
        p: ParallelConfig,
        boundary: tuple[int, str],
        device: torch.device,
        tied: tuple[nn.Module | None, nn.Module | None] | None,
        has_moe: bool,
    ) -> None:
        """Everything but the model: ``module`` is this rank's parallelized stage model and ``chunks``
        its :class:`~meshtron.parallel.pipeline.stage.StageChunk` views (or objects with the same
        interface); ``boundary`` is (hidden size, compute dtype); ``tied``, for tied embeddings, is
        this rank's (embedding, LM head), each None where another stage holds it."""
        self.parallel, self.mesh, self.device, self._boundary = p, mesh, device, boundary
        self.cp_mesh = mesh["cp"]  # sliced once: slicing a DeviceMesh is host work on its rank tensor
        self._has_moe = has_moe
        self.pp_mesh = pp_mesh = mesh["pp"]
        self.pp_group = pp_mesh.get_group()
        self.num_stages = p.pp * p.virtual_stages
        self.module, self.chunks = module, chunks
        self.data_group = dense_data_mesh(mesh).get_group()
        average_router_losses_over_microbatches(self.module, p.microbatches)
        self._moe = {s: [m for mod in c.modules() for m in moe_layers(mod)] for s, c in self.chunks.items()}
        self.moes = [m for layers in self._moe.values() for m in layers]
        entries = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)[pp_mesh.get_local_rank()]
        units = {s: _fsdp_units(c) for s, c in self.chunks.items()}
        grads = _gradient_group(mesh) if p.schedule in V_SHAPED else None
        unsplit = [s for s, c in self.chunks.items() if _fused_backward(c)]
        self.executor = PipelineExecutor(entries, self.num_stages, self.pp_group, units, grads, unsplit)
        self._aux: torch.Tensor | None = None
        self.relay = None  # an executor Relay for model statistics that cross stages (HF MoE aux loss)
        self._tied, self._tie_group, self._tied_copy = None, None, None
        if tied is not None and p.schedule not in V_SHAPED:  # a V holds both ends on rank 0: one weight
            embed, head = tied
            self._tie_group = _first_last_group(mesh)
            self._tied = (embed or head).weight if self._tie_group else None
            self._tied_copy = self._tied if head is not None else None  # the norm counts the first stage's

    def forward_backward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The step's global loss as a device scalar on every rank (reading it is the caller's host sync)."""
        micro = split_microbatches(input_ids, labels, self.cp_mesh, self.parallel.microbatches, position_ids)
        tokens = global_token_count(micro, self.data_group)
        aux: list[torch.Tensor] = []

        def forward(stage: int, x: torch.Tensor, mb: int) -> torch.Tensor:
            out = self._chunk_forward(micro, stage, x, mb)
            aux.extend(m.last_aux_loss for m in self._moe[stage] if m.last_aux_loss is not None)
            return out

        def loss(loss_sum: torch.Tensor, mb: int) -> torch.Tensor:
            return loss_sum / tokens

        ids = [mb[0] for mb in micro]
        total = self.executor.run(forward, ids, loss, self._boundary_tensor(ids), self.relay)
        if self._tied is not None:
            self._sum_tied_grads()
        dist.all_reduce(total, group=self.data_group)  # zero except on the last stage
        aux_sum = torch.stack(aux).sum() if aux else torch.zeros((), device=self.device)
        count = torch.full((), float(len(aux)), device=self.device)  # a fill, not a host-to-device copy
        stats = torch.stack([total, aux_sum, count])
        dist.all_reduce(stats, group=self.pp_group)
        # Every MoE layer yields one aux loss per micro-batch, so the count is never 0 for a MoE model.
        self._aux = stats[1] / stats[2] if self._has_moe else None
        return stats[0]

    def _chunk_forward(self, micro: list, stage: int, x: torch.Tensor, mb: int) -> torch.Tensor:
        """Chunk ``stage`` on micro-batch ``mb``; the last chunk returns the micro-batch's summed
        token loss (fused head + loss)."""
        chunk = self.chunks[stage]
        return chunk(x, micro[mb][2], micro[mb][1] if chunk.is_last else None)

    def _boundary_tensor(self, ids: list[torch.Tensor]) -> tuple[tuple[int, ...], torch.dtype]:
        return boundary_tensor(self.parallel, *self._boundary, ids[0].shape[0], ids[0].shape[1])

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss, counted tokens) of the global batch, without gradients, on every rank."""
        micro = split_microbatches(input_ids, labels, self.cp_mesh, self.parallel.microbatches)
        tokens = global_token_count(micro, self.data_group)
        ids = [mb[0] for mb in micro]
        with replaying():  # the MoE statistics stay those of the last training step
            total = self.executor.forward_only(partial(self._chunk_forward, micro), ids, self._boundary_tensor(ids))
        dist.all_reduce(total, group=self.data_group)  # zero except on the last stage
        dist.all_reduce(total, group=self.pp_group)
        return total, tokens

    def _sum_tied_grads(self) -> None:
        """The embedding (first stage) and LM head (last stage) are copies of one tied weight: each
        gets the sum of both gradients, so identical optimizer updates keep the copies equal."""
        grad = self._tied.grad
        if isinstance(grad, DTensor) and grad.placements != self._tied.placements:
            # A vocab-parallel embedding's backward leaves its gradient replicated: take this rank's
            # slice (no communication) so that both copies reduce the same elements.
            grad = self._tied.grad = grad.redistribute(self._tied.device_mesh, self._tied.placements)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        # With [parallel] offload the gradient shard is on the host: NCCL sums on the device.
        summed = copy_to(local, self.device)
        dist.all_reduce(summed, group=self._tie_group)
        if summed is not local:
            local.copy_(copy_to(summed, local.device))

    def aux_loss(self) -> torch.Tensor | None:
        """Mean of the last step's aux losses over every MoE layer of every stage and micro-batch."""
        return self._aux

    def mtp_losses(self) -> torch.Tensor | None:
        return None  # multi-token prediction runs without a pipeline (meshtron.config.checks)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to the norm over all stages; a tied LM head copy is clipped but counted once (first stage)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        total = global_grad_norm([p for p in params if p is not self._tied_copy], pp_mesh=self.pp_mesh)
        scale_grads_(params, max_norm, total)
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return full_state_dict(self.module, self.pp_group)
