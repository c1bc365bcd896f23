"""``benchmarks/cpu_step_vs_transformers.py --tiny`` runs end to end: the losses agree and the table is written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_step_benchmark_tiny_run(tmp_path):
    spec = importlib.util.spec_from_file_location("cpu_step", ROOT / "benchmarks" / "cpu_step_vs_transformers.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    text = bench.main(["--tiny", "--threads", "1", "--out", str(tmp_path / "step")])
    assert "Smoke run" in text and (tmp_path / "step.md").read_text() == text
    runs = json.loads((tmp_path / "step.json").read_text())["runs"]
    assert [run["dtype"] for run in runs] == ["float32", "bfloat16"]
    for run in runs:
        assert set(run["summary"]) == {"meshtron model", "meshtron trainer", "transformers"}
        assert max(run["loss_rel_diff"].values()) <= bench.TOLERANCE[run["dtype"]]
        for name, times in run["times"].items():
            assert len(times["wall"]) == len(times["cpu"]) == 2 and min(times["wall"]) > 0, name
        for name, row in run["summary"].items():
            assert row["min_wall"] <= row["median_wall"] and row["min_cpu"] <= row["median_cpu"], name
            # Each meshtron row's ratios are its own figures over transformers'.
            if name != "transformers":
                theirs = run["summary"]["transformers"]
                assert abs(row["ratio_median_wall"] * theirs["median_wall"] - row["median_wall"]) < 1e-9, name
    assert abs(runs[0]["first_step_loss"]["transformers"] - 5.5452) < 0.1  # ln(256): random weights and tokens
    assert f"| float32 | meshtron model | {runs[0]['summary']['meshtron model']['median_wall']:.3f} |" in text


def test_stored_table_is_its_own_steps_summarised():
    """benchmarks/results/cpu_step_vs_transformers.*: every median, min and ratio in the committed table is
    recomputed from the step times stored beside it, and the CPU it names is the one the JSON records."""
    spec = importlib.util.spec_from_file_location("cpu_step", ROOT / "benchmarks" / "cpu_step_vs_transformers.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stored = json.loads((ROOT / "benchmarks" / "results" / "cpu_step_vs_transformers.json").read_text())
    table = (ROOT / "benchmarks" / "results" / "cpu_step_vs_transformers.md").read_text()
    assert f"({stored['cpu']})" in table.splitlines()[0]
    for run in stored["runs"]:
        summary = bench.summarise(run["times"])
        assert summary == run["summary"], run["dtype"]
        assert all(len(t["wall"]) == int(stored["settings"]["steps"]) for t in run["times"].values())
        for name, row in summary.items():
            assert bench._row(run["dtype"], name, row) in table, (run["dtype"], name)
