"""Activation checkpointing of transformer blocks (a memory/compute trade, not a mesh dimension).

We use PyTorch's composable ``checkpoint`` (non-reentrant, installed as forward hooks) rather than
``checkpoint_wrapper``: it adds no ``_checkpoint_wrapped_module`` level, so parameter names, state
dicts and checkpoints are the same with and without it. Apply it before FSDP (composable
checkpoint and ``fully_shard`` on the same block is the combination PyTorch tests), after TP/EP/CP.

Recomputation replays the block's forward in backward with the same RNG state, so a checkpointed
run gives bit-identical losses and gradients to a plain one on the same layout.
"""

from __future__ import annotations

import contextlib

from torch import nn

from meshtron.config import ACTIVATION_CHECKPOINTING, not_one_of
from meshtron.models.moe import replaying
from meshtron.torch_private import checkpoint


def checkpointed_layers(layer_ids: list[int], mode: str, every: int) -> list[int]:
    """Which global layer indices to checkpoint.

    ``full``: all of them; ``selective``: layers whose global index is a multiple of ``every``
    (0, N, 2N, ...), so the choice does not change when a pipeline stage holds only some layers.
    """
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(not_one_of("activation_checkpointing", mode, ACTIVATION_CHECKPOINTING))
    if every < 1:
        raise ValueError(f"ac_every must be >= 1, got {every}.")
    if mode == "none":
        return []
    if mode == "full":
        return list(layer_ids)
    return [i for i in layer_ids if i % every == 0]


def apply_activation_checkpointing(model: nn.Module, mode: str = "none", every: int = 2) -> list[int]:
    """Checkpoint the blocks in ``model.layers`` chosen by ``mode``; returns their global indices."""
    layers = model.layers
    chosen = checkpointed_layers([int(key) for key in layers], mode, every)
    for index in chosen:
        # The recomputation must not count MoE router statistics a second time.
        checkpoint(layers[str(index)], context_fn=lambda: (contextlib.nullcontext(), replaying()))
    return chosen


def is_checkpointed(module: nn.Module) -> bool:
    """Whether activation checkpointing wraps ``module`` (its backward replays its forward)."""
    return checkpoint.state(module) is not None
