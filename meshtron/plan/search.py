"""Layouts for N devices ranked by predicted throughput, with the memory check that marks which fit.

A candidate keeps the recipe's model, batch, dtype and data-parallel mode and chooses the mesh (for MoE
models a dense one with the experts folded over it), then the micro-batch count, checkpointing mode and,
when pp > 1, schedule that fit with the best predicted throughput (the lowest-memory choice when none fits);
host offload only when no layout fits without it. What it tries, what it leaves out and why: docs/planner.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from meshtron.config import FSDP_GATHERS, Config, ConfigError
from meshtron.parallel.layout import validate_layout
from meshtron.plan.activations import layer_offloaded
from meshtron.plan.memory import GIB, Assumptions, Breakdown, predict_memory
from meshtron.plan.speed import Hardware, StepTime, predict_step_time, recompute_factor

# (activation_checkpointing, ac_policy) pairs, from the least recomputation to the most (a group is
# ordered by the predicted recomputation, ``_by_recomputation``: with a large ac_every selective
# recomputes less than alternate_matmuls).
AC_MODES = (("none", None), ("op", "save_matmuls"), ("op", "alternate_matmuls"), ("selective", None), ("full", None))
# (schedule, virtual stages, checkpointing modes) tried when pp > 1, besides interleaved 1F1B
# (:func:`pipeline_schedules`).
PIPELINE_SCHEDULES = (("1f1b", 1, AC_MODES), ("zb1p", 1, AC_MODES[:1]), ("zbv", 2, AC_MODES[:1]))


@dataclass
class LayoutPlan:
    """The planner's prediction for one layout: its memory per rank, its step time and whether it fits."""

    cfg: Config
    memory: Breakdown
    time: StepTime
    fits: bool
    evaluated: int = 1  # memory models the search evaluated to choose this variant of its mesh shape

    def layout(self) -> dict:
        p = self.cfg.parallel
        keys = (
            "pp",
            "dp",
            "cp",
            "ep",
            "tp",
            "sp",
            "etp",
            "fold_ep",
            "schedule",
            "virtual_stages",
            "microbatches",
            "activation_checkpointing",
            "data_parallel",
            "fsdp_gather",
            "offload",
            "offload_activations",
        )
        layout = {k: getattr(p, k) for k in keys}
        if p.activation_checkpointing == "op":
            layout["ac_policy"] = p.ac_policy
        return layout

    def overrides(self) -> str:
        """The ``--parallel.key value`` flags that select this layout."""
        return " ".join(f"--parallel.{k} {str(v).lower()}" for k, v in self.layout().items())

    def to_json(self) -> dict:
        return {
            "layout": self.layout(),
            "memory_gib": {k: round(v, 3) for k, v in self.memory.gib().items()},
            "total_gib": round(self.memory.total / GIB, 3),
            "host_gib_per_rank": round(self.memory.host_total / GIB, 3),
            "host_optimizer_seconds": self.time.host_optimizer,
            "host_accumulate_seconds": self.time.host_accumulate,
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


def evaluate(
    cfg: Config,
    hw: Hardware,
    assumptions: Assumptions = Assumptions(),  # noqa: B008 - a frozen dataclass
) -> LayoutPlan:
    memory = predict_memory(cfg, assumptions)
    return LayoutPlan(cfg, memory, predict_step_time(cfg, hw), fits(cfg, memory, hw))


def ranks_per_node(cfg: Config, hw: Hardware) -> int:
    p = cfg.parallel
    return min(hw.gpus_per_node, p.pp * p.dp * p.cp * p.mesh_ep * p.tp)


def fits(cfg: Config, memory: Breakdown, hw: Hardware) -> bool:
    """Whether each rank fits its device and a node's ranks together its host memory."""
    host = memory.host_total * ranks_per_node(cfg, hw)
    return memory.total <= hw.memory_gib * GIB and host <= hw.host_memory_gib * GIB


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shapes(cfg: Config, world_size: int, gpus_per_node: int) -> list[dict]:
    """Every pp x dp x cp x ep x tp = ``world_size`` with tp inside a node and ep only for MoE models,
    and for MoE models every folded expert split of each dense shape (:func:`folded_splits`); pp = 1 only with
    multi-token prediction, which runs without a pipeline."""
    m = cfg.model
    shapes = []
    for tp in _divisors(world_size):
        if tp > gpus_per_node:
            continue
        for pp in _divisors(world_size // tp):
            if pp > m.num_hidden_layers or (pp > 1 and m.num_nextn_predict_layers):
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
    return [
        dict(ep=ep, etp=etp, fold_ep=True)
        for etp in _divisors(tp)
        if m.moe_intermediate_size % etp == 0
        for ep in _divisors(stage_ranks // etp)
        if ep > 1 and m.num_experts % ep == 0
    ]


def pipeline_schedules(cfg: Config, pp: int) -> tuple[tuple[str, int, tuple[tuple[str, str | None], ...]], ...]:
    """(schedule, virtual stages, checkpointing modes) the search tries on ``pp`` stages, interleaved
    1F1B last, by ascending virtual stages."""
    if pp == 1:
        return (("1f1b", 1, AC_MODES),)
    layers = cfg.model.num_hidden_layers
    chunks = layers // pp if layers % pp == 0 else 1
    return PIPELINE_SCHEDULES + tuple(("interleaved", v, AC_MODES) for v in _divisors(chunks) if v > 1)


def _variant(
    cfg: Config,
    shape: dict,
    micro: int,
    schedule: str,
    virtual: int,
    ac: tuple[str, str | None] = AC_MODES[0],
    gather: str | None = None,
) -> Config:
    """``ac``: (activation_checkpointing, ac_policy; None keeps the recipe's)."""
    mode, policy = ac
    parallel = dataclasses.replace(
        cfg.parallel,
        **shape,
        sp=shape["tp"] > 1,
        microbatches=micro,
        schedule=schedule,
        virtual_stages=virtual,
        activation_checkpointing=mode,
        ac_policy=policy or cfg.parallel.ac_policy,
        fsdp_gather=gather or cfg.parallel.fsdp_gather,
    )
    return dataclasses.replace(cfg, parallel=parallel)


def _runs(variant: Config, world_size: int) -> bool:
    """Whether the layout is valid (micro-batches against stages per schedule, when pp > 1)."""
    try:
        validate_layout(variant, world_size)
    except ConfigError:
        return False
    return True


def _variant_groups(cfg: Config, shape: dict, world_size: int, schedule: str | None) -> Iterator[list[Config]]:
    """The shape's variants in groups, each ordered by checkpointing from none to full: a group's first
    fitting variant is its fastest (docs/planner.md). With pp = 1 a group per micro-batch count (and
    ``fsdp_gather`` mode, unless replicated); with
    pp > 1 a group per schedule and virtual-stage count (:func:`pipeline_schedules`' order), at the
    largest micro-batch count it runs; ``schedule``: only that one's."""
    t = cfg.train
    readers = shape["dp"] * (1 if shape["fold_ep"] else shape["ep"])
    if t.global_batch_size % readers:
        return
    counts = _divisors(t.global_batch_size // readers)
    if shape["pp"] == 1:
        gathers = FSDP_GATHERS if cfg.parallel.data_parallel != "replicate" else (cfg.parallel.fsdp_gather,)
        for micro in counts:
            if _runs(_variant(cfg, shape, micro, "1f1b", 1), world_size):
                for gather in gathers:
                    group = [_variant(cfg, shape, micro, "1f1b", 1, ac, gather) for ac in AC_MODES]
                    yield _by_recomputation([v for v in group if _offloads_what_it_sets(v)])
        return
    for name, virtual, ac_modes in pipeline_schedules(cfg, shape["pp"]):
        micro = next((m for m in reversed(counts) if _runs(_variant(cfg, shape, m, name, virtual), world_size)), None)
        if micro is not None and schedule in (None, name):
            variants = (_variant(cfg, shape, micro, name, virtual, ac) for ac in ac_modes)
            group = [v for v in variants if _offloads_what_it_sets(v)]
            if group:
                yield _by_recomputation(group)


def _offloads_what_it_sets(variant: Config) -> bool:
    """False for an ``offload_activations`` variant whose checkpointing recomputes every block (full,
    ``op``, selective at every layer): activation offload moves only the blocks kept whole, so it offloads
    nothing and would rank the variant without it a second time."""
    layers = range(variant.model.num_hidden_layers)
    return not variant.parallel.offload_activations or any(layer_offloaded(variant, i) for i in layers)


def _by_recomputation(group: list[Config]) -> list[Config]:
    """The variants ordered by the compute their recomputation adds (stable: ties keep AC_MODES' order)."""
    return sorted(group, key=recompute_factor)


class _ShapeSearch:
    """One mesh shape's evaluations: memory first, the step time only of a variant that fits."""

    def __init__(self, hw: Hardware, assumptions: Assumptions):
        self.hw, self.assumptions = hw, assumptions
        self.fitting: list[LayoutPlan] = []
        self.smallest: tuple[Config, Breakdown] | None = None
        self.evaluated = 0

    def first_fitting(self, group: list[Config]) -> LayoutPlan | None:
        """The group's first variant that fits, timed; None when none does."""
        for variant in group:
            memory = predict_memory(variant, self.assumptions)
            self.evaluated += 1
            if fits(variant, memory, self.hw):
                self.fitting.append(LayoutPlan(variant, memory, predict_step_time(variant, self.hw), True))
                return self.fitting[-1]
            if self.smallest is None or memory.total < self.smallest[1].total:
                self.smallest = (variant, memory)
        return None

    def best(self) -> LayoutPlan | None:
        """The fitting variant with the best throughput, else the smallest."""
        if self.fitting:
            best = max(self.fitting, key=lambda p: p.time.tokens_per_second)
        elif self.smallest is not None:
            best = LayoutPlan(*self.smallest, predict_step_time(self.smallest[0], self.hw), False)
        else:
            return None
        return dataclasses.replace(best, evaluated=self.evaluated)


def best_variant(
    cfg: Config,
    shape: dict[str, int],
    world_size: int,
    hw: Hardware,
    assumptions: Assumptions = Assumptions(),  # noqa: B008 - a frozen dataclass
    schedule: str | None = None,
) -> LayoutPlan | None:
    """The fitting variant with the best throughput, else the smallest; None when the shape is invalid
    (``schedule``: with pp > 1, of that schedule only, as a published run fixed it).
    Interleaved 1F1B stops at the first virtual-stage count that does not fit or is not faster than
    the one before: each step of v cuts a smaller share of bubble ((p - 1) / (v m + p - 1)) and adds
    as much pipeline traffic and more held activations than the one before."""
    search = _ShapeSearch(hw, assumptions)
    previous: LayoutPlan | None = None
    for group in _variant_groups(cfg, shape, world_size, schedule):
        plan = search.first_fitting(group)
        if group[0].parallel.schedule != "interleaved":
            continue
        if plan is None or (previous is not None and plan.time.tokens_per_second <= previous.time.tokens_per_second):
            break
        previous = plan
    return search.best()


def rank_layouts(
    cfg: Config,
    world_size: int,
    hw: Hardware,
    assumptions: Assumptions = Assumptions(),  # noqa: B008 - a frozen dataclass
) -> list[LayoutPlan]:
    """Valid layouts for ``world_size`` devices, fitting ones first, each group by predicted throughput;
    with host offload only when none fits without it (docs/planner.md)."""
    shapes = mesh_shapes(cfg, world_size, hw.gpus_per_node)
    plans = [best_variant(cfg, shape, world_size, hw, assumptions) for shape in shapes]
    if not any(p is not None and p.fits for p in plans):
        plans += [
            best_variant(variant, shape, world_size, hw, assumptions)
            for variant in offload_variants(cfg)
            for shape in shapes
        ]
    plans = [p for p in plans if p is not None]
    return sorted(plans, key=lambda p: (not p.fits, -p.time.tokens_per_second))


def offload_variants(cfg: Config) -> list[Config]:
    """The recipe with each host offload it does not set already: the optimizer state (FSDP and HSDP
    only), the saved activations (not with compiled blocks), both."""
    p = cfg.parallel
    optimizer = ("none", "optimizer") if p.data_parallel in ("fsdp", "hsdp") else ("none",)
    activations = (False,) if p.compile else (False, True)
    return [
        dataclasses.replace(cfg, parallel=dataclasses.replace(p, offload=o, offload_activations=a))
        for o in optimizer
        for a in activations
        if (o, a) != ("none", False) and (o, a) != (p.offload, p.offload_activations)
    ]


def fitting_layout(
    cfg: Config,
    world_size: int,
    hw: Hardware,
    assumptions: Assumptions = Assumptions(),  # noqa: B008 - a frozen dataclass
) -> LayoutPlan | None:
    """The fastest layout predicted to fit, or None."""
    ranked = rank_layouts(cfg, world_size, hw, assumptions)
    return ranked[0] if ranked and ranked[0].fits else None
