"""meshtron.plan's step time against throughput others published, for the configurations meshtron can express.

The rows are torchtitan's bf16 Llama 3.1 8B FSDP runs on H100s (its
``benchmarks/llama3_h100_202412_torchtitan.md``, tables 1 and 3: 8 and 128 GPUs, local batch 2, sequence
8192, selective activation checkpointing, eager and compiled). meshtron's model is the same decoder
(RMSNorm, RoPE, GQA, SwiGLU; no attention bias, untied head), set from the recipe with overrides. Each row
is dry-run (``meshtron.dryrun``: the real step traced on fake tensors) and predicted twice: with the
traced step's roofline as the compute term (every op at its FLOPs over the peak or its bytes over the
memory bandwidth), and with the planner's GEMM-size compute model (``meshtron.plan.gemm``); both add the planner's
exposed communication and bubble. The roofline is a bound (every kernel at the peak or the bandwidth): it
predicts faster than any real run. These are models of other people's runs, not measurements of
meshtron. Not comparable: torchtitan's Float8 rows (meshtron has no Float8), and Megatron-LM's GPT-3
rows (learned positions, GeLU, LayerNorm: not meshtron's decoder).

Differences that remain: torchtitan's selective checkpointing saves chosen ops inside every block,
meshtron's checkpoints every second block; torchtitan's H100s ran at 500 W with HBM2e (2.4 TB/s; peak
between the SXM and NVL datasheets, by its own account), so each row is predicted on the H100 SXM
datasheet and on 835 TFLOP/s, 2.4 TB/s.

The second table holds the layout search (``meshtron.plan.search.best_variant``, restricted to the
published tp x pp x dp, choosing micro-batches, checkpointing and schedule, interleaved 1F1B included)
to Megatron-Core r0.8.0's H100 weak-scaling table (NVIDIA/Megatron-LM, tag core_r0.8.0, README
"Training Speed and Scalability" and ``images/model_table.png``: GPT models, vocabulary 131,072,
sequence 4,096, dp 48; heads, hidden size, layers, tp, pp, batch and per-GPU TFLOP/s read from that
table) and to torchtitan's published Llama 3.1 70B and 405B rows (pytorch/torchtitan
``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``: 70B, bf16, 256 H100s, FSDP 32 x TP 8, full
checkpointing, local batch 16, vanilla TP 597.3 tokens/s per GPU; ``benchmarks/llama3_h100_202412_torchtitan.md``
table 5: 405B, 512 H100s, FSDP 8 x TP 8 x PP 8, local batch 32, 1F1B 100 tokens/s per GPU, but in Float8: predicted in
bf16, so not like for like; sequence 8,192 as in torchtitan's ``train_configs/llama3_{70b,405b}.toml``). Megatron
publishes TFLOP/s per GPU in its own count (``megatron/training/training.py`` ``num_floating_point_operations``
at core_r0.8.0: 12 L h^2 (2 + s / h + 4 + V / (2 L h)) per token for these GPT models, attention not
halved for the mask); tokens/s per GPU is that over this count. meshtron's decoder is not Megatron's
GPT (SwiGLU, RMSNorm, RoPE): each GPT model is run as meshtron's with the same heads, hidden size,
layers and vocabulary (untied: the table's parameter counts include both), and a SwiGLU width of
8 h / 3 rounded to a multiple of 8 x tp (``swiglu_width``), whose three matrices hold the parameters and FLOPs
of GPT's two 4h-wide ones to within 0.1 %. Each row gives the predicted step's terms: compute, the exposed tp / dp / pp
communication and the bubble's share, which add up to the step. The compute model's one fitted figure
(``meshtron.plan.gemm.STEP_OVERHEAD``) is set so that the median of Megatron's nine rows is predicted at 1.0:
their level is calibration, their spread across model sizes and torchtitan's rows are what the table checks.

A last column gives each row's MFU, published and predicted, in one count for every row (``mfu``), and the rows
predicted outside 0.9-1.1 are listed below the table with the term that puts them there (``WHY``).

Run: ``PYTHONPATH=. python benchmarks/published_speed.py`` (writes benchmarks/results/published_speed.md);
``--planner`` regenerates only the second table (no dry runs).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.config import load_config  # noqa: E402
from meshtron.dryrun import dry_run, tokens_per_second_per_device  # noqa: E402
from meshtron.models.qwen2 import flops_per_token  # noqa: E402
from meshtron.plan.gemm import ALIGN, STEP_OVERHEAD  # noqa: E402
from meshtron.plan.search import LayoutPlan, best_variant  # noqa: E402
from meshtron.plan.speed import Hardware, predict_step_time  # noqa: E402
from meshtron.watch.metrics import datasheet  # noqa: E402

LLAMA_3_1_8B = {
    "model.vocab_size": 128256,
    "model.hidden_size": 4096,
    "model.intermediate_size": 14336,
    "model.num_hidden_layers": 32,
    "model.num_attention_heads": 32,
    "model.num_key_value_heads": 8,
    "model.attention_bias": "false",
    "model.rope_theta": 500000.0,
    "model.tie_word_embeddings": "false",
    "model.max_position_embeddings": 8192,
    "model.rms_norm_eps": 1e-5,
    "train.seq_len": 8192,
    "train.dtype": "bfloat16",
    "parallel.tp": 1,
    "parallel.sp": "false",
    "parallel.activation_checkpointing": "selective",
    "parallel.ac_every": 2,
    "parallel.microbatches": 1,
    "parallel.data_parallel": "fsdp",
}
# (label, GPUs, global batch, published tokens/s per GPU: eager, compiled)
ROWS = [
    ("Llama 3.1 8B, FSDP 8 (torchtitan table 1)", 8, 16, 5762, 6667),
    ("Llama 3.1 8B, FSDP 128 (torchtitan table 3)", 128, 256, 5605, 6514),
]
DEVICES = [("H100 SXM datasheet", Hardware()), ("835 TFLOP/s, 2.4 TB/s", Hardware(peak_tflops=835.0, memory_tbps=2.4))]
OUT = ROOT / "benchmarks" / "results" / "published_speed.md"
PLANNER_HEADING = "## The layout search on Megatron-LM's and torchtitan's published H100 layouts"

# Megatron-Core r0.8.0 model_table.png: (model, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU, MFU %)
MEGATRON = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 41),
    ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 47),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 49),
    ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 46),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 42),
    ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, 43),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 44),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 48),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 47),
]
MEGATRON_VOCAB, MEGATRON_SEQ, MEGATRON_DP = 131072, 4096, 48
LLAMA_3_1 = {
    "70B": dict(hidden=8192, intermediate=28672, layers=80, heads=64),
    "405B": dict(hidden=16384, intermediate=53248, layers=126, heads=128),
}
# torchtitan: (label, model, tp, pp, dp, local batch, published tokens/s per GPU, schedule or None for the search's)
TORCHTITAN = [
    ("Llama 3.1 70B, FSDP 32 x TP 8, bf16 (torchtitan asyncTP, vanilla TP)", "70B", 8, 1, 32, 16, 597.3, None),
    ("Llama 3.1 405B, FSDP 8 x TP 8 x PP 8, 1F1B (torchtitan table 5, Float8)", "405B", 8, 8, 8, 32, 100, "1f1b"),
]
# Not a row: table 5's interleaved run (128 tokens/s per GPU): 126 layers do not split into equal chunks over
# pp 8, so the search (Megatron's rule) has no interleaved layout for it.


def _config(gpus: int, batch: int):
    overrides = {**LLAMA_3_1_8B, "parallel.dp": gpus, "train.global_batch_size": batch}
    return load_config(ROOT / "recipes" / "qwen2p5_7b.toml", [f"--{k}={v}" for k, v in overrides.items()])


def megatron_flops_per_token(hidden: int, layers: int) -> float:
    """Megatron's count for its GPT models (MHA, 4h GeLU MLP): 12 L h^2 (2 + s / h + 4 + V / (2 L h))."""
    h, s, v = hidden, MEGATRON_SEQ, MEGATRON_VOCAB
    return 12 * layers * h * h * (2 + s / h + 4 + v / (2 * layers * h))


def _model_config(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, seq: int, batch: int
):
    overrides = {
        "model.vocab_size": vocab,
        "model.hidden_size": hidden,
        "model.intermediate_size": intermediate,
        "model.num_hidden_layers": layers,
        "model.num_attention_heads": heads,
        "model.num_key_value_heads": kv_heads,
        "model.attention_bias": "false",
        "model.tie_word_embeddings": "false",
        "model.max_position_embeddings": seq,
        "train.seq_len": seq,
        "train.dtype": "bfloat16",
        "train.global_batch_size": batch,
        "parallel.data_parallel": "fsdp",
    }
    return load_config(ROOT / "recipes" / "qwen2p5_7b.toml", [f"--{k}={v}" for k, v in overrides.items()])


def swiglu_width(hidden: int, tp: int) -> int:
    """SwiGLU's width holding GPT's two 4h-wide matrices' parameters, 8 h / 3, rounded so that each tp shard
    is a multiple of ``meshtron.plan.gemm.ALIGN``: GPT's 4 h is, and a misaligned shard runs cuBLAS's slow
    kernels (a third of the rate on an H100: benchmarks/results/gemm_roofline.md), which Megatron never paid."""
    step = ALIGN * tp
    return step * round(8 * hidden / 3 / step)


def megatron_config(row: tuple):
    _, heads, hidden, layers, tp, _, _, batch, _, _ = row
    return _model_config(hidden, swiglu_width(hidden, tp), layers, heads, heads, MEGATRON_VOCAB, MEGATRON_SEQ, batch)


def planned(cfg, tp: int, pp: int, dp: int, schedule: str | None = None) -> LayoutPlan:
    """The search's layout on exactly tp x pp x dp (FSDP over dp, SP with tp), optionally one schedule."""
    shape = dict(pp=pp, dp=dp, cp=1, ep=1, tp=tp, etp=1, fold_ep=False)
    return best_variant(cfg, shape, tp * pp * dp, Hardware(), schedule=schedule)


def terms(plan: LayoutPlan) -> dict[str, float]:
    """The step's seconds by term: compute, exposed tp / dp / pp (and any other group's) communication, bubble."""
    t = plan.time
    out = {"compute": t.compute}
    out.update({f"exposed {dims}": seconds for dims, seconds in t.exposed_by.items()})
    out["bubble"] = t.seconds * t.bubble
    return out


def mfu(tokens_per_gpu: float, cfg) -> float:
    """Model FLOPs utilization, in %, of ``tokens_per_gpu`` for ``cfg``'s model: meshtron's FLOP count per token
    (``flops_per_token``, the trainer's MFU: 6 x matmul parameters + causal attention) over the H100's dense bf16
    datasheet peak; one count for every row, published or predicted."""
    peak, _ = datasheet("H100")
    return 100 * tokens_per_gpu * flops_per_token(cfg.model, cfg.train.seq_len) / (peak * 1e12)


def planner_row(label: str, plan: LayoutPlan, gpus: int, published: float) -> str:
    p, t = plan.cfg.parallel, plan.time
    per_gpu = t.tokens_per_second / gpus
    parts = terms(plan)
    shown = ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if v > 0.0005 or k in ("compute", "bubble"))
    layout = (
        f"{p.schedule}{f' v {p.virtual_stages}' if p.virtual_stages > 1 else ''}, mb {p.microbatches}, "
        f"ac {p.activation_checkpointing}, {plan.memory.total / 2**30:.1f} GiB{'' if plan.fits else ' (does not fit)'}"
    )
    return (
        f"| {label} | {layout} | {published:,.0f} | {per_gpu:,.0f} | {per_gpu / published:.2f} | "
        f"{t.seconds:.2f} | {shown} | {mfu(published, plan.cfg):.1f} / {mfu(per_gpu, plan.cfg):.1f} |"
    )


def outside_band(results: list[tuple]) -> list[str]:
    """Each row predicted outside 0.9-1.1 of its published figure, with the MFUs that explain it: ``results``
    holds (key, label, plan, gpus, published) per row, keys as in :data:`WHY`."""
    megatron = {key: mfu(published, plan.cfg) for key, _, plan, _, published in results if key in MEGATRON_KEYS}
    low, high = min(megatron.values()), max(megatron.values())
    lines = [
        "",
        f"Rows outside 0.9-1.1, and why. Megatron's nine runs reached {low:.1f}-{high:.1f} % MFU in this "
        "table's count; the compute model's one fitted figure (`meshtron.plan.gemm.STEP_OVERHEAD`) is set on "
        "them, so the planner predicts a step of their efficiency.",
        "",
    ]
    for key, label, plan, gpus, published in results:
        predicted = plan.time.tokens_per_second / gpus
        if 0.9 <= predicted / published <= 1.1:
            continue
        figures = dict(
            published=mfu(published, plan.cfg),
            predicted=mfu(predicted, plan.cfg),
            **megatron,
            bubble=plan.time.seconds * plan.time.bubble,
            step=plan.time.seconds,
            tp=terms(plan).get("exposed tp", 0.0),
            gap=megatron["70B"] / mfu(published, plan.cfg),
            overhead=STEP_OVERHEAD,
        )
        lines.append(f"- {label}: {predicted / published:.3f}. " + WHY[key].format(**figures))
    return lines


MEGATRON_KEYS = tuple(row[0] for row in MEGATRON)
# Why a row stays outside 0.9-1.1: filled in with the row's published and predicted MFU, Megatron's MFU per
# model (its keys), the predicted step's bubble, exposed tp communication and length in seconds, gap: Megatron's
# 70B MFU over the row's published one, and the compute model's fitted overhead.
WHY = {
    "1.7B": "Published {published:.1f} % MFU, Megatron's lowest; predicted {predicted:.1f} %, the step all compute. "
    "Megatron's README puts its small models' lower MFU down to their smaller GEMMs; the planner's GEMM "
    "model prices those, then multiplies the kernels' time by the same fitted {overhead:.2f} at every size "
    "(launch gaps, host work, the optimizer and casts), and this 2,048-wide model's step spent more beyond "
    "its kernels. Likely why: those costs are per kernel, and its kernels are the shortest of the table.",
    "32B": "Published {published:.1f} % MFU, predicted {predicted:.1f} %: tp 8's communication is exposed for "
    "{tp:.2f} s of the {step:.2f} s step. Megatron's runs hid it behind the GEMMs (`--tp-comm-overlap`, as "
    "its README states); the search leaves `[parallel] tp_overlap` off, its default until a GPU has measured "
    "the rings.",
    "Llama 70B": "torchtitan's published run reached {published:.1f} % MFU where Megatron's 70B reached {70B:.1f} %; "
    "the "
    "prediction ({predicted:.1f} %) is of a step as efficient as Megatron's: {70B:.1f} / {published:.1f} = "
    "{gap:.2f}. Part of that is torchtitan's full recomputation (its published config), which the search "
    "drops where the step fits without (one more forward: a third more FLOPs); the rest is efficiency the "
    "planner, fitted on Megatron, does not see.",
    "Llama 405B": "Published in Float8 at {published:.1f} % MFU (of the bf16 peak), where Megatron reached {314B:.1f} "
    "and "
    "{462B:.1f} % at 314B and 462B in bf16; predicted in bf16 at {predicted:.1f} %, lowered by 1F1B's "
    "bubble ({bubble:.2f} s of the {step:.2f} s step) and full recomputation on the published layout.",
}


def planner_section() -> list[str]:
    lines = [
        PLANNER_HEADING,
        "",
        "`meshtron.plan.search.best_variant` on the published tp x pp x dp (H100 SXM datasheet, 80 GiB, 8 per node, "
        "the GEMM-size compute model of `meshtron.plan.gemm`, 450 GB/s NVLink, 50 GB/s InfiniBand per GPU); "
        "tokens/s per GPU; ratio = predicted / published; "
        "terms in seconds of the predicted step (they add up to it). Megatron's published figure is its TFLOP/s "
        "per GPU over its FLOP count per token (`benchmarks/published_speed.py`).",
        "",
        "| published run | meshtron's layout | published | predicted | ratio | step s | terms (s) | "
        "MFU % published / predicted |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    results = []
    for row in MEGATRON:
        name, _, hidden, layers, tp, pp, gpus, batch, tflops, published_mfu = row
        published = tflops * 1e12 / megatron_flops_per_token(hidden, layers)
        label = (
            f"Megatron GPT {name}, tp {tp} x pp {pp} x dp {MEGATRON_DP}, {gpus:,} GPUs, batch {batch} "
            f"({published_mfu} % MFU)"
        )
        results.append((name, label, planned(megatron_config(row), tp, pp, MEGATRON_DP), gpus, published))
    for label, model, tp, pp, dp, local, published, schedule in TORCHTITAN:
        shape = LLAMA_3_1[model]
        cfg = _model_config(
            shape["hidden"], shape["intermediate"], shape["layers"], shape["heads"], 8, 128256, 8192, local * dp
        )
        results.append((f"Llama {model}", label, planned(cfg, tp, pp, dp, schedule), tp * pp * dp, published))
    for _, label, plan, gpus, published in results:
        lines.append(planner_row(label, plan, gpus, published))
        print(lines[-1], flush=True)
    return lines + outside_band(results)


def dry_run_section() -> list[str]:
    lines = [
        "# Predicted against published throughput",
        "",
        "Models of other people's runs, not measurements of meshtron (`benchmarks/published_speed.py`"
        " explains the rows and what differs). Tokens/s per GPU; error = predicted / published - 1.",
        "",
        "| configuration | published eager | published compiled | device model | roofline predicted | "
        "error vs eager | error vs compiled | GEMM model predicted | error vs eager |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, gpus, batch, eager, compiled in ROWS:
        cfg = _config(gpus, batch)
        for device, hw in DEVICES:
            traces = dry_run(cfg, gpus, hw=hw)
            roofline = tokens_per_second_per_device(cfg, gpus, traces)
            hw_cfg = dataclasses.replace(hw, gpus_per_node=8)
            modelled = cfg.train.global_batch_size * cfg.train.seq_len / predict_step_time(cfg, hw_cfg).seconds / gpus
            lines.append(
                f"| {label} | {eager:,} | {compiled:,} | {device} | {roofline:,.0f} | "
                f"{100 * (roofline / eager - 1):+.0f} % | {100 * (roofline / compiled - 1):+.0f} % | "
                f"{modelled:,.0f} | {100 * (modelled / eager - 1):+.0f} % |"
            )
            print(lines[-1], flush=True)
    peak, bandwidth = datasheet("H100")
    lines += [
        "",
        f"H100 SXM datasheet: {peak:g} TFLOP/s dense bf16, {bandwidth:g} TB/s (`meshtron.watch.metrics.DATASHEET`); "
        "inter-node 50 GB/s per GPU (400 Gb/s, as in torchtitan's cluster).",
    ]
    return lines


def main(argv: list[str]) -> None:
    if "--planner" in argv:  # keep the dry-run table as last written
        first = OUT.read_text().split(PLANNER_HEADING)[0].rstrip().splitlines()
    else:
        first = dry_run_section()
    OUT.write_text("\n".join(first + [""] + planner_section()) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
