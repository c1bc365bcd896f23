"""Sharded HF loading vs from_pretrained-then-parallelize (per-rank peak memory), and step time of a
parallelized transformers Qwen2 vs meshtron's native model of the same shape.

Memory: a ~370 MB fp32 Llama folder (sharded safetensors) loaded on 4 ranks as dp = 2 x tp = 2 with
FSDP. Each rank resets its peak RSS (``/proc/self/clear_refs``) before loading and reports
``VmHWM`` minus the RSS before loading, plus the tensor bytes it read from the files.

Step time: forward + backward + AdamW of one rank-local batch, dp = 2 x tp = 2, CPU gloo ranks
(fastest of the timed steps, the two models interleaved step by step, slowest rank). CPU timings on a shared machine: compare the two rows
with each other, not with GPU figures.

    python benchmarks/hf_parallelize.py   # writes benchmarks/results/hf_parallelize.md
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULT = Path(__file__).parent / "results" / "hf_parallelize.md"
BIG = dict(  # Llama-style, about 92 M parameters = 370 MB fp32
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
    num_key_value_heads=4, max_position_embeddings=512,
)
STEP = dict(  # shared by the HF Qwen2 and the native meshtron model
    vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, tie_word_embeddings=False,
)
RANKS, DP, TP = 4, 2, 2
BATCH, SEQ, WARMUP, STEPS = 2, 256, 2, 6
NOTES = """Notes. Each load runs in a fresh 4-rank launch. The sharded loader reads exactly one quarter of
the tensor bytes per rank; its RSS peak is higher than that because safetensors reads through
`mmap` (the file pages a column slice touches count in RSS while the file is mapped; the loader maps
one file at a time) and each slice is copied once into its parameter. The from_pretrained path
holds the whole model on every rank, and tp-rank 0 of each group (ranks 0 and 2) also holds the
scatter buffers of `distribute_tensor`. Step times are CPU gloo timings on a heavily shared 2-core
machine (load average 15-50 during our runs; repeated runs moved each figure by up to 3x); only
the interleaved pair of one run is comparable, and GPU timings were not taken."""


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_during(fn):
    """(result, peak RSS increase in MiB) of ``fn()`` on this rank."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    result = fn()
    return result, (_rss_kib("VmHWM") - before) / 1024


def _gather(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _measure_load(load, folder: str, out: str, name: str) -> None:
    """Record this rank's peak RSS increase and bytes read while ``load(folder, mesh)`` runs."""
    import transformers  # noqa: F401 - imported before the measurement, as a training script would

    from meshtron import build_mesh

    mesh = build_mesh(dp=DP, tp=TP)
    read, peak = _peak_during(lambda: load(folder, mesh))
    rows = _gather((peak, read))
    if dist.get_rank() == 0:
        Path(out, f"{name}.json").write_text(json.dumps(rows))


def _sharded(folder: str, mesh) -> int:
    from meshtron import load_hf_checkpoint

    return load_hf_checkpoint(folder, mesh)[1]


def _full_then_parallelize(folder: str, mesh) -> int:
    from transformers import AutoModelForCausalLM

    from meshtron import parallelize_hf_model

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    read = sum(p.numel() * p.element_size() for p in model.parameters())
    parallelize_hf_model(model, mesh)
    return read


def memory_sharded(folder: str, out: str) -> None:
    _measure_load(_sharded, folder, out, "sharded")


def memory_full(folder: str, out: str) -> None:
    _measure_load(_full_then_parallelize, folder, out, "full")


def _hf_model(mesh):
    import transformers

    from meshtron import parallelize_hf_model

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**STEP, max_position_embeddings=SEQ))
    return parallelize_hf_model(model, mesh)


def _native_model(mesh):
    from meshtron.config import ModelConfig
    from meshtron.models import InitialWeights, build_model
    from meshtron.checkpoint import load_full_state_dict
    from meshtron.parallel.data import apply_data_parallel
    from meshtron.parallel.tensor import apply_tensor_parallel

    cfg = ModelConfig(**STEP)
    with torch.device("meta"):
        model = build_model(cfg)
    apply_tensor_parallel(model, mesh["tp"])
    apply_data_parallel(model, mesh)
    model.to_empty(device="cpu")
    model.tie_weights()
    load_full_state_dict(model, InitialWeights(cfg, 0))
    return model


def _time_alternating(steps: dict) -> dict[str, float]:
    """Fastest step of each model, the models' steps interleaved so both see the same machine load;
    the slowest rank's figure."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(WARMUP + STEPS):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return {name: max(_gather(min(t))) for name, t in times.items()}


def measure_step_time(folder: str, out: str) -> None:
    from meshtron import build_mesh
    from meshtron.parallel.tensor import parallel_token_loss_sum

    mesh = build_mesh(dp=DP, tp=TP)
    group = mesh["dp"].get_group()
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    ids = torch.randint(0, STEP["vocab_size"], (BATCH, SEQ), generator=gen)

    hf = _hf_model(mesh)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def hf_step():
        hf(input_ids=ids, labels=ids).loss.backward()
        hf_opt.step()
        hf_opt.zero_grad()

    native = _native_model(mesh)
    native_opt = torch.optim.AdamW(native.parameters(), lr=1e-4)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

    def native_step():
        count = (labels != -100).sum().float()
        dist.all_reduce(count, group=group)
        (parallel_token_loss_sum(native(ids), labels) / count).backward()
        native_opt.step()
        native_opt.zero_grad()

    rows = _time_alternating({"transformers Qwen2 + parallelize_hf_model": hf_step, "meshtron native Qwen2": native_step})
    if dist.get_rank() == 0:
        Path(out, "steps.json").write_text(json.dumps(rows))


def _write_folder(folder: Path) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BIG))
    model.save_pretrained(folder, max_shard_size="100MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    from meshtron.testing import run_checks

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        total = _write_folder(folder)
        # Separate launches: fresh processes, so one load's freed memory cannot hide the other's peak.
        run_checks([memory_sharded, measure_step_time], RANKS, str(folder), tmp, timeout=900)
        run_checks([memory_full], RANKS, str(folder), tmp, timeout=900)
        memory = [(s, b, f, fb) for (s, b), (f, fb) in zip(*(json.loads(Path(tmp, f"{n}.json").read_text())
                                                           for n in ("sharded", "full")))]
        steps = json.loads(Path(tmp, "steps.json").read_text())
    lines = [
        "# HF models: sharded loading and step time",
        "",
        f"Measured with `python benchmarks/hf_parallelize.py` on {RANKS} CPU gloo ranks (dp = {DP} x tp = {TP}, "
        f"FSDP), torch {torch.__version__}, on a shared 2-core machine.",
        "",
        f"## Per-rank peak memory while loading a {total / 2**20:.0f} MiB fp32 Llama "
        f"({BIG['num_hidden_layers']} layers, hidden {BIG['hidden_size']}, vocab {BIG['vocab_size']})",
        "",
        "Peak RSS increase during the load (VmHWM after minus RSS before), and tensor bytes read from the files.",
        "",
        "| rank | load_hf_checkpoint: peak (MiB) | bytes read (MiB) | from_pretrained + parallelize: peak (MiB) | "
        "bytes read (MiB) |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r} | {s:.0f} | {b / 2**20:.0f} | {f:.0f} | {fb / 2**20:.0f} |" for r, (s, b, f, fb) in enumerate(memory)]
    lines += [
        "",
        f"One rank's share of the weights is {total / RANKS / 2**20:.0f} MiB.",
        "",
        f"## Step time (forward + backward + AdamW), batch {BATCH} x {SEQ} tokens per data rank",
        "",
        f"Model: {json.dumps(STEP)}. Fastest of {STEPS} steps after {WARMUP} warm-up (the two models' steps interleaved), slowest rank.",
        "",
        "| model | step time (ms) |",
        "|---|---|",
    ]
    lines += [f"| {name} | {seconds * 1e3:.0f} |" for name, seconds in steps.items()]
    lines += ["", NOTES]
    RESULT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
