"""Start-up cost of filling a sharded model with the initial weights: seconds and peak host RAM per rank.

A Qwen2.5-7B-width model (hidden 3584, intermediate 18944, vocab 152064, 28 query / 4 KV heads)
with its layers truncated is built on the meta device, parallelized (tp, FSDP over dp) and filled
by ``meshtron.parallel.runner.materialize_sharded`` on CPU ranks. Reported per rank (the busiest):
the seconds of that call and the peak resident set (``ru_maxrss``) before and after it.

    python benchmarks/sharded_init.py --label after     # adds/overwrites that row, rewrites the table

Each label's row is kept in ``benchmarks/results/sharded_init.json`` so a run of the old code
("before") and of the new one ("after") end up in one table.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from meshtron.mesh import build_mesh
from meshtron.models import build_model, count_parameters
from meshtron.parallel.runner import materialize_sharded, parallelize
from meshtron.testing import run_checks

RESULTS = Path(__file__).parent / "results"


def _config(layers: int, dp: int, tp: int) -> Config:
    model = ModelConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=layers,
        num_attention_heads=28,
        num_key_value_heads=4,
    )
    return Config(model=model, parallel=ParallelConfig(dp=dp, tp=tp), train=TrainConfig(seed=0))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(layers: int, dp: int, tp: int, out: str) -> None:
    cfg = _config(layers, dp, tp)
    mesh = build_mesh(dp=dp, tp=tp)
    with torch.device("meta"):
        model = build_model(cfg.model)
    parallelize(model, mesh, cfg)
    dist.barrier()
    rss_before = _peak_rss_mib()
    start, cpu = time.perf_counter(), _cpu_seconds()
    materialize_sharded(model, torch.device("cpu"), cfg)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    stats = torch.tensor([seconds, cpu, rss_before, _peak_rss_mib()], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        keys = ["seconds", "cpu_seconds", "rss_before_mib", "rss_peak_mib"]
        Path(out).write_text(json.dumps(dict(zip(keys, stats.tolist()))))


def _table(rows: dict) -> str:
    lines = [
        "# Sharded initialisation: Qwen2.5-7B width, truncated layers, CPU ranks",
        "",
        "Hidden 3584, intermediate 18944, vocab 152064, 28 / 4 heads; the embedding alone is",
        f"152064 x 3584 = {152064 * 3584 * 4 / 2**30:.2f} GiB in fp32. `materialize_sharded` on gloo ranks sharing the",
        "2-core development machine (one thread per rank) while other jobs ran, so wall seconds vary a",
        "lot from run to run; CPU seconds (user + system of the rank) are the comparable figure. Peak RSS",
        "is `ru_maxrss`; all columns are the busiest rank's. `before`: every rank draws every full parameter on CPU "
        "(`torch.randn` from a",
        "generator per parameter) and keeps its slice; `after`: every rank computes only its own slices",
        "(`meshtron/models/counter_rng.py`). The old code could not run on 8 ranks of this 23 GiB machine",
        "(each rank peaks at about twice the largest full parameter plus its shards), hence the 2-rank",
        "comparison. The fill's RSS cost beyond the rank's own shards (the last column, fp32, even split)",
        "is what initialisation adds: before, two full temporaries of the largest parameter; after, the",
        "bounded chunks of the counter-based generator (and FSDP's shard padding).",
        "",
        "| code | layout | layers | parameters | wall s | CPU s | peak RSS before the fill (MiB) | peak RSS after "
        "(MiB) | fill's RSS cost (MiB) | the rank's shards (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in rows.items():
        with torch.device("meta"):
            params = count_parameters(build_model(_config(r["layers"], r["dp"], r["tp"]).model))
        cost = r["rss_peak_mib"] - r["rss_before_mib"]
        lines.append(
            f"| {label} | dp {r['dp']} x tp {r['tp']} | {r['layers']} | {params / 1e9:.2f} B | {r['seconds']:.1f} | "
            f"{r['cpu_seconds']:.1f} | "
            f"{r['rss_before_mib']:.0f} | {r['rss_peak_mib']:.0f} | {cost:.0f} | "
            f"{params * 4 / (r['dp'] * r['tp']) / 2**20:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="row name, e.g. before / after")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    store = RESULTS / "sharded_init.json"
    rows = json.loads(store.read_text()) if store.exists() else {}
    out = RESULTS / "sharded_init.run.json"
    run_checks([measure], args.dp * args.tp, args.layers, args.dp, args.tp, str(out), timeout=900)
    rows[args.label] = {**json.loads(out.read_text()), "layers": args.layers, "dp": args.dp, "tp": args.tp}
    out.unlink()
    store.write_text(json.dumps(rows, indent=1) + "\n")
    table = _table(rows)
    (RESULTS / "sharded_init.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
