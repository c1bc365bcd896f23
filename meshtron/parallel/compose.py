"""Composition of the parallelisms, in the order the design needs.

Order on a meta-device model: pipeline split (by the pipeline runner) -> tensor/sequence (tp) ->
expert (ep) -> context (cp) -> activation checkpointing -> compile -> data (FSDP over dp x ep x cp).
Then parameters are allocated and each rank computes only its own slices of the deterministic
initial weights (or loads them from a checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.checkpoint import fill_local_slices
from meshtron.config import Config
from meshtron.host import fake_tensors, simulating
from meshtron.models import InitialWeights
from meshtron.parallel.checkpointing import apply_activation_checkpointing
from meshtron.parallel.compile import apply_compile
from meshtron.parallel.context import apply_context_parallel
from meshtron.parallel.data import apply_data_parallel
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.tensor import apply_tensor_parallel


def parallelize(model: nn.Module, mesh, cfg: Config) -> nn.Module:
    """Apply every parallelism except the pipeline split to ``model`` (in place; meta or real)."""
    p = cfg.parallel
    model.document_mask = cfg.data.document_mask
    if model.lm_head is not None:
        model.lm_head.chunk_tokens = cfg.train.loss_chunk_tokens
    apply_tensor_parallel(model, mesh["tp"], p.sp)
    # Under SP the MoE blocks keep their sequence shards, so tp ranks hold different tokens there.
    apply_expert_parallel(model, mesh, sequence_parallel=p.sp)
    apply_context_parallel(model, mesh, comm_type=p.cp_comm_type, a2a_size=p.cp_a2a_size)
    apply_activation_checkpointing(model, p.activation_checkpointing, p.ac_every)
    if p.compile:
        apply_compile(model)
    apply_data_parallel(model, mesh, p.data_parallel, cfg.train.dtype, p.fsdp_prefetch)
    return model


def materialize_sharded(model: nn.Module, device: torch.device, cfg: Config) -> None:
    """Allocate a parallelized meta-device model and fill it with the layout-independent initial
    weights, each rank computing only its own slices on ``device``."""
    with fake_tensors():
        model.to_empty(device=device)
    model.tie_weights()  # to_empty replaces tied parameters one module at a time
    if not simulating():  # a dry run's tensors hold no values
        fill_local_slices(model, InitialWeights(cfg.model, cfg.train.seed))
