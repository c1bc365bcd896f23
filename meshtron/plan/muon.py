"""Muon's work per step on its busiest rank: the matrices it orthogonalizes and their Newton–Schulz FLOPs.

Mirrors ``meshtron/optim.py: _orthogonalized_stack``: a stage's matrices of one shape and placement form a
stack, split by matrix over every rank of the stage except those that split an expert stack's leading dim
(ep, and FSDP where it shards the experts), so the busiest rank takes the ceiling of its share of each stack.
See docs/optimizers.md, 'In the planner'.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from meshtron.config import Config
from meshtron.plan.parameters import (
    Coords,
    chunk_size,
    data_shards,
    fsdp_shard_dim,
    model_parallel_shape,
    muon_param,
    stage_params,
)


class MuonWork(NamedTuple):
    matrices: int  # whole matrices the busiest rank orthogonalizes per step
    flops: float  # their Newton–Schulz matmul FLOPs


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """Matmul FLOPs of ``steps`` quintic iterations on one ``rows x cols`` matrix, on its wide side (m the
    smaller dim): ``A = XX^T`` 2m²n, ``A²`` 2m³, ``(bA + cA²)X`` 2m²n."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m**3)


def muon_work(cfg: Config) -> MuonWork:
    """Of every pipeline rank, the one with the most Newton–Schulz FLOPs (zero work without Muon)."""
    if cfg.train.optimizer != "muon":
        return MuonWork(0, 0.0)
    return max((_stage_work(cfg, pp_rank) for pp_rank in range(cfg.parallel.pp)), key=lambda w: w.flops)


def _stage_work(cfg: Config, pp_rank: int) -> MuonWork:
    p = cfg.parallel
    stage_ranks = p.dp * p.cp * p.tp * (1 if p.fold_ep else p.ep)
    stacks: dict[tuple, list] = {}
    for q in stage_params(cfg, pp_rank):
        if muon_param(q):
            stacks.setdefault((q.shape, q.tp_dim, q.expert), []).append(q)
    coords = Coords(pp=pp_rank)
    expert_shards, _ = data_shards(cfg, coords, expert=True)
    matrices, flops = 0, 0.0
    for (shape, _, expert), params in stacks.items():
        per_param, width = 1, stage_ranks
        if expert:  # each expert's matrix whole; ep, and FSDP over the experts, keep them where they are
            local = model_parallel_shape(params[0], cfg, coords)
            per_param, whole_experts = local[0], p.ep
            if fsdp_shard_dim(params[0], cfg, local, expert_shards) == 0:
                per_param, whole_experts = chunk_size(local[0], expert_shards, 0), p.ep * expert_shards
            width = stage_ranks // whole_experts
        taken = math.ceil(len(params) / width) * per_param
        matrices += taken
        flops += taken * newton_schulz_flops(shape[-2], shape[-1], cfg.train.muon_ns_steps)
    return MuonWork(matrices, flops)
