"""``benchmarks/mfu.py --tiny`` runs end to end here (the real shapes need a GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from meshtron import env

ROOT = Path(__file__).resolve().parents[1]


def test_mfu_benchmark_tiny_run(tmp_path):
    spec = importlib.util.spec_from_file_location("mfu", ROOT / "benchmarks" / "mfu.py")
    mfu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mfu)
    text = mfu.main(["--tiny", "--out", str(tmp_path / "mfu")])
    assert ("CPU smoke run" in text) == (env.device_type() != "cuda")
    (row,) = json.loads((tmp_path / "mfu.json").read_text())["rows"]
    for impl in ("meshtron", "transformers"):
        assert row[impl]["tokens_per_s"] > 0 and 0 < row[impl]["mfu"] < 1, row
        assert 4 < row[impl]["last_loss"] < 8, row  # near ln(512) = 6.2: random weights, random tokens
    assert (tmp_path / "mfu.md").read_text() == text
