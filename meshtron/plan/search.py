"""Layouts for N devices ranked by predicted throughput, with the memory check that marks which fit.

A candidate keeps the recipe's model, batch, dtype and data-parallel mode and chooses
pp x dp x cp x ep x tp = N (tp inside one node, SP whenever tp > 1) or, for MoE models, a dense
pp x dp x cp x tp = N with the experts folded over it (ep x etp dividing dp x cp x tp, etp dividing
tp), then the micro-batch count,
activation-checkpointing mode and, when pp > 1, schedule that fit with the best predicted
throughput (the lowest-memory choice when none fits). Schedules: 1F1B with every checkpointing
mode; the zero-bubble ``zb1p`` and ``zbv`` without checkpointing only, since with it the executor
runs every backward whole at ``B`` (1F1B's bubble, more held activations). Without a pipeline, FSDP
and HSDP also try both ``fsdp_gather`` modes: gathering per micro-batch, or once per step holding the
unsharded weights and gradients (pipelines always hold them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtron.config import FSDP_GATHERS, Config, ConfigError
from meshtron.parallel.layout import validate_layout
from meshtron.parallel.pipeline.stage import check_pipeline
from meshtron.plan.memory import GIB, Assumptions, Breakdown, predict_memory
from meshtron.plan.speed import Hardware, StepTime, predict_step_time

AC_MODES = ("none", "selective", "full")
# (schedule, virtual stages, checkpointing modes) tried when pp > 1.
PIPELINE_SCHEDULES = (("1f1b", 1, AC_MODES), ("zb1p", 1, ("none",)), ("zbv", 2, ("none",)))


@dataclass
class Plan:
    cfg: Config
    memory: Breakdown
    time: StepTime
    fits: bool

    def layout(self) -> dict:
        p = self.cfg.parallel
        keys = ("pp", "dp", "cp", "ep", "tp", "sp", "etp", "fold_ep", "schedule", "virtual_stages", "microbatches",
                "activation_checkpointing", "data_parallel", "fsdp_gather")
        return {k: getattr(p, k) for k in keys}

    def overrides(self) -> str:
        """The ``--parallel.key value`` flags that select this layout."""
        return " ".join(f"--parallel.{k} {str(v).lower()}" for k, v in self.layout().items())

    def to_json(self) -> dict:
        return {
            "layout": self.layout(),
            "memory_gib": {k: round(v, 3) for k, v in self.memory.gib().items()},
            "total_gib": round(self.memory.total / GIB, 3),
            "dominant": self.memory.dominant,
            "busiest_pp_rank": self.memory.pp_rank,
            "peak_phase": self.memory.phase,
            "fits": self.fits,
            "step_seconds": self.time.seconds,
            "tokens_per_second": self.time.tokens_per_second,
            "compute_seconds": self.time.compute,
            "exposed_comm_seconds": self.time.exposed_comm,
            "bubble": self.time.bubble,
            "comm_bytes_per_rank": self.time.comm_bytes,
        }


def evaluate(cfg: Config, hw: Hardware, assumptions: Assumptions = Assumptions()) -> Plan:
    memory = predict_memory(cfg, assumptions)
    return Plan(cfg, memory, predict_step_time(cfg, hw), memory.total <= hw.memory_gib * GIB)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(cfg: Config, world_size: int, gpus_per_node: int) -> list[dict]:
    """Every pp x dp x cp x ep x tp = ``world_size`` with tp inside a node and ep only for MoE models,
    and for MoE models every folded expert split of each dense shape (:func:`folded_splits`)."""
    m = cfg.model
    shapes = []
    for tp in _divisors(world_size):
        if tp > gpus_per_node:
            continue
        for pp in _divisors(world_size // tp):
            if pp > m.num_hidden_layers:
                continue
            for cp in _divisors(world_size // (tp * pp)):
                for ep in _divisors(world_size // (tp * pp * cp)) if m.is_moe else [1]:
                    dp = world_size // (tp * pp * cp * ep)
                    shapes.append(dict(pp=pp, dp=dp, cp=cp, ep=ep, tp=tp, etp=1, fold_ep=False))
                    if m.is_moe and ep == 1:
                        shapes += [dict(shapes[-1], **split) for split in folded_splits(cfg, dp * cp * tp, tp)]
    return shapes


def folded_splits(cfg: Config, stage_ranks: int, tp: int) -> list[dict]:
    """Folded (ep, etp) of a stage's ``stage_ranks`` dense ranks: etp dividing tp and the experts'
    width, ep > 1 dividing the expert count, ep x etp dividing the stage."""
    m = cfg.model
    return [dict(ep=ep, etp=etp, fold_ep=True)
            for etp in _divisors(tp) if m.moe_intermediate_size % etp == 0
            for ep in _divisors(stage_ranks // etp) if ep > 1 and m.num_experts % ep == 0]


def _variants(cfg: Config, shape: dict[str, int], world_size: int) -> list[Config]:
    """The shape with each valid micro-batch count, schedule and checkpointing mode."""
    t = cfg.train
    readers = shape["dp"] * (1 if shape["fold_ep"] else shape["ep"])
    if t.global_batch_size % readers:
        return []
    schedules = PIPELINE_SCHEDULES if shape["pp"] > 1 else (("1f1b", 1, AC_MODES),)
    gathers = FSDP_GATHERS if shape["pp"] == 1 and cfg.parallel.data_parallel != "replicate" else \
        (cfg.parallel.fsdp_gather,)
    out = []
    for micro in _divisors(t.global_batch_size // readers):
        for schedule, virtual, ac_modes in schedules:
            parallel = dataclasses.replace(cfg.parallel, **shape, sp=shape["tp"] > 1, microbatches=micro,
                                           schedule=schedule, virtual_stages=virtual)
            variant = dataclasses.replace(cfg, parallel=parallel)
            try:  # checkpointing does not change validity: once per schedule
                validate_layout(variant, world_size)
                if shape["pp"] > 1:
                    check_pipeline(variant)  # micro-batches against stages, per schedule
            except ConfigError:
                continue
            out += [dataclasses.replace(variant, parallel=dataclasses.replace(parallel, activation_checkpointing=ac,
                                                                              fsdp_gather=gather))
                    for ac in ac_modes for gather in gathers]
    return out


def best_variant(
    cfg: Config, shape: dict[str, int], world_size: int, hw: Hardware, assumptions: Assumptions = Assumptions()
) -> Plan | None:
    """The fitting variant with the best throughput, else the smallest; None when the shape is invalid."""
    plans = [evaluate(variant, hw, assumptions) for variant in _variants(cfg, shape, world_size)]
    fitting = [p for p in plans if p.fits]
    if fitting:
        return max(fitting, key=lambda p: p.time.tokens_per_second)
    return min(plans, key=lambda p: p.memory.total, default=None)


def rank_layouts(cfg: Config, world_size: int, hw: Hardware, assumptions: Assumptions = Assumptions()) -> list[Plan]:
    """Valid layouts for ``world_size`` devices, fitting ones first, each group by predicted throughput."""
    shapes = mesh_shapes(cfg, world_size, hw.gpus_per_node)
    plans = [best_variant(cfg, shape, world_size, hw, assumptions) for shape in shapes]
    plans = [p for p in plans if p is not None]
    return sorted(plans, key=lambda p: (not p.fits, -p.time.tokens_per_second))


def fitting_layout(
    cfg: Config, world_size: int, hw: Hardware, assumptions: Assumptions = Assumptions()
) -> Plan | None:
    """The fastest layout predicted to fit, or None."""
    ranked = rank_layouts(cfg, world_size, hw, assumptions)
    return ranked[0] if ranked and ranked[0].fits else None
