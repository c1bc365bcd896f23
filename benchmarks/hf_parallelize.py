"""Sharded HF loading vs from_pretrained-then-parallelize (per-rank peak memory), and step time of a
parallelized transformers Qwen2 (dense) and Qwen2-MoE vs meshtron's native model of the same shape.

Memory: a ~370 MB fp32 Llama folder (sharded safetensors) loaded on 4 ranks as dp = 2 x tp = 2 with
FSDP. Each rank resets its peak RSS (``/proc/self/clear_refs``) before loading and reports
``VmHWM`` minus the RSS before loading, plus the tensor bytes it read from the files.

Step time: forward + backward + AdamW of one rank-local batch on CPU gloo ranks (fastest of the timed
steps, the two models interleaved step by step, slowest rank): the dense pair on dp = 2 x tp = 2, the
MoE pair on dp = 2 x ep = 2 (experts split over ep, fed by all-to-all). CPU timings: compare the two
rows of one table with each other, not with GPU figures.

    python benchmarks/hf_parallelize.py                # all parts; writes benchmarks/results/hf_parallelize.md
    python benchmarks/hf_parallelize.py --parts moe    # only some parts; the file keeps the other sections
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULT = Path(__file__).parent / "results" / "hf_parallelize.md"
BIG = dict(  # Llama-style, about 92 M parameters = 370 MB fp32
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=6,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
STEP = dict(  # shared by the HF Qwen2 and the native meshtron model
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
MOE = dict(  # Qwen2-MoE shape shared by transformers and the native model; every layer sparse
    STEP,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=512,
)
RANKS, DP, TP = 4, 2, 2
# Per step-time part: mesh, transformers architecture prefix, model shape, transformers-only config.
STEP_CASES = {
    "step": dict(mesh=dict(dp=DP, tp=TP), arch="Qwen2", shape=STEP, hf={}),
    # Router logits on, so the transformers loss includes the load-balancing term as the native one does.
    "moe": dict(mesh=dict(dp=2, ep=2), arch="Qwen2Moe", shape=MOE, hf=dict(output_router_logits=True)),
}
BATCH, SEQ, WARMUP, STEPS = 2, 256, 2, 6
MEMORY_NOTES = """Notes. Each load runs in a fresh 4-rank launch. The sharded loader reads exactly one quarter of
the tensor bytes per rank; its RSS peak is higher than that because safetensors reads through
`mmap` (the file pages a column slice touches count in RSS while the file is mapped; the loader maps
one file at a time) and each slice is copied once into its parameter. The from_pretrained path
holds the whole model on every rank, and tp-rank 0 of each group (ranks 0 and 2) also holds the
scatter buffers of `distribute_tensor`."""
STEP_NOTES = {
    "step": """Notes. CPU gloo timings on a heavily shared 2-core machine (load average 15-50 during our
runs; repeated runs moved each figure by up to 3x); only the interleaved pair of one run is
comparable, and GPU timings were not taken.""",
    "moe": """Notes. Layout: each rank reads its own batch (dp x ep = 4 data ranks), holds 4 of the 8 experts
of every layer (ep = 2; expert gradients reduced over dp) and its FSDP share of the dense weights
(over dp x ep). Per MoE layer, EP's all-to-all sends each token's hidden state (256 fp32) to the
rank holding each of its 2 chosen experts and back, and the same volume of gradients in backward;
with balanced routing about half of the 1024 routed rows per rank cross to the other ep rank. Both models use the same
dispatch (meshtron's all-to-all with grouped matmuls), so equal step times are expected; this single
run's 4 ms gap (0.4 %) is not a measured difference. CPU gloo timings on the otherwise idle
2-core machine (4 ranks on 2 cores); only the interleaved pair of one run is comparable, and GPU timings were not \
taken.""",
}


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


def _hf_model(mesh, arch: str, shape: dict, hf: dict):
    """transformers' ``{arch}ForCausalLM`` of ``shape`` (plus the transformers-only keys ``hf``), parallelized."""
    import transformers

    from meshtron import parallelize_hf_model

    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**shape, **hf, max_position_embeddings=SEQ)
    return parallelize_hf_model(getattr(transformers, f"{arch}ForCausalLM")(config), mesh)


def _native_model(mesh, shape: dict):
    """meshtron's model of ``shape``, parallelized and filled as the training runner does."""
    from meshtron.config import Config, ModelConfig
    from meshtron.models import build_model
    from meshtron.parallel.compose import materialize_sharded, parallelize

    cfg = Config(model=ModelConfig(**shape))
    with torch.device("meta"):
        model = build_model(cfg.model)
    materialize_sharded(parallelize(model, mesh, cfg), torch.device("cpu"), cfg)
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


def _measure_step_time(part: str, out: str) -> None:
    from meshtron import build_mesh
    from meshtron.mesh import batch_mesh, dense_data_mesh
    from meshtron.parallel.vocab_loss import parallel_token_loss_sum

    case = STEP_CASES[part]
    mesh = build_mesh(**case["mesh"])
    group = dense_data_mesh(mesh).get_group()  # the ranks holding different tokens (dp x ep here)
    gen = torch.Generator().manual_seed(batch_mesh(mesh).get_local_rank())
    ids = torch.randint(0, case["shape"]["vocab_size"], (BATCH, SEQ), generator=gen)

    hf = _hf_model(mesh, case["arch"], case["shape"], case["hf"])
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def hf_step():
        hf(input_ids=ids, labels=ids).loss.backward()
        hf_opt.step()
        hf_opt.zero_grad()

    native = _native_model(mesh, case["shape"])
    native_opt = torch.optim.AdamW(native.parameters(), lr=1e-4)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

    def native_step():
        count = (labels != -100).sum().float()
        dist.all_reduce(count, group=group)
        (parallel_token_loss_sum(native(ids), labels) / count).backward()
        native_opt.step()
        native_opt.zero_grad()

    arch = case["arch"]
    rows = _time_alternating(
        {f"transformers {arch} + parallelize_hf_model": hf_step, f"meshtron native {arch}": native_step}
    )
    if dist.get_rank() == 0:
        Path(out, f"{part}.json").write_text(json.dumps(rows))


def step_dense(folder: str, out: str) -> None:
    _measure_step_time("step", out)


def step_moe(folder: str, out: str) -> None:
    _measure_step_time("moe", out)


def _write_folder(folder: Path) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BIG))
    model.save_pretrained(folder, max_shard_size="100MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


PARTS = ("memory", "step", "moe")


def _memory_section(tmp: str, total: int) -> list[str]:
    memory = [
        (s, b, f, fb)
        for (s, b), (f, fb) in zip(*(json.loads(Path(tmp, f"{n}.json").read_text()) for n in ("sharded", "full")))
    ]
    lines = [
        f"## Per-rank peak memory while loading a {total / 2**20:.0f} MiB fp32 Llama "
        f"({BIG['num_hidden_layers']} layers, hidden {BIG['hidden_size']}, vocab {BIG['vocab_size']})",
        "",
        f"dp = {DP} x tp = {TP}, FSDP. Peak RSS increase during the load (VmHWM after minus RSS before), and tensor "
        "bytes read from the files.",
        "",
        "| rank | load_hf_checkpoint: peak (MiB) | bytes read (MiB) | from_pretrained + parallelize: peak (MiB) | "
        "bytes read (MiB) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r} | {s:.0f} | {b / 2**20:.0f} | {f:.0f} | {fb / 2**20:.0f} |" for r, (s, b, f, fb) in enumerate(memory)
    ]
    return lines + ["", f"One rank's share of the weights is {total / RANKS / 2**20:.0f} MiB.", "", MEMORY_NOTES]


def _step_section(tmp: str, part: str) -> list[str]:
    case = STEP_CASES[part]
    steps = json.loads(Path(tmp, f"{part}.json").read_text())
    layout = " x ".join(f"{dim} = {size}" for dim, size in case["mesh"].items())
    title = "MoE step time" if part == "moe" else "Step time"
    lines = [
        f"## {title} (forward + backward + AdamW), {layout}, batch {BATCH} x {SEQ} tokens per data rank",
        "",
        f"Model: {json.dumps(case['shape'])}. Fastest of {STEPS} steps after {WARMUP} warm-up (the two models' steps "
        "interleaved), slowest rank.",
        "",
        "| model | step time (ms) |",
        "|---|---|",
    ]
    lines += [f"| {name} | {seconds * 1e3:.0f} |" for name, seconds in steps.items()]
    return lines + ["", STEP_NOTES[part]]


def _previous_sections() -> dict[str, str]:
    """The committed file's sections by part, so a run of some parts keeps the others' figures."""
    titles = {"memory": "## Per-rank peak memory", "step": "## Step time", "moe": "## MoE step time"}
    text = RESULT.read_text() if RESULT.exists() else ""
    blocks = ["## " + b for b in text.split("\n## ")[1:]]
    return {part: b.rstrip("\n") for b in blocks for part, title in titles.items() if b.startswith(title)}


def main(argv: list[str] | None = None) -> None:
    from meshtron.testing import run_checks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parts = parser.parse_args(argv).parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    sections = _previous_sections()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        total = _write_folder(folder) if "memory" in parts else 0
        checks = {"memory": memory_sharded, "step": step_dense, "moe": step_moe}
        # Separate launches: fresh processes, so one load's freed memory cannot hide the other's peak.
        run_checks([checks[p] for p in PARTS if p in parts], RANKS, str(folder), tmp, timeout=900)
        if "memory" in parts:
            run_checks([memory_full], RANKS, str(folder), tmp, timeout=900)
            sections["memory"] = "\n".join(_memory_section(tmp, total))
        sections.update({p: "\n".join(_step_section(tmp, p)) for p in ("step", "moe") if p in parts})
    lines = [
        "# HF models: sharded loading and step time",
        "",
        f"Measured with `python benchmarks/hf_parallelize.py` on {RANKS} CPU gloo ranks, torch {torch.__version__}, "
        "on a 2-core machine (each section names its mesh).",
    ]
    for part in PARTS:
        if part in sections:
            lines += ["", sections[part]]
    RESULT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
