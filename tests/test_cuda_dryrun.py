"""The dry run on fake CUDA devices (``MESHTRON_DEVICE=cuda python -m meshtron.train --dry-run N``).

It needs a CUDA build of torch, which the project's own environment never holds (the README installs
the CPU wheel): these tests run the CUDA environment's python as a subprocess where one exists
(``MESHTRON_CUDA_VENV``, default ``~/.cache/meshtron/venv-cuda``, made by benchmarks/cuda_dry_run.sh)
and skip with the reason otherwise. What the CPU build can check runs everywhere: its one-line refusal.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("MESHTRON_CUDA_VENV", Path.home() / ".cache" / "meshtron" / "venv-cuda"))
PYTHON = VENV / "bin" / "python"


def _cuda_python_missing() -> str | None:
    """Why the CUDA dry run cannot run here, or None."""
    if not PYTHON.exists():
        return f"no CUDA environment at {VENV} (benchmarks/cuda_dry_run.sh makes one; MESHTRON_CUDA_VENV names another)"
    probe = subprocess.run([str(PYTHON), "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True)
    if probe.returncode or probe.stdout.strip() in ("", "None"):
        return f"{PYTHON} has no CUDA build of torch: {probe.stdout.strip() or probe.stderr.strip()[-200:]}"
    return None


needs_cuda_python = pytest.mark.skipif(_cuda_python_missing() is not None, reason=str(_cuda_python_missing()))


def cuda_dry_run(*args: str) -> dict:
    """The ``--json`` report of a dry run on fake CUDA devices, run by the CUDA environment's python."""
    done = subprocess.run([str(PYTHON), "-m", "meshtron.train", "--json", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "MESHTRON_DEVICE": "cuda", "PYTHONPATH": str(ROOT)},
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build: it has nothing to refuse")
def test_a_cpu_build_refuses_a_cuda_dry_run(capsys, monkeypatch):
    """With the CPU wheel, MESHTRON_DEVICE=cuda gets one line saying what to install, before anything is traced."""
    from meshtron.train import main

    monkeypatch.setenv("MESHTRON_DEVICE", "cuda")
    assert main(["--recipe", "recipes/debug_dense.toml", "--dry-run", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtron: a dry run on CUDA (MESHTRON_DEVICE=cuda) needs a CUDA build of torch") and \
        "pip install torch==" in err and err.count("\n") == 1, err


@needs_cuda_python
def test_shipped_recipe_traces_on_fake_cuda():
    """Qwen2.5-0.5B at its stated 8 GPUs (FSDP over 8, 2 micro-batches) on fake ``cuda:0``: FSDP2's streams
    and events, the device guard and SDPA's kernel choice answered by the stand-ins; within 5 % of the plan
    (45.16 GiB traced, 46.38 planned: the CPU trace's figures) and the bytes sent equal to it; every collective
    on ``cuda:0`` as NCCL takes it (the dry run refuses any other) and no host sync."""
    report = cuda_dry_run("--recipe", "recipes/qwen2p5_0p5b.toml", "--dry-run", "8")
    (rank,) = report["ranks"]
    assert 0.95 <= rank["ratio"] <= 1.05 and rank["host_syncs"] == {}, rank
    for key, sent in rank["comm_bytes"].items():
        assert abs(sent["traced"] - sent["planned"]) <= 64, (key, sent)
