"""``benchmarks/step_cost.py``: its smoke run end to end, and the committed table recomputed from its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("step_cost", ROOT / "benchmarks" / "step_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _check_rows(bench, rows: list[dict]) -> None:
    """Each row's phases add up to its total and its sites to no more than its forward + backward; LocalAdamW
    steps with few calls per parameter (its own per-group set-up and one fused kernel per device and dtype) and
    fewer than torch's fused AdamW over DTensors; transformers runs no FSDP2 or DTensor code."""
    for row in rows:
        calls = row["python_calls"]
        assert sum(calls["by_phase"].values()) == calls["total"], row["run"]
        assert sum(calls["forward_backward_by_site"].values()) == calls["by_phase"]["forward + backward"], row["run"]
        assert min(row["cpu_seconds"]) > 0 and row["median_cpu_seconds"] <= max(row["cpu_seconds"])
    by_run = {(r["shape"], r["run"]): r for r in rows}
    for shape in {r["shape"] for r in rows}:
        ours, torch_adamw = by_run[shape, "meshtron trainer"], by_run[shape, "meshtron trainer, torch fused AdamW"]
        optimizer = ours["python_calls"]["by_phase"]["optimizer"]
        assert optimizer <= 16 * ours["parameters"] + 100, (shape, optimizer, ours["parameters"])
        assert optimizer < torch_adamw["python_calls"]["by_phase"]["optimizer"], shape
        theirs = by_run[shape, "transformers"]["python_calls"]["forward_backward_by_site"]
        assert theirs["data parallel"] == theirs["DTensor"] == 0, shape


def _check_device_rows(bench, rows: list[dict], configs: dict) -> None:
    """Sites add up to the totals; both steps' GEMM FLOPs are the analytic 6 x matmul parameters x tokens
    (``flops_per_token`` without its attention term) and their attention FLOPs agree: the same model math."""
    from meshtron.models import flops_per_token

    for row in rows:
        assert sum(row["kernels_by_site"].values()) == row["kernels"], row["run"]
        assert abs(sum(row["non_gemm_gb_by_site"].values()) - row["non_gemm_gb"]) < 1e-6 * row["non_gemm_gb"]
        analytic = flops_per_token(configs[row["shape"]], 0) * row["seq"] / 1e12
        assert abs(row["gemm_tflop"] - analytic) <= 1e-3 * analytic, (row["shape"], row["run"], analytic)
    theirs = bench.device_theirs(rows)
    for row in rows:
        assert row["attention_tflop"] == theirs[row["shape"]]["attention_tflop"] > 0, row["shape"]
        assert "data parallel" not in theirs[row["shape"]]["kernels_by_site"], row["shape"]


def test_step_cost_tiny_run(tmp_path):
    bench = _bench()
    text = bench.main(["--tiny", "--out", str(tmp_path / "cost")])
    assert "Smoke run" in text and (tmp_path / "cost.md").read_text() == text
    rows = json.loads((tmp_path / "cost.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["meshtron trainer", "meshtron trainer, torch fused AdamW", "transformers"]
    _check_rows(bench, rows)
    stored = json.loads((tmp_path / "cost.json").read_text())
    configs = bench.shapes(bench.parse_args(["--tiny"]))
    _check_device_rows(bench, stored["device_rows"], configs)


def test_stored_step_cost_table_is_its_json():
    bench = _bench()
    stored = json.loads((ROOT / "benchmarks" / "results" / "step_cost.json").read_text())
    table = (ROOT / "benchmarks" / "results" / "step_cost.md").read_text()
    rows = stored["rows"]
    assert {r["shape"] for r in rows} == {"Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B (8 of 28 layers)"}
    _check_rows(bench, rows)
    ratios = bench.ratios(rows)
    for row in rows:
        assert bench.table_line(row, ratios[row["shape"], row["run"]]) in table, (row["shape"], row["run"])
    device = stored["device_rows"]
    _check_device_rows(bench, device, bench.shapes(bench.parse_args([])))
    for row in device:
        assert bench.device_line(row, bench.device_theirs(device)[row["shape"]]) in table, (row["shape"], row["run"])
