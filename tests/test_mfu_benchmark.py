"""``benchmarks/mfu.py --tiny`` runs end to end here (the real shapes need a GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from meshtron import env

ROOT = Path(__file__).resolve().parents[1]


def test_mfu_benchmark_tiny_run(tmp_path):
    spec = importlib.util.spec_from_file_location("mfu", ROOT / "benchmarks" / "mfu.py")
    mfu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mfu)
    text = mfu.main(["--tiny", "--modes", "eager", "compiled", "--out", str(tmp_path / "mfu")])
    assert ("CPU smoke run" in text) == (env.device_type() != "cuda")
    rows = json.loads((tmp_path / "mfu.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["meshtron eager", "meshtron compiled", "transformers"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu_measured"] < 1, row
        assert 4 < row["last_loss"] < 8, row  # near ln(512) = 6.2: random weights, random tokens
    assert rows[0]["predicted_memory_gib"] > 0 and rows[0]["speedup"] > 0
    assert (tmp_path / "mfu.md").read_text() == text


def test_datasheet_peaks_name_the_card():
    from meshtron.metrics import datasheet_peak_flops

    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert datasheet_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert datasheet_peak_flops("NVIDIA H200") == 989e12
    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) is None
    assert datasheet_peak_flops("NVIDIA GeForce RTX 4090") is None
