"""What recording every collective (meshtron.watch.collective_log, the hang report's evidence) costs per step.

4 CPU ranks (gloo), the debug recipes on four layouts: each rank builds the recipe's Trainer in-process
and runs steps in alternating blocks with the recording off (``collective_log.uninstall()``) and on
(``install()``), so drift of a shared machine hits both alike; the figure is the median step time of
each, measured on rank 0 (the step ends in collectives, so every rank's wall time is the same), and the
collectives recorded per step. A second table times one recorded call on a 1-rank gloo group (a scalar
all_reduce, c10d and functional) against the bare call.

Run: ``PYTHONPATH=. python benchmarks/collective_log.py`` (writes benchmarks/results/collective_log.md).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

from meshtron.testing import run_checks  # noqa: E402
from meshtron.watch import collective_log  # noqa: E402

LAYOUTS = [
    ("debug_dense", "dp 4 (FSDP)", {"dp": 4}),
    ("debug_dense", "dp 2 x tp 2 + SP", {"dp": 2, "tp": 2, "sp": "true"}),
    ("debug_dense", "pp 2 x dp 2, 4 micro-batches", {"pp": 2, "dp": 2, "microbatches": 4}),
    ("debug_moe", "dp 2 x ep 2", {"dp": 2, "ep": 2}),
]
BLOCKS, STEPS_PER_BLOCK, WARMUP, ROUNDS = 6, 3, 2, 6
OUT = ROOT / "benchmarks" / "results" / "collective_log.md"


def measure_layout(root: str, recipe: str, sizes: dict) -> None:
    from meshtron.config import load_config
    from meshtron.mesh import recipe_mesh
    from meshtron.parallel.layout import validate_layout
    from meshtron.train import Trainer

    layout = {"pp": 1, "dp": 1, "cp": 1, "ep": 1, "tp": 1, **sizes}
    args = [
        "--train.output_dir",
        f"{root}/{recipe}",
        "--data.cache_dir",
        f"{root}/cache",
        "--train.steps",
        str(WARMUP + 2 * BLOCKS * STEPS_PER_BLOCK),
    ]
    for key, value in layout.items():
        args += [f"--parallel.{key}", str(value)]
    cfg = load_config(ROOT / "recipes" / f"{recipe}.toml", args)
    validate_layout(cfg, dist.get_world_size())
    trainer = Trainer(cfg, recipe_mesh(cfg))
    step, times = 0, {"off": [], "on": []}
    for _ in range(WARMUP):
        trainer.train_step(step)
        step += 1
    issued = 0
    for block in range(2 * BLOCKS):
        mode = "on" if block % 2 else "off"
        (collective_log.install if mode == "on" else collective_log.uninstall)()
        for _ in range(STEPS_PER_BLOCK):
            dist.barrier()
            before, start = collective_log.LOG.issued, time.perf_counter()
            trainer.train_step(step)
            times[mode].append(time.perf_counter() - start)
            issued = collective_log.LOG.issued - before if mode == "on" else issued
            step += 1
    if dist.get_rank() == 0:
        Path(root, "result.json").write_text(json.dumps({"times": times, "collectives": issued}))


def _per_call_us(call, reps: int = 5000) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps * 1e6


def measure_calls(root: str) -> None:
    """One rank: the same scalar collective with and without the recording, alternating; the fastest
    of ROUNDS rounds of each (other processes only ever add time)."""
    x = torch.ones(())
    group = dist.new_group([0])
    calls = {
        "dist.all_reduce (blocking)": lambda: dist.all_reduce(x, group=group),
        "dist.all_reduce(async_op=True) + wait": lambda: dist.all_reduce(x, group=group, async_op=True).wait(),
        "funcol.all_reduce + wait": lambda: funcol.all_reduce(x, "sum", group).wait(),
    }
    rows = {}
    for name, call in calls.items():
        bare, recorded = [], []
        for _ in range(ROUNDS):
            collective_log.uninstall()
            bare.append(_per_call_us(call))
            collective_log.install()
            recorded.append(_per_call_us(call))
        rows[name] = (min(bare), min(recorded))
    Path(root, "calls.json").write_text(json.dumps(rows))


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        run_checks([measure_calls], 1, root)
        calls = json.loads(Path(root, "calls.json").read_text())
    worst_us = max(recorded - bare for bare, recorded in calls.values())
    rows = []
    for recipe, label, sizes in LAYOUTS:
        with tempfile.TemporaryDirectory() as root:
            run_checks([measure_layout], 4, root, recipe, sizes)
            result = json.loads(Path(root, "result.json").read_text())
        off, on = statistics.median(result["times"]["off"]), statistics.median(result["times"]["on"])
        rows.append((recipe, label, result["collectives"], off, on))
        print(rows[-1], flush=True)
    lines = [
        "# Cost of recording every collective (the hang report's log)",
        "",
        f"4 CPU ranks (gloo, 2 cores shared), torch {torch.__version__}; median of {BLOCKS * STEPS_PER_BLOCK} "
        f"steps with the recording off and of as many with it on, in alternating blocks of {STEPS_PER_BLOCK} "
        f"after {WARMUP} warm-up steps. Script: `benchmarks/collective_log.py`. The measured difference is",
        "mostly the machine's noise (other processes share its 2 cores); the bound is the collectives per step",
        f"times the costliest recorded call below ({worst_us:.1f} us), over the step time.",
        "",
        "| recipe | layout | collectives recorded per step | step off (ms) | step on (ms) | measured | bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for recipe, label, count, off, on in rows:
        bound = count * worst_us * 1e-6 / off
        lines.append(
            f"| {recipe} | {label} | {count} | {1e3 * off:.1f} | {1e3 * on:.1f} | "
            f"{100 * (on / off - 1):+.1f} % | {100 * bound:.2f} % |"
        )
    lines += [
        "",
        f"One scalar collective on a 1-rank gloo group (fastest of {ROUNDS} rounds of 5000 calls each way):",
        "",
        "| call | bare (us) | recorded (us) | recording adds (us) |",
        "|---|---|---|---|",
    ]
    for name, (bare, recorded) in calls.items():
        lines.append(f"| {name} | {bare:.1f} | {recorded:.1f} | {recorded - bare:.1f} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
