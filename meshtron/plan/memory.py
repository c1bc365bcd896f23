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
  tied embedding), at the end of the forward the root and LM-head units; with pp > 1 every unit of
  the stage stays gathered for the whole step (issue 15);
- ``unsharded_grads``: the unit being reduced (pp = 1, fsdp); the whole stage's gradients in fp32
  when they accumulate unreduced (pp > 1, or hsdp/replicate with several micro-batches);
- ``reduce_scatter``: the fp32 input buffer of the largest unit's gradient reduction (in backward; with
  pp > 1 only beyond the activations the other micro-batches have freed by the chunk's last backward);
- ``activations``: saved tensors per layer and token (:func:`layer_activation_bytes`) times the layers
  a rank holds, the tokens of one micro-batch and the micro-batches in flight (pp schedules: each
  weighed by its own stage at the rank's peak, ``held_by_stage``); activation checkpointing keeps only block inputs. In backward add one layer's
  working set (:func:`backward_working_bytes`: its gradient temporaries and, checkpointed, its
  recomputed saved tensors, less the saved tensors of the layers after it, already freed);
- ``loss``: the fused chunked LM head + cross-entropy: per in-flight micro-batch the hidden-state
  gradient [tokens, H] and the fp32 weight-gradient accumulator [V/tp, H] it saves for backward; at the
  end of the forward also one chunk's fp32 logits (plus its compute-dtype copy in bf16) [chunk, V/tp]
  and a [V/tp, H] product;
- ``ep_dispatch``: the routed token copies being sent and received by one MoE layer's all-to-all;
- ``other``: CUDA context, communicator buffers and allocator fragmentation (:class:`Assumptions`).

The peak (:func:`rank_breakdown`) is the largest of three moments, as torch's ``MemTracker`` finds
them (8 CPU ranks: ``benchmarks/plan_whole_step.py``; one rank with real Qwen2.5 shapes:
``benchmarks/plan_single_rank.py``): the end of the forward (all saved activations and the loss's
chunk buffers; with pp = 1 only the root and LM-head units gathered, no gradient reduction, and
unsharded gradients only when earlier micro-batches left them accumulating), the backward of one
layer (saved activations plus that layer's working set, the micro-batch's own loss tensors consumed,
the gathered / unsharded-gradient / reduce-scatter buffers) and the end of the backward (every
gradient, the last unit's reduction). ``grads`` exist whole before the last backward only when an
earlier micro-batch reduced into them (:func:`sharded_grads_before_backward`; pipelines: once a
stage of the rank released its units before the peak, :func:`sharded_grads_at_peak`); otherwise the backward counts those already reduced (:func:`backward_peak`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from meshtron.config import Config, ModelConfig
from meshtron.mesh import ExpertSplit, expert_hsdp_shards
from meshtron.parallel.pipeline.schedules import V_SHAPED, build_schedule, held_by_stage, last_weight_passes
from meshtron.parallel.pipeline.split import chunk_layer_ranges, chunk_rank, split_layers

GIB = 2**30
FP32 = 4

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

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.terms.items()}


def _memo_by_key(fn):
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


def kv_split(m: ModelConfig, tp: int) -> bool:
    """KV heads are split over tp when tp divides them; otherwise each tp rank keeps them whole."""
    return m.kv_heads % tp == 0


def _layer_params(m: ModelConfig, layer: int, tp: int) -> list[Param]:
    h, d = m.hidden_size, m.head_size
    kv_dim = 0 if kv_split(m, tp) else None
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


@_memo_by_key
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


def local_numel(param: Param, cfg: Config, coords: Coords) -> int:
    """Elements of ``param``'s DTensor local shard on the rank at ``coords``."""
    shape = model_parallel_shape(param, cfg, coords)
    shards, index = data_shards(cfg, coords, param.expert)
    # Experts shard the first dim the shard count divides (data.even_shard_dim); the rest dim 0.
    dim = next((d for d, n in enumerate(shape) if n % shards == 0), 0) if param.expert else 0
    shape[dim] = chunk_size(shape[dim], shards, index)
    return math.prod(shape)


def state_bytes(cfg: Config, coords: Coords = Coords()) -> dict[str, int]:
    """Exact fp32 ``params``, ``grads`` and AdamW ``optimizer`` bytes of the rank at ``coords``."""
    elements, tensors = _local_elements((_layout_key(cfg), coords), cfg)
    return {
        "params": FP32 * elements,
        "grads": FP32 * elements,
        "optimizer": 2 * FP32 * elements + FP32 * tensors,
    }


def _layout_key(cfg: Config) -> tuple:
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


def _stage_chunks(cfg: Config, pp_rank: int) -> list[range]:
    p = cfg.parallel
    return split_layers(cfg.model.num_hidden_layers, p.pp, p.virtual_stages, _v_shape(cfg))[pp_rank]


@_memo_by_key
def _local_elements(key: tuple, cfg: Config) -> tuple[int, int]:
    coords = key[1]
    params = stage_params(cfg, coords.pp)
    return sum(local_numel(q, cfg, coords) for q in params), len(params)


def unit_elements(cfg: Config, pp_rank: int) -> dict[str, int]:
    """Unsharded elements (after tp / ep) of each FSDP unit on ``pp_rank``."""
    return dict(_unit_elements((_layout_key(cfg), pp_rank), cfg))


@_memo_by_key
def _unit_elements(key: tuple, cfg: Config) -> tuple[tuple[str, int], ...]:
    pp_rank = key[1]
    units: dict[str, int] = {}
    for param in stage_params(cfg, pp_rank):
        units[param.unit] = units.get(param.unit, 0) + math.prod(model_parallel_shape(param, cfg, Coords()))
    return tuple(units.items())


def compute_bytes(cfg: Config) -> int:
    return 2 if cfg.train.dtype == "bfloat16" else 4


def _sp_split(cfg: Config) -> int:
    p = cfg.parallel
    return p.tp if p.sp and p.tp > 1 else 1


def layer_activation_bytes(cfg: Config, layer: int) -> float:
    """Bytes saved for backward per token of one decoder layer (no checkpointing).

    Mirrors what autograd keeps in ``models/qwen2.py``: each RMSNorm its fp32 input and its
    compute-dtype normalized value (4 + c per element); the q/k/v and gate/up inputs (sequence-split
    with SP); attention's rotated q, k, v, output and the o_proj input copy plus an fp32 log-sum-exp
    per head; SwiGLU's gate, silu(gate), up and product. MoE layers: router probabilities and choices,
    per routed copy the expert input, output (twice) and the four SwiGLU tensors (tokens split over tp),
    the shared expert. ``tests/test_plan.py`` compares it with the tensors autograd saves for a block.
    """
    m, p = cfg.model, cfg.parallel
    c, h, tp, sp = compute_bytes(cfg), m.hidden_size, p.tp, _sp_split(cfg)
    heads = m.num_attention_heads / tp
    kv = m.kv_heads / tp if kv_split(m, tp) else 1
    norms = 2 * (4 + c) * h / sp
    attention = c * h / sp + c * m.head_size * (3 * heads + 2 * kv) + FP32 * heads
    if not m.is_moe_layer(layer):
        return norms + attention + c * h / sp + 4 * c * m.intermediate_size / tp
    k = m.num_experts_per_tok
    # Per routed copy: the expert input, the down projection's output and its unpermuted copy, SwiGLU.
    routed = k * c * (3 * h + 4 * m.moe_intermediate_size) / tp
    # The shared expert: SwiGLU, its output (scaled by the sigmoid gate) and the gate.
    shared = c * (4 * m.shared_expert_intermediate_size / tp + h + 1) if m.shared_expert_intermediate_size else 0
    router = FP32 * m.num_experts + 2 * 8 * k  # fp32 probabilities, int64 choices and their sort order
    return norms + attention + c * h + router + routed + shared


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
    """(action index, {stage: (held, waiting)}) after each of the rank's actions (``held_by_stage``);
    stages with checkpointed or compiled layers run their backward whole (the executor's ``unsplit``)."""
    return _schedule_facts(cfg, pp_rank)[0]


def _schedule_facts(cfg: Config, pp_rank: int) -> tuple[tuple, int]:
    """(the rank's moments, the index of its first FSDP release: a stage's last weight pass)."""
    p = cfg.parallel
    if p.pp == 1:
        return ((0, {0: (1, 0)}),), 0
    return _facts_by_rank(p.schedule, p.pp, p.microbatches, p.virtual_stages, unsplit_stages(cfg))[pp_rank]


@functools.lru_cache(maxsize=256)
def _facts_by_rank(schedule: str, pp: int, microbatches: int, virtual: int, unsplit: frozenset[int]):
    steps = build_schedule(schedule, pp, microbatches, virtual)
    return tuple((tuple(held_by_stage(rank_steps, unsplit)), min(last_weight_passes(rank_steps).values()))
                 for rank_steps in steps)


def _peak_moment(cfg: Config, pp_rank: int) -> Moment:
    """The moment the rank's in-flight micro-batches hold the most (activations and loss tensors),
    each counted by its own stage's bytes (:func:`_stage_bytes`)."""
    tokens = microbatch_tokens(cfg)
    per_stage = _rank_stage_bytes(cfg, pp_rank)
    last = cfg.parallel.pp * cfg.parallel.virtual_stages - 1
    loss = _loss_held_per_microbatch(cfg)

    def moment(index: int, held: dict[int, tuple[int, int]]) -> Moment:
        saved = tokens * sum(n * per_stage[s][0] + w * per_stage[s][1] for s, (n, w) in held.items())
        return Moment(index, held, saved, held.get(last, (0, 0))[0] * loss)

    return max((moment(*m) for m in _moments(cfg, pp_rank)), key=lambda m: m.saved + m.loss)


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
    kept = sum(c * h / sp if layer_checkpointed(cfg, i) else layer_activation_bytes(cfg, i) for i in layers)
    if stage == p.pp * p.virtual_stages - 1:
        kept += (4 + c) * h / sp  # the final norm's fp32 input and normalized value
    if stage > 0:
        kept += c * h / sp  # the stage input received from the previous stage
    waiting = sum(captured_gradient_bytes(cfg, i) for i in layers) if stage > 0 else c * h / sp
    return kept, waiting


def unsplit_stages(cfg: Config) -> frozenset[int]:
    """Stages whose backward the executor runs whole even in a zero-bubble schedule (its ``unsplit``):
    those with checkpointed or compiled layers."""
    p = cfg.parallel
    ranges = chunk_layer_ranges(cfg.model.num_hidden_layers, p.pp, p.virtual_stages)
    return frozenset(s for s, r in enumerate(ranges) if p.compile or any(layer_checkpointed(cfg, i) for i in r))


def layer_checkpointed(cfg: Config, layer: int) -> bool:
    p = cfg.parallel
    return p.activation_checkpointing == "full" or (
        p.activation_checkpointing == "selective" and layer % p.ac_every == 0
    )


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
    kv = m.kv_heads / tp if kv_split(m, tp) else 1
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
    out: dict[str, float] = {}
    for param in stage_params(cfg, coords.pp):
        out[param.unit] = out.get(param.unit, 0) + FP32 * local_numel(param, cfg, coords)
    return out


def backward_peak(cfg: Config, coords: Coords, reducing: bool | None = None) -> tuple[float, float]:
    """(working-set rise, gradients already reduced) at the layer of the backward where their sum peaks.

    The rise is :func:`backward_working_bytes`'. When the backward reduces as it goes (``reducing``;
    default: the step starts without sharded gradients, :func:`sharded_grads_before_backward`), those
    of the LM head and of every layer already through its backward appear as the activations go: with
    checkpointing the last layer's backward peaks with nearly all of them. Otherwise they are counted
    whole elsewhere, or not yet there, and add nothing here."""
    c, h, sp = compute_bytes(cfg), cfg.model.hidden_size, _sp_split(cfg)
    tokens = microbatch_tokens(cfg)
    if reducing is None:
        reducing = not sharded_grads_before_backward(cfg)
    grads = _unit_grad_bytes(cfg, coords) if reducing else {}
    best = (0.0, 0.0)
    for chunk in (list(r) for r in _stage_chunks(cfg, coords.pp)):
        freed, reduced = 0.0, grads.get("head", 0.0)
        for i in reversed(chunk):
            ckpt = layer_checkpointed(cfg, i)
            full = layer_activation_bytes(cfg, i)
            rise = tokens * ((full if ckpt else 0) + layer_gradient_bytes(cfg, i) - freed)
            if rise + reduced > sum(best):
                best = (rise, reduced)
            freed += c * h / sp if ckpt else full
            reduced += grads.get(f"block.{i}", 0.0) + grads.get(f"experts.{i}", 0.0)
    return best


def activation_bytes(cfg: Config, pp_rank: int) -> float:
    """Activations at the backward peak: the in-flight micro-batches' saved tensors plus one layer's
    backward working set (:func:`backward_working_bytes`)."""
    return saved_activation_bytes(cfg, pp_rank) + backward_working_bytes(cfg, pp_rank)


def loss_held_bytes(cfg: Config, pp_rank: int) -> float:
    """What the fused loss (``models/loss.py``) saves for backward per in-flight micro-batch of the last
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
    """``gathered``, ``unsharded_grads`` and ``reduce_scatter`` (module docstring) in backward, or at the
    end of the forward (``phase="forward"``): with pp = 1 only the root and LM-head units are gathered
    then (blocks reshard after their forward), no gradient is being reduced, and unsharded gradients
    exist only when earlier micro-batches' backward left them accumulating (not with GPipe); or at
    the end of the backward (``phase="backward end"``), when with pp = 1 only the embedding and root
    units are left to reduce (pp > 1: as in backward)."""
    p = cfg.parallel
    c = compute_bytes(cfg)
    units = unit_elements(cfg, pp_rank)
    blocks = [n for u, n in units.items() if u.startswith(("block.", "experts."))]
    largest = max(units.values())
    root = units.get("root", 0)
    accumulate = p.pp > 1 or (p.data_parallel != "fsdp" and p.microbatches > 1)
    if p.pp > 1:  # gathered once by the first forward, each unit's all-gather output copied out and freed
        gathered = c * sum(units.values())
    elif phase == "forward":
        gathered = c * (root + units.get("head", 0))
    else:
        # The unit in use, the blocks prefetched ahead (their all-gather outputs: a unit's output is
        # copied into its parameters and freed before the next prefetch is issued) and the root unit.
        ahead = p.fsdp_prefetch * max(blocks, default=0) if p.data_parallel != "replicate" else 0
        gathered = c * (largest + ahead + root)
    unsharded = FP32 * sum(units.values()) if accumulate else c * largest
    if phase == "backward end" and _reduces_in_last_backward(cfg):
        # Each unit's accumulated fp32 gradient is freed once reduce-scattered: one is left at a time.
        return {"gathered": gathered, "unsharded_grads": FP32 * largest, "reduce_scatter": FP32 * largest}
    if phase == "backward end" and p.pp == 1:
        # The embedding's unit and the root (final norm; a tied embedding) are reduced last, after
        # every block's gradient has been reduce-scattered and freed.
        last = max(root, units.get("embed", 0))
        return {"gathered": c * root, "unsharded_grads": (FP32 if accumulate else c) * last,
                "reduce_scatter": FP32 * last}
    if phase == "forward":
        backward_first = p.microbatches > 1 and not (p.pp > 1 and p.schedule == "gpipe")
        unsharded = FP32 * sum(units.values()) if accumulate and backward_first else 0
        return {"gathered": gathered, "unsharded_grads": unsharded, "reduce_scatter": 0}
    return {"gathered": gathered, "unsharded_grads": unsharded, "reduce_scatter": FP32 * largest}


def sharded_grads_before_backward(cfg: Config) -> bool:
    """Whether a rank holds its sharded fp32 gradients before the last backward of the step: only
    when an earlier micro-batch's backward already reduce-scattered into them (pp = 1 with full
    sharding, which reduces every micro-batch). The step starts with none (``zero_grad(set_to_none)``),
    replication and HSDP reduce on the last micro-batch. A 1F1B or GPipe stage holding one chunk
    reduces in that chunk's last weight pass, the step's last on the rank (1F1B, GPipe, zb1p), when
    the activations of every other micro-batch are gone: the dry run of Qwen2.5-7B (pp2 x dp2 x tp2,
    4 micro-batches) holds no sharded gradient at either stage's peak. Stages holding several chunks
    (interleaved, V shapes) reduce each chunk at its own last weight pass: whether that comes before
    the rank's peak is :func:`sharded_grads_at_peak`'s question."""
    p = cfg.parallel
    if p.pp > 1:
        return not _reduces_in_last_backward(cfg)
    return p.data_parallel == "fsdp" and p.microbatches > 1


def sharded_grads_at_peak(cfg: Config, pp_rank: int) -> bool:
    """Whether the rank holds sharded gradients at its activations' peak: with pp = 1 as
    :func:`sharded_grads_before_backward`; a pipeline rank once one of its stages released its FSDP
    units (reduce-scattered them at its last weight pass, ``executor._release_points``) at or before
    the peak moment. Interleaved and V-shaped ranks reach their peak in the steady state, before any
    chunk's last backward (the 7B and 72B dry runs: no sharded gradient at any stage's peak); their
    units released before it would also free their gathered parameters and unsharded gradients,
    which stay counted."""
    if cfg.parallel.pp == 1:
        return sharded_grads_before_backward(cfg)
    return _schedule_facts(cfg, pp_rank)[1] <= _peak_moment(cfg, pp_rank).index


def _reduces_in_last_backward(cfg: Config) -> bool:
    """A pipeline rank holding one chunk (GPipe, 1F1B, zb1p): it reduces its gradients unit by unit in
    its last weight pass, after every other micro-batch's activations are gone."""
    p = cfg.parallel
    return p.pp > 1 and p.virtual_stages == 1


def phase_terms(cfg: Config, coords: Coords, phase: str) -> dict[str, float]:
    """Every term but ``other`` live at the peak of ``phase``: ``"forward"`` (end of the forward, the
    fused loss running: all saved activations, the loss's chunk buffers), ``"backward"`` (one layer's
    backward: saved activations, its working set, the gradients reduced so far, reduction buffers) or
    ``"backward end"`` (every gradient, the last unit's reduction, no activations)."""
    terms: dict[str, float] = dict(state_bytes(cfg, coords))
    if phase != "backward end" and not sharded_grads_at_peak(cfg, coords.pp):
        terms["grads"] = 0
    terms.update(data_parallel_bytes(cfg, coords.pp, phase))
    terms["activations"] = terms["loss"] = terms["ep_dispatch"] = 0.0
    if phase == "backward end":
        return terms
    if phase == "forward":
        terms["activations"] = saved_activation_bytes(cfg, coords.pp)
        terms["loss"] = loss_bytes(cfg, coords.pp)
    else:
        # The micro-batch in backward has freed its final norm's saved tensors before its layers' backward.
        norm = final_norm_bytes(cfg, coords.pp)
        # A pipeline stage accumulates every unit's unsharded fp32 gradient over its micro-batches;
        # reducing one in the last backward frees that and leaves a shard no larger, so its peak is a
        # backward before any reduction, with every in-flight micro-batch's activations.
        rise, reduced = backward_peak(cfg, coords, reducing=False if cfg.parallel.pp > 1 else None)
        terms["grads"] += reduced  # nothing when they are counted whole, or not yet there
        terms["activations"] = saved_activation_bytes(cfg, coords.pp) + rise - norm
        # The micro-batch in backward has consumed its loss's saved gradients; the others still hold theirs.
        held = loss_held_bytes(cfg, coords.pp)
        if cfg.parallel.pp > 1:
            # Pipeline stages reduce their gradients in each chunk's last backward of the step, when one
            # micro-batch is left in flight: the buffer counts only beyond the others' freed activations.
            others = saved_activation_bytes(cfg, coords.pp) * (1 - 1 / in_flight(cfg, coords.pp))
            terms["reduce_scatter"] = max(0.0, terms["reduce_scatter"] - others)
        terms["loss"] = max(0.0, held - _loss_held_per_microbatch(cfg)) if held else 0.0
    terms["ep_dispatch"] = ep_dispatch_bytes(cfg)
    return terms


def rank_breakdown(cfg: Config, coords: Coords, assumptions: Assumptions = Assumptions()) -> Breakdown:
    """Every term for the rank at ``coords``, at the larger of its forward and backward peaks."""
    phases = {phase: phase_terms(cfg, coords, phase) for phase in PHASES}
    phase = max(PHASES, key=lambda k: sum(phases[k].values()))
    terms = phases[phase]
    terms["other"] = assumptions.reserved_gib * GIB + assumptions.fragmentation * sum(terms.values())
    return Breakdown({k: terms[k] for k in TERMS}, coords.pp, phase)


def predict_memory(cfg: Config, assumptions: Assumptions = Assumptions()) -> Breakdown:
    """The busiest rank's breakdown: the pipeline rank with the largest total (data and tp index 0,
    which ``torch.chunk`` gives the largest shards)."""
    ranks = (rank_breakdown(cfg, Coords(pp=r), assumptions) for r in range(cfg.parallel.pp))
    return max(ranks, key=lambda b: b.total)
