"""AdamW with linear warmup and cosine decay to ``min_lr``."""

from __future__ import annotations

import math

import torch

from meshtron.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): warmup, then cosine from lr to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW without weight decay on norms and biases (1-D parameters), fused on every device.

    The fused kernel keeps its step counts on the device (the unfused ones read them on the host
    for every parameter) and honours ``optimizer.found_inf``: the training step sets it to skip a
    non-finite update without a host sync.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr_at(0, cfg),
        betas=(cfg.beta1, cfg.beta2),
        fused=True,
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
