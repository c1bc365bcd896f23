"""The optimizers (AdamW; Muon beside AdamW) and the learning rate: linear warmup, cosine decay to ``min_lr``.

docs/optimizers.md says which parameters Muon takes and how its update stays the same on every layout.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.adam import adam

from meshtron.config import TrainConfig
from meshtron.models.qwen2 import LMHead
from meshtron.torch_private import adam_init_group, dtensor_local, shard_dim, shard_moved_to


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
            raise ValueError(
                f"{type(self).__name__}.step takes no closure: meshtron's training step runs forward and backward."
            )
        for group in self.param_groups:
            self._step_group(group)

    def _step_group(self, group: dict) -> None:
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


class MuonWithAdamW(LocalAdamW):
    """Muon on the param groups marked ``muon``, :class:`LocalAdamW` on the others: one optimizer, so one state
    dict, one learning-rate schedule and one ``found_inf``.

    Muon's step for a weight ``W`` with gradient ``g`` and momentum ``m`` (torch SGD's form, as Moonlight's):
    ``m <- momentum m + g``; ``u = g + momentum m`` (Nesterov) or ``m``; ``O`` = the Newton–Schulz
    orthogonalization of each whole matrix of ``u``; ``W <- W (1 - lr wd) - lr scale O``. The momentum is a
    DTensor placed like ``W``, so checkpoints reshard it as they do AdamW's moments.
    """

    def _step_group(self, group: dict) -> None:
        if not group.get("muon"):
            super()._step_group(group)
            return
        found_inf = getattr(self, "found_inf", None)
        keep = None if found_inf is None else found_inf == 0  # a non-finite step changes nothing, no host sync
        mu, params, updates = group["momentum"], [p for p in group["params"] if p.grad is not None], []
        for param in params:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                # A step count as AdamW keeps (torch's Adam expects one in every state it loads).
                state["step"] = torch.zeros((), dtype=torch.float32, device=_local(param).device)
            state["step"].add_(1 if keep is None else keep.to(torch.float32))
            grad, momentum = _local(param.grad), _local(state["momentum_buffer"])
            new_momentum = momentum * mu + grad
            momentum.copy_(new_momentum if keep is None else torch.where(keep, new_momentum, momentum))
            updates.append(grad + mu * momentum if group["nesterov"] else momentum)
        for param, ortho in zip(params, orthogonalized(updates, params, group["ns_steps"], group["ns_coefficients"])):
            weight = _local(param)
            scale = update_scale(param.shape, group["scale"], group["fan_out_dim"])
            new_weight = weight * (1 - group["lr"] * group["weight_decay"]) - (group["lr"] * scale) * ortho
            weight.copy_(new_weight if keep is None else torch.where(keep, new_weight, weight))


def newton_schulz(matrices: torch.Tensor, steps: int, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """The quintic Newton–Schulz iteration on the last two dims (a batch of matrices): ``X`` scaled to unit
    Frobenius norm, then ``X <- aX + (bA + cA^2)X`` with ``A = XX^T``, which drives every singular value
    towards 1 (near the orthogonal polar factor ``UV^T``) without an SVD. Computed on the wide side, where the
    Gram matrix is the smaller one; in float32."""
    a, b, c = coefficients
    x = matrices.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(matrices.dtype)


def orthogonalized(updates: list[torch.Tensor], params: list[torch.Tensor], steps: int, coefficients) -> list:
    """This rank's block of the Newton–Schulz orthogonalization of each update (``params[i]``'s local block,
    or the whole parameter when it is a plain tensor), each matrix orthogonalized whole.

    The parameters of one shape and placement (a layer's q_proj in every block, say) go as one stack, so
    the iteration is spread: see :func:`_orthogonalized_stack`."""
    out: list = [None] * len(params)
    for batch in _same_layout(params):
        stack = torch.stack([updates[i] for i in batch])
        for i, ortho in zip(batch, _orthogonalized_stack(stack, params[batch[0]], steps, coefficients).unbind(0)):
            out[i] = ortho
    return out


def _same_layout(params: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``params`` grouped by global shape and placement, in first-seen order (the same on every
    rank that shares their meshes, as the collectives need)."""
    groups: dict = {}
    for i, p in enumerate(params):
        where = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
        groups.setdefault((tuple(p.shape), p.dtype, where), []).append(i)
    return list(groups.values())


def _orthogonalized_stack(stack: torch.Tensor, like: torch.Tensor, steps: int, coefficients) -> torch.Tensor:
    """The orthogonalized stack ``[P, ...]`` of local blocks of P parameters placed like ``like``.

    Muon's collectives are here. The stack is redistributed so that each rank of the mesh dims that split
    the matrices (FSDP's, tp's, etp's) or replicate them gets whole matrices of its share of the P: an
    all-to-all over the splitting dims, a local slice over the replicating ones. Each rank iterates on its
    share only, and the reverse redistribution (an all-to-all; an all-gather over the replicating dims) hands
    every rank its blocks of the results. Splits of an expert stack's leading dim keep each matrix whole and
    stay as they are."""
    if not isinstance(like, DTensor):
        return newton_schulz(stack, steps, coefficients)
    mesh, matrix_dims = like.device_mesh, range(stack.ndim - 2, stack.ndim)
    held = tuple(p if shard_dim(p) is None else shard_moved_to(p, shard_dim(p) + 1) for p in like.placements)
    spread = tuple(p if shard_dim(p) not in (None, *matrix_dims) else Shard(0) for p in held)
    shape = torch.Size((stack.shape[0], *like.shape))
    stride = torch.empty(shape, device="meta").stride()
    share = DTensor.from_local(stack, mesh, held, shape=shape, stride=stride).redistribute(mesh, spread)
    ortho = newton_schulz(share.to_local(), steps, coefficients)
    return DTensor.from_local(ortho, mesh, spread, shape=shape, stride=stride).redistribute(mesh, held).to_local()


def update_scale(shape: torch.Size, rule: str, fan_out_dim: int) -> float:
    """The factor on the orthogonal update: ``adamw_rms`` gives it AdamW's update RMS (Moonlight: 0.2 times
    the square root of the larger side, so AdamW's lr and weight decay carry over); ``spectral`` the RMS-to-RMS
    norm of 1 for a ``fan_in -> fan_out`` map (Keller Jordan's ``sqrt(max(1, fan_out / fan_in))``)."""
    rows, cols = shape[-2], shape[-1]
    if rule == "adamw_rms":
        return 0.2 * math.sqrt(max(rows, cols))
    fan_out, fan_in = (rows, cols) if fan_out_dim == -2 else (cols, rows)
    return math.sqrt(max(1.0, fan_out / fan_in))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return dtensor_local(tensor) if isinstance(tensor, DTensor) else tensor


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> LocalAdamW:
    """``[train] optimizer``: AdamW without weight decay on norms and biases (1-D parameters), fused on every
    device; or Muon on :func:`muon_matrices` beside that AdamW on the rest.

    The fused kernel keeps its step counts on the device (the unfused ones read them on the host
    for every parameter) and honours ``optimizer.found_inf``: the training step sets it to skip a
    non-finite update without a host sync.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "muon":
        return _build_muon(model, params, cfg)
    return LocalAdamW(_adamw_groups(params, cfg, lr_ratio=1.0), lr=lr_at(0, cfg), betas=(cfg.beta1, cfg.beta2))


def _adamw_groups(params: list[torch.Tensor], cfg: TrainConfig, lr_ratio: float) -> list[dict]:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": cfg.weight_decay, "lr_ratio": lr_ratio},
        {"params": no_decay, "weight_decay": 0.0, "lr_ratio": lr_ratio},
    ]


def _build_muon(model: nn.Module, params: list[torch.Tensor], cfg: TrainConfig) -> MuonWithAdamW:
    linears, experts = muon_matrices(model)
    taken = {id(p) for p in linears + experts}
    muon = {
        "muon": True,
        "momentum": cfg.muon_momentum,
        "nesterov": cfg.muon_nesterov,
        "ns_steps": cfg.muon_ns_steps,
        "ns_coefficients": tuple(cfg.muon_ns_coefficients),
        "scale": cfg.muon_scale,
        "weight_decay": cfg.weight_decay,
        "lr_ratio": 1.0,
    }
    adamw_ratio = (cfg.muon_adamw_lr or cfg.lr) / cfg.lr
    groups = [
        {"params": linears, "fan_out_dim": -2, **muon},  # nn.Linear: [out, in]
        {"params": experts, "fan_out_dim": -1, **muon},  # GroupedExperts: [E, in, out]
        *_adamw_groups([p for p in params if id(p) not in taken], cfg, adamw_ratio),
    ]
    groups = [g for g in groups if g["params"]]  # a pipeline stage may hold no experts, or no embedding
    optimizer = MuonWithAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    set_lr(optimizer, lr_at(0, cfg))
    return optimizer


def muon_matrices(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters Muon takes: the blocks' ``nn.Linear`` weights (q, k, v, o, gate, up and down each on its
    own, as the model stores them) and the routed experts' stacks (3-D ``[E, in, out]``, each expert's matrix
    on its own). Not the LM head (an ``LMHead``), the embedding, a router (its own module) or a one-output
    gate (orthogonalizing a row only normalizes it): those stay on AdamW, as in every anchor."""
    linears = [
        m.weight
        for m in model.modules()
        if isinstance(m, nn.Linear) and not isinstance(m, LMHead) and m.out_features > 1 and m.weight.requires_grad
    ]
    experts = [p for p in model.parameters() if p.ndim == 3 and p.requires_grad]
    return linears, experts


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Each group's lr is ``lr`` times its ``lr_ratio`` (AdamW's own peak beside Muon)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)
