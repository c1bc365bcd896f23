"""Activation checkpointing of transformer blocks (a memory/compute trade, not a mesh dimension).

PyTorch's composable ``checkpoint`` per block (parameter names unchanged), and under ``op`` torch's selective
checkpointing with the policies ``[parallel] ac_policy`` names; FSDP's hooks run outside the policy's record
(:func:`hooks_outside_op_record`). See docs/training.md#activation-checkpointing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from meshtron.config import AC_PARTS, AC_POLICIES, ACTIVATION_CHECKPOINTING, not_one_of
from meshtron.host import KeptReads
from meshtron.models.layers import MLP
from meshtron.models.moe import replaying
from meshtron.torch_private import (
    ATTENTION_FORWARD_KERNELS,
    GROUPED_MM,
    SacBypass,
    checkpoint,
    selective_checkpoint_contexts,
)

aten = torch.ops.aten
# The GEMMs of weights (linear layers, the experts' grouped GEMM). Not bmm / baddbmm: those multiply two
# activations, as attention's math kernels do (the ring's blocks off CUDA or under a document mask, SDPA's
# math fallback), and keeping their outputs keeps an O(S^2) score matrix per block.
MATMULS = frozenset({aten.mm.default, aten.addmm.default, GROUPED_MM.default})
# Fused attention kernels (CPU, flash, memory-efficient, cuDNN): their outputs include the log-sum-exp.
ATTENTION = frozenset(kernel.default for kernel in ATTENTION_FORWARD_KERNELS)


def checkpoints_layer(layer: int, mode: str, every: int) -> bool:
    """Whether ``mode`` checkpoints global layer ``layer`` (``op``: in part). ``full`` and ``op``: every
    layer; ``selective``: layers whose global index is a multiple of ``every`` (0, N, 2N, ...), so the
    choice does not change when a pipeline stage holds only some layers. The rule's one owner:
    :func:`checkpointed_layers` and the planner (``plan/activations.py``) call it."""
    return mode in ("full", "op") or (mode == "selective" and layer % every == 0)


def checkpointed_layers(layer_ids: list[int], mode: str, every: int) -> list[int]:
    """Which global layer indices to checkpoint (:func:`checkpoints_layer`)."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(not_one_of("activation_checkpointing", mode, ACTIVATION_CHECKPOINTING))
    if every < 1:
        raise ValueError(f"ac_every must be >= 1, got {every}.")
    return [i for i in layer_ids if checkpoints_layer(i, mode, every)]


class OpPolicy:
    """Which op outputs one call of a checkpointed block keeps (module doc); a fresh one per call.
    ``parts``: with the ``parts`` policy, those recomputed whole (``config.AC_PARTS``)."""

    def __init__(self, policy: str, parts: Collection[str] = ()):
        if policy not in AC_POLICIES:
            raise ValueError(not_one_of("ac_policy", policy, AC_POLICIES))
        for part in parts:
            if part not in AC_PARTS:
                raise ValueError(not_one_of("ac_parts entry", part, AC_PARTS))
        self.policy, self.parts = policy, frozenset(parts)
        self.matmuls = 0  # seen so far in this block call's forward

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in ATTENTION:
            return self._unless_recomputed("core_attn")
        if op.namespace == "_c10d_functional":
            return CheckpointPolicy.MUST_SAVE
        if op not in MATMULS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        self.matmuls += 1
        if self.policy == "alternate_matmuls" and self.matmuls % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op == GROUPED_MM.default:
            return self._unless_recomputed("moe_experts")
        return self._unless_recomputed("mlp") if _InMLP.depth else CheckpointPolicy.MUST_SAVE

    def _unless_recomputed(self, part: str) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE if part in self.parts else CheckpointPolicy.MUST_SAVE


class _InMLP:
    depth = 0  # MLP forwards running (the ``mlp`` part's matmuls are theirs)


def _mark_mlps(block: nn.Module) -> None:
    """Count the block's MLP forwards (dense MLPs, the shared expert) in ``_InMLP`` while they run."""

    def enter(*_):
        _InMLP.depth += 1

    def leave(*_):
        _InMLP.depth -= 1

    for module in block.modules():
        if isinstance(module, MLP):
            module.register_forward_pre_hook(enter)
            # also when the forward raises: a recomputation stops (by an exception) once it has rebuilt
            # what backward needs, inside a block's last MLP
            module.register_forward_hook(leave, always_call=True)


def recompute_contexts(mode: str, policy: str, parts: Collection[str] = ()) -> Callable[[], tuple]:
    """The composable checkpoint's ``context_fn``: (forward context, recomputation context), fresh per
    block call. The recomputation must not count MoE router statistics a second time (``replaying``)
    and takes the host reads of the forward it replays (``meshtron.host.KeptReads``) instead of waiting
    for the device again."""
    if mode == "op":
        OpPolicy(policy, parts)  # an unknown policy or part fails here, not in the first backward

    def contexts():
        reads = KeptReads()
        forward, recompute = (
            selective_checkpoint_contexts(OpPolicy(policy, parts))
            if mode == "op"
            else (contextlib.nullcontext(), contextlib.nullcontext())
        )
        return _together(forward, reads.keeping()), _together(recompute, reads.replaying(), replaying())

    return contexts


@contextlib.contextmanager
def _together(*managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def checkpoint_blocks(
    blocks: dict[int, nn.Module], mode: str, every: int, policy: str = "save_matmuls", parts: Collection[str] = ()
) -> list[int]:
    """Checkpoint the blocks (global index -> block) chosen by ``mode``; returns their indices."""
    chosen = checkpointed_layers(list(blocks), mode, every)
    for index in chosen:
        checkpoint(blocks[index], context_fn=recompute_contexts(mode, policy, parts))
        if mode == "op" and "mlp" in parts:
            _mark_mlps(blocks[index])
    return chosen


def apply_activation_checkpointing(
    model: nn.Module, mode: str = "none", every: int = 2, policy: str = "save_matmuls", parts: Collection[str] = ()
) -> list[int]:
    """Checkpoint the blocks in ``model.layers`` chosen by ``mode`` (``op``: what ``policy`` keeps);
    returns their global indices."""
    return checkpoint_blocks({int(key): block for key, block in model.layers.items()}, mode, every, policy, parts)


def hooks_outside_op_record(module: nn.Module) -> None:
    """The forward hooks ``module`` has so far (FSDP's: call after ``fully_shard``) run outside ``op``'s
    record of the ops a block calls: such hooks may call other ops, or as often, in the recomputation
    than in the forward (``meshtron.torch_private.SacBypass``). What they do is not the block's
    computation; it runs again in the recomputation as under ``full``."""

    def enter(*_):
        SacBypass.active = True

    def leave(*_):
        SacBypass.active = False

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_pre_hook(leave)
    module.register_forward_hook(enter, prepend=True)
    module.register_forward_hook(leave)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether activation checkpointing wraps ``module`` (its backward replays its forward)."""
    return checkpoint.state(module) is not None
