"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases and MLflow, opened on rank 0 by ``[track]``.

Each tracker receives every record as the scalars TensorBoard gets (:func:`meshtron.watch.metrics.board_scalars`),
at the record's step; the resolved recipe is the run's config (W&B) or parameters (MLflow). Run ids are kept in
``<output_dir>/trackers.json``, so a resumed run continues its runs. See docs/training.md, 'Trackers'.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from meshtron.extras import require

RUN_IDS = "trackers.json"
_MLFLOW_PARAMS_PER_BATCH = 100  # MLflow's limit on parameters in one log_batch request


class Tracker(Protocol):
    name: str
    run_id: str
    where: str  # the run's place, printed at start-up

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class Trackers:
    """The trackers ``[track]`` turns on, each with a new run, or, ``resumed`` from a checkpoint, the run
    ``trackers.json`` names (ids printed at start-up). A resumed run repeats the steps since its checkpoint:
    those a tracker already holds (``logged_through``, kept in ``trackers.json``) are not logged again, so
    each step is there once, as in ``metrics.jsonl``."""

    def __init__(self, track: Any, output_dir: str, recipe: dict[str, Any], resumed: bool):
        """``track``: the recipe's ``[track]`` section; ``recipe``: the whole recipe, resolved, as plain dicts."""
        self.path = Path(output_dir) / RUN_IDS
        saved = json.loads(self.path.read_text()) if resumed and self.path.is_file() else {}
        name = track.run_name or Path(output_dir).resolve().name
        self.trackers: list[Tracker] = []
        if track.wandb:
            self.trackers.append(WandbTracker(track, output_dir, recipe, name, saved.get("wandb")))
        if track.mlflow:
            self.trackers.append(MlflowTracker(track, output_dir, recipe, name, saved.get("mlflow")))
        self.logged_through = saved.get("logged_through", 0)
        for t in self.trackers:
            print(f"{t.name}: {'continuing' if t.name in saved else 'new'} run {t.run_id} ({t.where})", flush=True)
        self._save()

    def log(self, scalars: dict[str, float], step: int) -> None:
        if not self.trackers or step <= self.logged_through:
            return
        for t in self.trackers:
            t.log(scalars, step)
        self.logged_through = step
        self._save()

    def close(self) -> None:
        for t in self.trackers:
            t.close()

    def _save(self) -> None:
        if self.trackers:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            ids = {t.name: t.run_id for t in self.trackers}
            self.path.write_text(json.dumps({**ids, "logged_through": self.logged_through}, indent=2) + "\n")


class WandbTracker:
    """A W&B run (offline: written under ``<output_dir>/wandb`` for ``wandb sync``)."""

    name = "wandb"

    def __init__(self, t: Any, output_dir: str, recipe: dict[str, Any], run_name: str, run_id: str | None):
        wandb = require("wandb", "[track] wandb = true")
        self.run = wandb.init(
            project=t.project,
            name=run_name,
            tags=t.tags or None,
            config=recipe,
            dir=output_dir,
            mode=t.wandb_mode,
            id=run_id,
            resume="allow",
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.run_id = self.run.id
        self.where = self.run.url if t.wandb_mode == "online" else str(Path(self.run.dir).parent)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run in ``[track] mlflow_uri`` (default: a SQLite store in the output folder)."""

    name = "mlflow"

    def __init__(self, t: Any, output_dir: str, recipe: dict[str, Any], run_name: str, run_id: str | None):
        mlflow = require("mlflow", "[track] mlflow = true")
        from mlflow.entities import Param

        uri = t.mlflow_uri or f"sqlite:///{(Path(output_dir) / 'mlflow.db').resolve()}"
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.client = mlflow.tracking.MlflowClient(uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(t.project)
            ident = experiment.experiment_id if experiment else self.client.create_experiment(t.project)
            run_id = self.client.create_run(ident, run_name=run_name, tags=dict.fromkeys(t.tags, "")).info.run_id
            params = [Param(key, str(value)) for key, value in _flat(recipe).items()]
            for start in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
                self.client.log_batch(run_id, params=params[start : start + _MLFLOW_PARAMS_PER_BATCH])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.where = uri

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-3}}`` -> ``{"train.lr": 1e-3}``: MLflow parameters are flat."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


__all__ = ["RUN_IDS", "MlflowTracker", "Tracker", "Trackers", "WandbTracker"]
