"""Bytes each rank sends per step, by collective kind and mesh dimension, and the seconds they take at the
intra- or inter-node bandwidth each group spans (tp / sp, cp, ep, pp and the data-parallel collectives).

Apart from :mod:`meshtron.plan.speed`, which turns them into a step time, because the dry run and the tests
check these counts on their own. See docs/planner.md, 'Step time'.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

from meshtron.config import Config, ParallelConfig
from meshtron.mesh import ExpertSplit, expert_hsdp_shards
from meshtron.models.moe import router_stats_size
from meshtron.parallel.context import a2a_group_size, cp_comm
from meshtron.parallel.data_parallel import gathers_once_per_step, reduces_gradients
from meshtron.parallel.fp8_base import MX_BLOCK
from meshtron.parallel.pipeline.schedules import V_SHAPED
from meshtron.parallel.pipeline.split import chunk_layer_ranges, chunk_rank
from meshtron.parallel.tensor import local_heads, local_kv_heads
from meshtron.plan.activations import by_kind, layer_checkpointed, microbatch_tokens
from meshtron.plan.gemm import gemm_efficiency
from meshtron.plan.hardware import Hardware
from meshtron.plan.parameters import (
    FP32,
    Coords,
    compute_bytes,
    data_shards,
    fp8_gathered_weights,
    fp8_weights,
    fsdp_shard_dim,
    holds_last_stage,
    layer_params,
    layout_key,
    memo_by_key,
    model_parallel_shape,
    stage_params,
)

INT64 = FP64 = 8
FP8 = 1
# The output of torch's rowwise float8 GEMM, whatever the training dtype.
BF16 = 2


def group_is_intra_node(cfg: Config, dims: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether a group over ``dims`` stays inside one node: the ranks it spans (its outermost dim's
    stride times that dim's size) fit in a node."""
    p = cfg.parallel
    if dims[0].startswith("edp"):  # the experts' data groups: spread over the whole stage
        return p.dp * p.cp * p.mesh_ep * p.tp <= gpus_per_node
    if dims in (("cp_ring",), ("cp_a2a",)):  # a2a+p2p's groups: the all-to-all over consecutive cp ranks
        span = cp_a2a_ranks(cfg, gpus_per_node) if dims == ("cp_a2a",) else p.cp
        return span * p.mesh_ep * p.tp <= gpus_per_node
    if dims in (("ep",), ("etp",)):  # the experts' groups: etp innermost, ep next when folded
        span = p.etp if dims == ("etp",) else p.ep * (p.etp if p.fold_ep else p.tp)
        return span <= gpus_per_node
    sizes = dict(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.mesh_ep, tp=p.tp)
    order = tuple(sizes)
    outer = min(order.index(d) for d in dims)
    return math.prod(sizes[d] for d in order[outer:]) <= gpus_per_node


def cp_a2a_ranks(cfg: Config, gpus_per_node: int = 8) -> int:
    """The cp ranks of one all-to-all group (``a2a_group_size``; 1 for p2p and allgather), with
    ``gpus_per_node`` GPUs a node."""
    m, p = cfg.model, cfg.parallel
    return a2a_group_size(
        p.cp_comm_type, p.cp, p.cp_a2a_size, m.num_attention_heads // p.tp, gpus_per_node // (p.tp * p.mesh_ep)
    )


def cp_attention_bytes(cfg: Config, gpus_per_node: int = 8) -> dict[str, tuple[float, float]]:
    """Bytes one rank sends for one attention layer and micro-batch over cp, ``{"kind/dims": (forward,
    backward)}`` (a recomputation repeats the forward), as each ``[parallel] cp_comm_type`` moves them
    (``parallel/context``; dK / dV travel in fp32):

    - ``p2p``: cp - 1 K/V hops forward; cp - 1 K/V hops and cp dK/dV hops backward.
    - ``allgather``: K/V all-gathered forward, dK/dV reduce-scattered backward (ring algorithms: cp - 1
      local shards each).
    - ``a2a``: q, k, v and the output forward, their gradients backward, each (a - 1) / a of the local
      tensor, the K/V heads repeated up to a when fewer.
    - ``a2a+p2p``: that inside groups of a (``cp_a2a``), then the p2p ring over cp / a members
      (``cp_ring``) holding a x the tokens and 1 / a of the heads; a as ``a2a_group_size`` picks it
      (``gpus_per_node`` GPUs a node).

    ``benchmarks/results/cp_comm_types.md`` holds these against bytes counted on 8 CPU ranks."""
    m, p = cfg.model, cfg.parallel
    c, tokens = compute_bytes(cfg), microbatch_tokens(cfg)
    heads, kv_heads = local_heads(m.num_attention_heads, m.kv_heads, p.tp)
    a = cp_a2a_ranks(cfg, gpus_per_node)
    ring = p.cp // a
    ring_dims, a2a_dims = ("cp_ring", "cp_a2a") if 1 < a < p.cp else ("cp", "cp")
    kv_a = max(kv_heads, a)  # heads the all-to-all sends after repetition
    kv = 2 * (kv_a // a if a > 1 else kv_heads) * tokens * a * m.head_size  # K and V elements a ring member holds
    out: dict[str, tuple[float, float]] = {}
    if a > 1:
        moved = (2 * heads + 2 * kv_a) * tokens * m.head_size * c * (a - 1) / a
        out[f"all_to_all/{a2a_dims}"] = (moved, moved)
    if cp_comm(p.cp_comm_type).allgather:
        out["all_gather+reduce_scatter/cp"] = ((p.cp - 1) * kv * c, (p.cp - 1) * kv * FP32)
    elif ring > 1:
        out[f"p2p/{ring_dims}"] = ((ring - 1) * kv * c, (ring - 1) * kv * c + ring * kv * FP32)
    return out


def _ring(n: int) -> float:
    """Fraction of a buffer each rank sends in a ring all-gather or reduce-scatter of ``n`` ranks."""
    return (n - 1) / n


def communication(cfg: Config, stage: int | None = None) -> dict[str, float]:
    """Bytes one rank of pipeline rank ``stage`` sends per step, keyed ``"collective/dims"``, counted as a
    ring sends them (an all-gather its shard to n - 1 peers, a reduce-scatter (n - 1) / n of its input,
    an all-reduce twice that); ``stage=None``: pipeline rank 0's layers with both ends of the model and
    sends both ways (exact for pp = 1; the busiest stage's bound otherwise). The per-layer counts are
    those the dry run traces (``meshtron.dryrun``), per layer in :func:`_tp_transfers`: with SP, gathers
    and reduce-scatters of its activations forward and backward, the column-parallel inputs re-gathered
    for their weight gradients, and those a checkpointed layer's recomputation repeats (it stops at the
    last tensor the backward needs); a split backward's ``B`` and ``W`` share them (``B`` the
    reduce-scatters of the input gradients, ``W`` the re-gathers); the embedding and the head add 2 each
    where they are; the gathers that carry float8 under ``[train] fp8`` at their bytes
    (:func:`float8_sequence_gather_savings`); with ``tp_overlap`` the layers' are sends (``p2p/tp``,
    :func:`overlapped_rings`). Without SP, all-reduces, 1 per end. The vocab-parallel loss all-reduces
    3 fp32 statistics per token; under SP, the gradients of the parameters whole on every tp rank are
    all-reduced; MoE layers add their router statistics, expert dispatch and etp exchanges. Not counted:
    scalars (a few bytes)."""
    m, p = cfg.model, cfg.parallel
    c, tokens, h, mb = compute_bytes(cfg), microbatch_tokens(cfg), m.hidden_size, p.microbatches
    chunks = _stage_chunks(cfg, stage)
    layers = [i for chunk in chunks for i in chunk_layers(cfg, chunk)]
    ends = (0 in chunks) + (p.pp * p.virtual_stages - 1 in chunks) if stage is not None else 2
    out: dict[str, float] = {}
    if p.tp > 1:
        act = tokens * h * c * _ring(p.tp)
        counts = by_kind(cfg, _tp_transfers_recomputed, layers)
        step = sum(n.step for n, _ in counts)
        recomputed = sum(n.recomputed for n, checkpointed in counts if checkpointed)
        if p.sp and p.tp_overlap:  # the blocks' as rings of sends; the embedding and head as before
            per_token = sum(sum(rings) for rings in by_kind(cfg, overlapped_ring_bytes, layers))
            out["p2p/tp"] = per_token * tokens * _ring(p.tp) * mb
            if ends:
                out["all_gather+reduce_scatter/tp"] = 2 * ends * mb * act
        elif p.sp:
            float8 = sum(by_kind(cfg, float8_sequence_gather_savings, layers))
            out["all_gather+reduce_scatter/tp"] = (step + recomputed + 2 * ends) * mb * act - float8 * mb
        else:
            out["all_reduce/tp"] = 2 * (step + recomputed + ends) * act * mb
        reduced = 0.0
        if stage is None or holds_last_stage(cfg, stage):  # the vocab-parallel loss: 3 fp32 per token
            reduced += 3 * FP32 * tokens * mb
        if p.sp:  # parameters whole on every tp rank (norms, routers) get partial gradients from their shards
            whole = [q for q in stage_params(cfg, stage or 0) if q.tp_dim is None and not q.expert]
            norms = sum(math.prod(q.shape) for q in whole if not _is_router(q))
            routers = sum(math.prod(q.shape) for q in whole if _is_router(q))
            # Norms: with pp > 1 once, from the held fp32 gradients. Routers (``tensor.ReplicateParallel``)
            # reduce their local view's gradient in each backward, in the compute dtype.
            reduced += norms * (FP32 if p.pp > 1 else c * mb) + routers * c * mb
        if reduced:
            out["all_reduce/tp"] = out.get("all_reduce/tp", 0.0) + 2 * reduced * _ring(p.tp)
    if p.cp > 1:
        recomputed = sum(layer_checkpointed(cfg, i) for i in layers)
        for key, (forward, backward) in cp_attention_bytes(cfg).items():
            out[key] = out.get(key, 0.0) + (forward * (len(layers) + recomputed) + backward * len(layers)) * mb
    moe = sum(m.is_moe_layer(i) for i in layers) if m.is_moe else 0
    rows = tokens * m.num_experts_per_tok / p.tp if m.is_moe else 0  # every rank's own token copies
    rerun = sum(m.is_moe_layer(i) and layer_checkpointed(cfg, i) for i in layers) if m.is_moe else 0
    if p.tp > 1 and not p.sp and moe:
        # The experts take each tp rank's slice of the replicated tokens: their outputs are gathered
        # forward (again in a recomputation), the slices' input and routing-weight gradients backward.
        out["all_gather+reduce_scatter/tp"] = (
            ((2 * h + m.num_experts_per_tok) * moe + h * rerun) * tokens * c * _ring(p.tp) * mb
        )
    out.update(_router_stats_bytes(cfg, moe + rerun))
    if p.ep > 1:
        # Dispatch and combine forward and backward, after the routed-row counts; a checkpointed MoE
        # layer's recomputation exchanges the counts, dispatches and combines again.
        out["all_to_all/ep"] = (
            ((4 * moe + 2 * rerun) * rows * h * c + (moe + rerun) * m.num_experts * INT64) * _ring(p.ep) * mb
        )
    if p.etp > 1:
        # An expert slice's rows gathered and its outputs reduce-scattered, forward and backward (uneven:
        # all-to-alls), again in a checkpointed layer's recomputation; before each gather, the rows per
        # (source, local expert) counts, E int64.
        out["all_to_all/etp"] = (4 * moe + 2 * rerun) * p.etp * rows * h * c * _ring(p.etp) * mb
        out["all_gather+reduce_scatter/etp"] = (moe + rerun) * m.num_experts * INT64 * (p.etp - 1) * mb
    if p.pp > 1:  # each chunk's activations forward, gradients back, to a neighbour chunk on another rank
        sends = (
            sum(_peer(cfg, chunk, chunk + 1) + _peer(cfg, chunk, chunk - 1) for chunk in chunks)
            if stage is not None
            else 2 * p.virtual_stages
        )
        out["p2p/pp"] = sends * tokens * h * c / (p.tp if p.sp else 1) * mb
    out.update(_data_parallel_bytes(cfg, 0 if stage is None else stage))
    out.update(_tied_embedding_bytes(cfg, 0 if stage is None else stage))
    return out


def _tied_embedding_bytes(cfg: Config, stage: int) -> dict[str, float]:
    """A tied embedding under a pipeline whose two ends are on different ranks (not a V): the first and the
    last pp rank each hold a copy (the embedding, the LM head) and all-reduce its gradient shard between them
    once a step, in fp32 as the data-parallel reduction leaves it (``PipelineRunner._sum_tied_grads``): the
    vocabulary's rows split over tp, then over the ranks FSDP shards over (padded, as it shards them)."""
    p, m = cfg.parallel, cfg.model
    if p.pp == 1 or not m.tie_word_embeddings or p.schedule in V_SHAPED or stage not in (0, p.pp - 1):
        return {}
    rows = math.ceil(math.ceil(m.vocab_size / p.tp) / data_shards(cfg, Coords(), expert=False)[0])
    return {"all_reduce/pp": 2 * FP32 * rows * m.hidden_size * _ring(2)}


class Transfers(NamedTuple):
    """tp transfers of one layer's activations per micro-batch: over the step, again in a checkpointed
    layer's recomputation."""

    step: int
    recomputed: int


def _tp_transfers_recomputed(cfg: Config, layer: int) -> tuple[Transfers, bool]:
    """The layer's tp transfers and whether its recomputation repeats them (``op`` keeps DTensor's
    (functional) collectives' outputs: its recomputation sends nothing over tp)."""
    checkpointed = layer_checkpointed(cfg, layer) and cfg.parallel.activation_checkpointing != "op"
    return _tp_transfers(cfg, layer, cfg.parallel.sp), checkpointed


def _tp_transfers(cfg: Config, layer: int, sp: bool) -> Transfers:
    """With SP (all-gathers and reduce-scatters), attention gathers its input and reduce-scatters its
    output forward, both again backward, and re-gathers the q/k/v input for their weight gradients:
    5; its recomputation runs to its output: 2. A dense MLP (a MoE's shared
    expert follows its plan) the same, but its recomputation stops after the gate/up gather: 1; the
    shared expert's output is needed by its gate's backward, so it is recomputed whole: 2. Routed
    experts take each rank's sequence shard as it is: 0. Without SP, all-reduces: attention's output
    forward and its input's gradient backward (2), its output again when recomputed (1); a dense MLP or
    shared expert the same, recomputed: dense none, shared expert 1."""
    m = cfg.model
    moe = m.is_moe_layer(layer)
    mlp = not moe or bool(m.shared_expert_intermediate_size)
    if sp:
        return Transfers(5 + 5 * mlp, 2 + (2 if moe else 1) * mlp)
    return Transfers(2 + 2 * mlp, 1 + (1 if moe and mlp else 0))


# The column-parallel projections SP computes from one gathered input (``tensor.SequenceParallelColwise``).
SP_COLUMN_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
)


def _token_scale_bytes(recipe: str, hidden: int) -> float:
    """Bytes of scales a float8 input row of ``hidden`` elements carries: a float32 per token under the rowwise
    recipes, an E8M0 byte per :data:`MX_BLOCK` elements under ``mxfp8``, none under ``tensorwise``."""
    return {"rowwise": FP32, "rowwise_with_gw_hp": FP32, "mxfp8": hidden / MX_BLOCK}.get(recipe, 0)


def _weight_gradient_in_training_dtype_input(recipe: str) -> bool:
    """Whether the weight gradient's re-gathered input travels in the compute dtype: ``rowwise_with_gw_hp``
    computes that GEMM in high precision, ``mxfp8`` casts along the tokens it gathers."""
    return recipe in ("rowwise_with_gw_hp", "mxfp8")


def float8_sequence_gather_savings(cfg: Config, layer: int) -> float:
    """Bytes per micro-batch one layer's SP all-gathers send less where they carry float8
    (``tensor.PackedProjections.start_input_gather``): a column-parallel group whose projections are all
    float8 gathers its input at 1 byte an element (plus a float32 scale per token under the rowwise
    recipes; under ``mxfp8`` an E8M0 byte per 32 elements) instead of the compute dtype's, in the forward,
    again in a recomputation that repeats the layer's transfers, and in the backward's re-gather for the weight
    gradients, which carries float8 too but under ``rowwise_with_gw_hp`` (its weight gradient in high
    precision) and ``mxfp8`` (cast along the gathered tokens) and gathers no scales (the rowwise ones are
    scaled along the tokens). Qwen2.5-7B, tensorwise, tp 4 + SP, checkpointed: 6 of a
    layer's 13 gathers and reduce-scatters in float8 (docs/fp8.md#planned has the traced bytes)."""
    p, recipe = cfg.parallel, cfg.train.fp8
    if not (p.sp and p.tp > 1) or recipe == "none":
        return 0.0
    float8 = {q.name.split(".", 2)[2].removesuffix(".weight") for q in fp8_weights(cfg, layer_params(cfg, layer))}
    groups = sum(all(name in float8 for name in group) for group in SP_COLUMN_GROUPS)
    c, h = compute_bytes(cfg), cfg.model.hidden_size
    scales = _token_scale_bytes(recipe, h)
    recomputed = _tp_transfers_recomputed(cfg, layer)[1]
    forward = (1 + recomputed) * (c * h - h - scales)
    regather = 0 if _weight_gradient_in_training_dtype_input(recipe) else c * h - h
    return groups * (forward + regather) * microbatch_tokens(cfg) * _ring(p.tp)


def overlapped_rings(cfg: Config, layer: int) -> list[float]:
    """Under ``tp_overlap`` (``parallel/tensor_overlap.py``): the FLOPs of the GEMMs each tp ring of one
    layer overlaps, per rank and micro-batch; each ring sends ``tp - 1`` sequence shards, the bytes of the
    SP collective it replaces (:func:`_tp_transfers`' count, except that an overlapped MLP's recomputation
    runs its down-projection ring before it saves that GEMM's input: 2, not 1). Per column-parallel group
    (q/k/v, gate/up) of width ``n`` per rank reading hidden size ``h`` and its row-parallel projection
    (o, down) of width ``k``, over ``t`` tokens: forward 2thn and 2tkh; backward the input gradient's
    ring 2tnh, the weight gradient's re-gather 2thn, the row projection's output-gradient gather both
    its gradients 4tkh; a checkpointed layer's recomputation repeats the forward two."""
    m, p = cfg.model, cfg.parallel
    t, h, tp = microbatch_tokens(cfg), m.hidden_size, p.tp
    kv = local_kv_heads(m.kv_heads, tp)
    groups = [((m.num_attention_heads // tp + 2 * kv) * m.head_size, m.num_attention_heads // tp * m.head_size)]
    width = m.shared_expert_intermediate_size if m.is_moe_layer(layer) else m.intermediate_size
    if width:
        groups.append((2 * width // tp, width // tp))
    rings = []
    for n, k in groups:
        col, row = 2 * t * h * n, 2 * t * k * h
        rings += [col, row, col, col, 2 * row] + ([col, row] if layer_checkpointed(cfg, layer) else [])
    return rings


# Per overlapped group of a layer (overlapped_rings' order): its column-parallel projections and the
# row-parallel projection after them.
_RING_GROUPS = (
    (SP_COLUMN_GROUPS[0], "self_attn.o_proj"),
    (SP_COLUMN_GROUPS[1], "mlp.down_proj"),
    (SP_COLUMN_GROUPS[2], "mlp.shared_expert.down_proj"),
)


def overlapped_ring_bytes(cfg: Config, layer: int) -> list[float]:
    """Bytes per token of each of :func:`overlapped_rings`' rings (each sends ``tp - 1`` shards of
    ``tokens / tp`` rows, every row ``hidden`` wide): the compute dtype's, or under ``[train] fp8`` where the
    ring's GEMMs are float8 (``parallel/tensor_overlap.py``: operands cast whole, float8 rows sent with their
    per-token scales): the input gathers (forward, recomputation) 1 byte an element plus a float32 scale per
    token under the rowwise recipes; the reduce-scatters of those recipes' partial sums bf16 (torch's rowwise
    float8 GEMM returns it); the weight gradient's re-gather 1 byte (the compute dtype under
    rowwise_with_gw_hp); the row projection's output-gradient gather 1 byte under tensorwise (one cast for both
    GEMMs), a float8 input-gradient operand with its scales and a float8 weight-gradient one under rowwise,
    the compute dtype under rowwise_with_gw_hp (cast chunk by chunk). Under ``mxfp8`` the input gathers carry MX
    bytes (:func:`_token_scale_bytes`) and every other ring the compute dtype (its GEMMs return it, and cast
    along their own contraction dims)."""
    m, recipe = cfg.model, cfg.train.fp8
    c, h = compute_bytes(cfg), m.hidden_size
    float8 = {q.name.split(".", 2)[2].removesuffix(".weight") for q in fp8_weights(cfg, layer_params(cfg, layer))}
    scale, partial = _token_scale_bytes(recipe, h), BF16 if recipe in ("rowwise", "rowwise_with_gw_hp") else c
    output_gradient = {"tensorwise": h, "rowwise": 2 * h + scale, "rowwise_with_gw_hp": c * h, "mxfp8": c * h}
    groups = [_RING_GROUPS[0]]
    if m.intermediate_size and not m.is_moe_layer(layer):
        groups.append(_RING_GROUPS[1])
    elif m.is_moe_layer(layer) and m.shared_expert_intermediate_size:
        groups.append(_RING_GROUPS[2])
    rings = []
    for columns, row in groups:
        col8, row8 = all(name in float8 for name in columns), row in float8
        gather = h + scale if col8 else c * h
        row_sum = partial * h if row8 else c * h
        regather = (c * h if _weight_gradient_in_training_dtype_input(recipe) else h) if col8 else c * h
        rings += [gather, row_sum, partial * h if col8 else c * h, regather, output_gradient[recipe] if row8 else c * h]
        rings += [gather, row_sum] if layer_checkpointed(cfg, layer) else []
    return rings


def overlapped_tp_seconds(cfg: Config, hw: Hardware) -> float:
    """Exposed time per step of pipeline rank 0's tp rings (``tp_overlap``): per ring, one chunk's
    transfer (what a device does not hide: the issue's model of the ring's start, and of NCCL's kernels
    taking SMs from the GEMM) plus, at each of its ``tp - 1`` steps, the chunk's transfer time beyond
    the GEMM of one chunk it overlaps (GEMMs at ``hw.mfu`` of the peak, or at the efficiency
    :mod:`meshtron.plan.gemm` gives a layer's GEMMs of one chunk's rows)."""
    p = cfg.parallel
    rows = microbatch_tokens(cfg) // p.tp
    efficiency = hw.mfu if hw.mfu is not None else gemm_efficiency(cfg, rows, hw)
    gemm_rate = hw.peak_tflops * 1e12 * efficiency * p.tp  # a chunk is 1/tp of the ring's GEMM
    layers = [i for chunk_index in _stage_chunks(cfg, None) for i in chunk_layers(cfg, chunk_index)]
    rings = [
        ring
        for flops, nbytes in zip(by_kind(cfg, overlapped_rings, layers), by_kind(cfg, overlapped_ring_bytes, layers))
        for ring in zip(flops, nbytes)
    ]
    sends = [(flops, _seconds(cfg, "p2p/tp", rows * per_token, hw)) for flops, per_token in rings]
    return p.microbatches * sum(send + (p.tp - 1) * max(0.0, send - flops / gemm_rate) for flops, send in sends)


def _is_router(param) -> bool:
    """A MoE router or shared-expert gate: replicated over tp and run on its local view."""
    return param.name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight"))


def _router_stats_bytes(cfg: Config, calls: int) -> dict[str, float]:
    """Each native MoE call (a checkpointed layer's recomputation too) all-reduces its router
    statistics, ``models.moe.router_stats_size`` float64 numbers, over the ranks holding different
    tokens (``parallel.expert.token_mesh``); an ``hf_model``'s router loss is not modelled."""
    m, p = cfg.model, cfg.parallel
    split = p.sp and p.tp > 1
    holders = p.dp * p.cp * p.mesh_ep * (p.tp if split else 1)
    if not calls or holders == 1 or m.hf_model:
        return {}
    nbytes = 2 * router_stats_size(m.num_experts) * FP64 * _ring(holders) * calls * p.microbatches
    return {f"all_reduce/{'dp_cp_ep_tp' if split else 'dp_ep_cp'}": nbytes}


def _stage_chunks(cfg: Config, stage: int | None) -> list[int]:
    """Global chunk (virtual stage) indices pipeline rank ``stage`` runs (None: rank 0's)."""
    p = cfg.parallel
    rank = 0 if stage is None else stage
    return [i for i in range(p.pp * p.virtual_stages) if chunk_rank(i, p.pp, p.schedule in V_SHAPED) == rank]


def _peer(cfg: Config, chunk: int, neighbour: int) -> bool:
    """Whether ``neighbour`` exists and runs on another rank than ``chunk`` (a V's turn stays on its rank)."""
    p = cfg.parallel
    v = p.schedule in V_SHAPED
    return 0 <= neighbour < p.pp * p.virtual_stages and chunk_rank(neighbour, p.pp, v) != chunk_rank(chunk, p.pp, v)


def chunk_layers(cfg: Config, chunk: int) -> range:
    p = cfg.parallel
    return chunk_layer_ranges(cfg.model.num_hidden_layers, p.pp, p.virtual_stages)[chunk]


def fsdp_gathers_once(p: ParallelConfig) -> bool:
    """Whether FSDP gathers each unit once per step and holds it: always under a pipeline (its executor
    holds a stage's units through the step), and with ``fsdp_gather = "per_step"``."""
    return p.pp > 1 or gathers_once_per_step(p)


def fsdp_reductions(p: ParallelConfig) -> int:
    """Gradient reductions per step: every micro-batch's where full sharding gathers per micro-batch
    without a pipeline (``data.reduces_gradients``), else the step's last only."""
    return p.microbatches if p.pp == 1 and reduces_gradients(p, 0, p.microbatches) else 1


def _data_parallel_bytes(cfg: Config, stage: int) -> dict[str, float]:
    """FSDP and HSDP gather each unit twice per micro-batch (forward; backward; the root unit, which
    FSDP keeps from its forward to its backward, once), or with pp > 1 or ``fsdp_gather = "per_step"``
    once per step and keep it; FSDP reduce-scatters the fp32 gradients per micro-batch (pp > 1 or
    ``per_step``: once), HSDP reduce-scatters and all-reduces them once per step, replicate all-reduces
    them once. The dense parameters over the dense data mesh (dp x cp x ep), the routed
    experts over theirs (edp). Each parameter's sharded dim is padded to a multiple of the shard count,
    as FSDP shards it (:func:`_padded`)."""
    p = cfg.parallel
    out: dict[str, float] = {}
    for root, in_fp8 in ((False, False), (True, False), (False, True)):
        padded = functools.partial(_padded, cfg, stage, (root, in_fp8))
        for key, nbytes in _data_parallel_group_bytes(
            cfg, padded, p.dp, p.cp * p.mesh_ep, "dp_ep_cp", "cp_ep", root, gather_bytes=FP8 if in_fp8 else None
        ).items():
            out[key] = out.get(key, 0.0) + nbytes
    experts = functools.partial(_padded, cfg, stage, "experts")
    if experts(1):
        edp = p.dp * p.cp * p.mesh_ep * p.tp // (p.ep * p.etp)
        shard = expert_hsdp_shards(dict(cp=p.cp, ep=p.mesh_ep, tp=p.tp), ExpertSplit(p.ep, p.etp, p.fold_ep))
        for key, nbytes in _data_parallel_group_bytes(cfg, experts, edp // shard, shard, "edp", "edp_shard").items():
            out[key] = out.get(key, 0.0) + nbytes
    return out


def _data_parallel_group_bytes(
    cfg: Config,
    padded: Callable[[int], int],
    replicas: int,
    shard: int,
    whole: str,
    sharded: str,
    root: bool = False,
    gather_bytes: int | None = None,
) -> dict[str, float]:
    """Bytes for parameters of ``padded(shards)`` elements as FSDP gathers them over ``shards`` ranks,
    data-parallel over ``replicas x shard`` ranks (hsdp: replicated over ``replicas``, sharded over
    ``shard``; fsdp / replicate: over all of them, keyed ``whole``); ``gather_bytes``: bytes an element
    all-gathers (default: the compute dtype's; float8 weights: 1)."""
    p = cfg.parallel
    ranks = replicas * shard
    if ranks == 1 or not padded(1):
        return {}
    if p.data_parallel == "replicate":
        return {f"all_reduce/{whole}": 2 * FP32 * padded(1) * _ring(ranks)}
    sharding = ranks if p.data_parallel == "fsdp" else shard
    gathers = 1 if fsdp_gathers_once(p) else (1 if root else 2) * p.microbatches
    gathered = gather_bytes or compute_bytes(cfg)
    moved = padded(sharding) * (gathers * gathered + fsdp_reductions(p) * FP32) * _ring(sharding)
    if p.data_parallel == "fsdp":
        return {f"all_gather+reduce_scatter/{whole}": moved}
    out = {f"all_gather+reduce_scatter/{sharded}": moved} if shard > 1 else {}
    if replicas > 1:
        replica_key = "dp" if whole == "dp_ep_cp" else "edp_replicate"
        out[f"all_reduce/{replica_key}"] = 2 * FP32 * padded(shard) / shard * _ring(replicas)
    return out


def _padded(cfg: Config, stage: int, group: tuple[bool, bool] | str, shards: int) -> int:
    """Elements of pipeline rank ``stage``'s parameters of ``group`` ((in the root unit, gathered in
    float8) of the dense ones, or ``"experts"``) as FSDP gathers them over ``shards`` ranks: each one's
    sharded dim (``memory.fsdp_shard_dim``: not a vocabulary tp splits unevenly, the experts' first
    ``shards`` divides) padded to a multiple of ``shards``."""
    return _padded_elements((layout_key(cfg), cfg.train.fp8, stage, group, shards), cfg)


@memo_by_key
def _padded_elements(key: tuple, cfg: Config) -> int:
    _, _, stage, group, shards = key
    params = stage_params(cfg, stage)
    if group == "experts":
        members = [q for q in params if q.expert]
    else:
        root, in_fp8 = group
        float8 = {q.name for q in fp8_gathered_weights(cfg, params)}
        members = [q for q in params if not q.expert and (q.unit == "root") == root and (q.name in float8) == in_fp8]
    total = 0
    for q in members:
        shape = model_parallel_shape(q, cfg, Coords())
        dim = fsdp_shard_dim(q, cfg, shape, shards)
        total += -(-shape[dim] // shards) * shards * math.prod(shape[:dim] + shape[dim + 1 :])
    return total


# The mesh dimensions each key's group spans.
COMM_DIMS = {
    "tp": ("tp",),
    "cp": ("cp",),
    "cp_ring": ("cp_ring",),
    "cp_a2a": ("cp_a2a",),
    "ep": ("ep",),
    "etp": ("etp",),
    "pp": ("pp",),
    "dp": ("dp",),
    "dp_ep_cp": ("dp", "cp", "ep"),
    "dp_cp_ep_tp": ("dp", "cp", "ep", "tp"),
    "cp_ep": ("cp", "ep"),
    "edp": ("edp",),
    "edp_shard": ("edp_shard",),
    "edp_replicate": ("edp_replicate",),
}


def _seconds(cfg: Config, key: str, nbytes: float, hw: Hardware) -> float:
    intra = group_is_intra_node(cfg, COMM_DIMS[key.split("/")[1]], hw.gpus_per_node)
    return nbytes / ((hw.intra_gbps if intra else hw.inter_gbps) * 1e9)
