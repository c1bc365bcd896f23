"""Plain PyTorch model definitions (no parallel code)."""

from meshtron.models.moe import MoE, aux_loss, moe_layers, update_expert_bias
from meshtron.models.qwen2 import (
    InitialWeights,
    Transformer,
    build_model,
    count_parameters,
    flops_per_token,
    materialize,
    token_loss_sum,
)

__all__ = [
    "InitialWeights",
    "MoE",
    "Transformer",
    "aux_loss",
    "build_model",
    "count_parameters",
    "flops_per_token",
    "materialize",
    "moe_layers",
    "token_loss_sum",
    "update_expert_bias",
]
