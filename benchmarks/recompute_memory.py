"""Activation checkpointing modes on one process: what a step's forward keeps for backward, and the
matmul FLOPs its backward runs, against the planner.

A small native dense model (debug_dense widened: hidden 256, 4 layers, seq 512, batch 4, fp32) runs one
forward + backward per mode (none, op with each policy, selective every 2nd block, full). Measured:
the bytes of the storages still alive after the forward that the graph keeps for backward
(``meshtron.plan.measure.kept_tensor_bytes``: autograd's saved tensors and a selective checkpoint's
cache; the loss's own tensors included) and the backward's matmul FLOPs (recomputation included,
counted per aten matmul). Planned: the layers' ``layer_kept_bytes`` x tokens and the step FLOP factor
``recompute_factor`` (the planner's 3-forward-units step; compare the ratio to none). And, each mode in a
fresh process after a small warm-up step, the growth of the process's peak RSS over one forward + backward
(Linux: the peak reset through ``/proc/self/clear_refs``, then ``VmHWM`` less the RSS before; the CPU
allocator's real high-water mark, the parameters' gradients included).

    PYTHONPATH=. python benchmarks/recompute_memory.py   # ~1 minute on 2 CPU cores

Writes benchmarks/results/recompute_memory.md.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.config import load_config  # noqa: E402
from meshtron.models import build_model  # noqa: E402
from meshtron.parallel.recompute import apply_activation_checkpointing  # noqa: E402
from meshtron.plan.activations import layer_kept_bytes  # noqa: E402
from meshtron.plan.measure import MatmulFlops, kept_tensor_bytes  # noqa: E402
from meshtron.plan.speed import recompute_factor  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "recompute_memory.md"
BATCH, SEQ = 4, 512
MODES = [
    ("none", "save_matmuls"),
    ("op", "save_matmuls"),
    ("op", "alternate_matmuls"),
    ("selective", "save_matmuls"),
    ("full", "save_matmuls"),
]


def config(mode: str, policy: str):
    return load_config(
        ROOT / "recipes" / "debug_dense.toml",
        [
            "--model.hidden_size=256",
            "--model.intermediate_size=768",
            "--model.num_attention_heads=8",
            f"--train.seq_len={SEQ}",
            f"--parallel.activation_checkpointing={mode}",
            f"--parallel.ac_policy={policy}",
        ],
    )


def measure(base: torch.nn.Module, mode: str, policy: str, tokens, labels) -> tuple[int, float]:
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, mode, 2, policy)
    holder = {}

    def forward():
        holder["loss"] = model(tokens, labels=labels)
        return holder["loss"]

    kept = kept_tensor_bytes(forward, exclude=list(model.parameters()))
    counter = MatmulFlops()
    with counter:
        holder.pop("loss").backward()
    return kept, counter.flops


def inputs() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model every mode starts from and the batch, the same in every process."""
    torch.manual_seed(0)
    base = build_model(config("none", "save_matmuls").model)
    base.init_weights(0)
    return base, torch.randint(0, 256, (BATCH, SEQ)), torch.randint(0, 256, (BATCH, SEQ))


def peak_rss_growth(mode: str, policy: str) -> int:
    """Runs in a fresh process: the growth of its peak RSS over one forward + backward under ``mode``, after a
    warm-up step on one short sequence (allocator and kernels started)."""
    base, tokens, labels = inputs()
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, mode, 2, policy)
    model(tokens[:1, :64], labels=labels[:1, :64]).backward()
    model.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    start = _status_bytes("VmRSS")
    model(tokens, labels=labels).backward()
    return _status_bytes("VmHWM") - start


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (Linux), in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _rss_in_fresh_process(mode: str, policy: str) -> int:
    out = subprocess.run(
        [sys.executable, __file__, "--rss", mode, policy], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    base, tokens, labels = inputs()
    rows, reference = [], None
    for mode, policy in MODES:
        cfg = config(mode, policy)
        kept, flops = measure(base, mode, policy, tokens, labels)
        rss = _rss_in_fresh_process(mode, policy)
        planned = sum(layer_kept_bytes(cfg, i) for i in range(cfg.model.num_hidden_layers)) * BATCH * SEQ
        reference = reference or (kept, flops, rss)
        name = mode + (f" ({policy})" if mode == "op" else "")
        rows.append(
            f"| {name} | {kept / 2**20:.2f} | {planned / 2**20:.2f} | {kept / reference[0]:.3f} | "
            f"{rss / 2**20:.1f} | {rss / reference[2]:.3f} | "
            f"{flops / 1e9:.3f} | {flops / reference[1]:.3f} | {recompute_factor(cfg):.3f} |"
        )
        print(rows[-1], flush=True)
    OUT.write_text(
        "\n".join(
            [
                "# Activation checkpointing: kept activations and recomputed matmuls (one process, CPU)",
                "",
                f"`PYTHONPATH=. python benchmarks/recompute_memory.py`: debug_dense widened to hidden 256, "
                f"intermediate 768, 8 heads, 4 layers; batch {BATCH} x seq {SEQ}, fp32. Kept: bytes alive after the "
                "forward for backward (whole model, loss included); planned: the layers' `layer_kept_bytes` x tokens "
                "(layers only). Backward matmul GFLOP counted per aten matmul (recomputation included); the "
                "planner's step factor is its forward + backward + recomputation over 3 forward units. Peak RSS "
                "growth: each mode in a fresh process, the growth of its peak RSS (`VmHWM`, reset first) over one "
                "forward + "
                "backward after a warm-up step (parameter gradients included).",
                "",
                "| mode | kept MiB | planned layers MiB | kept / none | peak RSS growth MiB | / none | backward matmul "
                "GFLOP "
                "| / none | planned step factor |",
                "|---|---|---|---|---|---|---|---|---|",
                *rows,
                "",
            ]
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rss"]:
        print(json.dumps(peak_rss_growth(*sys.argv[2:4])))
    else:
        main()
