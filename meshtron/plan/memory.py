"""Per-rank memory model: bytes by named term, as pure functions of a :class:`Config` and its layout.

No process group, no tensors: every figure comes from the model shapes and the rules the parallel
modules follow (see each term's function for the code it mirrors).

State (exact: ``tests/test_plan.py`` checks it against the DTensor local shards of a parallelized
meta-device model):

- ``params``: fp32 master parameters. tp splits q/k/v/gate/up by rows, o/down by columns, the
  embedding and LM head by vocabulary rows (KV heads fewer than tp stay whole); ep splits routed
  experts by expert and etp their gate/up by columns, down by rows; then FSDP shards dim 0 of the
  local tensor over the data mesh (experts: the first dim the shard count divides, over their edp
  ranks) with ``torch.chunk`` sizes, HSDP only over ep x cp (experts: their edp ranks in a dp
  slice), replicate not at all;
- ``grads``: the same elements, fp32;
- ``optimizer``: AdamW's two fp32 moments plus one fp32 step count per parameter tensor.

Transients and activations (estimates, compute dtype ``c`` = 2 bytes in bf16, 4 in fp32):

- ``gathered``: unsharded compute copies. With pp = 1 FSDP holds in backward the unit in use,
  ``fsdp_prefetch`` blocks gathered ahead (their all-gather outputs) and the root unit (final norm,
  tied embedding), at the end of the forward the root and LM-head units; with ``fsdp_gather =
  "per_step"`` every unit, held from the step's first forward to the last backward; with pp > 1 a
  stage's units stay gathered from its first forward to its release (issue 15);
- ``unsharded_grads``: the unit being reduced (pp = 1, fsdp per micro-batch); the whole stage's
  gradients in fp32 when they accumulate unreduced (pp > 1: from the stage's first weight pass to its
  release; or, with several micro-batches, hsdp, replicate and ``per_step``);
- ``reduce_scatter``: the fp32 input buffer of a gradient reduction: in a layer's backward that of the
  unit reduced before it, kept until the layer's own reduction (an untied LM head's in the first
  layer's, the largest layer unit's in the rest; the embedding reduces after the layers), at the end
  of the backward the embedding's or root's; with pp > 1 the largest unit's at the stage's release;
- ``activations``: saved tensors per layer and token (:func:`layer_activation_bytes`) times the layers
  a rank holds, the tokens of one micro-batch and the micro-batches in flight (pp schedules: each
  weighed by its own stage at the rank's peak, ``held_by_stage``); activation checkpointing keeps only block inputs. In backward add one layer's
  working set (:func:`backward_working_bytes`: its gradient temporaries and, checkpointed, its
  recomputed saved tensors, less the saved tensors of the layers after it, already freed);
- ``loss``: the fused chunked LM head + cross-entropy: per in-flight micro-batch the hidden-state
  gradient [tokens, H] and the fp32 weight-gradient accumulator [V/tp, H] it saves for backward; at the
  end of the forward also one chunk's fp32 logits (plus its compute-dtype copy in bf16) [chunk, V/tp]
  and a [V/tp, H] product;
- ``ep_dispatch``: the routed token copies being sent and received by one MoE layer's all-to-all (in
  backward only without full checkpointing, whose recomputed copies are the layer's saved tensors);
- ``other``: CUDA context, communicator buffers and allocator fragmentation (:class:`Assumptions`).

Host offload (``[parallel] offload``, ``offload_activations``; pp = 1): ``Breakdown.host`` holds the
rank's host-memory bytes by term (:func:`host_bytes`). ``offload = "optimizer"`` moves ``params``,
``grads`` and ``optimizer`` there whole (FSDP2's CPU offload keeps the fp32 shards, their gradients
and so AdamW's moments on the host; a unit's shard visits the device only for its all-gather, a
transient not counted); ``offload_activations`` moves the saved tensors of every block not recomputed
(:func:`layer_offloaded`): on the device remain, at the end of the forward, one block's tensors whose
copy is still in flight and, in backward, the block whose tensors are copied back (counted as a
recomputed block is). A node needs the sum of its ranks' host bytes.

The peak (:func:`rank_breakdown`) is the largest of three moments, as torch's ``MemTracker`` finds
them (8 CPU ranks: ``benchmarks/plan_whole_step.py``; one rank with real Qwen2.5 shapes:
``benchmarks/plan_single_rank.py``): the end of the forward (all saved activations and the loss's
chunk buffers; with pp = 1 only the root and LM-head units gathered (every unit, per step), no gradient reduction, and
unsharded gradients only when earlier micro-batches left them accumulating), the backward of one
layer (saved activations plus that layer's working set, the micro-batch's own loss tensors consumed,
the gathered / unsharded-gradient / reduce-scatter buffers) and the end of the backward (every
gradient, the last unit's reduction). ``grads`` exist whole before the last backward only when an
earlier micro-batch reduced into them (:func:`sharded_grads_before_backward`); otherwise the backward
counts those already reduced (:func:`backward_peak`). A pipeline rank's peak is found by walking its
schedule (:func:`pipeline_moments`): after every forward, during every backward and weight pass and at
every stage's release, each of its stages' units, gradients and micro-batches counted as they are
then (the 72B dry run, pp4 x dp4 x tp4 interleaved: one chunk's fp32 gradients at the peak, not both,
which put the old whole-step model 25 % high).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from meshtron.config import Config, ModelConfig
from meshtron.mesh import ExpertSplit, expert_hsdp_shards
from meshtron.parallel.checkpointing import checkpoints_layer
from meshtron.parallel.context import cp_comm
from meshtron.parallel.data import data_shard_dim, gathers_once_per_step, reduces_gradients
from meshtron.parallel.float8 import fits_fp8, float8_all_gather
from meshtron.parallel.pipeline.schedules import (
    SPLIT_BACKWARD,
    B,
    F,
    V_SHAPED,
    W,
    built_schedule,
    held_by_stage,
    last_weight_passes,
    runs_backward_whole,
    split_backwards,
    steady_microbatches,
)
from meshtron.parallel.pipeline.split import chunk_layer_ranges, chunk_rank, split_layers
from meshtron.parallel.tensor import kv_heads_split, local_kv_heads

GIB = 2**30
FP32 = 4
T = TypeVar("T")

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
PHASES = ("forward", "backward", "backward end")


@dataclass(frozen=True)
class Assumptions:
    """What the model cannot derive from shapes. The defaults are estimates, not measurements on GPUs:
    about a GiB for the CUDA context, NCCL and cuBLAS workspaces, and 5 % caching-allocator slack."""

    reserved_gib: float = 1.0
    fragmentation: float = 0.05
    # Host memory of each rank's own process (Python, torch and the CUDA libraries, the data loader):
    # an estimate, counted in ``Breakdown.host`` beside what offload puts there.
    host_reserved_gib: float = 4.0


class Coords(NamedTuple):
    """A rank's index along each mesh dimension (the planner reports the busiest: index 0 of each)."""

    pp: int = 0
    dp: int = 0
    cp: int = 0
    ep: int = 0
    tp: int = 0


@dataclass(frozen=True)
class Param:
    """One parameter tensor of the model: its full shape and how tp / ep split it."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None  # dim split over tp (experts: over etp; None: whole on every tp rank)
    expert: bool = False  # routed experts: dim 0 split over ep, data mesh edp
    unit: str = "root"  # FSDP unit: "block.<i>", "experts.<i>", "embed", "head" or "root"


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


def memo_by_key(fn):
    """Cache ``fn(key, *args)`` by ``key`` alone: configs are unhashable dataclasses, and the planner
    evaluates hundreds of layouts of one model, so inventories are built once per key."""
    cache: dict = {}

    @functools.wraps(fn)
    def cached(key, *args):
        if key not in cache:
            cache[key] = fn(key, *args)
        return cache[key]

    return cached


def chunk_size(n: int, parts: int, index: int) -> int:
    """Elements of ``torch.chunk``'s piece ``index`` when ``n`` is cut into ``parts`` (DTensor Shard, FSDP2)."""
    step = -(-n // parts)
    return max(0, min(step, n - index * step))


def _layer_params(m: ModelConfig, layer: int, tp: int) -> list[Param]:
    h, d = m.hidden_size, m.head_size
    kv_dim = 0 if kv_heads_split(m.kv_heads, tp) else None
    unit = f"block.{layer}"
    p = f"layers.{layer}."
    out = [Param(p + "input_layernorm.weight", (h,), unit=unit)]
    for proj, rows, split in (("q", m.num_attention_heads * d, 0), ("k", m.kv_heads * d, kv_dim), ("v", m.kv_heads * d, kv_dim)):
        out.append(Param(f"{p}self_attn.{proj}_proj.weight", (rows, h), split, unit=unit))
        if m.attention_bias:
            out.append(Param(f"{p}self_attn.{proj}_proj.bias", (rows,), split, unit=unit))
    out.append(Param(p + "self_attn.o_proj.weight", (h, m.num_attention_heads * d), 1, unit=unit))
    out.append(Param(p + "post_attention_layernorm.weight", (h,), unit=unit))
    if not m.is_moe_layer(layer):
        return out + _mlp_params(p + "mlp.", h, m.intermediate_size, unit)
    e, i = m.num_experts, m.moe_intermediate_size
    out.append(Param(p + "mlp.gate.weight", (e, h), unit=unit))
    experts = f"experts.{layer}"
    for name, shape, etp_dim in (("gate_proj", (e, h, i), 2), ("up_proj", (e, h, i), 2), ("down_proj", (e, i, h), 1)):
        out.append(Param(f"{p}mlp.experts.{name}", shape, etp_dim, expert=True, unit=experts))
    if m.shared_expert_intermediate_size:
        out += _mlp_params(p + "mlp.shared_expert.", h, m.shared_expert_intermediate_size, unit)
        out.append(Param(p + "mlp.shared_expert_gate.weight", (1, h), unit=unit))
    return out


def layer_params(cfg: Config, layer: int) -> list[Param]:
    """Decoder layer ``layer``'s parameters: full shapes, and how tp / ep split them."""
    return _layer_params(cfg.model, layer, cfg.parallel.tp)


def _mlp_params(prefix: str, h: int, inner: int, unit: str) -> list[Param]:
    return [
        Param(prefix + "gate_proj.weight", (inner, h), 0, unit=unit),
        Param(prefix + "up_proj.weight", (inner, h), 0, unit=unit),
        Param(prefix + "down_proj.weight", (h, inner), 1, unit=unit),
    ]


def stage_params(cfg: Config, pp_rank: int) -> tuple[Param, ...]:
    """Parameters pipeline rank ``pp_rank`` holds (all of them when pp = 1), as ``prune_to_stage`` keeps.

    Tied embeddings: one parameter in the root unit where one rank holds both ends (pp = 1, or the
    V of ``zbv`` / ``dualpipev``); otherwise the first stage's embedding and the last stage's LM head
    are separate copies, each an FSDP unit of its own.
    """
    p = cfg.parallel
    return _stage_params((repr(cfg.model), p.tp, p.pp, p.virtual_stages, _v_shape(cfg), pp_rank), cfg.model)


@memo_by_key
def _stage_params(key: tuple, m: ModelConfig) -> tuple[Param, ...]:
    _, tp, pp, virtual, v_shape, pp_rank = key
    vocab = (m.vocab_size, m.hidden_size)
    layers = [i for r in split_layers(m.num_hidden_layers, pp, virtual, v_shape)[pp_rank] for i in r]
    last = pp_rank == _last_stage_rank(pp, virtual, v_shape)
    tied_root = m.tie_word_embeddings and pp_rank == 0 and last
    out = []
    if pp_rank == 0:
        out.append(Param("embed_tokens.weight", vocab, 0, unit="root" if tied_root else "embed"))
    for layer in layers:
        out += _layer_params(m, layer, tp)
    if last:
        out.append(Param("norm.weight", (m.hidden_size,)))
        if not tied_root:
            out.append(Param("lm_head.weight", vocab, 0, unit="head"))
    return tuple(out)


class ExpertCoords(NamedTuple):
    """A rank's place in its stage's expert split (``meshtron.mesh.expert_meshes``)."""

    edp: int  # ranks holding the same expert slice
    edp_index: int
    ep_index: int
    etp_index: int


def expert_coords(cfg: Config, c: Coords) -> ExpertCoords:
    p = cfg.parallel
    edp = p.dp * p.cp * p.mesh_ep * p.tp // (p.ep * p.etp)
    if p.fold_ep:  # the stage's ranks in mesh order (tp innermost) reshaped into (edp, ep, etp)
        flat = (c.dp * p.cp + c.cp) * p.tp + c.tp
        return ExpertCoords(edp, flat // (p.ep * p.etp), flat // p.etp % p.ep, flat % p.etp)
    rest = p.tp // p.etp  # edp = (dp, cp, tp / etp) in mesh order
    return ExpertCoords(edp, (c.dp * p.cp + c.cp) * rest + c.tp // p.etp, c.ep, c.tp % p.etp)


def data_shards(cfg: Config, coords: Coords, expert: bool) -> tuple[int, int]:
    """(shard count, this rank's shard index) of the data-parallel sharding (``parallel/data.py``)."""
    p, c = cfg.parallel, coords
    if p.data_parallel == "replicate":
        return 1, 0
    if expert:
        e = expert_coords(cfg, c)
        if p.data_parallel == "hsdp":  # replicate over dp slices, shard inside one
            shards = expert_hsdp_shards(dict(cp=p.cp, ep=p.mesh_ep, tp=p.tp), ExpertSplit(p.ep, p.etp, p.fold_ep))
            return shards, e.edp_index % shards
        return e.edp, e.edp_index
    ep = p.mesh_ep
    if p.data_parallel == "hsdp":  # replicate over dp, shard over cp x ep
        return p.cp * ep, c.cp * ep + c.ep
    return p.dp * p.cp * ep, (c.dp * p.cp + c.cp) * ep + c.ep


def model_parallel_shape(param: Param, cfg: Config, coords: Coords) -> list[int]:
    """The tensor this rank holds after tp and ep (experts: ep and etp), before data-parallel sharding."""
    p = cfg.parallel
    shape = list(param.shape)
    if param.expert:
        e = expert_coords(cfg, coords)
        shape[0] = chunk_size(shape[0], p.ep, e.ep_index)
        if param.tp_dim is not None:
            shape[param.tp_dim] = chunk_size(shape[param.tp_dim], p.etp, e.etp_index)
    elif param.tp_dim is not None:
        shape[param.tp_dim] = chunk_size(shape[param.tp_dim], p.tp, coords.tp)
    return shape


def _uneven_split_dims(param: Param, cfg: Config) -> set[int]:
    """The dim tp (experts: ep, etp) splits unevenly, as ``parallel.data.uneven_split_dims`` finds it."""
    p = cfg.parallel
    splits = {0: p.ep} if param.expert else {}
    if param.tp_dim is not None:
        splits[param.tp_dim] = p.etp if param.expert else p.tp
    return {d for d, n in splits.items() if param.shape[d] % n}


def local_numel(param: Param, cfg: Config, coords: Coords) -> int:
    """Elements of ``param``'s DTensor local shard on the rank at ``coords``."""
    shape = model_parallel_shape(param, cfg, coords)
    shards, index = data_shards(cfg, coords, param.expert)
    dim = fsdp_shard_dim(param, cfg, shape, shards)
    shape[dim] = chunk_size(shape[dim], shards, index)
    return math.prod(shape)


def fsdp_shard_dim(param: Param, cfg: Config, shape: list[int], shards: int) -> int:
    """The dim of ``param``'s model-parallel ``shape`` FSDP shards over ``shards`` ranks
    (``parallel.data.data_shard_dim``: not one tp / ep left uneven; experts the first ``shards`` divides)."""
    return data_shard_dim(shape, _uneven_split_dims(param, cfg), shards, prefer_even=param.expert)


def state_bytes(cfg: Config, coords: Coords = Coords()) -> dict[str, int]:
    """Exact fp32 ``params``, ``grads`` and AdamW ``optimizer`` bytes of the rank at ``coords``."""
    elements, tensors = _local_elements((layout_key(cfg), coords), cfg)
    return {
        "params": FP32 * elements,
        "grads": FP32 * elements,
        "optimizer": 2 * FP32 * elements + FP32 * tensors,
    }


def layout_key(cfg: Config) -> tuple:
    """What the parameter figures depend on (the planner caches them by it)."""
    p = cfg.parallel
    return (repr(cfg.model), p.pp, p.dp, p.cp, p.ep, p.tp, p.etp, p.fold_ep, p.virtual_stages, _v_shape(cfg),
            p.data_parallel)


def _v_shape(cfg: Config) -> bool:
    return cfg.parallel.schedule in V_SHAPED


def holds_last_stage(cfg: Config, pp_rank: int) -> bool:
    """Whether ``pp_rank`` runs the last stage (final norm, LM head, loss): rank pp - 1, or rank 0 of a V."""
    p = cfg.parallel
    return pp_rank == _last_stage_rank(p.pp, p.virtual_stages, _v_shape(cfg))


def _last_stage_rank(pp: int, virtual: int, v_shape: bool) -> int:
    return chunk_rank(pp * virtual - 1, pp, v_shape)


def _stage_layer_ranges(cfg: Config, pp_rank: int) -> list[range]:
    """The layer range of each chunk (virtual stage) pipeline rank ``pp_rank`` runs, in its order."""
    p = cfg.parallel
    return split_layers(cfg.model.num_hidden_layers, p.pp, p.virtual_stages, _v_shape(cfg))[pp_rank]


@memo_by_key
def _local_elements(key: tuple, cfg: Config) -> tuple[int, int]:
    coords = key[1]
    params = stage_params(cfg, coords.pp)
    return sum(local_numel(q, cfg, coords) for q in params), len(params)


def unit_elements(cfg: Config, pp_rank: int) -> dict[str, int]:
    """Unsharded elements (after tp / ep) of each FSDP unit on ``pp_rank``."""
    return dict(_unit_elements((layout_key(cfg), pp_rank), cfg))


@memo_by_key
def _unit_elements(key: tuple, cfg: Config) -> tuple[tuple[str, int], ...]:
    pp_rank = key[1]
    units: dict[str, int] = {}
    for param in stage_params(cfg, pp_rank):
        units[param.unit] = units.get(param.unit, 0) + math.prod(model_parallel_shape(param, cfg, Coords()))
    return tuple(units.items())


def unit_gathered_bytes(cfg: Config, pp_rank: int) -> dict[str, float]:
    """Bytes of each FSDP unit on ``pp_rank`` once all-gathered: the compute dtype's per element, 1 for the
    weights FSDP gathers in float8 (:func:`fp8_gathered_weights`), which torchao's float8 all-gather hands
    the block as float8 tensors (the dry run of Qwen2.5-7B at dp 8, tensorwise: 0.217 GiB per gathered
    block where bf16 holds 0.434)."""
    return dict(_unit_gathered_bytes((layout_key(cfg), cfg.train.dtype, cfg.train.fp8, pp_rank), cfg))


@memo_by_key
def _unit_gathered_bytes(key: tuple, cfg: Config) -> tuple[tuple[str, float], ...]:
    pp_rank, c = key[-1], compute_bytes(cfg)
    params = stage_params(cfg, pp_rank)
    float8 = {q.name for q in fp8_gathered_weights(cfg, params)}
    units: dict[str, float] = {}
    for q in params:
        units[q.unit] = units.get(q.unit, 0) + (1 if q.name in float8 else c) * math.prod(model_parallel_shape(q, cfg, Coords()))
    return tuple(units.items())


def compute_bytes(cfg: Config) -> int:
    return 2 if cfg.train.dtype == "bfloat16" else 4


def fp8_weights(cfg: Config, params) -> list:
    """Of ``params`` (``memory.Param``), the weights ``[train] fp8`` computes with in float8
    (``meshtron.parallel.float8``): the blocks' attention and MLP projections (the shared expert's too;
    not the routed experts, the router or the gates) whose dims are multiples of 16."""
    if cfg.train.fp8 == "none":
        return []
    return [q for q in params if q.unit.startswith("block") and not q.expert and q.name.endswith("_proj.weight")
            and fits_fp8(q.shape)]


def fp8_gathered_weights(cfg: Config, params) -> list:
    """The :func:`fp8_weights` FSDP all-gathers in float8 (1 byte an element): those of the recipes with
    torchao's float8 all-gather, at tp 1 over more than one data rank (``meshtron.parallel.float8.float8_all_gather``)."""
    p = cfg.parallel
    gathered = float8_all_gather(cfg.train.fp8, p.tp, p.dp * p.cp * p.mesh_ep)
    return fp8_weights(cfg, params) if gathered else []


def _sp_split(cfg: Config) -> int:
    p = cfg.parallel
    return p.tp if p.sp and p.tp > 1 else 1


def layer_activation_bytes(cfg: Config, layer: int) -> float:
    """Bytes saved for backward per token of one decoder layer (no checkpointing).

    Mirrors what autograd keeps in ``models/qwen2.py``: each RMSNorm its fp32 input and its
    compute-dtype normalized value (4 + c per element); the q/k/v and gate/up inputs (sequence-split
    with SP); attention's rotated q, k, v, output and the o_proj input copy plus an fp32 log-sum-exp
    per head, and with document masks its mask (:func:`document_mask_bytes`); SwiGLU's gate, silu(gate),
    up and product. MoE layers: router probabilities and choices, per routed copy the expert input,
    output (twice) and the four SwiGLU tensors (tokens split over tp), the shared expert. ``tests/test_plan.py`` compares it with the tensors autograd saves for a block.
    """
    m, p = cfg.model, cfg.parallel
    c, h, tp, sp = compute_bytes(cfg), m.hidden_size, p.tp, _sp_split(cfg)
    heads = m.num_attention_heads / tp
    kv = local_kv_heads(m.kv_heads, tp)
    norms = 2 * (4 + c) * h / sp
    attention = c * h / sp + c * m.head_size * (3 * heads + 2 * kv) + FP32 * heads + document_mask_bytes(cfg)
    if not m.is_moe_layer(layer):
        return norms + attention + c * h / sp + 4 * c * m.intermediate_size / tp
    k = m.num_experts_per_tok
    # Per routed copy: the expert input and the down projection's output (with etp both over the etp
    # ranks' gathered rows: the 57B-A14B at etp 2 traced 1.044-1.083 x the plan until counted), the
    # output's unpermuted copy, SwiGLU (its columns split over etp: the same bytes).
    routed = k * c * ((1 + 2 * p.etp) * h + 4 * m.moe_intermediate_size) / tp
    # The shared expert: SwiGLU, its output (scaled by the sigmoid gate) and the gate.
    shared = c * (4 * m.shared_expert_intermediate_size / tp + h + 1) if m.shared_expert_intermediate_size else 0
    router = FP32 * m.num_experts + 2 * 8 * k  # fp32 probabilities, int64 choices and their sort order
    return norms + attention + c * h + router + routed + shared


def document_mask_bytes(cfg: Config) -> float:
    """Per token, the document mask attention saves with ``[data] document_mask`` and no cp: a row of
    the window's keys in the compute dtype (``models.qwen2.CausalAttention`` hands SDPA a ``[B, 1, S, S]``
    boolean mask, which it turns into an additive one and keeps for backward; the dry run of Qwen2.5-0.5B
    at sequence 2048 holds 64 MiB more per layer). Context parallelism masks only the blocks that
    straddle a document start, one at a time (not counted)."""
    return compute_bytes(cfg) * cfg.train.seq_len if cfg.data.document_mask and cfg.parallel.cp == 1 else 0.0


def microbatch_tokens(cfg: Config) -> int:
    """Tokens of one micro-batch on one rank: its dp x ep share of the batch and cp share of the sequence."""
    p, t = cfg.parallel, cfg.train
    return t.global_batch_size // (p.dp * p.mesh_ep) // p.microbatches * t.seq_len // p.cp


def in_flight(cfg: Config, pp_rank: int) -> int:
    """Micro-batches whose activations a rank holds at its peak (each one model chunk with virtual stages)."""
    return sum(live for live, _ in _peak_moment(cfg, pp_rank).held.values())


class Moment(NamedTuple):
    """The rank's state after one action of its schedule: what its in-flight micro-batches hold."""

    index: int  # of the action in the rank's steps
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


class Action(NamedTuple):
    """One compute action of a rank's schedule and the micro-batches its stages hold before and after it."""

    index: int
    kind: str  # "F", "B" or "W"
    stage: int
    split: bool  # a ``B`` computing input gradients only, its graph kept for the ``W``
    held: dict[int, tuple[int, int]]  # as :class:`Moment`'s
    prior: dict[int, tuple[int, int]]  # ``held`` of the rank's action before it (none before the first)


@functools.lru_cache(maxsize=256)
def _actions_by_rank(schedule: str, pp: int, microbatches: int, virtual: int, unsplit: frozenset[int]):
    """Per rank: (its distinct :class:`Action` s, :func:`_distinct_actions`, {stage: :class:`StageSpan`})."""
    out = []
    for steps in built_schedule(schedule, pp, microbatches, virtual):
        split = {key for key in split_backwards(steps) if key[0] not in unsplit}
        actions, prior = [], {}
        for i, held in held_by_stage(steps, unsplit):
            actions.append(Action(i, steps[i].kind, steps[i].stage, (steps[i].stage, steps[i].mb) in split, held, prior))
            prior = held
        spans = _stage_spans(steps, actions, split)
        out.append((_distinct_actions(actions, spans), spans))
    return tuple(out)


def _stage_spans(steps, actions: list[Action], split: set[tuple[int, int]]) -> dict[int, StageSpan]:
    """{stage: :class:`StageSpan`} of one rank. A release is at the rank's last action at or before the
    stage's last weight pass: an unsplit stage's ``W`` is no action here (its ``B`` ran the whole
    backward), and no action falls between the two."""
    first: dict[tuple[str, int], int] = {}
    for a in actions:
        weight = a.kind == W or (a.kind == B and (a.stage, steps[a.index].mb) not in split)
        for kind in (a.kind, "weight") if weight else (a.kind,):
            first.setdefault((kind, a.stage), a.index)
    indices = [a.index for a in actions]
    return {stage: StageSpan(first[(F, stage)], first[("weight", stage)], first[(B, stage)],
                             indices[bisect.bisect_right(indices, last) - 1])
            for stage, last in last_weight_passes(steps).items()}


def _distinct_actions(actions: list[Action], spans: dict[int, StageSpan]) -> tuple[Action, ...]:
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


def _moment(cfg: Config, per_stage: dict[int, tuple[float, float]], index: int,
            held: dict[int, tuple[int, int]]) -> Moment:
    """What ``held`` holds: each stage's micro-batches weighed by :func:`_stage_bytes`."""
    saved = microbatch_tokens(cfg) * sum(n * per_stage[s][0] + w * per_stage[s][1] for s, (n, w) in held.items())
    last = cfg.parallel.pp * cfg.parallel.virtual_stages - 1
    return Moment(index, held, saved, held.get(last, (0, 0))[0] * _loss_held_per_microbatch(cfg))


def _rank_stage_bytes(cfg: Config, pp_rank: int) -> dict[int, tuple[float, float]]:
    """:func:`_stage_bytes` of each global stage the rank runs."""
    p = cfg.parallel
    stages = range(p.pp * p.virtual_stages)
    return {s: _stage_bytes(cfg, s) for s in stages if chunk_rank(s, p.pp, _v_shape(cfg)) == pp_rank}


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


def _layer_kept_on_device(cfg: Config, layer: int) -> float:
    return 0.0 if layer_offloaded(cfg, layer) else layer_kept_bytes(cfg, layer)


def unsplit_stages(cfg: Config) -> frozenset[int]:
    """Stages whose backward the executor runs whole even in a zero-bubble schedule (its ``unsplit``):
    those with checkpointed or compiled layers."""
    p = cfg.parallel
    ranges = chunk_layer_ranges(cfg.model.num_hidden_layers, p.pp, p.virtual_stages)
    return frozenset(s for s, r in enumerate(ranges)
                     if runs_backward_whole(r, lambda i: layer_checkpointed(cfg, i), lambda _: p.compile))


def layer_offloaded(cfg: Config, layer: int) -> bool:
    """Whether the layer's saved tensors go to host memory (``offload_activations``, not recomputed)."""
    return cfg.parallel.offload_activations and not layer_checkpointed(cfg, layer)


def offloads_optimizer(cfg: Config) -> bool:
    return cfg.parallel.offload == "optimizer"


def offloaded_activation_bytes(cfg: Config) -> float:
    """pp = 1: host bytes of one micro-batch's offloaded saved tensors (every offloaded layer's)."""
    return microbatch_tokens(cfg) * sum(by_kind(cfg, _offloaded_bytes, range(cfg.model.num_hidden_layers)))


def _offloaded_bytes(cfg: Config, layer: int) -> float:
    return layer_activation_bytes(cfg, layer) if layer_offloaded(cfg, layer) else 0.0


def host_bytes(cfg: Config, coords: Coords, assumptions: Assumptions) -> dict[str, float]:
    """The rank's host memory by term (module docstring): the offloaded fp32 state, the offloaded saved
    tensors and the process's own (``assumptions.host_reserved_gib``)."""
    state = state_bytes(cfg, coords) if offloads_optimizer(cfg) else dict.fromkeys(("params", "grads", "optimizer"), 0)
    return {**state, "activations": offloaded_activation_bytes(cfg), "other": assumptions.host_reserved_gib * GIB}


def layer_checkpointed(cfg: Config, layer: int) -> bool:
    """Whether the layer's backward replays its forward (``op``: in part)."""
    return checkpoints_layer(layer, cfg.parallel.activation_checkpointing, cfg.parallel.ac_every)


def layer_kind(cfg: Config, layer: int) -> tuple[bool, bool]:
    """What the per-layer figures (bytes, FLOPs, transfers, GEMM times) depend on besides the config:
    whether the layer is a MoE layer and whether it is checkpointed."""
    return cfg.model.is_moe_layer(layer), layer_checkpointed(cfg, layer)


def by_kind(cfg: Config, fn: Callable[[Config, int], T], layers: Iterable[int]) -> list[T]:
    """``fn(cfg, i)`` of each of ``layers``, evaluated once per :func:`layer_kind` (the layout search
    evaluates thousands of variants of models a hundred layers deep)."""
    values: dict[tuple[bool, bool], T] = {}
    out = []
    for i in layers:
        kind = layer_kind(cfg, i)
        if kind not in values:
            values[kind] = fn(cfg, i)
        out.append(values[kind])
    return out


def layer_kept_bytes(cfg: Config, layer: int) -> float:
    """Per token, what one layer keeps from its forward to its backward: its saved tensors; checkpointed,
    its input; under ``op`` its input and the op outputs the policy keeps (:func:`op_kept_bytes`)."""
    if not layer_checkpointed(cfg, layer):
        return layer_activation_bytes(cfg, layer)
    input_bytes = compute_bytes(cfg) * cfg.model.hidden_size / _sp_split(cfg)
    return input_bytes + (op_kept_bytes(cfg, layer) if cfg.parallel.activation_checkpointing == "op" else 0.0)


def layer_recomputed_bytes(cfg: Config, layer: int) -> float:
    """Per token, the saved tensors a layer's recomputation rebuilds in its backward: none without
    checkpointing, all of them for a checkpointed block, under ``op`` those the kept outputs do not
    stand for (estimate: the plain block's less the kept op outputs)."""
    if not layer_checkpointed(cfg, layer):
        return 0.0
    full = layer_activation_bytes(cfg, layer)
    return max(full - op_kept_bytes(cfg, layer), 0.0) if cfg.parallel.activation_checkpointing == "op" else full


def block_matmuls(cfg: Config, layer: int) -> list[tuple[float, float]]:
    """Per token, (output elements, input width) of each matmul of one layer's forward on one rank, in
    the order it runs them (``models/qwen2.py``, ``models/moe.py``): q, k, v, o (o's partial sums: [H]
    on every tp rank), then gate, up, down; MoE layers: the router, per routed copy grouped gate, up and
    down (tokens split over tp, down's rows gathered over etp), the shared expert's gate and its gate,
    up and down."""
    return [shape for shape, _ in _block_matmul_parts(cfg, layer)]


def _block_matmul_parts(cfg: Config, layer: int) -> list[tuple[tuple[float, float], str]]:
    """:func:`block_matmuls` with the part each belongs to (``[parallel] ac_parts``' names; ``attention``
    and ``router`` for the projections and gates no part recomputes)."""
    m, p = cfg.model, cfg.parallel
    h, tp = m.hidden_size, p.tp
    q = m.head_size * m.num_attention_heads / tp
    kv = m.head_size * local_kv_heads(m.kv_heads, tp)
    attention = [((q, h), "attention"), ((kv, h), "attention"), ((kv, h), "attention"), ((h, q), "attention")]
    if not m.is_moe_layer(layer):
        inner = m.intermediate_size / tp
        return attention + [((inner, h), "mlp"), ((inner, h), "mlp"), ((h, inner), "mlp")]
    k, inner, shared = m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size / tp
    routed = [((k * inner / tp, h), "moe_experts")] * 2 + [((k * h * p.etp / tp, inner / p.etp), "moe_experts")]
    shared_expert = [((1, h), "router"), ((shared, h), "mlp"), ((shared, h), "mlp"), ((h, shared), "mlp")] if shared else []
    return attention + [((m.num_experts, h), "router")] + routed + shared_expert


def op_kept_matmuls(cfg: Config, layer: int) -> list[bool]:
    """Which of :func:`block_matmuls` the ``op`` policy keeps (``alternate_matmuls``: the 1st, 3rd, ...;
    ``parts``: those of no part ``ac_parts`` names)."""
    p = cfg.parallel
    parts = [part for _, part in _block_matmul_parts(cfg, layer)]
    if p.ac_policy == "parts":
        return [part not in p.ac_parts for part in parts]
    return [p.ac_policy != "alternate_matmuls" or i % 2 == 0 for i in range(len(parts))]


def op_recomputed_matmuls(cfg: Config, layer: int) -> list[bool]:
    """Which of :func:`block_matmuls` the backward of an ``op`` block runs again: those the policy does not
    keep, but a dense layer's down projection, the block's last op whose output only the residual add
    takes (which keeps nothing): torch's recomputation stops once it has rebuilt every saved tensor."""
    recomputed = [not kept for kept in op_kept_matmuls(cfg, layer)]
    if not cfg.model.is_moe_layer(layer):
        recomputed[-1] = False
    return recomputed


def _attention_recomputed(cfg: Config) -> bool:
    """Whether the ``op`` policy recomputes the attention kernel (``ac_parts`` naming ``core_attn``)."""
    return cfg.parallel.ac_policy == "parts" and "core_attn" in cfg.parallel.ac_parts


def recomputed_share(cfg: Config, layer: int) -> float:
    """The share of one layer's forward FLOPs its backward recomputes: 1 for a checkpointed block, 0
    without checkpointing; under ``op`` the matmuls the policy does not keep (:func:`op_kept_matmuls`)
    over the layer's matmuls and causal attention (kept: its output is saved, but with ``core_attn``)."""
    if not layer_checkpointed(cfg, layer):
        return 0.0
    if cfg.parallel.activation_checkpointing != "op":
        return 1.0
    m = cfg.model
    flops = [2 * out * width for out, width in block_matmuls(cfg, layer)]
    recomputed = sum(f for f, again in zip(flops, op_recomputed_matmuls(cfg, layer)) if again)
    # QK^T and AV over half the (causal) keys: 2 * 2 * S / 2 FLOPs per head dimension, per token.
    attention = 2 * cfg.train.seq_len * m.head_size * m.num_attention_heads / cfg.parallel.tp
    return (recomputed + attention * _attention_recomputed(cfg)) / (sum(flops) + attention)


def op_kept_bytes(cfg: Config, layer: int) -> float:
    """Per token, the op outputs ``activation_checkpointing = "op"`` keeps for one layer
    (``parallel/checkpointing.py``): attention's output and fp32 log-sum-exp per head (ring attention:
    one per ring step; none when ``ac_parts`` recomputes ``core_attn``), the tp collectives' outputs (DTensor's: per attention and MLP half, with SP the
    gathered input [H] and the reduce-scattered output [H / tp], without SP the all-reduced output
    [H]) and the matmul outputs the policy keeps (:func:`op_kept_matmuls`). ``tests/test_plan.py`` compares it with what a checkpointed block keeps."""
    m, p = cfg.model, cfg.parallel
    c, h, tp = compute_bytes(cfg), m.hidden_size, p.tp
    heads = m.num_attention_heads / tp
    ring_steps = p.cp if cp_comm(p.cp_comm_type).ring else 1
    attention = 0.0 if _attention_recomputed(cfg) else ring_steps * (c * m.head_size * heads + FP32 * heads)
    halves = 1 + (not m.is_moe_layer(layer) or bool(m.shared_expert_intermediate_size))
    collectives = halves * (c * h + c * h / tp if p.sp else c * h) if tp > 1 else 0.0
    kept = zip(block_matmuls(cfg, layer), op_kept_matmuls(cfg, layer))
    return attention + collectives + c * sum(out for (out, _), keep in kept if keep)


def saved_activation_bytes(cfg: Config, pp_rank: int) -> float:
    """Tensors the in-flight micro-batches keep for backward at the rank's peak (:func:`_stage_bytes`
    per stage: saved tensors, the final norm's, the stage input; with a split backward also the output
    gradients each waiting ``W`` restarts from)."""
    return _peak_moment(cfg, pp_rank).saved


def captured_gradient_bytes(cfg: Config, layer: int) -> float:
    """Per token, the output gradients a split backward's ``B`` records for one layer and its ``W``
    restarts from (``parallel/pipeline/executor.py``): one per node where a weight's gradient
    branches off: both norms' outputs, q / k / v, o_proj's and down_proj's (partial) outputs, gate and
    up; MoE layers: router and shared-expert gate logits, per routed copy gate, up and down, the
    shared expert. ``tests/test_plan.py`` compares it with what ``B`` records for a block."""
    m, p = cfg.model, cfg.parallel
    c, h, tp, sp = compute_bytes(cfg), m.hidden_size, p.tp, _sp_split(cfg)
    kv = local_kv_heads(m.kv_heads, tp)
    common = 2 * h / sp + h + m.head_size * (m.num_attention_heads / tp + 2 * kv)
    if not m.is_moe_layer(layer):
        return c * (common + h + 2 * m.intermediate_size / tp)
    routed = m.num_experts_per_tok * (h + 2 * m.moe_intermediate_size) / tp
    shared = h + 2 * m.shared_expert_intermediate_size / tp + 1 if m.shared_expert_intermediate_size else 0
    return c * (common + m.num_experts + routed + shared)


def final_norm_bytes(cfg: Config, pp_rank: int) -> float:
    """The final norm's saved tensors for one micro-batch (last stage): fp32 input and normalized value."""
    c, h = compute_bytes(cfg), cfg.model.hidden_size
    return microbatch_tokens(cfg) * (4 + c) * h / _sp_split(cfg) if holds_last_stage(cfg, pp_rank) else 0


def layer_gradient_bytes(cfg: Config, layer: int) -> float:
    """Per token, the gradients one layer's backward holds at once next to its saved tensors: the
    hidden-state gradient coming in and going out, and the widest op's two input gradients (SwiGLU's
    gate and up: [I/tp] each; MoE: per routed copy, plus the shared expert's)."""
    m, p = cfg.model, cfg.parallel
    c, h, sp, tp = compute_bytes(cfg), m.hidden_size, _sp_split(cfg), p.tp
    hidden = 2 * c * h / sp
    if not m.is_moe_layer(layer):
        return hidden + 2 * c * m.intermediate_size / tp
    routed = m.num_experts_per_tok * c * (h + 2 * m.moe_intermediate_size) / tp
    shared = 2 * c * m.shared_expert_intermediate_size / tp
    return hidden + routed + shared


# An eager float8 cast (torchao's ``hp_tensor_and_scale_to_float8``: the operand times its scale in fp32,
# clamped to the float8 range in fp32, then converted) holds all three at once: 9 bytes an element.
FP8_CAST_BYTES = FP32 + FP32 + 1


def fp8_operand_width(cfg: Config, layer: int) -> float:
    """Per token, the widest operand the layer's float8 GEMMs cast (those of :func:`fp8_weights`): a
    linear's output gradient (its local rows; a row-parallel one's whole [H], gathered under SP) or its
    input (its local columns; a column-parallel one's under SP cast on the sequence shard before the
    gather). 0 for a layer without any (``[train] fp8 = "none"``)."""
    sp = _sp_split(cfg)
    widths = [0.0]
    for q in fp8_weights(cfg, layer_params(cfg, layer)):
        rows, columns = model_parallel_shape(q, cfg, Coords())
        widths += [rows, columns if q.tp_dim == 1 else columns / sp]
    return max(widths)


def fp8_cast_gradient_bytes(cfg: Config, layer: int) -> float:
    """Per token, what a layer's backward holds beside its saved tensors while a float8 GEMM casts its
    widest operand (:func:`fp8_operand_width`) for the weight gradient: the incoming hidden-state
    gradient and its float8 copy, that GEMM's input gradient already computed, and the cast's
    :data:`FP8_CAST_BYTES`. The dry runs of Qwen2.5-7B (4 layers, tensorwise) peak there at dp 8 (the
    down projection's input, [I / tp] a token, cast after its input gradient) and, at the same bytes within
    1 %, at dp 2 x tp 4 + SP in the recomputed forward's cast of that input (beside the packed gate /
    up output SP feeds the MLP, [2 I / tp]). Not counted: a weight's cast (at most 9 bytes an element of
    one local weight; 0.14 GiB for the 7B's gate at tp 4) and the fp32 copies of the routed experts'
    emulated grouped GEMM (``Float8GroupedMatmul``), which the dry run cannot trace."""
    width = fp8_operand_width(cfg, layer)
    if not width:
        return 0.0
    c = compute_bytes(cfg)
    return (c + 1) * cfg.model.hidden_size + (c + FP8_CAST_BYTES) * width


def backward_working_bytes(cfg: Config, pp_rank: int) -> float:
    """The rise over the saved activations while one layer runs backward (last layer first), at the
    layer where :func:`backward_peak` finds the backward's peak: its gradient temporaries and, if
    checkpointed, its recomputed saved tensors, less the saved tensors of the layers after it, already
    freed. Without checkpointing that is the last layer's gradients;
    with it, about one recomputed layer (MemTracker's temporaries at the peak are one block's saved
    tensors, ``benchmarks/results/plan_validation.md``)."""
    return backward_peak(cfg, Coords(pp=pp_rank))[0]


def _unit_grad_bytes(cfg: Config, coords: Coords) -> dict[str, float]:
    """Sharded fp32 gradient bytes of each FSDP unit on the rank at ``coords``."""
    return dict(_unit_shard_bytes((layout_key(cfg), coords), cfg))


@memo_by_key
def _unit_shard_bytes(key: tuple, cfg: Config) -> tuple[tuple[str, float], ...]:
    coords = key[1]
    out: dict[str, float] = {}
    for param in stage_params(cfg, coords.pp):
        out[param.unit] = out.get(param.unit, 0) + FP32 * local_numel(param, cfg, coords)
    return tuple(out.items())


class BackwardPeak(NamedTuple):
    """One layer's backward at the peak of a rank's backward (:func:`backward_peak`)."""

    rise: float  # working-set rise over the saved activations (:func:`backward_working_bytes`)
    reduced: float  # sharded fp32 gradients of the units already reduced
    reduce_scatter: float  # the fp32 reduce-scatter input live beside it (:func:`reduce_scatter_in_flight`)


def backward_peak(cfg: Config, coords: Coords, reducing: bool | None = None) -> BackwardPeak:
    """The layer of the backward where the rise, the gradients already reduced and the reduce-scatter
    input in flight (pp = 1) sum highest.

    The rise is :func:`backward_working_bytes`'. When the backward reduces as it goes (``reducing``;
    default: the step starts without sharded gradients, :func:`sharded_grads_before_backward`), those
    of the LM head and of every layer already through its backward appear as the activations go: with
    checkpointing the last layer's backward peaks with nearly all of them. Otherwise they are counted
    whole elsewhere, or not yet there, and add nothing here."""
    if reducing is None:
        reducing = not sharded_grads_before_backward(cfg)
    grads = _unit_grad_bytes(cfg, coords) if reducing else {}
    in_flight = reduce_scatter_in_flight(cfg, coords.pp)
    return max((_chunk_backward_peak(cfg, r, grads, in_flight) for r in _stage_layer_ranges(cfg, coords.pp)), key=sum)


def reduce_scatter_in_flight(cfg: Config, pp_rank: int) -> tuple[float, float]:
    """pp = 1: the fp32 reduce-scatter input live while the backward's first layer runs, and while each
    later one does. FSDP2 keeps a unit's input until the next unit's post-backward
    (``reduce_scatter_max_input_buffers`` = 1), so each layer runs beside the unit reduced before it: an
    untied LM head's [V/tp, H] for the first (it reduces before the layers; Qwen2.5-7B at dp 256 x tp 4,
    where the state is small and the backward peaks in that layer, traced 0.29 GiB above the plan until
    counted: 0.51 GiB beside a layer's 0.22), the largest layer unit's for the rest."""
    block = FP32 * largest_layer_unit(cfg, pp_rank)
    return max(block, FP32 * unit_elements(cfg, pp_rank).get("head", 0)), block


def largest_layer_unit(cfg: Config, pp_rank: int) -> int:
    """Elements of the rank's largest decoder-layer unit (a block's or a layer's experts; 0 without any)."""
    return max((n for u, n in unit_elements(cfg, pp_rank).items() if u.startswith(("block.", "experts."))), default=0)


def _chunk_backward_peak(cfg: Config, layers: range, grads: dict[str, float],
                         in_flight: tuple[float, float] = (0.0, 0.0)) -> BackwardPeak:
    """:func:`backward_peak` over one chunk's ``layers``, with the sharded gradient bytes ``grads`` of
    the units that reduce as the backward goes (empty: none) and the reduce-scatter input ``in_flight``
    during its first layer's backward and each later one's (pipelines reduce at their release: none)."""
    tokens = microbatch_tokens(cfg)
    best = BackwardPeak(0.0, 0.0, 0.0)
    freed, reduced, buffer = 0.0, grads.get("head", 0.0), in_flight[0]
    backward = by_kind(cfg, _layer_backward_bytes, reversed(layers))
    for i, (back, gradients, kept) in zip(reversed(layers), backward):
        rise = tokens * (back + gradients - freed)
        if rise + reduced + buffer > sum(best):
            best = BackwardPeak(rise, reduced, buffer)
        freed += kept
        reduced += grads.get(f"block.{i}", 0.0) + grads.get(f"experts.{i}", 0.0)
        buffer = in_flight[1]
    return best


def _layer_backward_bytes(cfg: Config, layer: int) -> tuple[float, float, float]:
    """Per token, a layer's saved tensors back for its backward (a recomputed or copied-back layer's come
    back for it only), its gradient temporaries, and what it kept on the device until then."""
    offloaded = layer_offloaded(cfg, layer)
    back = layer_activation_bytes(cfg, layer) if offloaded else layer_recomputed_bytes(cfg, layer)
    gradients = max(layer_gradient_bytes(cfg, layer), fp8_cast_gradient_bytes(cfg, layer))
    return back, gradients, 0.0 if offloaded else layer_kept_bytes(cfg, layer)


def activation_bytes(cfg: Config, pp_rank: int) -> float:
    """Activations at the backward peak: the in-flight micro-batches' saved tensors plus one layer's
    backward working set (:func:`backward_working_bytes`)."""
    return saved_activation_bytes(cfg, pp_rank) + backward_working_bytes(cfg, pp_rank)


def loss_held_bytes(cfg: Config, pp_rank: int) -> float:
    """What the fused loss (``models/chunked_loss.py``) saves for backward per in-flight micro-batch of the last
    stage at the rank's peak: the hidden-state gradient [tokens, H] and the fp32 weight-gradient
    accumulator [V/tp, H]."""
    return _peak_moment(cfg, pp_rank).loss


def _loss_held_per_microbatch(cfg: Config) -> float:
    p, m = cfg.parallel, cfg.model
    return microbatch_tokens(cfg) * m.hidden_size * compute_bytes(cfg) + m.vocab_size / p.tp * m.hidden_size * FP32


def loss_chunk_bytes(cfg: Config, pp_rank: int) -> float:
    """The fused loss's working buffers while it runs (forward only: backward just scales the saved
    gradients): one chunk's fp32 logits [chunk, V/tp], which become the logit gradient in place, plus
    its compute-dtype copy when that is not fp32, and the chunk's [V/tp, H] weight-gradient product."""
    p, m = cfg.parallel, cfg.model
    if not holds_last_stage(cfg, pp_rank):
        return 0
    c, vocab = compute_bytes(cfg), m.vocab_size / p.tp
    chunk = min(cfg.train.loss_chunk_tokens, microbatch_tokens(cfg)) * vocab * (FP32 + (c if c != FP32 else 0))
    return chunk + vocab * m.hidden_size * c


def loss_bytes(cfg: Config, pp_rank: int) -> float:
    """The fused, chunked LM head + cross-entropy on the last stage at its peak (end of forward)."""
    return loss_held_bytes(cfg, pp_rank) + loss_chunk_bytes(cfg, pp_rank)


def ep_dispatch_bytes(cfg: Config) -> float:
    """One MoE layer's routed token copies being sent and received (tokens split over tp); with etp
    also the etp ranks' rows gathered and the copies sent to each of them."""
    m, p = cfg.model, cfg.parallel
    if not m.is_moe or p.ep * p.etp == 1:
        return 0
    rows = microbatch_tokens(cfg) * m.num_experts_per_tok / p.tp
    exchanged = 2 if p.ep > 1 else 0
    gathered = 2 * p.etp if p.etp > 1 else 0
    return (exchanged + gathered) * rows * m.hidden_size * compute_bytes(cfg)


def data_parallel_bytes(cfg: Config, pp_rank: int, phase: str = "backward") -> dict[str, float]:
    """pp = 1: ``gathered``, ``unsharded_grads`` and ``reduce_scatter`` (module docstring) in backward
    (but ``reduce_scatter``, which depends on the layer at the peak: :func:`backward_peak`), at the end
    of the forward (``phase="forward"``: only the root and LM-head units gathered, blocks reshard after
    their forward, no gradient being reduced, unsharded gradients only when earlier micro-batches'
    backward left them accumulating) or at the end of the backward (``phase="backward end"``: only the
    embedding and root units left to reduce). Gathered per step (``fsdp_gather``), every unit stays
    gathered through the forward and the backward. Pipelines: :func:`pipeline_moments`."""
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
        return {"gathered": held or gathered.get("root", 0) + gathered.get("head", 0), "unsharded_grads": unsharded,
                "reduce_scatter": 0}
    if phase == "backward end":
        # The embedding's unit and the root (final norm; a tied embedding) are reduced last, after
        # every block's gradient has been reduce-scattered and freed.
        last = max(root, units.get("embed", 0))
        return {"gathered": gathered.get("root", 0), "unsharded_grads": (FP32 if accumulate else c) * last,
                "reduce_scatter": FP32 * last}
    # The unit in use, the blocks prefetched ahead (their all-gather outputs: a unit's output is
    # copied into its parameters and freed before the next prefetch is issued) and the root unit;
    # the unit whose gradients it computes is a layer's (the embedding's and LM head's are outside the
    # layers). The reduce-scatter input beside it depends on the layer: :func:`backward_peak`.
    block = largest_layer_unit(cfg, pp_rank) or largest
    in_use = max((b for u, b in gathered.items() if u.startswith(("block.", "experts."))), default=max(gathered.values()))
    ahead = p.fsdp_prefetch * in_use if p.data_parallel != "replicate" else 0
    unsharded = FP32 * sum(units.values()) if accumulate else c * block
    return {"gathered": held or in_use + ahead + gathered.get("root", 0), "unsharded_grads": unsharded}


def sharded_grads_before_backward(cfg: Config) -> bool:
    """pp = 1: whether the rank holds its sharded fp32 gradients before the last backward of the step:
    only when an earlier micro-batch's backward already reduce-scattered into them (full sharding
    gathered per micro-batch reduces every micro-batch). The step starts with none
    (``zero_grad(set_to_none)``); replication, HSDP and ``per_step`` reduce on the last micro-batch."""
    p = cfg.parallel
    return p.microbatches > 1 and reduces_gradients(p, 0, p.microbatches)


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
    stage_of = {i: s for s, r in enumerate(chunk_layer_ranges(cfg.model.num_hidden_layers, p.pp, p.virtual_stages))
                for i in r}
    special = {"embed": [0], "head": [p.pp * p.virtual_stages - 1], "root": list(spans)}
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
    return {"gathered": sum(g.gathered for g in live),
            "unsharded_grads": sum(g.unsharded for g in live if g.span.grads <= index),
            "grads": sum(g.sharded for g in groups if g.span.released < index)}


def _reducing_largest(units: dict[str, float], group: _UnitGroup, restarted_weights: bool, c: float) -> dict[str, float]:
    """The units while a release reduce-scatters its group's largest unit: FSDP's post-backward has
    resharded that unit and folded its fresh compute-dtype gradients (counted in ``weight_grads`` after
    a restarted ``W``) into the fp32 accumulator before it allocates the reduce-scatter input (the 57B
    pp8 x cp4 x tp2 zbv dry run: chunk 15's experts unit frees 3.3 GiB of each before its 6.6 GiB
    input; counting them beside it put that release 5.7 GiB above the trace)."""
    gathered = c * group.largest / FP32
    folded = gathered if restarted_weights and group.largest_in_layers else 0.0
    return {**units, "gathered": units["gathered"] - gathered, "unsharded_grads": units["unsharded_grads"] - folded}


def _chunk_weight_gradient_bytes(cfg: Config, pp_rank: int, ranges: list[range], stages) -> dict[int, float]:
    """Per stage, the compute-dtype weight gradients of its layers: a restarted ``W``
    (``executor._Deferred.run``) computes them before they are added to ``.grad`` (the dry runs: 0.4 GiB
    per 0.43 GiB layer of a Qwen2.5-7B zbv chunk, 3.9 GiB over a 72B pp8 zbv chunk's 4.5)."""
    units = unit_elements(cfg, pp_rank)
    c = compute_bytes(cfg)
    return {s: c * sum(units.get(f"{kind}.{i}", 0) for i in ranges[s] for kind in ("block", "experts")) for s in stages}


def pipeline_moments(cfg: Config, coords: Coords) -> dict[str, list[dict[str, float]]]:
    """pp > 1: the terms (all but the fp32 state) at each moment of the rank's schedule, by phase.

    ``forward``: after each ``F`` (its micro-batch's tensors saved; on the last stage the loss's
    chunk buffers); ``backward``: during each ``B`` or ``W`` (the micro-batches held before it; a
    ``B`` adds its stage's working set, :func:`backward_peak`, and has freed its own final norm and
    loss tensors; a restarted ``W`` its chunk's weight gradients); ``backward end``: each release (a stage's last weight pass, ``_release_points``),
    with the reduce-scatter input of its largest unit, the released units still whole. FSDP units
    follow :func:`_unit_groups`: gathered from their stage's first forward, fp32 gradients from its
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
    backward_dispatch = 0.0 if _recomputes_every_layer(cfg) else dispatch
    c = compute_bytes(cfg)
    # The embedding's backward ends the first stage's (its W, or an unsplit B), once the micro-batch's saved
    # tensors are freed: its compute-dtype gradient is live beside the fp32 accumulator FSDP folds it into
    # (Qwen2.5-7B pp16 x tp4 zb1p, stage 0: a 0.25 GiB gradient; the trace held 0.23 GiB above the plan).
    fresh_embedding = c * unit_elements(cfg, coords.pp).get("embed", 0)
    out: dict[str, list[dict[str, float]]] = {phase: [] for phase in PHASES}
    for a in actions:
        prior, after = _moment(cfg, per_stage, a.index - 1, a.prior), _moment(cfg, per_stage, a.index, a.held)
        units = _units_at(groups, a.index)
        if a.kind == F:
            chunk = loss_chunk_bytes(cfg, coords.pp) if a.stage == last else 0.0
            out["forward"].append({**units, "activations": after.saved, "loss": after.loss + chunk,
                                   "reduce_scatter": 0.0, "ep_dispatch": dispatch})
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
            out["backward"].append({**units, "activations": held, "loss": max(0.0, prior.loss - consumed),
                                    "reduce_scatter": 0.0, "ep_dispatch": backward_dispatch if a.kind == B else 0.0})
        for g in groups:
            if g.span.released == a.index:
                out["backward end"].append({**_reducing_largest(units, g, a.kind == W and a.stage > 0, c),
                                            "activations": after.saved, "loss": after.loss,
                                            "reduce_scatter": g.largest, "ep_dispatch": 0.0})
    return out


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
        return {phase: {**state, **max(moments[phase], key=lambda t: sum(t.values()))} for phase in PHASES}
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
        terms["activations"] = saved_activation_bytes(cfg, coords.pp) + offload_in_flight_bytes(cfg)
        terms["loss"] = loss_bytes(cfg, coords.pp)
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


def offload_in_flight_bytes(cfg: Config) -> float:
    """At the end of the forward, the last offloaded block's saved tensors, still on the device while
    their copies run (the largest such block)."""
    return microbatch_tokens(cfg) * max(by_kind(cfg, _offloaded_bytes, range(cfg.model.num_hidden_layers)), default=0.0)


def _recomputes_every_layer(cfg: Config) -> bool:
    """Full checkpointing: a MoE layer's backward re-runs its forward, whose dispatched copies are then
    its recomputed saved tensors (in :func:`backward_peak`'s rise, not again beside it; the A2.7B dry
    run's rise over its last layer's backward is 16.1 GiB, the layer's tensors and gradients 16.3)."""
    return cfg.parallel.activation_checkpointing in ("full", "op")


def rank_breakdown(cfg: Config, coords: Coords, assumptions: Assumptions = Assumptions()) -> Breakdown:
    """Every term for the rank at ``coords``, at the larger of its forward and backward peaks."""
    phases = all_phase_terms(cfg, coords)
    phase = max(PHASES, key=lambda k: sum(phases[k].values()))
    terms = phases[phase]
    terms["other"] = assumptions.reserved_gib * GIB + assumptions.fragmentation * sum(terms.values())
    return Breakdown({k: terms[k] for k in TERMS}, coords.pp, phase, host_bytes(cfg, coords, assumptions))


def predict_memory(cfg: Config, assumptions: Assumptions = Assumptions()) -> Breakdown:
    """The busiest rank's breakdown: the pipeline rank with the largest total (data and tp index 0,
    which ``torch.chunk`` gives the largest shards)."""
    ranks = (rank_breakdown(cfg, Coords(pp=r), assumptions) for r in range(cfg.parallel.pp))
    return max(ranks, key=lambda b: b.total)
