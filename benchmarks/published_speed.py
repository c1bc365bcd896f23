"""meshtron.plan's step time against throughput others published, for the configurations meshtron can express.

The rows are torchtitan's bf16 Llama 3.1 8B FSDP runs on H100s (its
``benchmarks/llama3_h100_202412_torchtitan.md``, tables 1 and 3: 8 and 128 GPUs, local batch 2, sequence
8192, selective activation checkpointing, eager and compiled). meshtron's model is the same decoder
(RMSNorm, RoPE, GQA, SwiGLU; no attention bias, untied head), set from the recipe with overrides. Each row
is dry-run (``meshtron.dryrun``: the real step traced on fake tensors) and predicted twice: with the
traced step's roofline as the compute term (every op at its FLOPs over the peak or its bytes over the
memory bandwidth), and with the planner's older assumption of 40 % MFU; both add the planner's exposed
communication and bubble. The roofline is a bound (every kernel at the peak or the bandwidth): it
predicts faster than any real run. These are models of other people's runs, not measurements of
meshtron. Not comparable: torchtitan's Float8 rows (meshtron has no Float8), and Megatron-LM's GPT-3
rows (learned positions, GeLU, LayerNorm: not meshtron's decoder).

Differences that remain: torchtitan's selective checkpointing saves chosen ops inside every block,
meshtron's checkpoints every second block; torchtitan's H100s ran at 500 W with HBM2e (2.4 TB/s; peak
between the SXM and NVL datasheets, by its own account), so each row is predicted on the H100 SXM
datasheet and on 835 TFLOP/s, 2.4 TB/s.

Run: ``PYTHONPATH=. python benchmarks/published_speed.py`` (writes benchmarks/results/published_speed.md).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.config import load_config  # noqa: E402
from meshtron.dryrun import dry_run, tokens_per_second_per_device  # noqa: E402
from meshtron.metrics import datasheet  # noqa: E402
from meshtron.plan.speed import Hardware, predict_step_time  # noqa: E402

LLAMA_3_1_8B = {
    "model.vocab_size": 128256, "model.hidden_size": 4096, "model.intermediate_size": 14336,
    "model.num_hidden_layers": 32, "model.num_attention_heads": 32, "model.num_key_value_heads": 8,
    "model.attention_bias": "false", "model.rope_theta": 500000.0, "model.tie_word_embeddings": "false",
    "model.max_position_embeddings": 8192, "model.rms_norm_eps": 1e-5,
    "train.seq_len": 8192, "train.dtype": "bfloat16", "parallel.tp": 1, "parallel.sp": "false",
    "parallel.activation_checkpointing": "selective", "parallel.ac_every": 2, "parallel.microbatches": 1,
    "parallel.data_parallel": "fsdp",
}
# (label, GPUs, global batch, published tokens/s per GPU: eager, compiled)
ROWS = [("Llama 3.1 8B, FSDP 8 (torchtitan table 1)", 8, 16, 5762, 6667),
        ("Llama 3.1 8B, FSDP 128 (torchtitan table 3)", 128, 256, 5605, 6514)]
DEVICES = [("H100 SXM datasheet", Hardware()),
           ("835 TFLOP/s, 2.4 TB/s", Hardware(peak_tflops=835.0, memory_tbps=2.4))]
OUT = ROOT / "benchmarks" / "results" / "published_speed.md"


def _config(gpus: int, batch: int):
    overrides = {**LLAMA_3_1_8B, "parallel.dp": gpus, "train.global_batch_size": batch}
    return load_config(ROOT / "recipes" / "qwen2p5_7b.toml", [f"--{k}={v}" for k, v in overrides.items()])


def main() -> None:
    lines = ["# Predicted against published throughput", "",
             "Models of other people's runs, not measurements of meshtron (`benchmarks/published_speed.py`"
             " explains the rows and what differs). Tokens/s per GPU; error = predicted / published - 1.", "",
             "| configuration | published eager | published compiled | device model | roofline predicted | "
             "error vs eager | error vs compiled | 40 % MFU predicted | error vs eager |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, gpus, batch, eager, compiled in ROWS:
        cfg = _config(gpus, batch)
        for device, hw in DEVICES:
            traces = dry_run(cfg, gpus, hw=hw)
            roofline = tokens_per_second_per_device(cfg, gpus, traces)
            hw_cfg = dataclasses.replace(hw, gpus_per_node=8)
            mfu = cfg.train.global_batch_size * cfg.train.seq_len / predict_step_time(cfg, hw_cfg).seconds / gpus
            lines.append(f"| {label} | {eager:,} | {compiled:,} | {device} | {roofline:,.0f} | "
                         f"{100 * (roofline / eager - 1):+.0f} % | {100 * (roofline / compiled - 1):+.0f} % | "
                         f"{mfu:,.0f} | {100 * (mfu / eager - 1):+.0f} % |")
            print(lines[-1], flush=True)
    peak, bandwidth = datasheet("H100")
    lines += ["", f"H100 SXM datasheet: {peak:g} TFLOP/s dense bf16, {bandwidth:g} TB/s (`meshtron.metrics.DATASHEET`); "
              "inter-node 50 GB/s per GPU (400 Gb/s, as in torchtitan's cluster)."]
    OUT.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
