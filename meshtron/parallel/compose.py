"""Composition of the parallelisms, in the one order both kinds of model follow.

:func:`compose` writes that order once; each kind of model supplies how it applies each dimension's
parallelism (:class:`Parallelisms`): :class:`NativeParallelisms` here, ``meshtron.hf.parallelize.HFParallelisms``
for transformers models.
See docs/training.md#how-the-parallelisms-compose.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from meshtron.checkpoint import fill_local_slices
from meshtron.config import Config
from meshtron.host import fake_tensors, simulating
from meshtron.mesh import dense_data_mesh
from meshtron.models import InitialWeights
from meshtron.parallel.compile import apply_compile
from meshtron.parallel.context import apply_context_parallel
from meshtron.parallel.data_parallel import apply_data_parallel
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.float8 import apply_float8
from meshtron.parallel.offload import apply_activation_offload
from meshtron.parallel.recompute import apply_activation_checkpointing
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.parallel.tensor_overlap import apply_overlapped_tensor_parallel


class Parallelisms(Protocol):
    """How one kind of model applies each dimension's parallelism; each method changes ``model`` in place."""

    def setup(self, model: nn.Module) -> None: ...
    def tensor(self, model: nn.Module) -> None: ...
    def expert(self, model: nn.Module) -> None: ...
    def context(self, model: nn.Module) -> None: ...
    def checkpointing(self, model: nn.Module) -> None: ...
    def compile(self, model: nn.Module) -> None: ...
    def data(self, model: nn.Module) -> None: ...


def compose(model: nn.Module, parallelisms: Parallelisms) -> nn.Module:
    """Apply every parallelism except the pipeline split to ``model`` (in place), in the one order."""
    parallelisms.setup(model)  # the model's own settings (its loss), what the plans need found first
    parallelisms.tensor(model)
    parallelisms.expert(model)
    parallelisms.context(model)
    parallelisms.checkpointing(model)
    parallelisms.compile(model)
    parallelisms.data(model)
    return model


class NativeParallelisms:
    """:class:`Parallelisms` for meshtron's own models, from the recipe's ``[parallel]`` keys."""

    def __init__(self, mesh, cfg: Config):
        self.mesh, self.cfg, self.p = mesh, cfg, cfg.parallel

    def setup(self, model: nn.Module) -> None:
        model.document_mask = self.cfg.data.document_mask
        if model.lm_head is not None:
            model.lm_head.chunk_tokens = self.cfg.train.loss_chunk_tokens
        apply_float8(model, self.cfg.train.fp8, self.p.tp, dense_data_mesh(self.mesh).size(), self.p.offload != "none")

    def tensor(self, model: nn.Module) -> None:
        apply = apply_overlapped_tensor_parallel if self.p.tp_overlap else apply_tensor_parallel
        apply(model, self.mesh["tp"], self.p.sp)

    def expert(self, model: nn.Module) -> None:
        # Under SP the MoE blocks keep their sequence shards, so tp ranks hold different tokens there.
        apply_expert_parallel(model, self.mesh, sequence_parallel=self.p.sp)

    def context(self, model: nn.Module) -> None:
        apply_context_parallel(model, self.mesh, comm_type=self.p.cp_comm_type, a2a_size=self.p.cp_a2a_size)

    def checkpointing(self, model: nn.Module) -> None:
        apply_activation_checkpointing(
            model, self.p.activation_checkpointing, self.p.ac_every, self.p.ac_policy, self.p.ac_parts
        )
        if self.p.offload_activations:  # the blocks checkpointing left alone
            apply_activation_offload(model)

    def compile(self, model: nn.Module) -> None:
        if self.p.compile:
            apply_compile(model)

    def data(self, model: nn.Module) -> None:
        apply_data_parallel(
            model, self.mesh, self.p.data_parallel, self.cfg.train.dtype, self.p.fsdp_prefetch, self.p.offload
        )


def parallelize(model: nn.Module, mesh, cfg: Config) -> nn.Module:
    """Apply every parallelism except the pipeline split to a native ``model`` (in place; meta or real)."""
    return compose(model, NativeParallelisms(mesh, cfg))


def materialize_sharded(model: nn.Module, device: torch.device, cfg: Config) -> None:
    """Allocate a parallelized meta-device model and fill it with the layout-independent initial
    weights, each rank computing only its own slices on ``device``. With ``[parallel] offload =
    "optimizer"`` the parameters are allocated on the host, where FSDP2 keeps their shards: allocated on a
    GPU, its first forward refuses them ("FSDP parameters should be materialized on CPU"); the buffers stay
    on ``device``, where the step reads them."""
    with fake_tensors():
        allocate_empty(model, device, on_host=cfg.parallel.offload == "optimizer")
    model.tie_weights()  # to_empty replaces tied parameters one module at a time
    if not simulating():  # a dry run's tensors hold no values
        fill_local_slices(model, InitialWeights(cfg.model, cfg.train.seed))


def allocate_empty(model: nn.Module, device: torch.device, on_host: bool) -> None:
    """A meta-device ``model``'s tensors made real (uninitialised) on ``device``; ``on_host`` (``[parallel]
    offload = "optimizer"``): its parameters on the host, where FSDP2 keeps their shards, its buffers on
    ``device``, where the step reads them."""
    model.to_empty(device="cpu" if on_host else device)
    if on_host:
        _buffers_to(model, device)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Every buffer of ``model`` reallocated (empty) on ``device``."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, torch.empty_like(buffer, device=device))
