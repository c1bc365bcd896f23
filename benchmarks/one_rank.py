"""One-rank ``meshtron.train`` runs for the benchmarks that compare training settings (fp8_curves, loss_curves)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from meshtron.watch.plot import read_records

ROOT = Path(__file__).resolve().parent.parent


def one_rank_command(recipe: Path, *overrides: str) -> list[str]:
    """``torchrun --nproc_per_node 1 -m meshtron.train --recipe recipe [--section.key value ...]``."""
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
    return [*run, "-m", "meshtron.train", "--recipe", str(recipe), *overrides]


def train_one_rank(recipe: Path, out: Path, *overrides: str) -> list[dict]:
    """Train ``recipe`` on one rank into ``out`` (its output_dir); its metrics records."""
    command = one_rank_command(recipe, *overrides, "--train.output_dir", str(out))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return read_records(out)
