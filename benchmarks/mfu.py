"""Single-device training throughput and MFU of Qwen2.5 shapes: meshtron next to transformers.

For each shape (Qwen2.5-0.5B, 1.5B, and 7B truncated to ``--layers-7b`` layers so it fits one
80 GB card) at ``--seq`` tokens (4096) and ``--batch`` sequences per step:

* meshtron: the training loop's own step (``meshtron.train.training_step``): the model built on the
  meta device, parallelized for one rank (FSDP2 unit per block, bf16 compute with fp32 master
  weights and fp32 gradient reduction), fused AdamW with the non-finite guard on the device, global
  gradient clipping, SDPA attention (restricted to the flash / memory-efficient / cuDNN kernels on
  CUDA, so a silent fallback to the math kernel is an error), optionally ``torch.compile`` per block.
  On CUDA the timed steps run under ``torch.cuda.set_sync_debug_mode("error")``: any host sync in
  the step fails the run (``--no-sync-check`` turns that off);
* transformers: ``Qwen2ForCausalLM`` built from the same shape's ``Qwen2Config`` directly on the
  device (random init), ``attn_implementation="sdpa"``, fp32 weights under bf16 autocast (the usual
  bf16 mixed-precision recipe for it), the same batch, the same fused AdamW and clipping.

Reported per run: tokens/s, MFU = training FLOPs per token (``meshtron.models.flops_per_token``:
6 x matmul parameters + causal attention) x tokens/s / the measured bf16 matmul peak of this device
(``meshtron.metrics.matmul_flops``), peak memory, and meshtron's speed-up over transformers.
``--tiny`` runs a small model for a few steps on any device (a smoke test; its numbers mean nothing).

Run on a GPU: ``PYTHONPATH=. python benchmarks/mfu.py [--compile] [--batch 1] [--seq 4096]``
(writes benchmarks/results/mfu.{md,json}; ``--out`` picks another stem).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron import env
from meshtron.config import Config, ModelConfig, ParallelConfig, TrainConfig, load_config
from meshtron.mesh import build_mesh
from meshtron.metrics import matmul_flops, synchronize
from meshtron.models import build_model, flops_per_token
from meshtron.optim import build_optimizer
from meshtron.parallel.runner import StepRunner
from meshtron.train import read_scalars, training_step

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RESULTS = Path(__file__).parent / "results"
TINY = ModelConfig(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
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


def fused_attention_only(device: torch.device):
    """On CUDA, SDPA may only pick a fused kernel (flash, memory-efficient, cuDNN), never math."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])


def no_host_syncs(device: torch.device, enabled: bool):
    """``torch.cuda.set_sync_debug_mode("error")`` for the block: a host sync raises."""
    if device.type != "cuda" or not enabled:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def mode():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return mode()


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def timed(step, steps: int, warmup: int, device: torch.device, sync_check: bool) -> tuple[float, list]:
    """Seconds per step over ``steps`` after ``warmup``; the step's outputs are read only afterwards."""
    for _ in range(warmup):
        step()
    synchronize(device)
    outputs = []
    start = time.perf_counter()
    with no_host_syncs(device, sync_check):
        for _ in range(steps):
            outputs.append(step())
        synchronize(device)
    return (time.perf_counter() - start) / steps, outputs


def run_meshtron(model_cfg: ModelConfig, args, batch: torch.Tensor, device: torch.device) -> dict:
    cfg = Config(model=model_cfg, parallel=ParallelConfig(compile=args.compile),
                 train=TrainConfig(dtype=args.dtype, seq_len=args.seq, global_batch_size=args.batch))
    with torch.device("meta"):
        model = build_model(model_cfg)
    runner = StepRunner(model, build_mesh(), cfg, device)
    optimizer = build_optimizer(runner.module, cfg.train)
    ids, labels = batch[:, :-1], batch[:, 1:]

    def step():
        with fused_attention_only(device):
            return training_step(runner, optimizer, ids, labels, cfg.train.max_grad_norm)

    seconds, outputs = timed(step, args.steps, args.warmup, device, args.sync_check)
    losses = [read_scalars(loss)[0] for loss, _ in outputs]
    del runner, optimizer, model
    return {"seconds_per_step": seconds, "last_loss": losses[-1]}


def run_transformers(model_cfg: ModelConfig, args, batch: torch.Tensor, device: torch.device) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshtron.hf import hf_config_dict

    hf_cfg = Qwen2Config.from_dict(hf_config_dict(model_cfg), attn_implementation="sdpa")
    with torch.device(device):
        model = Qwen2ForCausalLM(hf_cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # it shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    # Its own code may sync (mask building, loss bookkeeping): not checked.
    seconds, outputs = timed(step, args.steps, args.warmup, device, sync_check=False)
    loss = outputs[-1].item()
    del model, optimizer
    return {"seconds_per_step": seconds, "last_loss": loss}


def measure(name: str, model_cfg: ModelConfig, args, device: torch.device, peak: float) -> dict:
    tokens = args.batch * args.seq
    flops = flops_per_token(model_cfg, args.seq)
    batch = torch.randint(0, model_cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    row: dict = {"shape": name, "layers": model_cfg.num_hidden_layers, "batch": args.batch, "seq": args.seq}
    for impl, run in (("meshtron", run_meshtron), ("transformers", run_transformers)):
        _reset_memory(device)
        result = run(model_cfg, args, batch, device)
        per_s = tokens / result["seconds_per_step"]
        row[impl] = {**result, "tokens_per_s": per_s, "mfu": flops * per_s / peak,
                     "peak_memory_gib": _peak_memory_gib(device)}
        print(f"{name} {impl}: {per_s:,.0f} tokens/s, MFU {100 * row[impl]['mfu']:.1f}%", flush=True)
    row["speedup"] = row["meshtron"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
    return row


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def write_results(rows: list[dict], args, device: torch.device, peak_of: tuple[float, torch.dtype], out: Path) -> str:
    label = device_name(device)
    peak, peak_dtype = peak_of
    settings = (f"dtype {args.dtype}, compile {'on' if args.compile else 'off'}, {args.steps} timed steps after "
                f"{args.warmup} warm-up, host-sync check {'on' if args.sync_check and device.type == 'cuda' else 'off'}")
    lines = [
        f"# Single-device training throughput: meshtron vs transformers ({label})",
        "",
        *(["**CPU smoke run (`--tiny`): checks that the script works; not a performance result.**", ""]
          if device.type != "cuda" else []),
        f"Device: {label}; measured {str(peak_dtype).removeprefix('torch.')} matmul peak "
        f"{peak / 1e12:.2f} TFLOP/s. {settings}. Produced by `benchmarks/mfu.py`.",
        "",
        "| shape | layers | batch x seq | meshtron tokens/s | MFU | peak mem GiB | transformers tokens/s | MFU "
        "| peak mem GiB | speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours, theirs = r["meshtron"], r["transformers"]
        mem = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
        lines.append(
            f"| {r['shape']} | {r['layers']} | {r['batch']} x {r['seq']} | {ours['tokens_per_s']:,.0f} | "
            f"{100 * ours['mfu']:.1f}% | {mem(ours['peak_memory_gib'])} | {theirs['tokens_per_s']:,.0f} | "
            f"{100 * theirs['mfu']:.1f}% | {mem(theirs['peak_memory_gib'])} | {r['speedup']:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    record = {"device": label, "peak_flops": peak, "peak_dtype": str(peak_dtype), "settings": vars(args), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small model, short sequence: a smoke test")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; 64 with --tiny)")
    parser.add_argument("--layers-7b", type=int, default=8, help="layers kept of Qwen2.5-7B's 28")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (meshtron)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-sync-check", dest="sync_check", action="store_false",
                        help="do not run meshtron's timed steps under torch.cuda.set_sync_debug_mode('error')")
    parser.add_argument("--out", type=Path, default=RESULTS / "mfu", help="results path without suffix")
    args = parser.parse_args(argv)
    defaults = {"seq": (64, 4096), "steps": (2, 10), "warmup": (1, 3)}
    for key, (tiny, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    device = env.local_device()
    own_group = not dist.is_initialized()
    if own_group:  # one rank; torchrun is not needed
        dist.init_process_group(env.backend(), store=dist.HashStore(), rank=0, world_size=1)
    try:
        # bf16 matmuls are emulated on most CPUs: the smoke run measures its fp32 peak instead.
        dtype = torch.bfloat16 if args.dtype == "bfloat16" and device.type == "cuda" else torch.float32
        peak = matmul_flops(device, dtype, n=8192 if device.type == "cuda" else 512)
        rows = [measure(name, cfg, args, device, peak) for name, cfg in shapes(args).items()]
    finally:
        if own_group:
            dist.destroy_process_group()
    text = write_results(rows, args, device, (peak, dtype), args.out)
    print(text)
    return text


if __name__ == "__main__":
    main()
