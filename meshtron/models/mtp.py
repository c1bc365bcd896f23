"""Multi-token prediction's inputs and targets, built on whole sequences before any split of the batch.

Module k of DeepSeek-V3's MTP (``meshtron.models.qwen2.MTPBlock``) reads, at position i, the embedding of token
i + k and predicts token i + k + 1: the label at i + k. Shifting the whole sequence first lets context
parallelism, micro-batching and the data ranks split these like the labels, each rank holding its
positions' inputs and targets without asking its neighbours. See docs/training.md, 'Multi-token prediction'.
"""

from __future__ import annotations

import torch

from meshtron.config import ModelConfig
from meshtron.data.sampler import IGNORE_INDEX


def mtp_loss_weights(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """Each loss's weight in what a step minimizes: 1 for the next-token loss, ``mtp_loss_coef / depth`` for
    every module's (DeepSeek-V3: λ times their mean)."""
    depth = cfg.num_nextn_predict_layers
    return torch.tensor([1.0] + [cfg.mtp_loss_coef / depth for _ in range(depth)], device=device)


def tokens_ahead(
    input_ids: torch.Tensor, labels: torch.Tensor, depth: int, documents: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each ``[B, S, depth]``: for module k (column k - 1) at position i, token i + k and
    the label at i + k; past the sequence's end the input is token 0 and the target ignored (-100), and with
    ``documents`` (packed positions restarting at 0 per document) so is every target in another document."""
    batch, seq = input_ids.shape
    inputs = input_ids.new_zeros(batch, seq, depth)
    targets = labels.new_full((batch, seq, depth), IGNORE_INDEX)
    for k in range(1, min(depth, seq - 1) + 1):
        inputs[:, : seq - k, k - 1] = input_ids[:, k:]
        ahead = labels[:, k:]
        if documents is not None:
            same_document = documents[:, k:] == documents[:, : seq - k] + k
            ahead = torch.where(same_document, ahead, IGNORE_INDEX)
        targets[:, : seq - k, k - 1] = ahead
    return inputs, targets
