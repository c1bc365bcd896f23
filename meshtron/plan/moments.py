"""A rank's memory moment by moment along its pipeline schedule: the micro-batches each of its stages
holds after every action (:class:`Moment`), where its FSDP units are gathered, gain gradients and are
released (:class:`StageSpan`), and the terms at each moment (:func:`pipeline_moments`); pp = 1 is the
one-moment case.

Apart from the per-layer figures because only this part walks the schedules (``parallel/pipeline/
schedules.py``), and the walks are cached per schedule shape for the layout search.
See docs/planner.md, 'Memory model'."""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

from meshtron.config import Config
from meshtron.parallel.pipeline.schedules import (
    SPLIT_BACKWARD,
    B,
    F,
    W,
    built_schedule,
    held_by_stage,
    last_weight_passes,
    runs_backward_whole,
    split_backwards,
    steady_microbatches,
)
from meshtron.parallel.pipeline.split import chunk_layer_ranges, chunk_rank
from meshtron.plan.activations import (
    _chunk_backward_peak,
    _loss_held_per_microbatch,
    _recomputes_every_layer,
    _sp_split,
    by_kind,
    captured_gradient_bytes,
    ep_dispatch_bytes,
    final_norm_bytes,
    layer_checkpointed,
    layer_kept_bytes,
    layer_offloaded,
    loss_chunk_bytes,
    microbatch_tokens,
    offload_in_flight_bytes,
    offload_window_bytes,
    offloaded_activation_bytes,
)
from meshtron.plan.parameters import (
    FP32,
    Coords,
    _unit_grad_bytes,
    _v_shape,
    compute_bytes,
    unit_elements,
    unit_gathered_bytes,
)

PHASES = ("forward", "backward", "backward end")


def in_flight(cfg: Config, pp_rank: int) -> int:
    """Micro-batches whose activations a rank holds at its peak (each one model chunk with virtual stages)."""
    return sum(live for live, _ in _peak_moment(cfg, pp_rank).held.values())


class Moment(NamedTuple):
    """The rank's state after one action of its schedule: what its in-flight micro-batches hold."""

    index: int  # of the action in the rank's entries
    held: dict[int, tuple[int, int]]  # global stage -> (micro-batches held, of them split backwards waiting for W)
    saved: float  # their saved activations and recorded gradients (:func:`saved_activation_bytes`)
    loss: float  # the fused loss's saved tensors of the last stage's micro-batches (:func:`loss_held_bytes`)


def _moments(cfg: Config, pp_rank: int) -> tuple[tuple[int, dict[int, tuple[int, int]]], ...]:
    """(action index, {stage: (held, waiting)}) after each of the rank's distinct actions (``held_by_stage``);
    stages with checkpointed or compiled layers run their backward whole (the executor's ``unsplit``)."""
    p = cfg.parallel
    if p.pp == 1:
        return ((0, {0: (1, 0)}),)
    return tuple((a.index, a.held) for a in _rank_actions(cfg, pp_rank)[0])


def _rank_actions(cfg: Config, pp_rank: int) -> tuple[tuple, dict]:
    p = cfg.parallel
    # Unsplit stages matter only where a schedule splits backwards: one walk for every checkpointing mode.
    unsplit = unsplit_stages(cfg) if p.schedule in SPLIT_BACKWARD else frozenset()
    # Past the steady state's micro-batch count more only repeat the same states: walk that count.
    microbatches = steady_microbatches(p.schedule, p.pp, p.microbatches)
    return _actions_by_rank(p.schedule, p.pp, microbatches, p.virtual_stages, unsplit)[pp_rank]


class StageSpan(NamedTuple):
    """Where in a rank's actions one stage's FSDP units change state (``parallel/pipeline/executor.py``)."""

    gathered: int  # its first forward all-gathers them; they stay unsharded through the step
    grads: int  # its first weight-gradient pass (a ``W``, or a ``B`` run whole) creates their fp32 gradients
    backward: int  # its first ``B``: the fused loss's backward gives the LM head's gradient there
    released: int  # its last weight pass reduce-scatters those and frees both (``_release_points``)


class HeldAction(NamedTuple):
    """One compute action of a rank's schedule (a ``schedules.Action``, by its index) and the micro-batches
    its stages hold before and after it."""

    index: int
    kind: str  # "F", "B" or "W"
    stage: int
    split: bool  # a ``B`` computing input gradients only, its graph kept for the ``W``
    held: dict[int, tuple[int, int]]  # as :class:`Moment`'s
    prior: dict[int, tuple[int, int]]  # ``held`` of the rank's action before it (none before the first)


@functools.lru_cache(maxsize=256)
def _actions_by_rank(schedule: str, pp: int, microbatches: int, virtual: int, unsplit: frozenset[int]):
    """Per rank: (its distinct :class:`HeldAction` s, :func:`_distinct_actions`, {stage: :class:`StageSpan`})."""
    out = []
    for entries in built_schedule(schedule, pp, microbatches, virtual):
        split = {key for key in split_backwards(entries) if key[0] not in unsplit}
        actions, prior = [], {}
        for i, held in held_by_stage(entries, unsplit):
            actions.append(
                HeldAction(
                    i, entries[i].kind, entries[i].stage, (entries[i].stage, entries[i].mb) in split, held, prior
                )
            )
            prior = held
        spans = _stage_spans(entries, actions, split)
        out.append((_distinct_actions(actions, spans), spans))
    return tuple(out)


def _stage_spans(entries, actions: list[HeldAction], split: set[tuple[int, int]]) -> dict[int, StageSpan]:
    """{stage: :class:`StageSpan`} of one rank. A release is at the rank's last action at or before the
    stage's last weight pass: an unsplit stage's ``W`` is no action here (its ``B`` ran the whole
    backward), and no action falls between the two."""
    first: dict[tuple[str, int], int] = {}
    for a in actions:
        weight = a.kind == W or (a.kind == B and (a.stage, entries[a.index].mb) not in split)
        for kind in (a.kind, "weight") if weight else (a.kind,):
            first.setdefault((kind, a.stage), a.index)
    indices = [a.index for a in actions]
    return {
        stage: StageSpan(
            first[(F, stage)],
            first[("weight", stage)],
            first[(B, stage)],
            indices[bisect.bisect_right(indices, last) - 1],
        )
        for stage, last in last_weight_passes(entries).items()
    }


def _distinct_actions(actions: list[HeldAction], spans: dict[int, StageSpan]) -> tuple[HeldAction, ...]:
    """The first of the actions that :func:`pipeline_moments` gives equal terms: same kind, stage and
    split, same micro-batches held before and after, and the same side of every span boundary (where
    units are gathered, gain gradients or are released; a boundary's own action is the only one there).
    A 1F1B steady state of thousands of micro-batches repeats a few such states, which the layout
    search would otherwise walk for every pp rank of every candidate."""
    bounds = sorted({i for span in spans.values() for i in span})
    seen, out = set(), []
    for a in actions:
        below = bisect.bisect_left(bounds, a.index)
        at = bounds[below] if below < len(bounds) and bounds[below] == a.index else None
        key = (a.kind, a.stage, a.split, tuple(sorted(a.held.items())), tuple(sorted(a.prior.items())), below, at)
        if key not in seen:
            seen.add(key)
            out.append(a)
    return tuple(out)


def _peak_moment(cfg: Config, pp_rank: int) -> Moment:
    """The moment the rank's in-flight micro-batches hold the most (activations and loss tensors),
    each counted by its own stage's bytes (:func:`_stage_bytes`)."""
    per_stage = _rank_stage_bytes(cfg, pp_rank)
    return max((_moment(cfg, per_stage, *m) for m in _moments(cfg, pp_rank)), key=lambda m: m.saved + m.loss)


def _moment(
    cfg: Config, per_stage: dict[int, tuple[float, float]], index: int, held: dict[int, tuple[int, int]]
) -> Moment:
    """What ``held`` holds: each stage's micro-batches weighed by :func:`_stage_bytes`."""
    saved = microbatch_tokens(cfg) * sum(n * per_stage[s][0] + w * per_stage[s][1] for s, (n, w) in held.items())
    last = cfg.parallel.pp * cfg.parallel.virtual_stages - 1
    return Moment(index, held, saved, held.get(last, (0, 0))[0] * _loss_held_per_microbatch(cfg))


def _rank_stages(cfg: Config, pp_rank: int) -> list[int]:
    """The global stages the rank runs."""
    p = cfg.parallel
    return [s for s in range(p.pp * p.virtual_stages) if chunk_rank(s, p.pp, _v_shape(cfg)) == pp_rank]


def _rank_stage_bytes(cfg: Config, pp_rank: int) -> dict[int, tuple[float, float]]:
    """:func:`_stage_bytes` of each global stage the rank runs."""
    return {s: _stage_bytes(cfg, s) for s in _rank_stages(cfg, pp_rank)}


def _stage_bytes(cfg: Config, stage: int) -> tuple[float, float]:
    """Per token of one micro-batch of global stage ``stage``: (what it holds from its ``F`` to its
    backward: every layer's saved tensors, checkpointed layers their input only, the last stage's
    final norm, a later stage's received input; what a split backward's ``B`` adds until its ``W``:
    the output gradients ``W`` restarts from, :func:`captured_gradient_bytes`, where the first stage's
    ``B`` is empty and keeps only the gradient it received, ``executor.py``)."""
    p, m = cfg.parallel, cfg.model
    c, h, sp = compute_bytes(cfg), m.hidden_size, _sp_split(cfg)
    layers = chunk_layer_ranges(m.num_hidden_layers, p.pp, p.virtual_stages)[stage]
    kept = sum(by_kind(cfg, _layer_kept_on_device, layers))
    if stage == p.pp * p.virtual_stages - 1:
        kept += (4 + c) * h / sp  # the final norm's fp32 input and normalized value
    if stage > 0:
        kept += c * h / sp  # the stage input received from the previous stage
    waiting = sum(by_kind(cfg, captured_gradient_bytes, layers)) if stage > 0 else c * h / sp
    return kept, waiting


def offloaded_held_bytes(cfg: Config, pp_rank: int) -> float:
    """Host bytes of the saved tensors ``offload_activations`` holds at the rank's most: every in-flight
    micro-batch's offloaded layers of its own stage (pp = 1: one micro-batch's, every offloaded layer's).
    A micro-batch's copies stay on the host until its backward (with a split backward, its ``W``) is done."""
    if not cfg.parallel.offload_activations:
        return 0.0
    p = cfg.parallel
    ranges = chunk_layer_ranges(cfg.model.num_hidden_layers, p.pp, p.virtual_stages)
    per_stage = {s: offloaded_activation_bytes(cfg, ranges[s]) for s in _rank_stages(cfg, pp_rank)}
    return max(sum(n * per_stage[s] for s, (n, _) in held.items()) for _, held in _moments(cfg, pp_rank))


def _layer_kept_on_device(cfg: Config, layer: int) -> float:
    return 0.0 if layer_offloaded(cfg, layer) else layer_kept_bytes(cfg, layer)


def unsplit_stages(cfg: Config) -> frozenset[int]:
    """Stages whose backward the executor runs whole even in a zero-bubble schedule (its ``unsplit``):
    those with checkpointed or compiled layers."""
    p = cfg.parallel
    ranges = chunk_layer_ranges(cfg.model.num_hidden_layers, p.pp, p.virtual_stages)
    return frozenset(
        s
        for s, r in enumerate(ranges)
        if runs_backward_whole(r, lambda i: layer_checkpointed(cfg, i), lambda _: p.compile)
    )


def saved_activation_bytes(cfg: Config, pp_rank: int) -> float:
    """Tensors the in-flight micro-batches keep for backward at the rank's peak (:func:`_stage_bytes`
    per stage: saved tensors, the final norm's, the stage input; with a split backward also the output
    gradients each waiting ``W`` restarts from)."""
    return _peak_moment(cfg, pp_rank).saved


def loss_held_bytes(cfg: Config, pp_rank: int) -> float:
    """What the fused loss (``models/chunked_loss.py``) saves for backward per in-flight micro-batch of the last
    stage at the rank's peak: the hidden-state gradient [tokens, H] and the fp32 weight-gradient
    accumulator [V/tp, H]."""
    return _peak_moment(cfg, pp_rank).loss


def loss_bytes(cfg: Config, pp_rank: int) -> float:
    """The fused, chunked LM head + cross-entropy on the last stage at its peak (end of forward)."""
    return loss_held_bytes(cfg, pp_rank) + loss_chunk_bytes(cfg, pp_rank)


class _UnitGroup(NamedTuple):
    """FSDP units of a pipeline rank that change state together (:class:`StageSpan`), with their bytes."""

    span: StageSpan
    gathered: float  # compute-dtype unsharded parameters
    unsharded: float  # fp32 accumulated gradients
    sharded: float  # fp32 gradient shards once reduce-scattered
    largest: float  # fp32 bytes of the largest unit: the reduce-scatter's input buffer
    largest_in_layers: bool  # a block's or experts' unit (its restarted W's gradients: weight_grads)


def _unit_groups(cfg: Config, coords: Coords, spans: dict[int, StageSpan]) -> list[_UnitGroup]:
    """The rank's units grouped by span: a block's by its layer's stage, the embedding's by the first,
    the LM head's by the last, the stage root's (final norm, tied embedding) by every stage of the
    rank, since its hooks run with each chunk: gathered at the first, released at the last."""
    p = cfg.parallel
    stage_of = {
        i: s for s, r in enumerate(chunk_layer_ranges(cfg.model.num_hidden_layers, p.pp, p.virtual_stages)) for i in r
    }
    last = p.pp * p.virtual_stages - 1
    stage_of.update({i: last for i in cfg.model.mtp_layers})  # the modules run after the head, on its stage
    special = {"embed": [0], "head": [last], "root": list(spans)}
    shards, gathered = _unit_grad_bytes(cfg, coords), unit_gathered_bytes(cfg, coords.pp)
    groups: dict[StageSpan, list[float]] = {}
    for unit, elements in unit_elements(cfg, coords.pp).items():
        used = special.get(unit) or [stage_of[int(unit.split(".")[1])]]
        grads = min(spans[s].backward if unit == "head" else spans[s].grads for s in used)
        span = StageSpan(min(spans[s].gathered for s in used), grads, grads, max(spans[s].released for s in used))
        g = groups.setdefault(span, [0.0, 0.0, 0.0, 0.0, False])
        g[0] += gathered[unit]
        g[1] += FP32 * elements
        g[2] += shards.get(unit, 0.0)
        if FP32 * elements > g[3]:
            g[3], g[4] = FP32 * elements, unit.startswith(("block.", "experts."))
    return [_UnitGroup(span, *g) for span, g in groups.items()]


def _units_at(groups: list[_UnitGroup], index: int) -> dict[str, float]:
    """``gathered``, ``unsharded_grads`` and sharded ``grads`` during the rank's action ``index``."""
    live = [g for g in groups if g.span.gathered <= index <= g.span.released]
    return {
        "gathered": sum(g.gathered for g in live),
        "unsharded_grads": sum(g.unsharded for g in live if g.span.grads <= index),
        "grads": sum(g.sharded for g in groups if g.span.released < index),
    }


def _reducing_largest(
    units: dict[str, float], group: _UnitGroup, restarted_weights: bool, c: float
) -> dict[str, float]:
    """The units while a release reduce-scatters its group's largest unit: FSDP's post-backward has
    resharded that unit and folded its fresh compute-dtype gradients (counted in ``weight_grads`` after
    a restarted ``W``) into the fp32 accumulator before it allocates the reduce-scatter input, so neither
    is live beside that input (docs/planner.md: the 57B's first choice on 64 GPUs)."""
    gathered = c * group.largest / FP32
    folded = gathered if restarted_weights and group.largest_in_layers else 0.0
    return {**units, "gathered": units["gathered"] - gathered, "unsharded_grads": units["unsharded_grads"] - folded}


def _chunk_weight_gradient_bytes(cfg: Config, pp_rank: int, ranges: list[range], stages) -> dict[int, float]:
    """Per stage, the compute-dtype weight gradients of its layers: a restarted ``W``
    (``executor._Deferred.run``) computes them before they are added to ``.grad``, which the last stages'
    dry runs traced above the plan until counted (docs/planner.md)."""
    units = unit_elements(cfg, pp_rank)
    c = compute_bytes(cfg)
    return {s: c * sum(units.get(f"{kind}.{i}", 0) for i in ranges[s] for kind in ("block", "experts")) for s in stages}


def pipeline_moments(cfg: Config, coords: Coords) -> dict[str, list[dict[str, float]]]:
    """pp > 1: the terms (all but the fp32 state) at each moment of the rank's schedule, by phase.

    ``forward``: after each ``F`` (its micro-batch's tensors saved; on the last stage the loss's
    chunk buffers); ``backward``: during each ``B`` or ``W`` (the micro-batches held before it; a
    ``B`` adds its stage's working set, :func:`backward_peak`, and has freed its own final norm and
    loss tensors; a restarted ``W`` its chunk's weight gradients); ``backward end``: each release (a stage's last weight
    pass, ``_release_points``), with the reduce-scatter input of its largest unit, the released units still whole. FSDP
    units follow :func:`_unit_groups`: gathered from their stage's first forward, fp32 gradients from its
    first weight pass, both freed at the release, which leaves the sharded gradients."""
    p = cfg.parallel
    actions, spans = _rank_actions(cfg, coords.pp)
    groups = _unit_groups(cfg, coords, spans)
    per_stage = _rank_stage_bytes(cfg, coords.pp)
    last = p.pp * p.virtual_stages - 1
    one_loss = _loss_held_per_microbatch(cfg)
    norm = final_norm_bytes(cfg, coords.pp)
    ranges = chunk_layer_ranges(cfg.model.num_hidden_layers, p.pp, p.virtual_stages)
    rises = {s: _chunk_backward_peak(cfg, ranges[s], {}).rise for s in spans}
    weight_grads = _chunk_weight_gradient_bytes(cfg, coords.pp, ranges, spans)
    dispatch = ep_dispatch_bytes(cfg)
    window = offload_window_bytes(cfg, [i for s in spans for i in ranges[s]])  # across the rank's stages
    backward_dispatch = 0.0 if _recomputes_every_layer(cfg) else dispatch
    c = compute_bytes(cfg)
    # The embedding's backward ends the first stage's (its W, or an unsplit B), once the micro-batch's saved
    # tensors are freed: its compute-dtype gradient is live beside the fp32 accumulator FSDP folds it into,
    # which shows on a first stage small enough for the embedding to matter (docs/planner.md).
    fresh_embedding = c * unit_elements(cfg, coords.pp).get("embed", 0)
    out: dict[str, list[dict[str, float]]] = {phase: [] for phase in PHASES}
    for a in actions:
        prior, after = _moment(cfg, per_stage, a.index - 1, a.prior), _moment(cfg, per_stage, a.index, a.held)
        units = _units_at(groups, a.index)
        if a.kind == F:
            chunk = loss_chunk_bytes(cfg, coords.pp) if a.stage == last else 0.0
            copying = offload_in_flight_bytes(cfg, ranges[a.stage])  # its last offloaded block's, still on the device
            out["forward"].append(
                {
                    **units,
                    "activations": after.saved + copying,
                    "loss": after.loss + chunk,
                    "reduce_scatter": 0.0,
                    "ep_dispatch": dispatch,
                }
            )
            if window:  # inside an offloaded block: its copies and the previous offloaded block's
                out["forward"].append(
                    {
                        **units,
                        "activations": after.saved + window,
                        "loss": prior.loss,
                        "reduce_scatter": 0.0,
                        "ep_dispatch": dispatch,
                    }
                )
        else:
            # The first stage's split B is empty: its W runs the whole backward. A split B keeps the
            # graph for its W (the final norm's saved tensors too) and records the gradients W
            # restarts from as it goes; a whole B frees the final norm's before the layers' backward.
            whole = a.kind == B or a.stage == 0
            freed = norm if a.stage == last and a.kind == B and not a.split else 0.0
            rise = rises[a.stage] - freed if whole else 0.0
            consumed = one_loss if a.kind == B and a.stage == last else 0.0
            saved = max(prior.saved, after.saved)
            if a.kind == W and a.stage > 0:  # a restarted W holds its chunk's weight gradients at once
                units["unsharded_grads"] += weight_grads[a.stage]
            held = saved + rise
            if a.stage == 0 and (a.kind == W or not a.split):  # after the micro-batch's tensors are freed
                units["unsharded_grads"] += fresh_embedding
                held = max(held - fresh_embedding, after.saved)
            out["backward"].append(
                {
                    **units,
                    "activations": held,
                    "loss": max(0.0, prior.loss - consumed),
                    "reduce_scatter": 0.0,
                    "ep_dispatch": backward_dispatch if a.kind == B else 0.0,
                }
            )
        for g in groups:
            if g.span.released == a.index:
                out["backward end"].append(
                    {
                        **_reducing_largest(units, g, a.kind == W and a.stage > 0, c),
                        "activations": after.saved,
                        "loss": after.loss,
                        "reduce_scatter": g.largest,
                        "ep_dispatch": 0.0,
                    }
                )
    return out
