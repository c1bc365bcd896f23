"""One-process CPU training step: meshtron's Qwen2 next to transformers' ``Qwen2ForCausalLM``, same weights.

A step is forward, loss, backward and a fused AdamW update of a batch of ``--batch`` x ``--seq`` tokens
(default: hidden 512, 4 layers, 8 heads / 2 KV heads, intermediate 1408, vocabulary 32,000, batch
4 x 512). Three contestants per dtype:

* ``meshtron model``: ``meshtron.models.Transformer`` alone, ``model(ids, positions, labels=...)``
  (the fused, chunked LM head + loss) divided by the token count;
* ``meshtron trainer``: what ``meshtron.train`` runs on one rank (``NoPipelineRunner`` on a 1-rank mesh:
  FSDP2 units, ``training_step``'s gradient clipping and on-device non-finite guard); the difference to
  the row above is the trainer's per-step overhead;
* ``transformers``: ``Qwen2ForCausalLM`` (``attn_implementation="sdpa"``), ``model(ids, labels=ids).loss``.

All three hold the same weights (transformers' random init, converted by ``meshtron.hf.from_hf``);
the first step's losses must agree within 1e-5 (float32) before anything is timed. bfloat16: the two
model rows run under ``torch.autocast`` (fp32 weights), the trainer row as the trainer does it (FSDP's
bf16 compute with fp32 master weights); its losses agree within 2e-2.

The machine this runs on may be shared, so the steps are interleaved (meshtron model, meshtron
trainer, transformers, meshtron model, ...): a load change hits every contestant alike. Per step the
wall time and the process CPU time (``time.process_time``, all threads) are recorded; the table gives
min and median of each and meshtron's ratios to transformers (ratio of medians, ratio of mins).
``torch.set_num_threads(--threads)`` is fixed and stated.

Run: ``PYTHONPATH=. python benchmarks/cpu_step_vs_transformers.py [--steps 10] [--threads 2]``
(writes benchmarks/results/cpu_step_vs_transformers.{md,json}; ``--out`` picks another stem).
``--tiny`` runs a small model for two steps (a smoke test; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.checkpoint import load_full_state_dict
from meshtron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from meshtron.mesh import build_mesh, exit_process, init_default_group
from meshtron.models import build_model
from meshtron.parallel.runner import NoPipelineRunner
from meshtron.parallel.step import training_step

RESULTS = Path(__file__).parent / "results"
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # relative loss difference allowed at the first step


def model_config(args) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 256),
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )


def transformers_model(cfg: ModelConfig, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshtron.hf import hf_config_dict

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config.from_dict(hf_config_dict(cfg), attn_implementation="sdpa")).train()


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def contestants(cfg: ModelConfig, dtype: str, batch: torch.Tensor, seed: int) -> dict:
    """name -> step function returning the step's loss (a 0-d tensor); every model with the same weights."""
    from meshtron.hf import from_hf

    hf = transformers_model(cfg, seed)
    weights = from_hf(hf.state_dict(), cfg)
    ours = build_model(cfg)
    ours.load_state_dict(weights)
    ours.train()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    labels = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)  # transformers' own shift
    positions = torch.arange(batch.shape[1]).expand_as(batch)
    tokens = (labels != -100).sum()

    def model_step(model, optimizer, loss_of):
        def step():
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                loss = loss_of(model)
            loss.backward()
            optimizer.step()
            return loss.detach()

        return step

    trainer_cfg = Config(
        model=cfg,
        parallel=ParallelConfig(),
        train=TrainConfig(dtype=dtype, seq_len=batch.shape[1], global_batch_size=batch.shape[0]),
    )
    with torch.device("meta"):
        model = build_model(cfg)
    runner = NoPipelineRunner(model, build_mesh(), trainer_cfg, torch.device("cpu"))
    load_full_state_dict(runner.module, weights)
    trainer_optimizer = adamw(runner.module.parameters())
    return {
        "meshtron model": model_step(
            ours, adamw(ours.parameters()), lambda m: m(batch, positions, labels=labels) / tokens
        ),
        "meshtron trainer": lambda: training_step(runner, trainer_optimizer, batch, labels, 1e9)[0],
        "transformers": model_step(hf, adamw(hf.parameters()), lambda m: m(input_ids=batch, labels=batch).loss),
    }


def check_losses(losses: dict[str, float], dtype: str) -> dict[str, float]:
    """Each meshtron loss's relative difference to transformers' at the first step; raises past the tolerance."""
    reference = losses["transformers"]
    diffs = {name: abs(loss - reference) / abs(reference) for name, loss in losses.items() if name != "transformers"}
    bad = {name: d for name, d in diffs.items() if d > TOLERANCE[dtype]}
    if bad:
        raise AssertionError(
            f"{dtype}: first-step losses differ from transformers' {reference:.6f} by {bad} "
            f"(> {TOLERANCE[dtype]:g}): {losses}"
        )
    return diffs


def interleaved(steps: dict, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per contestant, the wall and process-CPU seconds of each of ``rounds`` steps, taken in turn."""
    times = {name: {"wall": [], "cpu": []} for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            cpu, wall = time.process_time(), time.perf_counter()
            step()
            times[name]["wall"].append(time.perf_counter() - wall)
            times[name]["cpu"].append(time.process_time() - cpu)
    return times


def summarise(times: dict) -> dict:
    """min and median per clock and contestant, and meshtron's ratios to transformers."""
    rows = {
        name: {
            f"{stat}_{clock}": fn(t[clock])
            for clock in ("wall", "cpu")
            for stat, fn in (("min", min), ("median", statistics.median))
        }
        for name, t in times.items()
    }
    theirs = rows["transformers"]
    for name, row in rows.items():
        if name != "transformers":
            row.update({f"ratio_{key}": row[key] / theirs[key] for key in theirs})
    return rows


def measure(cfg: ModelConfig, dtype: str, args) -> dict:
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    steps = contestants(cfg, dtype, batch, args.seed)
    losses = {name: step().item() for name, step in steps.items()}  # the first step: also the warm-up
    diffs = check_losses(losses, dtype)
    print(f"{dtype}: first-step losses {losses}", flush=True)
    times = interleaved(steps, args.steps)
    return {
        "dtype": dtype,
        "first_step_loss": losses,
        "loss_rel_diff": diffs,
        "times": times,
        "summary": summarise(times),
    }


def _row(dtype: str, name: str, s: dict) -> str:
    ratio = lambda key: f"{s[key]:.3f}" if key in s else "1"  # noqa: E731
    return (
        f"| {dtype} | {name} | {s['median_wall']:.3f} | {s['min_wall']:.3f} | {ratio('ratio_median_wall')} | "
        f"{ratio('ratio_min_wall')} | {s['median_cpu']:.3f} | {s['min_cpu']:.3f} | {ratio('ratio_median_cpu')} | "
        f"{ratio('ratio_min_cpu')} |"
    )


# CPU instructions for bfloat16 GEMMs: without them torch emulates bf16 matmuls in float32 (AVX2 only: an
# AMD EPYC here ran one bf16 step in minutes against 3 s in float32), so the bf16 rows mean little there.
BF16_GEMM_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_description() -> str:
    """The CPU's model name and its bf16 GEMM instructions (from /proc/cpuinfo on Linux): the table's
    ratios hold for that CPU only."""
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.is_file() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    bf16 = [flag for flag in BF16_GEMM_FLAGS if flag in flags]
    return f"{model}, {platform.machine()}, bf16 GEMM instructions: {', '.join(bf16) or 'none'}"


def write_results(runs: list[dict], cfg: ModelConfig, args) -> str:
    cpu = f"{cpu_description()}, torch.set_num_threads({args.threads})"
    lines = [
        f"# One-process CPU training step: meshtron vs transformers ({cpu})",
        "",
        *(
            ["**Smoke run (`--tiny`): checks that the script works; not a performance result.**", ""]
            if args.tiny
            else []
        ),
        f"Model: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / "
        f"{cfg.kv_heads} KV heads, intermediate {cfg.intermediate_size}, vocabulary {cfg.vocab_size:,}; batch "
        f"{args.batch} x {args.seq} tokens; step = forward + loss + backward + fused AdamW. {args.steps} steps per "
        f"contestant, interleaved, after one warm-up step whose losses are compared (relative difference to "
        f"transformers: {_diffs(runs)}). Seconds per step; ratio = meshtron / transformers (below 1: meshtron "
        f"faster) of the medians and of the mins; CPU = process CPU time of all threads. Produced by "
        f"`benchmarks/cpu_step_vs_transformers.py`.",
        "",
        "| dtype | run | median s | min s | ratio (medians) | ratio (mins) | median CPU s | min CPU s "
        "| CPU ratio (medians) | CPU ratio (mins) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_row(run["dtype"], name, s) for run in runs for name, s in run["summary"].items()),
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    record = {"cpu": cpu, "settings": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    return text


def _diffs(runs: list[dict]) -> str:
    return "; ".join(
        f"{run['dtype']} " + ", ".join(f"{name} {d:.1e}" for name, d in run["loss_rel_diff"].items()) for run in runs
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small model, 2 steps: a smoke test")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per contestant")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "cpu_step_vs_transformers", help="results path without suffix"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.intermediate, args.vocab, args.seq, args.steps = 64, 2, 96, 256, 32, 2
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = model_config(args)
    own_group = not dist.is_initialized()
    init_default_group()  # one rank, for the trainer's 1-rank mesh; torchrun is not needed
    try:
        runs = [measure(cfg, dtype, args) for dtype in args.dtypes]
    finally:
        if own_group:
            dist.destroy_process_group()
    text = write_results(runs, cfg, args)
    print(text)
    return text


if __name__ == "__main__":
    main()
    exit_process(0)
