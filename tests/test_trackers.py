"""Experiment trackers (``[track]``, meshtron/watch/trackers.py): a one-rank debug run logged to Weights & Biases
(offline) and MLflow (its SQLite store) holds exactly the records of its ``metrics.jsonl``, read back through each
library's own schema and client, and a run resumed from its step-2 checkpoint continues the same two runs without
logging a step twice (the repeated steps keep what the trackers first received: the same losses). A tracker named
but not installed is refused before any process group exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from meshtron.config import ConfigError, infer_dp, load_config
from meshtron.testing import cached_recipe_mesh, documented_command, launch_checks, run_torchrun
from meshtron.watch.metrics import board_scalars
from meshtron.watch.trackers import RUN_IDS

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
TRACKED = ["--track.wandb", "true", "--track.mlflow", "true", "--track.tags", '["ci"]', "--track.run_name", "debug"]


def _overrides(out: Path) -> list[str]:
    return [
        "--train.steps",
        str(STEPS),
        "--train.log_every",
        "1",
        "--train.output_dir",
        str(out),
        "--checkpoint.every",
        "2",
        "--data.eval_source",
        "builtin",
        "--train.eval_every",
        "2",
        "--train.eval_steps",
        "1",
        *TRACKED,
    ]


def _train(out: Path, extra: list[str] = ()) -> None:
    from meshtron.parallel.layout import validate_layout
    from meshtron.train import Trainer

    cfg = infer_dp(load_config(ROOT / "recipes" / "debug_dense.toml", _overrides(out) + list(extra)), 1)
    validate_layout(cfg, torch.distributed.get_world_size())
    Trainer(cfg, cached_recipe_mesh(cfg)).fit()


def train_then_resume(root: str) -> None:
    """The run, its ids and records kept; then the step-4 checkpoint removed and the run resumed from step 2."""
    out = Path(root) / "run"
    _train(out)
    shutil.copy(out / RUN_IDS, Path(root) / "first_ids.json")
    shutil.copy(out / "metrics.jsonl", Path(root) / "first_metrics.jsonl")
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:08d}")
    _train(out, ["--checkpoint.resume", "true"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracked")
    launch_checks([train_then_resume], 1, str(root), timeout=300).raise_first()
    return root


def _scalars(metrics: Path) -> dict[tuple[str, int], float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return {(tag, r["step"]): value for r in records for tag, value in board_scalars(r).items()}


def _check_logged(logged: dict[tuple[str, int], float], root: Path) -> None:
    """The trackers hold the uninterrupted run's records exactly; steps 3 and 4, repeated by the resumed run,
    keep what they first received: the same losses, learning rates, gradient norms and evaluations (a resume is
    exact), the first attempt's timings."""
    assert logged == _scalars(root / "first_metrics.jsonl")
    resumed = _scalars(root / "run" / "metrics.jsonl")
    same = {k: v for k, v in resumed.items() if not k[0].startswith("perf/")}
    assert same and {k: logged[k] for k in same} == same


def test_a_resumed_run_continues_the_same_runs(run):
    first = json.loads((run / "first_ids.json").read_text())
    now = json.loads((run / "run" / RUN_IDS).read_text())
    assert now == {**first, "logged_through": STEPS} and first["logged_through"] == STEPS, (first, now)


def test_mlflow_holds_the_records_of_metrics_jsonl(run):
    from mlflow.tracking import MlflowClient

    out = run / "run"
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    ident = json.loads((out / RUN_IDS).read_text())["mlflow"]
    held = client.get_run(ident)
    assert held.info.run_name == "debug" and "ci" in held.data.tags
    assert held.data.params["train.steps"] == str(STEPS) and held.data.params["model.hidden_size"] == "64"
    logged = {}
    for key in held.data.metrics:
        for metric in client.get_metric_history(ident, key):
            assert (key, metric.step) not in logged, f"{key} logged twice at step {metric.step}"
            logged[(key, metric.step)] = metric.value
    _check_logged(logged, run)


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B run file: a 7-byte header, then LevelDB's log format (32 KiB blocks of chunks:
    crc32c, length, type; types 1 full, 2 first, 3 middle, 4 last), each record a serialized protobuf."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def test_wandb_offline_runs_hold_the_records_of_metrics_jsonl(run):
    from wandb.proto import wandb_internal_pb2

    out = run / "run"
    ident = json.loads((out / RUN_IDS).read_text())["wandb"]
    files = sorted((out / "wandb").glob(f"offline-run-*-{ident}/run-{ident}.wandb"))
    assert len(files) == 2, files  # the first run and its resumption, one id
    logged, config = {}, {}
    for path in files:
        for data in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                step = items.pop("_step")
                for key, value in items.items():
                    if not key.startswith("_"):
                        assert (key, step) not in logged, f"{key} logged twice at step {step}"
                        logged[(key, step)] = value
            elif kind in ("run", "config"):  # the config comes with the run record, updates after it
                updates = record.run.config.update if kind == "run" else record.config.update
                config.update({i.key: json.loads(i.value_json) for i in updates})
    _check_logged(logged, run)
    assert config["train"]["steps"] == STEPS and config["model"]["hidden_size"] == 64, config


def test_a_tracker_not_installed_is_refused_before_any_process_group(monkeypatch):
    import importlib.util

    from meshtron.train import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = load_config(ROOT / "recipes" / "debug_dense.toml", ["--track.mlflow", "true"])
    with pytest.raises(ConfigError, match=r"^\[track\] mlflow = true needs the mlflow package: pip install "):
        preflight(cfg)
    with pytest.raises(ConfigError, match=r"\[track\] wandb_mode must be one of"):
        load_config(ROOT / "recipes" / "debug_dense.toml", ["--track.wandb_mode", "cloud"])


def test_the_documented_command_tracks_a_run(tmp_path):
    """docs/training.md's 'Trackers' command, as typed, with its output folder under a temporary one."""

    from mlflow.tracking import MlflowClient

    command = documented_command(ROOT / "docs" / "training.md", "Trackers", "torchrun")
    done = run_torchrun([arg.replace("runs/t", str(tmp_path / "t")) for arg in command], ROOT, {"WANDB_SILENT": "true"})
    ids = json.loads((tmp_path / "t" / RUN_IDS).read_text())
    assert f"wandb: new run {ids['wandb']}" in done.stdout and f"mlflow: new run {ids['mlflow']}" in done.stdout
    client = MlflowClient(f"sqlite:///{tmp_path / 't' / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "train/loss")] == [1, 2]
    assert "debug" in client.get_run(ids["mlflow"]).data.tags
