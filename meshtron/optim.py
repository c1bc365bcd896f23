"""AdamW with linear warmup and cosine decay to ``min_lr``."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from meshtron.config import TrainConfig
from meshtron.torch_private import adam_init_group, dtensor_local


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): warmup, then cosine from lr to min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


class LocalAdamW(torch.optim.AdamW):
    """Fused AdamW whose kernel runs on the local tensors of DTensor parameters and state.

    The state stays DTensors, so checkpoints reshard it; only the step sees plain tensors: torch's AdamW hands
    DTensors to its foreach and fused ops, and DTensor dispatch of those lists costs host work per tensor on
    every step while computing the same kernel on the same local shards.
    """

    def __init__(self, params, **options):
        if options.get("amsgrad") or options.get("maximize"):
            raise ValueError("LocalAdamW runs plain AdamW: amsgrad and maximize are not supported.")
        super().__init__(params, fused=True, **options)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("LocalAdamW.step takes no closure: meshtron's training step runs forward and backward.")
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            has_complex = adam_init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, steps)
            beta1, beta2 = group["betas"]
            adam(
                *([_local(t) for t in tensors] for tensors in (params, grads, exp_avgs, exp_avg_sqs)),
                [],
                [_local(t) for t in steps],
                amsgrad=False,
                has_complex=has_complex,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                fused=True,
                capturable=False,
                differentiable=False,
                grad_scale=None,
                found_inf=getattr(self, "found_inf", None),
                decoupled_weight_decay=True,
            )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return dtensor_local(tensor) if isinstance(tensor, DTensor) else tensor


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW without weight decay on norms and biases (1-D parameters), fused on every device.

    The fused kernel keeps its step counts on the device (the unfused ones read them on the host
    for every parameter) and honours ``optimizer.found_inf``: the training step sets it to skip a
    non-finite update without a host sync.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return LocalAdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr_at(0, cfg),
        betas=(cfg.beta1, cfg.beta2),
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
