"""``python -m meshtron.watch.plot runs/X [runs/Y ...] [-o curves.png]``: loss, eval loss and throughput
curves of one or more runs (their ``metrics.jsonl``) in one PNG, one line per run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshtron.extras import MissingExtra, require

# (record key, panel title) per panel, left to right.
PANELS = (("loss", "training loss"), ("eval_loss", "eval loss"), ("tokens_per_sec", "tokens / s"))


def read_records(run: str | Path) -> list[dict]:
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run} has no metrics.jsonl; pass the train.output_dir of a run")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have ``key``."""
    kept = [r for r in records if r.get(key) is not None]
    return [r["step"] for r in kept], [r[key] for r in kept]


def draw(runs: list[str | Path]):
    """A matplotlib figure with one panel per entry of ``PANELS`` and one line per run."""
    matplotlib = require("matplotlib", "python -m meshtron.watch.plot")
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.8), constrained_layout=True)
    for run in runs:
        records = read_records(run)
        for ax, (key, _) in zip(axes, PANELS):
            steps, values = series(records, key)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=Path(run).name)
    for ax, (key, title) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, f"no '{key}' in these runs", ha="center", va="center", transform=ax.transAxes)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshtron.watch.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (train.output_dir) holding metrics.jsonl")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG to write (default: curves.png)")
    args = parser.parse_args(argv)
    try:
        fig = draw(args.runs)
    except (FileNotFoundError, MissingExtra) as err:
        print(f"meshtron.watch.plot: {err}", file=sys.stderr)
        return 2
    fig.savefig(args.output, dpi=120)
    print(f"meshtron.watch.plot: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
