"""Per-rank memory model: bytes by named term, as pure functions of a :class:`Config` and its layout.

This module composes the rank's terms at its peak (:func:`rank_breakdown`); the parameters and their exact
fp32 state are in :mod:`meshtron.plan.parameters`, one layer's activations per token in
:mod:`meshtron.plan.activations`, the walk of a pipeline rank's schedule in :mod:`meshtron.plan.moments`.
What each term counts, and the three moments of the peak: docs/planner.md#memory-model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from meshtron.config import Config
from meshtron.parallel.data_parallel import gathers_once_per_step, reduces_gradients
from meshtron.plan.activations import (
    BackwardPeak,
    _chunk_backward_peak,
    _recomputes_every_layer,
    ep_dispatch_bytes,
    final_norm_bytes,
    offload_in_flight_bytes,
    offload_window_bytes,
)
from meshtron.plan.moments import PHASES, loss_bytes, offloaded_held_bytes, pipeline_moments, saved_activation_bytes
from meshtron.plan.parameters import (
    FP32,
    Coords,
    _stage_layer_ranges,
    _unit_grad_bytes,
    compute_bytes,
    largest_layer_unit,
    offloads_optimizer,
    state_bytes,
    unit_elements,
    unit_gathered_bytes,
)

GIB = 2**30

TERMS = (
    "params",
    "grads",
    "optimizer",
    "gathered",
    "unsharded_grads",
    "reduce_scatter",
    "activations",
    "loss",
    "ep_dispatch",
    "other",
)


@dataclass(frozen=True)
class Assumptions:
    """What the model cannot derive from shapes. The defaults are estimates, not measurements on GPUs:
    about a GiB for the CUDA context, NCCL and cuBLAS workspaces, and 5 % caching-allocator slack."""

    reserved_gib: float = 1.0
    fragmentation: float = 0.05
    # Host memory of each rank's own process (Python, torch and the CUDA libraries, the data loader):
    # an estimate, counted in ``Breakdown.host`` beside what offload puts there.
    host_reserved_gib: float = 4.0


@dataclass
class Breakdown:
    """Per-rank bytes by term (:data:`TERMS`) for the busiest pipeline rank."""

    terms: dict[str, float] = field(default_factory=dict)
    pp_rank: int = 0
    phase: str = "backward"  # where the peak is: "forward" (end of forward, the loss), "backward" or "backward end"
    host: dict[str, float] = field(default_factory=dict)  # host-memory bytes by term (:func:`host_bytes`)

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.terms.items()}


def host_bytes(cfg: Config, coords: Coords, assumptions: Assumptions) -> dict[str, float]:
    """The rank's host memory by term (docs/planner.md#memory-model): the offloaded fp32 state, the offloaded saved
    tensors and the process's own (``assumptions.host_reserved_gib``)."""
    state = state_bytes(cfg, coords) if offloads_optimizer(cfg) else dict.fromkeys(("params", "grads", "optimizer"), 0)
    return {**state, "activations": offloaded_held_bytes(cfg, coords.pp), "other": assumptions.host_reserved_gib * GIB}


def backward_working_bytes(cfg: Config, pp_rank: int) -> float:
    """The rise over the saved activations while one layer runs backward (last layer first), at the
    layer where :func:`backward_peak` finds the backward's peak: its gradient temporaries and, if
    checkpointed, its recomputed saved tensors, less the saved tensors of the layers after it, already
    freed. Without checkpointing that is the last layer's gradients;
    with it, about one recomputed layer (MemTracker's temporaries at the peak are one block's saved
    tensors, ``benchmarks/results/plan_validation.md``)."""
    return backward_peak(cfg, Coords(pp=pp_rank))[0]


def backward_peak(cfg: Config, coords: Coords, reducing: bool | None = None) -> BackwardPeak:
    """The layer of the backward where the rise, the gradients already reduced and the reduce-scatter
    input in flight (pp = 1) sum highest.

    The rise is :func:`backward_working_bytes`'. When the backward reduces as it goes onto the device
    (``reducing``; default: the step starts without sharded gradients, :func:`sharded_grads_before_backward`,
    and they stay on the device: with the optimizer offloaded they go to the host), those of the LM head
    and of every layer already through its backward appear as the activations go: with checkpointing the
    last layer's backward peaks with nearly all of them. Otherwise they are counted whole elsewhere, or not
    yet there, and add nothing here."""
    if reducing is None:
        reducing = not sharded_grads_before_backward(cfg) and not offloads_optimizer(cfg)
    grads = _unit_grad_bytes(cfg, coords) if reducing else {}
    in_flight = reduce_scatter_in_flight(cfg, coords.pp)
    return max((_chunk_backward_peak(cfg, r, grads, in_flight) for r in _stage_layer_ranges(cfg, coords.pp)), key=sum)


def reduce_scatter_in_flight(cfg: Config, pp_rank: int) -> tuple[float, float]:
    """pp = 1: the fp32 reduce-scatter input live while the backward's first layer runs, and while each
    later one does. FSDP2 keeps a unit's input until the next unit's post-backward
    (``reduce_scatter_max_input_buffers`` = 1), so each layer runs beside the unit reduced before it: an
    untied LM head's [V/tp, H] for the first (it reduces before the layers, and can be larger than a
    layer's unit: where the state is small the backward peaks in that layer, docs/planner.md at 1,024
    ranks), the largest layer unit's for the rest."""
    block = FP32 * largest_layer_unit(cfg, pp_rank)
    return max(block, FP32 * unit_elements(cfg, pp_rank).get("head", 0)), block


def activation_bytes(cfg: Config, pp_rank: int) -> float:
    """Activations at the backward peak: the in-flight micro-batches' saved tensors plus one layer's
    backward working set (:func:`backward_working_bytes`)."""
    return saved_activation_bytes(cfg, pp_rank) + backward_working_bytes(cfg, pp_rank)


def data_parallel_bytes(cfg: Config, pp_rank: int, phase: str = "backward") -> dict[str, float]:
    """pp = 1: ``gathered``, ``unsharded_grads`` and ``reduce_scatter`` (docs/planner.md#memory-model) in backward
    (but ``reduce_scatter``, which depends on the layer at the peak: :func:`backward_peak`), at the end
    of the forward (``phase="forward"``: only the root and LM-head units gathered, with the last
    all-gather's output buffer (:func:`_last_gather_output`), blocks reshard after their forward, no gradient being
    reduced, unsharded gradients only when earlier micro-batches' backward left them accumulating) or at the end of the
    backward (``phase="backward end"``: only the embedding and root units left to reduce). Gathered per step
    (``fsdp_gather``), every unit stays gathered through the forward and the backward. Pipelines:
    :func:`pipeline_moments`."""
    p = cfg.parallel
    c = compute_bytes(cfg)
    units = unit_elements(cfg, pp_rank)
    gathered = unit_gathered_bytes(cfg, pp_rank)
    largest = max(units.values())
    root = units.get("root", 0)
    accumulate = p.microbatches > 1 and not reduces_gradients(p, 0, p.microbatches)
    held = sum(gathered.values()) if gathers_once_per_step(p) else 0  # fsdp_gather = "per_step"
    if phase == "forward":
        unsharded = FP32 * sum(units.values()) if accumulate else 0
        # Gathered per step, the loss of a later micro-batch follows no all-gather.
        return {
            "gathered": held or gathered.get("root", 0) + gathered.get("head", 0) + _last_gather_output(gathered),
            "unsharded_grads": unsharded,
            "reduce_scatter": 0,
        }
    if phase == "backward end":
        # The embedding's unit and the root (final norm; a tied embedding) are reduced last, after
        # every block's gradient has been reduce-scattered and freed.
        last = max(root, units.get("embed", 0))
        return {
            "gathered": gathered.get("root", 0),
            "unsharded_grads": (FP32 if accumulate else c) * last,
            "reduce_scatter": FP32 * last,
        }
    # The unit in use, the blocks prefetched ahead (their all-gather outputs: a unit's output is
    # copied into its parameters and freed before the next prefetch is issued) and the root unit;
    # the unit whose gradients it computes is a layer's (the embedding's and LM head's are outside the
    # layers). The reduce-scatter input beside it depends on the layer: :func:`backward_peak`.
    block = largest_layer_unit(cfg, pp_rank) or largest
    in_use = max(
        (b for u, b in gathered.items() if u.startswith(("block.", "experts."))), default=max(gathered.values())
    )
    ahead = p.fsdp_prefetch * in_use if p.data_parallel != "replicate" else 0
    unsharded = FP32 * sum(units.values()) if accumulate else c * block
    return {"gathered": held or in_use + ahead + gathered.get("root", 0), "unsharded_grads": unsharded}


def _last_gather_output(gathered: dict[str, float]) -> float:
    """The output buffer of the forward's last all-gather, still held at the loss: FSDP2 frees one only at
    the next all-gather's copy-in or at the root's post-forward (so that a copy-in can overlap the
    all-gather before it). The last is the LM head's, or with the head tied into the root unit the last
    layer's unit (at tp 1 a whole LM head, beside the loss: docs/planner.md, the 72B offload recipe)."""
    if "head" in gathered:
        return gathered["head"]
    layers = [u for u in gathered if u.startswith(("block.", "experts."))]
    return gathered[layers[-1]] if layers else 0.0


def sharded_grads_before_backward(cfg: Config) -> bool:
    """pp = 1: whether the rank holds its sharded fp32 gradients before the last backward of the step:
    only when an earlier micro-batch's backward already reduce-scattered into them (full sharding
    gathered per micro-batch reduces every micro-batch). The step starts with none
    (``zero_grad(set_to_none)``); replication, HSDP and ``per_step`` reduce on the last micro-batch."""
    p = cfg.parallel
    return p.microbatches > 1 and reduces_gradients(p, 0, p.microbatches)


def phase_terms(cfg: Config, coords: Coords, phase: str) -> dict[str, float]:
    """Every term but ``other`` live at the peak of ``phase``: ``"forward"`` (end of the forward, the
    fused loss running: all saved activations, the loss's chunk buffers), ``"backward"`` (one layer's
    backward: saved activations, its working set, the gradients reduced so far, reduction buffers) or
    ``"backward end"`` (every gradient, the last unit's reduction, no activations). Pipelines: the
    largest of the phase's moments in the rank's schedule (:func:`pipeline_moments`)."""
    return all_phase_terms(cfg, coords)[phase]


def all_phase_terms(cfg: Config, coords: Coords) -> dict[str, dict[str, float]]:
    """:func:`phase_terms` of every phase; a pipeline rank's schedule is walked once for all three."""
    if cfg.parallel.pp > 1:
        state = state_bytes(cfg, coords)
        moments = pipeline_moments(cfg, coords)
        return {
            phase: max(
                (_without_offloaded_state(cfg, {**state, **t}) for t in moments[phase]), key=lambda t: sum(t.values())
            )
            for phase in PHASES
        }
    return {phase: _without_offloaded_state(cfg, _unpipelined_phase_terms(cfg, coords, phase)) for phase in PHASES}


def _unpipelined_phase_terms(cfg: Config, coords: Coords, phase: str) -> dict[str, float]:
    terms: dict[str, float] = dict(state_bytes(cfg, coords))
    if phase != "backward end" and not sharded_grads_before_backward(cfg):
        terms["grads"] = 0
    terms.update(data_parallel_bytes(cfg, coords.pp, phase))
    terms["activations"] = terms["loss"] = terms["ep_dispatch"] = 0.0
    if phase == "backward end":
        return terms
    if phase == "forward":
        # Offloaded blocks: at the loss the last one's copies still run; inside one, it and the one before.
        saved, layers = saved_activation_bytes(cfg, coords.pp), range(cfg.model.num_hidden_layers)
        at_loss = (saved + offload_in_flight_bytes(cfg, layers), loss_bytes(cfg, coords.pp))
        terms["activations"], terms["loss"] = max(at_loss, (saved + offload_window_bytes(cfg, layers), 0.0), key=sum)
    else:
        rise, reduced, terms["reduce_scatter"] = backward_peak(cfg, coords)
        terms["grads"] += reduced  # nothing when they are counted whole
        # The micro-batch in backward has freed its final norm's saved tensors before its layers'
        # backward, and consumed its loss's saved gradients.
        terms["activations"] = saved_activation_bytes(cfg, coords.pp) + rise - final_norm_bytes(cfg, coords.pp)
        terms["loss"] = 0.0
    terms["ep_dispatch"] = ep_dispatch_bytes(cfg) if phase == "forward" or not _recomputes_every_layer(cfg) else 0.0
    return terms


def _without_offloaded_state(cfg: Config, terms: dict[str, float]) -> dict[str, float]:
    """``terms`` less the fp32 state ``offload = "optimizer"`` keeps in host memory."""
    return {**terms, **dict.fromkeys(("params", "grads", "optimizer"), 0.0)} if offloads_optimizer(cfg) else terms


def rank_breakdown(cfg: Config, coords: Coords, assumptions: Assumptions = Assumptions()) -> Breakdown:
    """Every term for the rank at ``coords``, at the larger of its forward and backward peaks."""
    phases = all_phase_terms(cfg, coords)
    phase = max(PHASES, key=lambda k: sum(phases[k].values()))
    terms = phases[phase]
    terms["other"] = assumptions.reserved_gib * GIB + assumptions.fragmentation * sum(terms.values())
    return Breakdown({k: terms[k] for k in TERMS}, coords.pp, phase, host_bytes(cfg, coords, assumptions))


def predict_memory(cfg: Config, assumptions: Assumptions = Assumptions()) -> Breakdown:
    """The busiest rank's breakdown: the pipeline rank with the largest total (data and tp index 0,
    which ``torch.chunk`` gives the largest shards), with the host bytes of the pipeline rank that keeps
    the most there: a node's ranks may hold any stage, and each needs at most that (with activation
    offload the first stage holds the most micro-batches, the last the most device memory)."""
    ranks = [rank_breakdown(cfg, Coords(pp=r), assumptions) for r in range(cfg.parallel.pp)]
    busiest = max(ranks, key=lambda b: b.total)
    return dataclasses.replace(busiest, host=max(ranks, key=lambda b: b.host_total).host)
