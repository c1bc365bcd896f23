"""Reading and writing HuggingFace model folders (config.json + safetensors, single or sharded)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from meshtron.config import ModelConfig
from meshtron.hf.convert import from_hf, hf_config_dict, layer_of, model_config_from_hf, to_hf

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """An HF folder or checkpoint file is missing, truncated or does not match the model."""


def read_hf_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: pass a folder written by save_pretrained (config.json + safetensors)."
        )
    try:
        return model_config_from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); re-export the checkpoint.") from None
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None


def weight_map(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index of a sharded folder or the single file."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            entries = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index ({err}).") from None
        files = {name: folder / file for name, file in entries.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise CheckpointError(f"{index} lists {missing[0]}, which does not exist; the download is incomplete.")
        return files
    single = folder / SINGLE_NAME
    if not single.is_file():
        raise CheckpointError(f"{folder} has neither {SINGLE_NAME} nor {INDEX_NAME}: not a safetensors HF folder.")
    with open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def check_hf_files(folder: str | Path) -> None:
    """Open every safetensors header of an HF folder: a missing or truncated file fails here, cheaply."""
    for path in sorted(set(weight_map(folder).values())):
        with open_safetensors(path):
            pass


def open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path} is unreadable or truncated ({err}); re-download or re-export it.") from None


def read_tensors(files: dict[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only ``names`` from their files (each file opened once; safetensors maps lazily)."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for path, wanted in by_file.items():
        with open_safetensors(path) as f:
            for name in wanted:
                try:
                    out[name] = f.get_tensor(name)
                except (SafetensorError, OSError) as err:
                    raise CheckpointError(f"{path}: cannot read tensor {name} ({err}); the file is corrupt.") from None
    return out


def load_hf_state_dict(folder: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole checkpoint converted to meshtron names."""
    files = weight_map(folder)
    return from_hf(read_tensors(files, files), cfg)


def load_hf_model(folder: str | Path, device: torch.device | str = "cpu"):
    """A meshtron model with the weights of an HF Qwen2 / Qwen2-MoE folder (unparallelized)."""
    from meshtron.models import build_model

    cfg = read_hf_config(folder)
    with torch.device("meta"):
        model = build_model(cfg)
    state = load_hf_state_dict(folder, cfg)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    _check_keys(folder, expected, set(state))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.to(device)


def _check_keys(folder, expected: set[str], found: set[str]) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(
            f"{folder} does not match its config.json: {detail} ({len(missing)} missing, "
            f"{len(unexpected)} unexpected). Check that the folder and recipe describe the same model."
        )


def save_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig, folder: str | Path, max_shard_bytes: int = 2 << 30
) -> None:
    """Write an HF folder that ``from_pretrained`` loads; sharded with an index above ``max_shard_bytes``.
    Qwen2's checkpoints have no place for multi-token prediction modules: they are left out, said on stdout."""
    if cfg.num_nextn_predict_layers:
        mtp = cfg.mtp_layers
        print(
            f"meshtron: HF export drops the {len(mtp)} multi-token prediction modules (layers {mtp[0]}..{mtp[-1]}): "
            "Qwen2 checkpoints have no place for them; the meshtron checkpoint keeps them.",
            flush=True,
        )
        state = {name: t for name, t in state.items() if layer_of(name) not in mtp}
    write_safetensors_folder(to_hf(state, cfg), hf_config_dict(cfg), folder, max_shard_bytes)


def write_safetensors_folder(
    tensors: dict[str, torch.Tensor], config: dict, folder: str | Path, max_shard_bytes: int = 2 << 30
) -> None:
    """config.json + safetensors (HF names), sharded with an index above ``max_shard_bytes``.

    Written into a temporary folder beside the target and renamed, so an interrupted export never
    leaves a half-written folder under the final name.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        shards = _shard(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_NAME), metadata={"format": "pt"})
        else:
            index = {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                "weight_map": {},
            }
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                index["weight_map"].update(dict.fromkeys(shard, name))
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        old = folder.with_name(f".{folder.name}.replaced") if folder.exists() else None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards
