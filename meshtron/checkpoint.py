"""Distributed checkpoints (DCP) written atomically, resumable on any parallel layout.

A checkpoint is written to a temporary folder and renamed only after every rank finished, with rank 0's
``meshtron.json`` last as the completeness marker, so a crash mid-save never touches the previous checkpoint
(asynchronous saves too: :class:`CheckpointWriter`). DCP stores tensors by global name and shape, so a checkpoint
reshards onto any layout. See docs/training.md (step 8) and docs/failures.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from meshtron.config import Config, ModelConfig, model_differences
from meshtron.torch_private import compute_local_shape_and_global_offset

MARKER = "meshtron.json"
# Optimizer state and param-group hyperparameters keyed by parameter name: pipeline stages hold
# different parameters, and DCP would otherwise merge every rank's positional param-group lists
# into one (a stage would load another stage's groups and lose its hyperparameters).
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointMismatch(ValueError):
    """A checkpoint exists but cannot be used for this run (other model shape, incomplete files)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """Newest ``step-*`` folder that has its completeness marker; temp or partial folders are ignored."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return max(complete, key=lambda p: p.name, default=None)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointWriter:
    """Writes the checkpoints of one run into ``root`` and keeps the newest ``keep`` complete ones
    (0: all). Every method is collective: every rank calls it at the same point of the run.

    ``async_save``: DCP's asynchronous save copies the state to host memory and returns; a background
    thread writes the shards while training goes on. The checkpoint is completed (marker, rename,
    pruning) by the next ``save`` or by ``wait``, once every rank's write has finished, so a run that
    dies mid-write leaves only the temp folder (deleted by the next run's first commit) and the
    previous checkpoint stays the latest.
    """

    def __init__(self, root: str | Path, keep: int = 0, async_save: bool = False):
        self.root, self.keep, self.async_save = Path(root), keep, async_save
        # The background write coordinates the ranks on a group of its own, so its collectives never
        # interleave with the training's on the default group (gloo: the staged copies are on the CPU).
        self._group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self._pending: tuple[Any, Path, Path, dict[str, Any]] | None = None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: Config,
        train_state: dict[str, Any],
    ) -> None:
        """Checkpoint ``step``; ``train_state`` must be JSON-serialisable (scheduler, data)."""
        self.wait()  # one save in flight at a time
        final = step_dir(self.root, step)
        tmp = final.with_name(f".{final.name}.tmp")
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of the same step
            tmp.mkdir(parents=True)
        _barrier()
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM),
        }
        torch.save(_rng_state(), tmp / f"rank-{_rank()}.pt")
        marker = {"step": step, "config": dataclasses.asdict(cfg), "train_state": train_state}
        if self.async_save:
            self._pending = (
                dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group),
                tmp,
                final,
                marker,
            )
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._commit(tmp, final, marker)

    def wait(self) -> None:
        """Complete the asynchronous save in flight, if any (waits for its writes on this rank)."""
        if self._pending is None:
            return
        future, tmp, final, marker = self._pending
        self._pending = None
        future.result()
        self._commit(tmp, final, marker)

    def _commit(self, tmp: Path, final: Path, marker: dict[str, Any]) -> None:
        """Once every rank has written its files: the marker, the rename, then the pruning, so no
        moment exists without a complete checkpoint, and the new one is never pruned (keep >= 1)."""
        _barrier()
        if _rank() == 0:
            (tmp / MARKER).write_text(json.dumps(marker, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _prune(self.root, self.keep, final)
        _barrier()


def _prune(root: Path, keep: int, committed: Path) -> None:
    """Delete the temp folders of saves that a crash cut short (none of this run's is in flight: one
    save at a time, and it was just committed), then all but the newest ``keep`` complete checkpoints,
    the one just committed always among those kept (a folder reused without resume may hold newer
    steps of an older run)."""
    for stale in root.glob(".step-*.tmp"):
        shutil.rmtree(stale)
    if keep <= 0:
        return
    complete = (p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file())
    others = sorted(p for p in complete if p != committed)
    for old in others[: len(others) - (keep - 1)]:
        shutil.rmtree(old)


def read_marker(path: str | Path) -> dict[str, Any]:
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise CheckpointMismatch(
            f"{path} has no {MARKER}: it is incomplete (a save was interrupted); use an older step."
        )
    return json.loads(marker.read_text())


def check_model_shape(saved: dict[str, Any], model_cfg: ModelConfig, path: str | Path) -> None:
    """Raise before any tensor is read when the checkpoint was written for another model shape."""
    details = model_differences(model_cfg, saved["config"]["model"], "checkpoint", ignore=("router_aux_loss_coef",))
    if details:
        raise CheckpointMismatch(
            f"{path} was saved for a different model ({details}). Point checkpoint.dir elsewhere or fix [model]."
        )


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Config
) -> dict[str, Any]:
    """Load into an already parallelized model/optimizer (any layout); returns the saved marker."""
    saved = read_marker(path)
    check_model_shape(saved, cfg.model, path)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM)
    rng = Path(path) / f"rank-{_rank()}.pt"
    if rng.is_file():  # absent when resuming on more ranks than saved: those ranks keep their seed
        _set_rng_state(torch.load(rng, weights_only=False))
    return saved


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy full (unsharded) tensors into a possibly sharded model without any communication.

    Each rank holds the full tensors and keeps only its own slice (``src_data_rank=None``), so this
    is exact and cannot hang. Only the keys this rank's model has (its pipeline stage) are needed.
    """
    own = model.state_dict()
    sources = {k: _source_name(model, full, k) for k in own}
    missing = [k for k, src in sources.items() if src is None]
    if strict and missing:
        raise KeyError(f"state dict lacks {missing[:3]} ({len(missing)} keys missing)")
    for name, param in own.items():
        if sources[name] is None:
            continue
        src = full[sources[name]]
        if tuple(src.shape) != tuple(param.shape):
            raise CheckpointMismatch(f"{name}: source shape {tuple(src.shape)} != model shape {tuple(param.shape)}")
        if isinstance(param, DTensor):
            local = distribute_tensor(src.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(src)


@torch.no_grad()
def fill_local_slices(model: torch.nn.Module, init) -> None:
    """Fill every parameter and buffer of a possibly sharded model with ``init.fill_(name, block,
    offsets)`` (e.g. :class:`meshtron.models.InitialWeights`), without any communication.

    Each rank passes only its own shard of a DTensor (with the shard's offsets in the global tensor,
    as DCP computes them for any placements, uneven or nested), so it computes only its slices, on
    the device they live on, and never allocates a full tensor.
    """
    for name, tensor in model.state_dict().items():
        offsets = (0,) * tensor.ndim
        if isinstance(tensor, DTensor):
            shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
            tensor = tensor.to_local()
            assert tuple(tensor.shape) == tuple(shape), (name, tuple(tensor.shape), shape)
        init.fill_(name, tensor, offsets)


def _source_name(model: torch.nn.Module, full, name: str) -> str | None:
    """Key of ``full`` that fills ``name``: itself, or the embedding for a tied LM head that sits on
    another pipeline stage than the embedding (HF folders store the shared weight once)."""
    if name in full:
        return name
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and name == "lm_head.weight" and "embed_tokens.weight" in full:
        return "embed_tokens.weight"
    return None


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's parameters on CPU (collective over each parameter's mesh)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
