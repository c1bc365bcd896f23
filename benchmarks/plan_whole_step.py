"""Whole-step per-rank memory and step time: meshtron.plan's prediction against one real training step
on 8 CPU ranks, across layouts covering every mesh dimension, the checkpointing modes, the pipeline
schedules, the three data-parallel modes and MoE with ep.

For each layout every rank builds the model with the training path's own pieces
(``build_model_runner`` + ``build_optimizer`` + ``training_step``), runs one warm-up step (which
creates the AdamW state), times the second step and measures the memory of the third under torch's
``torch.distributed._tools.mem_tracker.MemTracker`` (a ``TorchDispatchMode`` that follows every
tensor storage's lifetime, DTensors desugared to their local tensors, FSDP2's ``resize_`` frees
included). Reported per layout, for the busiest rank:

- state: fp32 parameters, gradients and AdamW state counted from the DTensor local shards against
  ``state_bytes`` (must be equal);
- peak: the largest live tensor bytes during the step against the planner's total without ``other``
  (``other`` is allocator slack and CUDA context: a tensor tracker cannot see it);
- transient: peak minus the persistent state (parameters + AdamW state), against the planner's
  ``grads + gathered + unsharded_grads + reduce_scatter + activations + loss + ep_dispatch``;
- step time: the measured step (without the tracker) against ``predict_step_time`` with this host's measured
  single-thread matmul rate shared by the ranks (MFU 1) and 2 GB/s gloo links (rough, see the output).

    PYTHONPATH=. python benchmarks/plan_whole_step.py      # ~2-4 minutes on 2 cores

    PYTHONPATH=. python benchmarks/plan_whole_step.py --reuse  # re-predict the stored measurements

Writes benchmarks/results/plan_whole_step.json (the table is in plan_validation.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORLD = int(os.environ.get("PLAN_WORLD", 8))
SEQ, BATCH = 128, 16
# (recipe, parallel overrides): every dimension, AC modes, the pp schedules, dp modes, MoE with ep.
LAYOUTS = [
    ("debug_dense", dict(dp=8)),
    ("debug_dense", dict(dp=2, tp=4, sp=True)),
    ("debug_dense", dict(dp=2, tp=4, sp=True, activation_checkpointing="full")),
    ("debug_dense", dict(dp=4, cp=2, activation_checkpointing="selective")),
    ("debug_dense", dict(dp=4, tp=2, data_parallel="replicate", microbatches=2)),
    ("debug_dense", dict(dp=2, cp=2, tp=2, sp=True, data_parallel="hsdp")),
    ("debug_dense", dict(pp=2, dp=4, schedule="1f1b", microbatches=4)),
    ("debug_dense", dict(pp=4, dp=2, schedule="gpipe", microbatches=4)),
    ("debug_dense", dict(pp=2, dp=2, tp=2, sp=True, schedule="interleaved", virtual_stages=2, microbatches=4)),
    ("debug_moe", dict(dp=2, ep=4)),
    ("debug_moe", dict(dp=2, ep=2, tp=2, sp=True)),
    ("debug_moe", dict(pp=2, cp=2, ep=2, microbatches=2)),
    # Zero-bubble: activations held until W plus the gradients W restarts from; the V placement.
    ("debug_dense", dict(pp=2, dp=4, schedule="zb1p", microbatches=4)),
    ("debug_dense", dict(pp=2, dp=2, tp=2, sp=True, schedule="zbv", virtual_stages=2, microbatches=4)),
    ("debug_moe", dict(pp=2, cp=2, ep=2, schedule="dualpipev", virtual_stages=2, microbatches=4)),
]


def layout_config(recipe: str, layout: dict):
    from meshtron.config import load_config

    args = [
        "--train.seq_len",
        str(SEQ),
        "--train.global_batch_size",
        str(BATCH),
        "--model.max_position_embeddings",
        str(2 * SEQ),
    ]
    for key, value in {"dp": 1, **layout}.items():
        args += [f"--parallel.{key}", str(value).lower()]
    return load_config(ROOT / "recipes" / f"{recipe}.toml", args)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def tracked_peak(runner, optimizer, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[int, dict[str, int]]:
    """Peak live tensor bytes of one training step under :func:`meshtron.dryrun.storage_tracker` (the model, its
    optimizer state and the batch tracked from before the step), and that peak by MemTracker's kinds."""
    from meshtron.dryrun import storage_tracker
    from meshtron.train import training_step

    tracker = storage_tracker()
    tracker.track_external(runner.module, optimizer, inputs, labels)
    with tracker:
        loss, _ = training_step(runner, optimizer, inputs, labels, 1.0)
        loss.item()
    peak = tracker.get_tracker_snapshot("peak")
    return sum(snap["Total"] for snap in peak.values()), {
        str(k): v for snap in peak.values() for k, v in snap.items() if k != "Total"
    }


def measure_layouts(out_path: str, layouts: list | None = None) -> None:
    """One check on every rank: each layout's measured state, peak and step time, gathered to rank 0."""
    import torch.distributed as dist

    from meshtron.mesh import batch_mesh
    from meshtron.models import build_model
    from meshtron.optim import build_optimizer
    from meshtron.parallel.runner import build_model_runner
    from meshtron.train import recipe_mesh, training_step

    rows = []
    for recipe, layout in layouts or LAYOUTS:
        cfg = layout_config(recipe, layout)
        mesh = recipe_mesh(cfg)
        coords = [mesh[d].get_local_rank() for d in ("pp", "dp", "cp", "ep", "tp")]
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build_model(cfg.model)
        runner = build_model_runner(model, mesh, cfg, torch.device("cpu"))
        optimizer = build_optimizer(runner.module, cfg.train)
        readers = batch_mesh(mesh)
        local_rows = BATCH // readers.size()
        gen = torch.Generator().manual_seed(1000 + readers.get_local_rank())
        ids = torch.randint(0, cfg.model.vocab_size, (local_rows, SEQ + 1), generator=gen)
        inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        training_step(runner, optimizer, inputs, labels, 1.0)  # warm-up: creates the AdamW state
        dist.barrier()
        start = time.perf_counter()
        loss, _ = training_step(runner, optimizer, inputs, labels, 1.0)  # timed without the tracker
        loss.item()
        elapsed = time.perf_counter() - start
        params = list(runner.module.parameters())
        peak_total, breakdown = tracked_peak(runner, optimizer, inputs, labels)
        opt_tensors = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        measured = {
            "coords": coords,
            "params": _bytes(params),
            "grads": _bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _bytes(opt_tensors),
            "peak": peak_total,
            "peak_by_kind": breakdown,
            "seconds": elapsed,
        }
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, measured)
        rows.append({"recipe": recipe, "layout": layout, "ranks": gathered})
        if dist.get_rank() == 0:
            Path(out_path).write_text(json.dumps(rows))
        del runner, optimizer, model
        dist.barrier()


def matmul_tflops() -> float:
    """Single-thread fp32 matmul rate of this host (TFLOP/s), the compute the ranks share."""
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(3):
        a @ b
    n, start = 200, time.perf_counter()
    for _ in range(n):
        a @ b
    return 2 * 256**3 * n / (time.perf_counter() - start) / 1e12


def compare(rows: list[dict], tflops: float) -> list[dict]:
    from meshtron.plan import Hardware, predict_step_time
    from meshtron.plan.fit import CPU_ASSUMPTIONS
    from meshtron.plan.memory import rank_breakdown
    from meshtron.plan.parameters import Coords, state_bytes

    cores = os.cpu_count() or 1
    hw = Hardware(
        gpus_per_node=WORLD,
        memory_gib=1e9,
        peak_tflops=tflops * min(1.0, cores / WORLD),
        mfu=1.0,
        intra_gbps=2.0,
        inter_gbps=2.0,
    )
    out = []
    for row in rows:
        cfg = layout_config(row["recipe"], row["layout"])
        per_rank = []
        for r in row["ranks"]:
            terms = rank_breakdown(cfg, Coords(*r["coords"]), CPU_ASSUMPTIONS).terms
            state = state_bytes(cfg, Coords(*r["coords"]))  # the peak's terms hold only the gradients live then
            predicted_peak = sum(v for k, v in terms.items() if k != "other")
            transient_terms = (
                "grads",
                "gathered",
                "unsharded_grads",
                "reduce_scatter",
                "activations",
                "loss",
                "ep_dispatch",
            )
            per_rank.append(
                {
                    "coords": r["coords"],
                    "state_exact": all(state[k] == r[k] for k in state),
                    "state_predicted": state,
                    "state_measured": {k: r[k] for k in state},
                    "peak_predicted": predicted_peak,
                    "peak_measured": r["peak"],
                    "transient_predicted": sum(terms[k] for k in transient_terms),
                    "transient_measured": r["peak"] - r["params"] - r["optimizer"],
                    "activations_predicted": terms["activations"],
                    "peak_by_kind": r["peak_by_kind"],
                }
            )
        busiest = max(per_rank, key=lambda x: x["peak_measured"])
        step = predict_step_time(cfg, hw).seconds
        measured_step = max(r["seconds"] for r in row["ranks"])
        out.append(
            {
                **row,
                "per_rank": per_rank,
                "busiest": busiest,
                "step_predicted": step,
                "step_measured": measured_step,
                "ranks": None,
            }
        )
    return out


def layout_name(recipe: str, layout: dict) -> str:
    sizes = " x ".join(f"{k} {layout[k]}" for k in ("pp", "dp", "cp", "ep", "tp") if layout.get(k, 1) > 1)
    extras = []
    if layout.get("sp"):
        extras.append("SP")
    extras.append(layout.get("data_parallel", "fsdp"))
    extras.append(f"ac {layout.get('activation_checkpointing', 'none')}")
    extras.append(f"mb {layout.get('microbatches', 1)}")
    if layout.get("pp", 1) > 1:
        extras.append(
            layout.get("schedule", "1f1b") + (f" v{layout['virtual_stages']}" if layout.get("virtual_stages") else "")
        )
    return f"{recipe.replace('debug_', '')}: {sizes} ({', '.join(extras)})"


def table(results: list[dict], tflops: float) -> str:
    kib = 1024
    lines = [
        "| layout | state exact (all ranks) | peak pred KiB | peak meas KiB | peak pred/meas | transient pred KiB "
        "| transient meas KiB | transient pred/meas | worst rank peak pred/meas | step pred s | step meas s | step "
        "pred/meas |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        b = r["busiest"]
        worst = max((x["peak_predicted"] / x["peak_measured"] for x in r["per_rank"]), key=lambda v: abs(v - 1))
        exact = all(x["state_exact"] for x in r["per_rank"])
        lines.append(
            f"| {layout_name(r['recipe'], r['layout'])} | {'yes' if exact else 'NO'} | "
            f"{b['peak_predicted'] / kib:,.0f} | "
            f"{b['peak_measured'] / kib:,.0f} | {b['peak_predicted'] / b['peak_measured']:.2f} | "
            f"{b['transient_predicted'] / kib:,.0f} | {b['transient_measured'] / kib:,.0f} | "
            f"{b['transient_predicted'] / b['transient_measured']:.2f} | {worst:.2f} | {r['step_predicted']:.3f} | "
            f"{r['step_measured']:.3f} | {r['step_predicted'] / r['step_measured']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    from meshtron.testing import run_checks

    out = ROOT / "benchmarks" / "results" / "plan_whole_step.json"
    raw = out.with_suffix(".raw.json")
    if "--reuse" not in sys.argv and "--rest" not in sys.argv:
        run_checks([measure_layouts], WORLD, str(raw), timeout=1800)
    rows = json.loads(raw.read_text())
    if "--rest" in sys.argv:  # measure only the layouts missing from the raw file, then merge
        rest = raw.with_suffix(".rest.json")
        run_checks([measure_layouts], WORLD, str(rest), LAYOUTS[len(rows) :], timeout=1800)
        rows += json.loads(rest.read_text())
        raw.write_text(json.dumps(rows))
        rest.unlink()
    if "--reuse" in sys.argv and out.exists():  # the stored measurements with the host rate measured with them
        tflops = json.loads(out.read_text())["host_matmul_tflops_1thread"]
    else:
        tflops = matmul_tflops()
    results = compare(rows, tflops)
    out.write_text(
        json.dumps({"host_matmul_tflops_1thread": tflops, "cores": os.cpu_count(), "layouts": results}, indent=1)
    )
    print(table(results, tflops))


if __name__ == "__main__":
    main()
