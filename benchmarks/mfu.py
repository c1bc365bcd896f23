"""Single-device training throughput and MFU of Qwen2.5 shapes: meshtron next to transformers.

For each shape (Qwen2.5-0.5B, 1.5B, and 7B truncated to ``--layers-7b`` layers so it fits one
80 GB card) at ``--seq`` tokens (4096) and ``--batch`` sequences per step:

* meshtron, once per ``--modes`` entry (``eager``, ``compiled``): the training loop's own step
  (``meshtron.train.training_step``): the model built on the meta device, parallelized for one rank
  (FSDP2 unit per block, bf16 compute with fp32 master weights and fp32 gradient reduction), fused
  AdamW with the non-finite guard on the device, global gradient clipping, SDPA attention
  (restricted to the fused kernels on CUDA, so a silent fallback to the math kernel is an error);
  ``compiled``: ``torch.compile`` per block. On CUDA the timed steps run under
  ``torch.cuda.set_sync_debug_mode("error")``: any host sync in the step fails the run
  (``--no-sync-check`` turns that off);
* transformers: ``Qwen2ForCausalLM`` built from the same shape's ``Qwen2Config`` directly on the
  device (random init), ``attn_implementation="sdpa"``, fp32 weights under bf16 autocast (the usual
  bf16 mixed-precision recipe for it), the same batch, the same fused AdamW and clipping.

Reported per run: tokens/s; MFU = training FLOPs per token (``meshtron.models.flops_per_token``:
6 x matmul parameters + causal attention) x tokens/s / the card's datasheet dense bf16 peak
(``meshtron.watch.metrics.datasheet_peak_flops``; ``--peak-tflops`` for an unlisted card), and the same
against the bf16 matmul peak measured on this device; peak allocated memory
(``torch.cuda.max_memory_allocated``) next to ``meshtron.plan``'s prediction for the same
configuration (allocated bytes: no CUDA context or allocator slack); meshtron's speed-up over
transformers. An out-of-memory run is recorded as such and the others go on.
``--tiny`` runs a small model for a few steps on any device (a smoke test; its numbers mean nothing).

Run on a GPU: ``PYTHONPATH=. python benchmarks/mfu.py [--modes eager compiled] [--batch 1] [--seq 4096]``
(writes benchmarks/results/mfu.{md,json}; ``--out`` picks another stem). ``benchmarks/gpu_check.sh``
runs it with the CUDA tests in one device call.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron import env
from meshtron.config import FSDP_GATHERS, Config, ModelConfig, ParallelConfig, TrainConfig, load_config
from meshtron.mesh import build_mesh, exit_process, init_default_group
from meshtron.models import build_model, flops_per_token
from meshtron.optim import build_optimizer
from meshtron.parallel.runner import NoPipelineRunner
from meshtron.plan import Assumptions, predict_memory
from meshtron.train import read_scalars, training_step
from meshtron.watch.metrics import datasheet_peak_flops, matmul_flops, synchronize
from meshtron.watch.syncs import no_host_syncs

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RESULTS = Path(__file__).parent / "results"
TINY = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
)


def shapes(args) -> dict[str, ModelConfig]:
    if args.tiny:
        return {"tiny (hidden 128, 2 layers)": TINY}
    seven = load_config(RECIPES / "qwen2p5_7b.toml").model
    seven.num_hidden_layers = args.layers_7b
    return {
        "Qwen2.5-0.5B": load_config(RECIPES / "qwen2p5_0p5b.toml").model,
        "Qwen2.5-1.5B": load_config(RECIPES / "qwen2p5_1p5b.toml").model,
        f"Qwen2.5-7B ({args.layers_7b} of 28 layers)": seven,
    }


ALLOCATED_ONLY = Assumptions(reserved_gib=0.0, fragmentation=0.0)  # what max_memory_allocated sees


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def timed(
    step, steps: int, warmup: int, device: torch.device, sync_check: bool, profile: tuple[Path, str] | None = None
) -> tuple[float, list]:
    """Seconds per step over ``steps`` after ``warmup``; the step's outputs are read only afterwards.
    ``profile`` (file, label): as many further steps, untimed, run under torch.profiler (its overhead would
    distort the timed ones), whose table is appended there."""
    for _ in range(warmup):
        step()
    synchronize(device)
    outputs = []
    start = time.perf_counter()
    with no_host_syncs(device, sync_check):
        for _ in range(steps):
            outputs.append(step())
        synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    if profile is not None:
        _profiled(step, steps, device, *profile)
    return seconds, outputs


def _profiled(step, steps: int, device: torch.device, path: Path, label: str) -> None:
    """``steps`` steps under torch.profiler; their kernels by device time (the busiest first) appended to
    ``path`` under ``label`` and the steps' wall time (profiled, so longer than the timed steps')."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    wall = time.perf_counter() - start
    with path.open("a") as out:
        out.write(f"\n## {label}: wall {wall:.3f} s for {steps} profiled steps\n")
        out.write(
            prof.key_averages().table(
                sort_by="self_device_time_total" if device.type == "cuda" else "self_cpu_time_total",
                row_limit=25,
                max_name_column_width=70,
            )
        )


def step_config(
    model_cfg: ModelConfig, dtype: str, batch: int, seq: int, compile: bool = False, fp8: str = "none", **parallel
) -> Config:
    """The one-rank recipe this benchmark trains (``parallel``: further ParallelConfig fields)."""
    return Config(
        model=model_cfg,
        parallel=ParallelConfig(compile=compile, **parallel),
        train=TrainConfig(dtype=dtype, seq_len=seq, global_batch_size=batch, fp8=fp8),
    )


def run_meshtron(
    cfg: Config,
    batch: torch.Tensor,
    device: torch.device,
    steps: int,
    warmup: int,
    sync_check: bool = True,
    profile: tuple[Path, str] | None = None,
) -> dict:
    """Trains ``cfg`` on one rank (a process group must exist): seconds per step, the timed steps'
    losses, the peak allocated memory and the planner's prediction of it."""
    _reset_memory(device)
    # Each shape compiles from scratch: after another model's blocks, dynamo's automatic dynamic shapes
    # would make even the head counts symbolic (and SDPA refuses a symbolic enable_gqa).
    torch._dynamo.reset()
    with torch.device("meta"):
        model = build_model(cfg.model)
    runner = NoPipelineRunner(model, build_mesh(), cfg, device)
    optimizer = build_optimizer(runner.module, cfg.train)
    ids, labels = batch[:, :-1], batch[:, 1:]

    # F821: ruff reads the del below as leaving these names undefined here; it runs after step's last call.
    def step():
        with env.fused_attention_only(device):
            return training_step(runner, optimizer, ids, labels, cfg.train.max_grad_norm)  # noqa: F821

    seconds, outputs = timed(step, steps, warmup, device, sync_check, profile)
    losses = [read_scalars(loss)[0] for loss, _ in outputs]
    del runner, optimizer, model, outputs
    return {
        "seconds_per_step": seconds,
        "losses": losses,
        "last_loss": losses[-1],
        "peak_memory_gib": _peak_memory_gib(device),
        "predicted_memory_gib": predict_memory(cfg, ALLOCATED_ONLY).total / 2**30,
    }


def run_transformers(
    model_cfg: ModelConfig,
    dtype: str,
    batch: torch.Tensor,
    device: torch.device,
    steps: int,
    warmup: int,
    profile: tuple[Path, str] | None = None,
) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshtron.hf import hf_config_dict

    _reset_memory(device)
    hf_cfg = Qwen2Config.from_dict(hf_config_dict(model_cfg), attn_implementation="sdpa")
    with torch.device(device):
        model = Qwen2ForCausalLM(hf_cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    # F821: ruff reads the del below as leaving these names undefined here; it runs after step's last call.
    def step():
        optimizer.zero_grad(set_to_none=True)  # noqa: F821
        with autocast:
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # noqa: F821 - it shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: F821
        optimizer.step()  # noqa: F821
        return loss.detach()

    # Its own code may sync (mask building, loss bookkeeping): not checked.
    seconds, outputs = timed(step, steps, warmup, device, sync_check=False, profile=profile)
    loss = outputs[-1].item()
    del model, optimizer, outputs
    return {"seconds_per_step": seconds, "last_loss": loss, "peak_memory_gib": _peak_memory_gib(device)}


def _guarded(run) -> dict:
    """The run's result, or ``{"error": "out of memory"}`` so the other runs still take place."""
    try:
        return run()
    except torch.OutOfMemoryError:
        gc.collect()
        return {"error": "out of memory"}


def measure(name: str, model_cfg: ModelConfig, args, device: torch.device, peaks: dict) -> list[dict]:
    """One row per meshtron mode and one for transformers, each with tokens/s and MFU against ``peaks``."""
    tokens = args.batch * args.seq
    flops = flops_per_token(model_cfg, args.seq)
    batch = torch.randint(0, model_cfg.vocab_size, (args.batch, args.seq + 1), device=device)

    def profile(impl: str) -> tuple[Path, str] | None:
        return (args.profile, f"{name} {impl}") if args.profile else None

    fp8 = "" if args.fp8 == "none" else f" fp8 {args.fp8}"
    runs = {
        f"meshtron {mode}{fp8}": lambda mode=mode: run_meshtron(
            step_config(
                model_cfg,
                args.dtype,
                args.batch,
                args.seq,
                compile=mode == "compiled",
                fp8=args.fp8,
                fsdp_gather=args.fsdp_gather,
            ),
            batch,
            device,
            args.steps,
            args.warmup,
            args.sync_check,
            profile(f"meshtron {mode}{fp8}"),
        )
        for mode in args.modes
    }
    runs["transformers"] = lambda: run_transformers(
        model_cfg, args.dtype, batch, device, args.steps, args.warmup, profile("transformers")
    )
    rows = []
    for impl, run in runs.items():
        row = {
            "shape": name,
            "layers": model_cfg.num_hidden_layers,
            "batch": args.batch,
            "seq": args.seq,
            "impl": impl,
            **_guarded(run),
        }
        if "error" not in row:
            row["tokens_per_s"] = tokens / row["seconds_per_step"]
            row.update(
                {
                    f"mfu_{kind}": flops * row["tokens_per_s"] / peaks[kind] if peaks[kind] else None
                    for kind in ("datasheet", "measured")
                }
            )
        print(f"{name} {impl}: {row.get('tokens_per_s', 0):,.0f} tokens/s {row.get('error', '')}", flush=True)
        rows.append(row)
    theirs = rows[-1].get("tokens_per_s")
    for row in rows[:-1]:
        row["speedup"] = row["tokens_per_s"] / theirs if theirs and "tokens_per_s" in row else None
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "n/a" if value is None else format(value, fmt)


def _table_line(r: dict) -> str:
    if "error" in r:
        return f"| {r['shape']} | {r['batch']} x {r['seq']} | {r['impl']} | {r['error']} | | | | | |"
    planner = "n/a"
    if r.get("predicted_memory_gib") is not None and r.get("peak_memory_gib"):
        error = r["predicted_memory_gib"] / r["peak_memory_gib"] - 1
        planner = f"{r['predicted_memory_gib']:.1f} ({100 * error:+.1f}%)"
    mfu = lambda key: "n/a" if r.get(key) is None else f"{100 * r[key]:.1f}%"  # noqa: E731
    return (
        f"| {r['shape']} | {r['batch']} x {r['seq']} | {r['impl']} | {r['tokens_per_s']:,.0f} | "
        f"{mfu('mfu_datasheet')} | {mfu('mfu_measured')} | {_cell(r, 'peak_memory_gib', '.1f')} | {planner} | "
        f"{_cell(r, 'speedup', '.2f')} |"
    )


def write_results(rows: list[dict], args, device: torch.device, peaks: dict, out: Path) -> str:
    label = device_name(device)
    settings = (
        f"dtype {args.dtype}, fsdp_gather {args.fsdp_gather}, {args.steps} timed steps after "
        f"{args.warmup} warm-up, host-sync check "
        f"{'on' if args.sync_check and device.type == 'cuda' else 'off'}"
    )
    datasheet = peaks["datasheet"]
    lines = [
        f"# Single-device training throughput: meshtron vs transformers ({label})",
        "",
        *(
            ["**CPU smoke run (`--tiny`): checks that the script works; not a performance result.**", ""]
            if device.type != "cuda"
            else []
        ),
        f"Device: {label}. MFU against the datasheet dense bf16 peak "
        f"{'(not listed for this device)' if datasheet is None else f'{datasheet / 1e12:.0f} TFLOP/s'} and against "
        f"the {peaks['measured_dtype']} matmul peak measured here, {peaks['measured'] / 1e12:.2f} TFLOP/s. {settings}. "
        "Peak memory: `torch.cuda.max_memory_allocated`; planner: `meshtron.plan`'s prediction of it for the "
        "same configuration (its error against the measured peak in brackets). Produced by `benchmarks/mfu.py`.",
        "",
        "| shape | batch x seq | run | tokens/s | MFU (datasheet) | MFU (measured peak) | peak mem GiB "
        "| planner GiB | speed-up vs transformers |",
        "|---|---|---|---|---|---|---|---|---|",
        *(_table_line(r) for r in rows),
    ]
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    record = {"device": label, "peaks": peaks, "settings": vars(args), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small model, short sequence: a smoke test")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; 64 with --tiny)")
    parser.add_argument("--layers-7b", type=int, default=8, help="layers kept of Qwen2.5-7B's 28")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["eager", "compiled"],
        default=["eager"],
        help="meshtron runs: eager and/or torch.compile per block",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--fsdp-gather",
        default="per_microbatch",
        choices=FSDP_GATHERS,
        help="meshtron's [parallel] fsdp_gather: per_step keeps each unit gathered from forward to "
        "backward (on one rank: no second cast and copy of every parameter in the backward)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="datasheet dense bf16 peak of a card meshtron.watch.metrics does not list",
    )
    parser.add_argument(
        "--no-sync-check",
        dest="sync_check",
        action="store_false",
        help="do not run meshtron's timed steps under torch.cuda.set_sync_debug_mode('error')",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "mfu", help="results path without suffix")
    parser.add_argument("--fp8", default="none", help="meshtron's runs with [train] fp8 set to this recipe")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="also profile the timed steps: each run's busiest kernels appended to this file",
    )
    args = parser.parse_args(argv)
    defaults = {"seq": (64, 4096), "steps": (2, 10), "warmup": (1, 3)}
    for key, (tiny, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def peaks_of(device: torch.device, args) -> dict:
    """The datasheet peak (None off the list) and the measured matmul peak, in FLOP/s, and the
    measured one's dtype."""
    # bf16 matmuls are emulated on most CPUs: the smoke run measures its fp32 peak instead.
    dtype = torch.bfloat16 if args.dtype == "bfloat16" and device.type == "cuda" else torch.float32
    listed = args.peak_tflops * 1e12 if args.peak_tflops else None
    if listed is None and device.type == "cuda":
        listed = datasheet_peak_flops(device_name(device), torch.bfloat16)
    return {
        "datasheet": listed,
        "measured": matmul_flops(device, dtype, n=8192 if device.type == "cuda" else 512),
        "measured_dtype": str(dtype).removeprefix("torch."),
    }


def main(argv=None) -> str:
    args = parse_args(argv)
    device = env.local_device()
    own_group = not dist.is_initialized()
    init_default_group()  # one rank; torchrun is not needed
    try:
        peaks = peaks_of(device, args)
        rows = [row for name, cfg in shapes(args).items() for row in measure(name, cfg, args, device, peaks)]
    finally:
        if own_group:
            dist.destroy_process_group()
    text = write_results(rows, args, device, peaks, args.out)
    print(text)
    return text


if __name__ == "__main__":
    main()
    exit_process(0)
