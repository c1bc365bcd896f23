"""Per-token bytes of one decoder layer: the tensors its forward saves, what activation checkpointing
keeps and recomputes, its backward's gradient temporaries and float8 casts, the walk of a chunk's
backward for its peak, and the fused loss's and the MoE dispatch's buffers (the ``activations``,
``loss`` and ``ep_dispatch`` terms of :mod:`meshtron.plan.memory`).

Functions of the config and a layer, with no schedule in them, so the step-time model can read the same
per-layer figures; :mod:`meshtron.plan.moments` weighs them by the micro-batches a rank holds.
See docs/planner.md, 'Memory model'."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, TypeVar

from meshtron.config import Config
from meshtron.models.chunked_loss import DEFAULT_CHUNK_TOKENS
from meshtron.parallel.context import cp_comm
from meshtron.parallel.fp8_base import MX_BLOCK
from meshtron.parallel.recompute import checkpoints_layer
from meshtron.parallel.tensor import local_kv_heads
from meshtron.plan.parameters import (
    FP32,
    Coords,
    compute_bytes,
    fp8_weights,
    holds_last_stage,
    layer_params,
    model_parallel_shape,
)

T = TypeVar("T")


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
    output (twice) and the four SwiGLU tensors (tokens split over tp), the shared expert. ``tests/test_plan.py``
    compares it with the tensors autograd saves for a block.
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
    # ranks' gathered rows, etp times the rank's own copies), the output's unpermuted copy, SwiGLU (its
    # columns split over etp: the same bytes).
    routed = k * c * ((1 + 2 * p.etp) * h + 4 * m.moe_intermediate_size) / tp
    # The shared expert: SwiGLU, its output (scaled by the sigmoid gate) and the gate.
    shared = c * (4 * m.shared_expert_intermediate_size / tp + h + 1) if m.shared_expert_intermediate_size else 0
    router = FP32 * m.num_experts + 2 * 8 * k  # fp32 probabilities, int64 choices and their sort order
    return norms + attention + c * h + router + routed + shared


def document_mask_bytes(cfg: Config) -> float:
    """Per token, the document mask attention saves with ``[data] document_mask`` and no cp: a row of
    the window's keys in the compute dtype (``models.qwen2.CausalAttention`` hands SDPA a ``[B, 1, S, S]``
    boolean mask, which it turns into an additive one and keeps for backward: docs/planner.md). Context
    parallelism masks only the blocks that straddle a document start, one at a time (not counted)."""
    return compute_bytes(cfg) * cfg.train.seq_len if cfg.data.document_mask and cfg.parallel.cp == 1 else 0.0


def microbatch_tokens(cfg: Config) -> int:
    """Tokens of one micro-batch on one rank: its dp x ep share of the batch and cp share of the sequence."""
    p, t = cfg.parallel, cfg.train
    return t.global_batch_size // (p.dp * p.mesh_ep) // p.microbatches * t.seq_len // p.cp


def layer_offloaded(cfg: Config, layer: int) -> bool:
    """Whether the layer's saved tensors go to host memory (``offload_activations``, not recomputed)."""
    return cfg.parallel.offload_activations and not layer_checkpointed(cfg, layer)


def offloaded_activation_bytes(cfg: Config, layers: Iterable[int]) -> float:
    """Host bytes of one micro-batch's offloaded saved tensors in ``layers``."""
    return microbatch_tokens(cfg) * sum(by_kind(cfg, _offloaded_bytes, layers))


def _offloaded_bytes(cfg: Config, layer: int) -> float:
    return layer_activation_bytes(cfg, layer) if layer_offloaded(cfg, layer) else 0.0


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
    shared_expert = (
        [((1, h), "router"), ((shared, h), "mlp"), ((shared, h), "mlp"), ((h, shared), "mlp")] if shared else []
    )
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
    (``parallel/recompute.py``): attention's output and fp32 log-sum-exp per head (ring attention:
    one per ring step; none when ``ac_parts`` recomputes ``core_attn``), the tp collectives' outputs (DTensor's: per
    attention and MLP half, with SP the gathered input [H] and the reduce-scattered output [H / tp], without SP the
    all-reduced output [H]) and the matmul outputs the policy keeps (:func:`op_kept_matmuls`). ``tests/test_plan.py``
    compares it with what a checkpointed block keeps."""
    m, p = cfg.model, cfg.parallel
    c, h, tp = compute_bytes(cfg), m.hidden_size, p.tp
    heads = m.num_attention_heads / tp
    ring_steps = p.cp if cp_comm(p.cp_comm_type).ring else 1
    attention = 0.0 if _attention_recomputed(cfg) else ring_steps * (c * m.head_size * heads + FP32 * heads)
    halves = 1 + (not m.is_moe_layer(layer) or bool(m.shared_expert_intermediate_size))
    collectives = halves * (c * h + c * h / tp if p.sp else c * h) if tp > 1 else 0.0
    kept = zip(block_matmuls(cfg, layer), op_kept_matmuls(cfg, layer))
    return attention + collectives + c * sum(out for (out, _), keep in kept if keep)


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
# torchao's emulated MX cast (``mx_formats.mx_tensor.to_mx``, RCEIL: ``meshtron.parallel.mxfp8.to_mx`` where the
# device has no MX kernel) holds the operand in float32, scaled and clamped at once (3 fp32 an element), and per
# 32-element block its amax, scale, exponent and reciprocal (13 bytes): 12.41 bytes an element, as
# tests/test_mxfp8.py measures it.
MX_CAST_BYTES = 3 * FP32 + 13 / MX_BLOCK


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
    :data:`FP8_CAST_BYTES`. That is where a layer's backward peaks under FP8 (docs/fp8.md#planned): without tp at
    the down projection's input ([I / tp] a token, cast after its input gradient), under tp + SP as high in
    the recomputed forward's cast of that input (beside the packed gate / up output SP feeds the MLP,
    [2 I / tp]). Not counted: a weight's cast (at most 9 bytes an element of
    one local weight; 0.14 GiB for the 7B's gate at tp 4) and the fp32 copies of the routed experts'
    emulated grouped GEMM (``Float8GroupedMatmul``), which the dry run cannot trace. Under ``mxfp8`` (emulated on
    the devices planned for) the weight gradient casts along the tokens: a transposed copy of the operand first
    (``mxfp8.along_tokens``), then :data:`MX_CAST_BYTES`; the gradient's MX copy has a scale byte per 32."""
    width = fp8_operand_width(cfg, layer)
    if not width:
        return 0.0
    c, h = compute_bytes(cfg), cfg.model.hidden_size
    if cfg.train.fp8 == "mxfp8":
        return (c + 1 + 1 / MX_BLOCK) * h + (2 * c + MX_CAST_BYTES) * width
    return (c + 1) * h + (c + FP8_CAST_BYTES) * width


class BackwardPeak(NamedTuple):
    """One layer's backward at the peak of a rank's backward (:func:`backward_peak`)."""

    rise: float  # working-set rise over the saved activations (:func:`backward_working_bytes`)
    reduced: float  # sharded fp32 gradients of the units already reduced
    reduce_scatter: float  # the fp32 reduce-scatter input live beside it (:func:`reduce_scatter_in_flight`)


def _chunk_backward_peak(
    cfg: Config, layers: range, grads: dict[str, float], in_flight: tuple[float, float] = (0.0, 0.0)
) -> BackwardPeak:
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


def _loss_held_per_microbatch(cfg: Config) -> float:
    """What a micro-batch's loss keeps for its backward. The fused head: the hidden states' gradient and the
    head's fp32 weight gradient, both computed in the forward. A transformers model's head and loss
    (``meshtron.hf.loss``: the head's logits, then the chunked cross-entropy over them): the head's input,
    its compute-dtype logits [tokens, V/tp] and an fp32 log-sum-exp per token."""
    p, m = cfg.parallel, cfg.model
    tokens, c = microbatch_tokens(cfg), compute_bytes(cfg)
    if m.hf_model:
        return tokens * (m.hidden_size * c + m.vocab_size / p.tp * c + FP32)
    return tokens * m.hidden_size * c + m.vocab_size / p.tp * m.hidden_size * FP32


def loss_chunk_bytes(cfg: Config, pp_rank: int) -> float:
    """The loss's working buffers at its most. The fused loss (forward only: backward just scales the saved
    gradients): one chunk's fp32 logits [chunk, V/tp], which become the logit gradient in place, plus its
    compute-dtype copy when that is not fp32, and the chunk's [V/tp, H] weight-gradient product. A
    transformers model's loss, at its backward's start, the activations all still held: the logits' whole
    compute-dtype gradient and two chunks of fp32 probabilities (a chunk's is made before the last one's
    is dropped)."""
    p, m = cfg.parallel, cfg.model
    if not holds_last_stage(cfg, pp_rank):
        return 0
    c, vocab = compute_bytes(cfg), m.vocab_size / p.tp
    tokens = microbatch_tokens(cfg)
    if m.hf_model:  # meshtron.hf.loss chunks at cross_entropy_sum's default
        return tokens * vocab * c + 2 * min(DEFAULT_CHUNK_TOKENS, tokens) * vocab * FP32
    chunk = min(cfg.train.loss_chunk_tokens, tokens) * vocab * (FP32 + (c if c != FP32 else 0))
    return chunk + vocab * m.hidden_size * c


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


def offload_in_flight_bytes(cfg: Config, layers: Iterable[int]) -> float:
    """At the end of a forward over ``layers``, the last offloaded block's saved tensors, still on the device
    while their copies run (the largest such block)."""
    return microbatch_tokens(cfg) * max(by_kind(cfg, _offloaded_bytes, layers), default=0.0)


def offload_window_bytes(cfg: Config, layers: Iterable[int]) -> float:
    """While an offloaded block's forward runs, the device holds its saved tensors, their copies running,
    those of the offloaded block before it, released when it ends (``parallel/offload.py``'s
    ``CopiesInFlight``), and its forward's temporaries (:func:`layer_forward_transient_bytes`): at most the
    two largest offloaded blocks of ``layers`` and the largest temporaries. (Without offload the forward
    peaks at the loss, after the last block, so no other moment counts them.)"""
    offloaded = [i for i in layers if layer_offloaded(cfg, i)]
    if not offloaded:
        return 0.0
    blocks = sorted(by_kind(cfg, _offloaded_bytes, offloaded), reverse=True)[:2]
    return microbatch_tokens(cfg) * (sum(blocks) + max(by_kind(cfg, layer_forward_transient_bytes, offloaded)))


def layer_forward_transient_bytes(cfg: Config, layer: int) -> float:
    """Per token, the most a block's forward holds beside the tensors it saves: under SP a dense MLP's
    all-gathered input and the packed gate/up output its two projections are cloned from
    (``parallel/sp_projections.py``; Qwen2.5-7B at tp 4: 3.2 GiB of 131,072 tokens, what activation offload
    leaves on the device inside a block: docs/planner.md); otherwise its output before the tp reduction."""
    m, c = cfg.model, compute_bytes(cfg)
    if cfg.parallel.sp and cfg.parallel.tp > 1 and not m.is_moe_layer(layer):
        return c * (m.hidden_size + 2 * m.intermediate_size / cfg.parallel.tp)
    return c * m.hidden_size


def _recomputes_every_layer(cfg: Config) -> bool:
    """Full checkpointing: a MoE layer's backward re-runs its forward, whose dispatched copies are then
    its recomputed saved tensors (in :func:`backward_peak`'s rise, not again beside it: counted twice, the
    MoE recipes' dry runs traced below the plan, docs/planner.md)."""
    return cfg.parallel.activation_checkpointing in ("full", "op")
