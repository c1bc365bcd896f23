"""Step-time model: compute, communication per collective kind and mesh dimension, host offload and the
pipeline bubble from the schedule simulator.

step time = (compute + exposed communication + host offload) / (1 - bubble), where tp, cp, ep and pp
transfers are exposed whole and the data-parallel traffic only beyond the compute it overlaps
(:func:`exposed_communication`), and the host offload's copies, optimizer step and gradient adds are
:func:`host_offload_seconds`. See docs/planner.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from meshtron.config import Config
from meshtron.models.qwen2 import flops_per_token
from meshtron.parallel.pipeline.schedules import built_schedule, steady_microbatches
from meshtron.parallel.pipeline.simulate import simulate
from meshtron.plan.activations import by_kind, offloaded_activation_bytes, recomputed_share
from meshtron.plan.communication import (
    _padded,
    _ring,
    _seconds,
    communication,
    fsdp_gathers_once,
    fsdp_reductions,
    overlapped_tp_seconds,
)
from meshtron.plan.gemm import step_compute_seconds
from meshtron.plan.hardware import EMULATED_FP8_RECIPES, Hardware
from meshtron.plan.moments import unsplit_stages
from meshtron.plan.parameters import (
    FP32,
    _stage_layer_ranges,
    fp8_weights,
    offloads_optimizer,
    stage_params,
    state_bytes,
)


@dataclass
class StepTime:
    seconds: float
    tokens_per_second: float
    compute: float
    exposed_comm: float
    bubble: float
    comm_bytes: dict[str, float] = field(default_factory=dict)  # "kind/dim" -> bytes per rank per step
    exposed_by: dict[str, float] = field(default_factory=dict)  # dims -> exposed seconds (exposed_communication)
    host_optimizer: float = 0.0  # seconds of the optimizer step on the host (``offload = "optimizer"``)
    host_accumulate: float = 0.0  # seconds of adding later micro-batches' gradient shards on the host


@functools.lru_cache(maxsize=256)
def pipeline_bubble(
    schedule: str, pp: int, microbatches: int, virtual: int, backward_cost: float, split: bool = True
) -> float:
    """Idle fraction of the simulated schedule (forward cost 1 per chunk). Of ``backward_cost`` the
    weight gradients take one forward's matmuls (``W`` of a split backward) and the rest is the input
    gradient (``B``); an unsplit backward costs the sum, and without ``split`` (any stage in
    ``moments.unsplit_stages``) every backward runs whole at ``B``."""
    if pp == 1:
        return 0.0
    steady = steady_microbatches(schedule, pp, microbatches)
    w = 1 if split else 0
    # Waits as the executor does, only for what an action consumes (the V schedules need it).
    result = simulate(built_schedule(schedule, pp, steady, virtual), 1, backward_cost - w, w_cost=w, rendezvous=False)
    if steady == microbatches:
        return result.bubble
    # Each micro-batch past the steady count adds a steady-state pattern, in which no rank idles: the
    # idle time stays, the busy time (every chunk's forward and backward) grows.
    idle = pp * result.makespan - pp * virtual * steady * (1 + backward_cost)
    return idle / (pp * virtual * microbatches * (1 + backward_cost) + idle)


def recompute_factor(cfg: Config) -> float:
    """Forward + backward cost 3 units per layer; each checkpointed layer adds the share of its forward
    it recomputes (:func:`recomputed_share`)."""
    layers = cfg.model.num_hidden_layers
    return 1 + sum(by_kind(cfg, recomputed_share, range(layers))) / layers / 3


def predict_step_time(
    cfg: Config,
    hw: Hardware = Hardware(),  # noqa: B008 - a frozen dataclass
    compute_seconds: float | None = None,
) -> StepTime:
    """``compute_seconds``: a rank's traced compute time (the dry run's roofline) instead of the
    model's (:func:`compute_time`)."""
    p, t = cfg.parallel, cfg.train
    tokens = t.global_batch_size * t.seq_len
    recompute = recompute_factor(cfg)
    compute = compute_seconds if compute_seconds is not None else compute_time(cfg, hw)
    comm = communication(cfg)
    host = host_offload_seconds(cfg, compute / recompute, hw)
    exposed_by = exposed_communication(cfg, comm, compute, hw, waited=host.reduce_scatter)
    if host.link:
        exposed_by["host"] = host.link
    exposed = sum(exposed_by.values())
    # Backward costs twice a forward, plus the recomputed forward of the checkpointed share of layers.
    bubble = pipeline_bubble(
        p.schedule, p.pp, p.microbatches, p.virtual_stages, 2 + 3 * (recompute - 1), split=not unsplit_stages(cfg)
    )
    seconds = (compute + exposed + host.optimizer + host.add) / (1 - bubble)
    return StepTime(seconds, tokens / seconds, compute, exposed, bubble, comm, exposed_by, host.optimizer, host.add)


# AdamW on fp32 state reads the parameter, its gradient and both moments and writes the parameter and
# the moments: 7 fp32 values, 28 bytes per parameter (torch's fused kernel, one pass).
ADAM_BYTES_PER_PARAM = 7 * FP32


class HostSeconds(NamedTuple):
    link: float  # exposed seconds of host-device copies
    optimizer: float  # seconds of the optimizer step on the host
    add: float = 0.0  # seconds of the host adding later micro-batches' gradient shards (accumulation_seconds)
    reduce_scatter: float = 0.0  # seconds of those micro-batches' gradient reduce-scatters, which the host waits for


# Of host_transfer_bytes: the gradient shards of the micro-batches after the first, copied blocking.
ACCUMULATED = "accumulated gradients"


def accumulated_reductions(cfg: Config) -> int:
    """Micro-batches per step whose reduce-scattered gradient shards FSDP2 adds into gradients already on
    the host (``offload = "optimizer"``, pp = 1, a reduce-scatter every micro-batch): all but the first.
    Their copy to the host blocks the host thread (``meshtron.host.TORCH_WAITS``)."""
    return fsdp_reductions(cfg.parallel) - 1 if offloads_optimizer(cfg) else 0


def host_transfer_bytes(cfg: Config) -> dict[str, float]:
    """Bytes the first pipeline rank copies per step between host and device: with ``offload =
    "optimizer"`` each unit's fp32 shard to the device for every all-gather (FSDP2 copies the shard, then
    casts it; a pipeline gathers once per step) and each reduce-scattered fp32 gradient shard back (the
    first micro-batch's under ``"gradients"``, the later ones, which accumulate on the host, under
    :data:`ACCUMULATED`); with ``offload_activations`` every offloaded block of its stages: its saved
    tensors out in forward and back in backward, per micro-batch."""
    p = cfg.parallel
    out: dict[str, float] = {}
    if offloads_optimizer(cfg):
        shard = state_bytes(cfg)["params"]
        gathers = 1 if fsdp_gathers_once(p) else 2 * p.microbatches
        reduces = fsdp_reductions(p)
        accumulated = accumulated_reductions(cfg)
        out["parameters"] = gathers * shard
        out["gradients"] = (reduces - accumulated) * shard
        if accumulated:
            out[ACCUMULATED] = accumulated * shard
    if p.offload_activations:
        stages = _stage_layer_ranges(cfg, 0)
        out["activations"] = 2 * p.microbatches * sum(offloaded_activation_bytes(cfg, layers) for layers in stages)
    return out


def host_offload_seconds(cfg: Config, compute: float, hw: Hardware) -> HostSeconds:
    """Host offload's cost per step, with ``compute`` the step's compute time without recomputation.
    Parameter copies, the first micro-batch's gradient copies (non-blocking, into pinned memory) and the
    saved tensors' outbound copies (offload side stream) run beside compute: together they hide behind it
    and only their excess over it is exposed. The saved tensors' copies back run on the compute stream when
    backward needs them: exposed whole. So are the later micro-batches' gradient copies, which block the
    host (:func:`accumulation_seconds`). The optimizer steps after the backward, on the host, before the
    next forward: exposed whole, at :data:`ADAM_BYTES_PER_PARAM` over ``hw.host_memory_gbps``."""
    moved = host_transfer_bytes(cfg)
    if not moved:
        return HostSeconds(0.0, 0.0)
    link = hw.host_link_gbps * 1e9
    back = moved.get("activations", 0.0) / 2
    blocking = moved.get(ACCUMULATED, 0.0)
    overlapped = (sum(moved.values()) - back - blocking) / link
    optimizer = 0.0
    if offloads_optimizer(cfg):
        optimizer = state_bytes(cfg)["params"] / FP32 * ADAM_BYTES_PER_PARAM / (hw.host_memory_gbps * 1e9)
    accumulation = accumulation_seconds(cfg, hw)
    return HostSeconds(
        (back + blocking) / link + max(0.0, overlapped - compute),
        optimizer,
        accumulation.add,
        accumulation.reduce_scatter,
    )


# Adding a gradient shard into the one on the host reads both and writes the sum: 3 fp32 values a parameter.
HOST_ADD_BYTES_PER_PARAM = 3 * FP32


class Accumulation(NamedTuple):
    add: float  # seconds of the host's adds
    reduce_scatter: float  # seconds of the reduce-scatters the host waits for before copying


def accumulation_seconds(cfg: Config, hw: Hardware) -> Accumulation:
    """The exposed cost of the micro-batches after the first under ``offload = "optimizer"``
    (:func:`accumulated_reductions`): FSDP2 adds each one's reduce-scattered gradient shard into the gradient
    already on the host, so it copies the shard to the host blocking (torch's ``foreach_reduce``) and adds it
    on the host thread. While the host waits for a unit's reduce-scatter and copy and then adds, it queues
    no further kernel and the device idles once the unit's backward is done: the reduce-scatter, the copy
    (:func:`host_offload_seconds` counts it, :data:`ACCUMULATED`) and the add, at
    :data:`HOST_ADD_BYTES_PER_PARAM` over ``hw.host_memory_gbps``, are all exposed."""
    accumulated = accumulated_reductions(cfg)
    if not accumulated:
        return Accumulation(0.0, 0.0)
    parameters = state_bytes(cfg)["params"] / FP32
    add = accumulated * parameters * HOST_ADD_BYTES_PER_PARAM / (hw.host_memory_gbps * 1e9)
    return Accumulation(add, accumulated * _gradient_reduce_scatter_seconds(cfg, hw))


def _gradient_reduce_scatter_seconds(cfg: Config, hw: Hardware) -> float:
    """Seconds of one micro-batch's fp32 gradient reduce-scatters under full sharding (the only mode that
    reduces every micro-batch, ``data.reduces_gradients``): the dense units over the dense data ranks,
    the experts over theirs, as :func:`_data_parallel_bytes` counts each."""
    p = cfg.parallel
    dense = p.dp * p.cp * p.mesh_ep
    elements = sum(_padded(cfg, 0, group, dense) for group in ((False, False), (True, False), (False, True)))
    seconds = _seconds(cfg, "reduce_scatter/dp_ep_cp", FP32 * elements * _ring(dense), hw)
    edp = p.dp * p.cp * p.mesh_ep * p.tp // (p.ep * p.etp)
    experts = _padded(cfg, 0, "experts", edp)
    if experts and edp > 1:
        seconds += _seconds(cfg, "reduce_scatter/edp", FP32 * experts * _ring(edp), hw)
    return seconds


def exposed_communication(
    cfg: Config, comm: dict[str, float], compute: float, hw: Hardware, waited: float = 0.0
) -> dict[str, float]:
    """Seconds of ``comm`` on the critical path, by the mesh dimensions of each group (``"tp"``, ``"pp"``,
    ...): every tp, cp, ep and pp transfer, of tp_overlap's rings only what their GEMMs do not hide; of
    the data-parallel ones, overlapping compute, only their excess over ``compute``, under ``"dp"``, but for
    ``waited`` seconds of them the host waits for (:func:`accumulation_seconds`), exposed whole."""
    out: dict[str, float] = {}
    overlapped = 0.0
    for key, nbytes in comm.items():
        seconds = overlapped_tp_seconds(cfg, hw) if key == "p2p/tp" else _seconds(cfg, key, nbytes, hw)
        if _is_data_parallel(key):
            overlapped += seconds
        else:
            dims = key.split("/")[1]
            out[dims] = out.get(dims, 0.0) + seconds
    out["dp"] = waited + max(0.0, overlapped - waited - compute)
    return out


def fp8_flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token that run as FP8 GEMMs: 2 per weight element in each of the forward, input-
    gradient and weight-gradient GEMMs, the last in the training dtype under ``rowwise_with_gw_hp``; none where the
    planned devices emulate the recipe (:data:`EMULATED_FP8_RECIPES`)."""
    if cfg.train.fp8 in EMULATED_FP8_RECIPES:
        return 0.0
    p = cfg.parallel
    params = {q.name: q for rank in range(p.pp) for q in stage_params(cfg, rank)}.values()
    gemms = 2 if cfg.train.fp8 == "rowwise_with_gw_hp" else 3
    return 2 * gemms * sum(math.prod(q.shape) for q in fp8_weights(cfg, params))


def compute_time(cfg: Config, hw: Hardware) -> float:
    """A rank's compute seconds per step: :func:`meshtron.plan.gemm.step_compute_seconds`, or with
    ``hw.mfu`` pinned the step's training FLOPs per rank (checkpointed forwards included) at that MFU."""
    if hw.mfu is None:
        return step_compute_seconds(cfg, hw)
    p, t = cfg.parallel, cfg.train
    world = p.pp * p.dp * p.cp * p.mesh_ep * p.tp
    return matmul_seconds(cfg, t.global_batch_size * t.seq_len * recompute_factor(cfg) / world, hw)


def matmul_seconds(cfg: Config, tokens: float, hw: Hardware) -> float:
    """Compute time of ``tokens`` tokens' training FLOPs at ``hw.mfu`` of the peak: the FP8 GEMMs' share at
    the FP8 peak, the rest at the training dtype's."""
    fp8 = fp8_flops_per_token(cfg)
    rest = flops_per_token(cfg.model, cfg.train.seq_len) - fp8
    return tokens * (rest / hw.peak_tflops + fp8 / hw.fp8_peak_tflops) / (1e12 * hw.mfu)


def _is_data_parallel(key: str) -> bool:
    return key.split("/")[1] in ("dp", "dp_ep_cp", "cp_ep", "edp", "edp_shard", "edp_replicate")


__all__ = [
    "ACCUMULATED",
    "ADAM_BYTES_PER_PARAM",
    "HOST_ADD_BYTES_PER_PARAM",
    "accumulated_reductions",
    "accumulation_seconds",
    "Hardware",
    "StepTime",
    "compute_time",
    "exposed_communication",
    "fp8_flops_per_token",
    "host_offload_seconds",
    "host_transfer_bytes",
    "matmul_seconds",
    "pipeline_bubble",
    "predict_step_time",
]
