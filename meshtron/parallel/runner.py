"""Composition of the parallelisms, in the order the design needs, and the per-step runner.

Order on a meta-device model: pipeline split -> tensor/sequence (tp) -> expert (ep) -> context (cp)
-> activation checkpointing -> data (FSDP over dp x ep x cp). Then parameters are allocated and
filled slice by slice from the deterministic initial weights (or a checkpoint), so no rank ever
holds more than one full parameter at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.checkpoint import fill_local_slices, gather_full_state_dict
from meshtron.config import Config
from meshtron.mesh import dense_data_mesh
from meshtron.models import InitialWeights, moe_layers
from meshtron.parallel.checkpointing import apply_activation_checkpointing
from meshtron.parallel.compile import apply_compile
from meshtron.parallel.context import apply_context_parallel, shard_batch
from meshtron.parallel.data import apply_data_parallel
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.grad_norm import clip_grad_norm_
from meshtron.parallel.tensor import apply_tensor_parallel, parallel_token_loss_sum


def parallelize(model: nn.Module, mesh, cfg: Config) -> nn.Module:
    """Apply every parallelism except the pipeline split to ``model`` (in place; meta or real)."""
    p = cfg.parallel
    apply_tensor_parallel(model, mesh["tp"], p.sp)
    # The TP plan gathers a MoE block's tokens even under SP, so tp ranks hold the same tokens there.
    apply_expert_parallel(model, mesh, sequence_parallel=False)
    apply_context_parallel(model, mesh)
    apply_activation_checkpointing(model, p.activation_checkpointing, p.ac_every)
    if p.compile:
        apply_compile(model)
    apply_data_parallel(model, mesh, p.data_parallel, cfg.train.dtype, p.fsdp_prefetch)
    return model


def materialize_sharded(model: nn.Module, device: torch.device, cfg: Config) -> None:
    """Allocate a parallelized meta-device model and fill it with the layout-independent initial
    weights, each rank computing only its own slices on ``device``."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty replaces tied parameters one module at a time
    fill_local_slices(model, InitialWeights(cfg.model, cfg.train.seed))


def split_microbatches(input_ids: torch.Tensor, labels: torch.Tensor, mesh, micro: int):
    """[(ids, labels, position_ids)] per micro-batch: this rank's cp slice of the sequence (with its
    global positions), split along the batch dimension."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    input_ids, labels, positions = shard_batch((input_ids, labels, positions), mesh)
    return list(zip(input_ids.chunk(micro), labels.chunk(micro), positions.chunk(micro)))


def global_token_count(micro: list, data_group) -> torch.Tensor:
    """Counted tokens of the whole step over the ranks that hold different tokens (dp x ep x cp)."""
    tokens = sum((lab != -100).sum() for _, lab, _ in micro).to(torch.float32)
    dist.all_reduce(tokens, group=data_group)
    return tokens


def average_router_losses_over_microbatches(module: nn.Module, micro: int) -> None:
    for moe in moe_layers(module):  # one router loss per micro-batch, averaged over them
        moe.aux_loss_scale /= micro
        moe.z_loss_scale /= micro


def _full_cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's parameters on CPU, on every rank (collective over each DTensor's mesh).

    ``gather_full_state_dict`` keeps the result on global rank 0 only, which lacks the other stages.
    """
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in module.state_dict().items()
    }


def export_hf(module: nn.Module, cfg: Config, folder: str, pp_group=None) -> None:
    """Write the full model as an HF folder from rank 0 (collective; ``pp_group`` gathers the stages)."""
    from meshtron.hf import save_hf

    if pp_group is None:
        state = gather_full_state_dict(module)
    else:
        state = _full_cpu_state(module)
        if 0 in dist.get_process_group_ranks(pp_group):
            # Only the pipeline that contains rank 0 ships its stages there; the others hold copies.
            stages = [None] * dist.get_world_size(pp_group) if dist.get_rank() == 0 else None
            dist.gather_object(state, stages, dst=0, group=pp_group)
            state = {k: v for stage in stages for k, v in stage.items()} if stages else state
    if dist.get_rank() == 0:
        save_hf(state, cfg.model, folder)
    dist.barrier()


class StepRunner:
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
        self._aux: list[torch.Tensor] = []

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The step's global loss as a device scalar (reading it is the caller's one host sync)."""
        micro = split_microbatches(input_ids, labels, self.cp_mesh, self.cfg.parallel.microbatches)
        tokens = global_token_count(micro, self.data_group)
        total = torch.zeros((), device=self.device)
        self._aux = []
        for i, (ids, lab, pos) in enumerate(micro):
            self.module.set_requires_gradient_sync(self._sync_gradients(i))
            loss = parallel_token_loss_sum(self.module(ids, pos), lab) / tokens
            loss.backward()
            total += loss.detach()
            self._aux.extend(m.last_aux_loss for m in self.moes if m.last_aux_loss is not None)
        dist.all_reduce(total, group=self.data_group)
        return total

    def _sync_gradients(self, microbatch: int) -> bool:
        """Full sharding reduce-scatters every micro-batch, so unsharded gradients never pile up;
        replication and HSDP keep full gradients anyway and reduce once, on the last micro-batch."""
        return self.cfg.parallel.data_parallel == "fsdp" or microbatch == self.cfg.parallel.microbatches - 1

    def aux_loss(self) -> torch.Tensor | None:
        return torch.stack(self._aux).mean() if self._aux else None

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip in place; returns the global norm before clipping as a device scalar."""
        return clip_grad_norm_(self.module.parameters(), max_norm)

    def export_hf(self, folder: str) -> None:
        export_hf(self.module, self.cfg, folder)


def build_step_runner(model: nn.Module, mesh, cfg: Config, device: torch.device):
    """The runner for this layout: pipelined when ``parallel.pp > 1``."""
    if cfg.parallel.pp > 1:
        from meshtron.parallel.pipeline.runner import PipelineRunner

        return PipelineRunner(model, mesh, cfg, device)
    return StepRunner(model, mesh, cfg, device)
