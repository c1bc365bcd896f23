"""Per-rank memory of parameters + gradients + AdamW state for Qwen2.5-7B at dp = 8: FSDP vs replication.

Nothing is allocated: the model is built on the meta device, sharded (or replicated) by
``apply_data_parallel`` in an 8-rank gloo launch, and the local shard sizes are summed. Training
keeps fp32 master weights (also with bf16 compute), so per parameter element a rank holds 4 bytes
of weight, 4 of gradient (the sharded gradient has the shard's shape) and 8 of AdamW state
(exp_avg, exp_avg_sq). The analytic ZeRO-3 figure is 16 bytes x N / dp.

    python benchmarks/data_parallel_memory.py   # writes benchmarks/results/data_parallel_memory.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtron.config import ModelConfig
from meshtron.mesh import build_mesh
from meshtron.models import build_model, count_parameters
from meshtron.parallel.data_parallel import apply_data_parallel
from meshtron.testing import run_checks

QWEN2P5_7B = ModelConfig(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
DP = 8
BYTES = {"params": 4, "grads": 4, "optimizer": 8}  # fp32 master weights, fp32 grads, AdamW m and v
RESULT = Path(__file__).parent / "results" / "data_parallel_memory.md"


def _local_elements(model: torch.nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def measure(out: str) -> None:
    mesh = build_mesh(dp=DP)
    rows = {}
    for mode in ("fsdp", "replicate"):
        with torch.device("meta"):
            model = build_model(QWEN2P5_7B)
        total = count_parameters(model)
        apply_data_parallel(model, mesh, mode, dtype="bfloat16")
        local = torch.tensor([_local_elements(model)])
        dist.all_reduce(local, op=dist.ReduceOp.MAX)  # the busiest rank (FSDP shards may be uneven)
        rows[mode] = int(local)
    if dist.get_rank() == 0:
        Path(out).write_text(_table(total, rows))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _table(total: int, rows: dict[str, int]) -> str:
    lines = [
        "# Per-rank parameter + gradient + optimizer memory, Qwen2.5-7B, dp = 8",
        "",
        f"Parameters: {total:,} ({total / 1e9:.2f} B). Measured from the meta-device model after",
        "`apply_data_parallel` on an 8-rank gloo launch (sum of local shard sizes, busiest rank);",
        "fp32 master weights and gradients, AdamW state 2 x fp32. Not included: activations and the",
        "transient bf16 all-gathered copies of the FSDP unit(s) in use (a block, or the",
        "embedding / lm_head, 152064 x 3584 = 1.02 GiB in bf16, plus the prefetched next one).",
        "",
        "| layout | elements / rank | params GiB | grads GiB | AdamW GiB | total GiB | analytic GiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    analytic = {"fsdp": 16 * total / DP, "replicate": 16 * total}
    names = {"fsdp": "FSDP (ZeRO-3) over dp = 8", "replicate": "replication (DDP-like)"}
    for mode, elements in rows.items():
        parts = [elements * BYTES[k] for k in BYTES]
        lines.append(
            f"| {names[mode]} | {elements:,} | "
            + " | ".join(_gib(p) for p in parts)
            + f" | {_gib(sum(parts))} | {_gib(analytic[mode])} |"
        )
    saving = rows["replicate"] / rows["fsdp"]
    lines += ["", f"FSDP holds 1/{saving:.2f} of the replicated state per rank (analytic ZeRO-3: 1/{DP}).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else str(RESULT)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    run_checks([measure], DP, out, timeout=600)
    print(Path(out).read_text())
