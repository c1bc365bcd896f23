"""``benchmarks/mfu.py --tiny`` runs end to end here (the real shapes need a GPU)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from meshtron import env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.full
def test_mfu_benchmark_tiny_run(tmp_path):
    spec = importlib.util.spec_from_file_location("mfu", ROOT / "benchmarks" / "mfu.py")
    mfu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mfu)
    profile = tmp_path / "profile.txt"
    text = mfu.main(
        [
            "--tiny",
            "--modes",
            "eager",
            "compiled",
            "--out",
            str(tmp_path / "mfu"),
            "--profile",
            str(profile),
            "--fsdp-gather",
            "per_step",
        ]
    )
    assert ("CPU smoke run" in text) == (env.device_type() != "cuda")
    assert "fsdp_gather per_step" in text
    rows = json.loads((tmp_path / "mfu.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["meshtron eager", "meshtron compiled", "transformers"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu_measured"] < 1, row
        assert 4 < row["last_loss"] < 8, row  # near ln(512) = 6.2: random weights, random tokens
    assert rows[0]["predicted_memory_gib"] > 0 and rows[0]["speedup"] > 0
    assert (tmp_path / "mfu.md").read_text() == text
    labels = re.findall(r"^## (.+): wall [0-9.]+ s", profile.read_text(), re.MULTILINE)
    assert labels == [f"tiny (hidden 128, 2 layers) {r['impl']}" for r in rows]


@pytest.mark.full
def test_mfu_benchmark_tiny_fp8_run(tmp_path):
    """``benchmarks/mfu.py --tiny --fp8 tensorwise``, as docs/benchmarks.md gives it: meshtron's runs train
    with ``[train] fp8`` and are labelled so."""
    pytest.importorskip("torchao")
    spec = importlib.util.spec_from_file_location("mfu", ROOT / "benchmarks" / "mfu.py")
    mfu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mfu)
    mfu.main(["--tiny", "--fp8", "tensorwise", "--modes", "compiled", "--out", str(tmp_path / "mfu")])
    rows = json.loads((tmp_path / "mfu.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["meshtron compiled fp8 tensorwise", "transformers"]
    assert 4 < rows[0]["last_loss"] < 8 and rows[0]["tokens_per_s"] > 0, rows[0]


def test_gemm_roofline_tiny_run(tmp_path):
    """``benchmarks/gemm_roofline.py --tiny``: each row's rate is its 2 m n k FLOPs over its time, and the
    planner's rate never exceeds the H100's datasheet peak."""
    spec = importlib.util.spec_from_file_location("gemm_roofline", ROOT / "benchmarks" / "gemm_roofline.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--tiny", "--iters", "2", "--out", str(tmp_path / "roofline")])
    result = json.loads((tmp_path / "roofline.json").read_text())
    assert [(r["m"], r["n"], r["k"]) for r in result["gemms"]] == [(256, 256, 256), (512, 128, 256), (128, 256, 512)]
    for row in result["gemms"]:
        assert 0 < row["planned_tflops"] <= 989 and row["ratio"] == row["measured_tflops"] / row["planned_tflops"]
    assert "| tiny | wgrad | bf16 | 128 | 256 | 512 |" in (tmp_path / "roofline.md").read_text()
    # The shapes a GPU run times: every distinct layer-0 GEMM of the listed models, forward and both gradients.
    shapes = bench.distinct_gemms(4096)
    assert len({(g.m, g.n, g.k) for _, _, g in shapes}) == len(shapes) and {k for _, k, _ in shapes} == {
        "fwd",
        "dgrad",
        "wgrad",
    }


def test_datasheet_peaks_name_the_card():
    from meshtron.watch.metrics import datasheet_peak_flops

    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert datasheet_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert datasheet_peak_flops("NVIDIA H200") == 989e12
    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) is None
    assert datasheet_peak_flops("NVIDIA GeForce RTX 4090") is None
