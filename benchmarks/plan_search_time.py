"""How long `python -m meshtron.plan` takes to answer (issue 43 item 3: within a minute for any GPU count up
to 16,384 on two CPU cores).

Each case runs the command as typed, in a process of its own, and records its wall time and its CPU time
(user + system, from ``getrusage`` of the finished child): on a machine shared with other jobs the wall time
grows with the load, the CPU time much less, so the CPU time stands for what an unloaded core would take.
The load average at each start is recorded too.

Cases: a Llama-3.1-405B-sized model (hidden 16,384, 126 layers, 128 heads, 8 KV heads, FFN 53,248,
vocabulary 128,256, sequence 8,192, untied, no attention bias) with Llama 3's batch of 2,048 sequences
(16M tokens), set on the 7B recipe by ``--model.*`` / ``--train.*`` flags, at 8 to 16,384 GPUs; and every
shipped recipe at 8, 1,024 and 16,384 GPUs.

    PYTHONPATH=. python benchmarks/plan_search_time.py [--only 405b|recipes]

Writes benchmarks/results/plan_search_time.md.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "plan_search_time.md"
LLAMA_405B = {
    "model.vocab_size": 128256,
    "model.hidden_size": 16384,
    "model.intermediate_size": 53248,
    "model.num_hidden_layers": 126,
    "model.num_attention_heads": 128,
    "model.num_key_value_heads": 8,
    "model.attention_bias": "false",
    "model.tie_word_embeddings": "false",
    "model.max_position_embeddings": 8192,
    "train.seq_len": 8192,
    "train.global_batch_size": 2048,
}
GPUS_405B = (8, 64, 512, 1024, 4096, 8192, 16384)
GPUS_RECIPES = (8, 1024, 16384)


def command(recipe: str, gpus: int, overrides: dict) -> list[str]:
    flags = [f"--{key}={value}" for key, value in overrides.items()]
    return [sys.executable, "-m", "meshtron.plan", "--recipe", recipe, "--gpus", str(gpus), *flags]


def timed(cmd: list[str]) -> tuple[float, float, float, str]:
    """(wall s, CPU s, load average at start, the first ranked row) of one run of ``cmd``."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    ).stdout
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    first = next((line.strip() for line in out.splitlines() if line.strip().startswith("1  ")), "")
    return wall, cpu, load, " ".join(first.split()[1:])


def cases(only: str | None) -> list[tuple[str, str, int, dict]]:
    out = []
    if only in (None, "405b"):
        out += [
            ("Llama-3.1-405B shape, batch 2,048 x 8,192", "recipes/qwen2p5_7b.toml", gpus, LLAMA_405B)
            for gpus in GPUS_405B
        ]
    if only in (None, "recipes"):
        out += [
            (path.stem, f"recipes/{path.name}", gpus, {})
            for path in sorted((ROOT / "recipes").glob("*.toml"))
            for gpus in GPUS_RECIPES
        ]
    return out


def main(argv: list[str]) -> None:
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    rows = ["| model | GPUs | wall s | CPU s | load average | first layout |", "|---|---:|---:|---:|---:|---|"]
    for label, recipe, gpus, overrides in cases(only):
        wall, cpu, load, first = timed(command(recipe, gpus, overrides))
        rows.append(f"| {label} | {gpus:,} | {wall:.1f} | {cpu:.1f} | {load:.1f} | {first} |")
        print(rows[-1], flush=True)
    OUT.write_text(
        "\n".join(
            [
                "# `python -m meshtron.plan`: time to answer",
                "",
                "`benchmarks/plan_search_time.py`: each case is the command as typed, in its own process; CPU s is the",
                "process's user + system time. The machine (2 cores) was shared with other jobs (the load average at",
                "each start is given): the wall time grows with the load, the CPU time much less and stands for an",
                "unloaded core. The target is an answer within 60 s.",
                "",
                *rows,
                "",
            ]
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
