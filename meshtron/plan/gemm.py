"""Compute time that follows each GEMM's shape: the planner's compute term without an assumed MFU.

Every GEMM a rank's layers run at its own shard (forward, input gradient, weight gradient), the attention
kernel's query-key blocks and the elementwise bytes, each on a roofline whose compute roof follows the GEMM's
size, with the shape constants of :data:`FIT` fitted to GEMMs timed on an H100. See docs/planner.md#compute-model.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from meshtron.config import Config
from meshtron.parallel.float8 import fits_fp8
from meshtron.parallel.tensor import local_kv_heads
from meshtron.plan.activations import by_kind, microbatch_tokens, recomputed_share
from meshtron.plan.hardware import EMULATED_FP8_RECIPES, Hardware
from meshtron.plan.parameters import FP32, compute_bytes

SMS = 132  # H100 / H200 SXM5 streaming multiprocessors (NVIDIA H100 Tensor Core GPU Architecture whitepaper)
ALIGN = 8  # elements: a dimension not a multiple of this (16 bytes in bf16) leaves cuBLAS's vectorized kernels


class KernelFit(NamedTuple):
    """The GEMM model's shape constants (docs/planner.md#compute-model), fitted to GEMMs timed on an H100 by
    ``benchmarks/gemm_roofline.py --fit`` (grid search, least mean absolute log error; the committed
    ``benchmarks/results/gemm_roofline.json`` reproduces these values, tests/test_plan.py checks that)."""

    tile: int  # output tile edge
    split_k: int  # the shortest piece of k a split-K / stream-K kernel gives one SM
    k_fill: int  # main-loop depth lost per output tile to prologue and epilogue
    misaligned: float  # the rate left when a dimension is not a multiple of ALIGN
    ceiling: dict  # dtype -> the fraction of the datasheet peak a full, deep, aligned GEMM reaches


FIT = KernelFit(tile=192, split_k=4096, k_fill=512, misaligned=0.19, ceiling={"bf16": 0.87, "fp8": 0.67})
HBM_EFFICIENCY = 0.9  # of the datasheet bandwidth a streaming kernel sustains (assumption)
ATTENTION_BLOCK = 128  # FlashAttention-2's query and key block for head dim 128
FP8_BYTES = 1

# Published rates the fitted ceilings are checked against (tests/test_plan.py), beside the H100 run they were
# fitted to (benchmarks/results/gemm_roofline.md).
SOURCES = {
    "bf16": (
        792.1,
        989.0,
        (6144, 17920, 2816),
        "stas00/ml-engineering compute/accelerator/README.md, Maximum Achievable Matmul FLOPS table: "
        "H100 SXM, torch.matmul bf16, CUDA 12.1, best of a shape search",
    ),
    "fp8": (
        1175.0,
        1979.0,
        (8192, 8192, 8192),
        "public report (gitea.d-robotics.cc han.zhao/test_gpu_scripts, reports_cublaslt_fp8_crosscheck_20260524.md): "
        "torch._scaled_mm e4m3 on H100 SXM, 1,170 and 1,180 on two nodes (cuBLASLt called directly: 1,609)",
    ),
}
# FlashAttention-2 on H100 80GB SXM5, head dim 128, TFLOP/s by sequence length (FlashAttention-3 paper,
# Shah et al. 2024, arXiv 2407.08608, figures "Attention forward / backward speed, head dim 128").
FLASH_FORWARD = ((512, 309.0), (1024, 350.0), (2048, 362.0), (4096, 368.0), (8192, 370.0), (16384, 370.0))
FLASH_BACKWARD = ((512, 214.0), (1024, 260.0), (2048, 291.0), (4096, 310.0), (8192, 318.0), (16384, 322.0))
FLASH_PEAK = 989.0  # the peak those rates are measured against
FLASH_BACKWARD_FLOPS = 2.5  # the backward's FLOPs per forward FLOP, as those figures count them
# The step's compute over the sum of its kernels' times: what launch gaps, host work, clocks under sustained
# power and the kernels left out (optimizer, casts) add. Fitted, not sourced: the one figure set so that the
# median of Megatron-LM's nine published H100 rows is predicted at 1.0 (benchmarks/published_speed.py): the
# kernel rates above alone (fitted to GEMMs timed on an H100) predict those rows too fast (docs/planner.md).
STEP_OVERHEAD = 1.25


class Gemm(NamedTuple):
    """``count`` GEMMs (a grouped GEMM's groups) of ``[m, k] x [k, n]``; ``fp8``: float8 inputs."""

    m: int
    n: int
    k: int
    count: int = 1
    fp8: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


def _edge(size: int, tile: int) -> int:
    """A tile's edge along a dimension: ``tile``, or for a shorter one its size rounded up to 16 (assumption)."""
    return min(tile, -(-size // 16) * 16)


def occupancy(m: int, n: int, k: int, count: int = 1, fit: KernelFit = FIT) -> float:
    """Share of the SMs' tensor-core throughput the GEMM keeps busy: its output padded to whole tiles,
    and, when its tiles (split along k in pieces of ``split_k``) are fewer than the SMs hold, the rest idle."""
    em, en = _edge(m, fit.tile), _edge(n, fit.tile)
    padded = count * math.ceil(m / em) * em * math.ceil(n / en) * en
    units = padded * math.ceil(k / fit.split_k) / (SMS * fit.tile * fit.tile)
    return count * m * n / padded * min(1.0, units)


def depth(k: int, fit: KernelFit = FIT) -> float:
    return k / (k + fit.k_fill)


def aligned(m: int, n: int, k: int) -> bool:
    """No dimension runs cuBLAS's unvectorized kernels: each a multiple of ``ALIGN`` or shorter than it (a
    GEMV's one row is not a misaligned leading dimension)."""
    return all(d <= ALIGN or d % ALIGN == 0 for d in (m, n, k))


def shape_efficiency(m: int, n: int, k: int, count: int = 1, fit: KernelFit = FIT) -> float:
    """The shape's share of a full, deep, aligned GEMM's rate (the ceiling aside)."""
    return occupancy(m, n, k, count, fit) * depth(k, fit) * (1.0 if aligned(m, n, k) else fit.misaligned)


def gemm_seconds(g: Gemm, hw: Hardware, out_bytes: int = 2) -> float:
    """One (grouped) GEMM on the size-dependent roofline (docs/planner.md#compute-model)."""
    dtype = "fp8" if g.fp8 else "bf16"
    peak = (hw.fp8_peak_tflops if g.fp8 else hw.peak_tflops) * 1e12
    element = FP8_BYTES if g.fp8 else out_bytes
    moved = g.count * ((g.m * g.k + g.k * g.n) * element + g.m * g.n * out_bytes)
    streamed = moved / (hw.memory_tbps * 1e12 * HBM_EFFICIENCY)
    if min(g.m, g.n) <= ALIGN:  # a matrix-vector product: cuBLAS runs a GEMV kernel, bound by the bytes
        return streamed
    return max(g.flops / (peak * FIT.ceiling[dtype] * shape_efficiency(g.m, g.n, g.k, g.count)), streamed)


def efficiency(g: Gemm, hw: Hardware) -> float:
    """Fraction of the dtype's peak the GEMM reaches."""
    peak = (hw.fp8_peak_tflops if g.fp8 else hw.peak_tflops) * 1e12
    return g.flops / gemm_seconds(g, hw) / peak


def backward(g: Gemm, weight_fp8: bool) -> list[Gemm]:
    """The input gradient ``[m, n] x [n, k]`` and the weight gradient ``[n, m] x [m, k]``."""
    return [Gemm(g.m, g.k, g.n, g.count, g.fp8), Gemm(g.n, g.k, g.m, g.count, g.fp8 and weight_fp8)]


def layer_gemms(cfg: Config, layer: int, rows: int) -> list[Gemm]:
    """One layer's forward GEMMs on one rank for ``rows`` tokens (the micro-batch, whole sequence after
    SP's gather), at the rank's tp / ep / etp shards."""
    m, p = cfg.model, cfg.parallel
    h, d, tp = m.hidden_size, m.head_size, p.tp
    kv = local_kv_heads(m.kv_heads, tp) * d
    q = m.num_attention_heads // tp * d
    heads, kv_rows = m.num_attention_heads * d, m.kv_heads * d
    out = [
        Gemm(rows, q, h, fp8=_fp8(cfg, heads, h)),
        Gemm(rows, kv, h, fp8=_fp8(cfg, kv_rows, h)),
        Gemm(rows, kv, h, fp8=_fp8(cfg, kv_rows, h)),
        Gemm(rows, h, q, fp8=_fp8(cfg, h, heads)),
    ]
    if not m.is_moe_layer(layer):
        return out + _mlp(rows, h, m.intermediate_size // tp, fp8=_fp8(cfg, m.intermediate_size, h))
    local_rows = rows // tp if p.sp else rows  # the router runs on the rank's own tokens
    out.append(Gemm(local_rows, m.num_experts, h))
    local_experts = m.num_experts // p.ep
    # Each rank's token copies (balanced routing), gathered over etp, spread over its local experts.
    expert_rows = max(1, rows * m.num_experts_per_tok // tp * p.etp // local_experts)
    # In float8 on the GPUs planned for (compute capability 9.x: meshtron.parallel.float8.runs_float8_kernel).
    experts_fp8 = _fp8(cfg, m.moe_intermediate_size, h)
    out += _mlp(expert_rows, h, m.moe_intermediate_size // p.etp, count=local_experts, fp8=experts_fp8)
    if m.shared_expert_intermediate_size:
        width = m.shared_expert_intermediate_size
        out += _mlp(rows, h, width // tp, fp8=_fp8(cfg, width, h)) + [Gemm(rows, 1, h)]
    return out


def _fp8(cfg: Config, *dims: int) -> bool:
    """Whether ``[train] fp8`` runs the GEMMs of a weight of (whole, unsplit) ``dims`` in float8 on the planned
    devices: both a multiple of the recipe's, as ``meshtron.parallel.float8.apply_float8`` converts (the routed
    experts' pair too), and a recipe those devices have a kernel for (:data:`EMULATED_FP8_RECIPES`)."""
    recipe = cfg.train.fp8
    return recipe not in ("none", *EMULATED_FP8_RECIPES) and fits_fp8(dims, recipe)


def _mlp(rows: int, h: int, width: int, count: int = 1, fp8: bool = False) -> list[Gemm]:
    """SwiGLU's gate and up projections, then down."""
    return [Gemm(rows, width, h, count, fp8)] * 2 + [Gemm(rows, h, width, count, fp8)]


def causal_block_share(seq: int) -> float:
    """Share of the query-key square a causal flash kernel computes: the blocks on and below the diagonal."""
    t = math.ceil(seq / ATTENTION_BLOCK)
    return (t + 1) / (2 * t)


def _flash_rate(table: tuple[tuple[int, float], ...], seq: int) -> float:
    """The published rate at ``seq`` (linear in log2 of the length between the measured ones, clamped)."""
    x = math.log2(min(max(seq, table[0][0]), table[-1][0]))
    for (s0, r0), (s1, r1) in zip(table, table[1:]):
        if x <= math.log2(s1):
            return r0 + (r1 - r0) * (x - math.log2(s0))
    return table[-1][1]


def attention_seconds(cfg: Config, rows: int, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's attention kernel for ``rows`` local queries, each over
    the whole sequence's keys, the kernel's blocks (docs/planner.md#compute-model) at the published rates."""
    m, seq = cfg.model, cfg.train.seq_len
    share = 1.0 if cfg.data.document_mask else causal_block_share(seq)
    flops = 4.0 * rows * seq * (m.num_attention_heads // cfg.parallel.tp) * m.head_size * share
    scale = hw.peak_tflops / FLASH_PEAK * 1e12
    forward = flops / (_flash_rate(FLASH_FORWARD, seq) * scale)
    return forward, FLASH_BACKWARD_FLOPS * flops / (_flash_rate(FLASH_BACKWARD, seq) * scale)


def elementwise_bytes(cfg: Config, layer: int, rows: int) -> float:
    """Forward bytes of one layer's elementwise kernels on one rank (docs/planner.md#compute-model)."""
    m, p = cfg.model, cfg.parallel
    tp, h, d = p.tp, m.hidden_size, m.head_size
    norm_rows = rows // tp if p.sp else rows
    kv = local_kv_heads(m.kv_heads, tp) * d
    width = m.intermediate_size // tp
    if m.is_moe_layer(layer):
        width = m.num_experts_per_tok * m.moe_intermediate_size // tp + m.shared_expert_intermediate_size // tp
    elements = norm_rows * 10 * h + rows * (2 * (m.num_attention_heads // tp * d + kv) + 3 * width)
    return elements * compute_bytes(cfg)


def layer_seconds(cfg: Config, layer: int, rows: int, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds of one layer for one micro-batch of ``rows`` tokens."""
    gemms = layer_gemms(cfg, layer, rows)
    weight_fp8 = cfg.train.fp8 != "rowwise_with_gw_hp"
    bandwidth = hw.memory_tbps * 1e12 * HBM_EFFICIENCY
    attn_forward, attn_backward = attention_seconds(cfg, rows, hw)
    elementwise = elementwise_bytes(cfg, layer, rows) / bandwidth
    forward = sum(gemm_seconds(g, hw) for g in gemms) + attn_forward + elementwise
    grads = sum(gemm_seconds(b, hw) for g in gemms for b in backward(g, weight_fp8))
    return forward, grads + attn_backward + 2 * elementwise


def head_seconds(cfg: Config, rows: int, hw: Hardware) -> float:
    """The LM head's GEMMs forward and backward and the loss's passes over the fp32 logits."""
    m, tp = cfg.model, cfg.parallel.tp
    g = Gemm(rows, m.vocab_size // tp, m.hidden_size)
    logits = 3 * rows * m.vocab_size // tp * FP32 / (hw.memory_tbps * 1e12 * HBM_EFFICIENCY)
    return gemm_seconds(g, hw) + sum(gemm_seconds(b, hw) for b in backward(g, False)) + logits


def step_compute_seconds(cfg: Config, hw: Hardware) -> float:
    """A rank's compute seconds per step: every micro-batch's layers (a checkpointed layer's forward
    twice) and the head, averaged over the pipeline ranks as the layers split evenly."""
    p = cfg.parallel
    rows = microbatch_tokens(cfg)
    total = head_seconds(cfg, rows, hw)
    trained = functools.partial(_trained_layer_seconds, rows=rows, hw=hw)
    for seconds in by_kind(cfg, trained, range(cfg.model.num_hidden_layers)):
        total += seconds
    return total * p.microbatches / p.pp * STEP_OVERHEAD


def _trained_layer_seconds(cfg: Config, layer: int, rows: int, hw: Hardware) -> float:
    """One layer's forward, the share of it recomputed, and its backward, for one micro-batch."""
    forward, grads = layer_seconds(cfg, layer, rows, hw)
    return forward * (1 + recomputed_share(cfg, layer)) + grads


def gemm_efficiency(cfg: Config, rows: int, hw: Hardware) -> float:
    """The FLOP-weighted efficiency of layer 0's forward GEMMs at ``rows`` tokens (tp_overlap's chunks)."""
    gemms = layer_gemms(cfg, 0, rows)
    return sum(g.flops for g in gemms) / sum(gemm_seconds(g, hw) * (hw.peak_tflops * 1e12) for g in gemms)


__all__ = [
    "FIT",
    "Gemm",
    "aligned",
    "KernelFit",
    "SOURCES",
    "attention_seconds",
    "causal_block_share",
    "efficiency",
    "gemm_efficiency",
    "gemm_seconds",
    "layer_gemms",
    "occupancy",
    "shape_efficiency",
    "step_compute_seconds",
]
