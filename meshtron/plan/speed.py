"""Step-time model: compute at an assumed MFU, communication per collective kind and mesh dimension,
and the pipeline bubble from the schedule simulator.

step time = (compute + exposed communication) / (1 - bubble)

- compute: ``flops_per_token`` x the step's tokens / devices / (peak x MFU), times 4/3 for every
  checkpointed block (its forward runs twice);
- communication: bytes each rank sends per step for each (collective, mesh dimension), at the
  intra-node bandwidth when the group fits in one node (tp is innermost, pp outermost), else the
  inter-node one. tp, cp, ep and pp transfers sit on the critical path; FSDP / HSDP / replicate
  traffic overlaps compute and only its excess is exposed;
- bubble: idle fraction of the simulated schedule (backward twice a forward, three times with
  recomputation; of it a split backward's ``W`` one forward, its ``B`` the rest; with activation
  checkpointing or compiled blocks the executor runs every backward whole at ``B``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from meshtron.config import Config
from meshtron.models.qwen2 import flops_per_token
from meshtron.parallel.pipeline.schedules import build_schedule
from meshtron.parallel.pipeline.simulate import simulate
from meshtron.plan.memory import FP32, compute_bytes, microbatch_tokens, unit_elements, unsplit_stages


@dataclass(frozen=True)
class Hardware:
    """Per-device figures (defaults: an H100 SXM node with 400 Gb/s InfiniBand per GPU)."""

    gpus_per_node: int = 8
    memory_gib: float = 80.0
    peak_tflops: float = 989.0  # dense bf16
    mfu: float = 0.40  # assumed fraction of peak the matmuls reach
    intra_gbps: float = 450.0  # GB/s per direction per GPU inside a node (NVLink)
    inter_gbps: float = 50.0  # GB/s per GPU between nodes


@dataclass
class StepTime:
    seconds: float
    tokens_per_second: float
    compute: float
    exposed_comm: float
    bubble: float
    comm_bytes: dict[str, float] = field(default_factory=dict)  # "kind/dim" -> bytes per rank per step


def group_is_intra_node(cfg: Config, dims: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether a group over ``dims`` stays inside one node: the ranks it spans (its outermost dim's
    stride times that dim's size) fit in a node."""
    p = cfg.parallel
    if dims in (("ep",), ("etp",)):  # the experts' groups: etp innermost, ep next when folded
        span = p.etp if dims == ("etp",) else p.ep * (p.etp if p.fold_ep else p.tp)
        return span <= gpus_per_node
    sizes = dict(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.mesh_ep, tp=p.tp)
    order = tuple(sizes)
    outer = min(order.index(d) for d in dims)
    return math.prod(sizes[d] for d in order[outer:]) <= gpus_per_node


def _ring(n: int) -> float:
    """Fraction of a buffer each rank sends in a ring all-gather or reduce-scatter of ``n`` ranks."""
    return (n - 1) / n


def communication(cfg: Config) -> dict[str, float]:
    """Bytes each rank sends per step, keyed ``"collective/dims"`` (Megatron's counts for tp / sp)."""
    m, p = cfg.model, cfg.parallel
    c, tokens, h = compute_bytes(cfg), microbatch_tokens(cfg), m.hidden_size
    layers = m.num_hidden_layers / p.pp
    mb = p.microbatches
    out: dict[str, float] = {}
    if p.tp > 1:
        act = tokens * h * c
        if p.sp:  # 2 all-gathers + 2 reduce-scatters forward, the same backward, and the re-gathers
            out["all_gather+reduce_scatter/tp"] = 10 * act * _ring(p.tp) * layers * mb
        else:  # 2 all-reduces forward, 2 backward
            out["all_reduce/tp"] = 4 * 2 * act * _ring(p.tp) * layers * mb
    if p.cp > 1:  # k and v around the ring forward; k, v, dk, dv backward
        kv = tokens * 2 * m.kv_heads * m.head_size * c
        out["p2p/cp"] = 3 * kv * (p.cp - 1) * layers * mb
    moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers)) / p.pp if m.is_moe else 0
    rows = tokens * m.num_experts_per_tok / p.tp if m.is_moe else 0  # every rank's own token copies
    if p.ep > 1:  # dispatch and combine, forward and backward
        out["all_to_all/ep"] = 4 * rows * h * c * _ring(p.ep) * moe * mb
    if p.etp > 1:  # gather of an expert slice's rows and reduce-scatter of its outputs, forward and backward
        out["all_gather+reduce_scatter/etp"] = 4 * p.etp * rows * h * c * _ring(p.etp) * moe * mb
    if p.pp > 1:
        out["p2p/pp"] = 2 * tokens * h * c / (p.tp if p.sp else 1) * mb
    out.update(_data_parallel_bytes(cfg))
    return out


def _data_parallel_bytes(cfg: Config) -> dict[str, float]:
    """FSDP gathers parameters twice (forward, backward) and reduce-scatters fp32 gradients per
    micro-batch; with pp > 1 (and hsdp / replicate) once per step."""
    p = cfg.parallel
    params = sum(unit_elements(cfg, 0).values())
    dense = p.dp * p.cp * p.mesh_ep
    rounds = 1 if p.pp > 1 or p.data_parallel != "fsdp" else p.microbatches
    if p.data_parallel == "replicate":
        return {"all_reduce/dp_ep_cp": 2 * FP32 * params * _ring(dense)} if dense > 1 else {}
    if p.data_parallel == "hsdp":
        shard, out = p.cp * p.mesh_ep, {}
        if shard > 1:
            out["all_gather+reduce_scatter/cp_ep"] = rounds * params * (2 * compute_bytes(cfg) + FP32) * _ring(shard)
        if p.dp > 1:
            out["all_reduce/dp"] = 2 * FP32 * params / shard * _ring(p.dp)
        return out
    if dense == 1:
        return {}
    return {"all_gather+reduce_scatter/dp_ep_cp": rounds * params * (2 * compute_bytes(cfg) + FP32) * _ring(dense)}


_DIMS = {"tp": ("tp",), "cp": ("cp",), "ep": ("ep",), "etp": ("etp",), "pp": ("pp",), "dp": ("dp",),
         "dp_ep_cp": ("dp", "cp", "ep"), "cp_ep": ("cp", "ep")}


def _seconds(cfg: Config, key: str, nbytes: float, hw: Hardware) -> float:
    intra = group_is_intra_node(cfg, _DIMS[key.split("/")[1]], hw.gpus_per_node)
    return nbytes / ((hw.intra_gbps if intra else hw.inter_gbps) * 1e9)


@functools.lru_cache(maxsize=256)
def pipeline_bubble(schedule: str, pp: int, microbatches: int, virtual: int, backward_cost: float,
                    split: bool = True) -> float:
    """Idle fraction of the simulated schedule (forward cost 1 per chunk). Of ``backward_cost`` the
    weight gradients take one forward's matmuls (``W`` of a split backward) and the rest is the input
    gradient (``B``); an unsplit backward costs the sum, and without ``split`` (any stage in
    ``memory.unsplit_stages``) every backward runs whole at ``B``."""
    if pp == 1:
        return 0.0
    steps = build_schedule(schedule, pp, microbatches, virtual)
    w = 1 if split else 0
    # Waits as the executor does, only for what an action consumes (the V schedules need it).
    return simulate(steps, 1, backward_cost - w, w_cost=w, rendezvous=False).bubble


def _recompute_factor(cfg: Config) -> float:
    """Forward + backward cost 3 units per layer; each checkpointed layer adds one forward."""
    m, p = cfg.model, cfg.parallel
    if p.activation_checkpointing == "none":
        return 1.0
    every = 1 if p.activation_checkpointing == "full" else p.ac_every
    checkpointed = len(range(0, m.num_hidden_layers, every))
    return 1 + checkpointed / m.num_hidden_layers / 3


def predict_step_time(cfg: Config, hw: Hardware = Hardware()) -> StepTime:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    world = p.pp * p.dp * p.cp * p.mesh_ep * p.tp
    tokens = t.global_batch_size * t.seq_len
    recompute = _recompute_factor(cfg)
    compute = flops_per_token(m, t.seq_len) * tokens * recompute / world / (hw.peak_tflops * 1e12 * hw.mfu)
    comm = communication(cfg)
    critical = sum(_seconds(cfg, k, v, hw) for k, v in comm.items() if not _is_data_parallel(k))
    overlapped = sum(_seconds(cfg, k, v, hw) for k, v in comm.items() if _is_data_parallel(k))
    exposed = critical + max(0.0, overlapped - compute)
    # Backward costs twice a forward, plus the recomputed forward of the checkpointed share of layers.
    bubble = pipeline_bubble(p.schedule, p.pp, p.microbatches, p.virtual_stages, 2 + 3 * (recompute - 1),
                             split=not unsplit_stages(cfg))
    seconds = (compute + exposed) / (1 - bubble)
    return StepTime(seconds, tokens / seconds, compute, exposed, bubble, comm)


def _is_data_parallel(key: str) -> bool:
    return key.split("/")[1] in ("dp", "dp_ep_cp", "cp_ep")


__all__ = ["Hardware", "StepTime", "communication", "group_is_intra_node", "pipeline_bubble", "predict_step_time"]
