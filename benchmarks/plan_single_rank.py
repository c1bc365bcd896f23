"""Whole-step memory of real Qwen2.5 shapes on one rank: meshtron.plan against torch's MemTracker.

``plan_whole_step.py`` checks the planner on 8 ranks with tiny models, where activations dominate. On
one rank with real shapes the fp32 state (16 bytes per parameter) and the 152k vocabulary's loss
buffers dominate instead, as on a single GPU: this is the CPU stand-in for ``tests/gpu``'s comparison
with ``torch.cuda.max_memory_allocated``. Each shape is the configuration ``benchmarks/mfu.py`` trains
(one rank, FSDP2 units, bf16 compute, fp32 master weights, fused AdamW), at a shorter sequence to fit
this host: a warm-up step creates the AdamW state, the next step runs under ``MemTracker`` (as
``plan_whole_step.tracked_peak``), and its peak is compared with ``predict_memory`` without ``other``
(allocated bytes: no CUDA context, no allocator slack).

    PYTHONPATH=. python benchmarks/plan_single_rank.py          # ~10 minutes, ~10 GB of host memory
    PYTHONPATH=. python benchmarks/plan_single_rank.py --reuse  # re-predict the stored measurements

Writes benchmarks/results/plan_single_rank.json (the table is in plan_validation.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = ROOT / "benchmarks" / "results" / "plan_single_rank.json"
# name: (recipe, layers kept or None for all, sequence, ParallelConfig overrides)
SHAPES = {
    "Qwen2.5-0.5B (tied), seq 1024": ("qwen2p5_0p5b", None, 1024, {}),
    "Qwen2.5-1.5B (4 of 28 layers, tied), seq 1024, full checkpointing": (
        "qwen2p5_1p5b",
        4,
        1024,
        {"activation_checkpointing": "full"},
    ),
    "Qwen2.5-0.5B (6 of 24 layers), seq 1024, 2 micro-batches": ("qwen2p5_0p5b", 6, 1024, {"microbatches": 2}),
}


def shape_config(name: str):
    """The one-rank bf16 config ``benchmarks/mfu.py`` would train for ``name``."""
    from meshtron.config import load_config

    recipe, layers, seq, parallel = SHAPES[name]
    model = load_config(ROOT / "recipes" / f"{recipe}.toml").model
    model.num_hidden_layers = layers or model.num_hidden_layers
    from mfu import step_config

    return step_config(model, "bfloat16", batch=parallel.get("microbatches", 1), seq=seq, **parallel)


def measure(name: str) -> int:
    from meshtron.mesh import build_mesh
    from meshtron.models import build_model
    from meshtron.optim import build_optimizer
    from meshtron.parallel.runner import NoPipelineRunner
    from meshtron.train import training_step

    cfg = shape_config(name)
    with torch.device("meta"):
        model = build_model(cfg.model)
    runner = NoPipelineRunner(model, build_mesh(), cfg, torch.device("cpu"))
    optimizer = build_optimizer(runner.module, cfg.train)
    ids = torch.randint(
        0,
        cfg.model.vocab_size,
        (cfg.train.global_batch_size, cfg.train.seq_len + 1),
        generator=torch.Generator().manual_seed(0),
    )
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    training_step(runner, optimizer, inputs, labels, 1.0)[0].item()  # creates the AdamW state
    from plan_whole_step import tracked_peak

    return tracked_peak(runner, optimizer, inputs, labels)[0]


def compare(measured: dict[str, int]) -> list[dict]:
    from meshtron.plan import Assumptions, predict_memory

    rows = []
    for name, peak in measured.items():
        b = predict_memory(shape_config(name), Assumptions(reserved_gib=0.0, fragmentation=0.0))
        rows.append(
            {
                "shape": name,
                "measured": peak,
                "predicted": b.total,
                "ratio": b.total / peak,
                "phase": b.phase,
                "terms": b.terms,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| shape | measured GiB | predicted GiB | predicted / measured | peak moment |",
        "|---|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['shape']} | {r['measured'] / 2**30:.3f} | {r['predicted'] / 2**30:.3f} | {r['ratio']:.3f} | "
        f"{r['phase']} |"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    if "--reuse" in sys.argv:
        measured = {r["shape"]: r["measured"] for r in json.loads(OUT.read_text())}
    else:
        from meshtron.mesh import init_default_group

        init_default_group()
        try:
            measured = {name: measure(name) for name in SHAPES}
        finally:
            dist.destroy_process_group()
    rows = compare(measured)
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    from meshtron.mesh import exit_process

    main()
    exit_process(0)
