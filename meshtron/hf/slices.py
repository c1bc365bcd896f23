"""Reading only this rank's slice of every tensor of a safetensors HF folder into sharded parameters.

Each parameter's global index range follows from its DTensor placements and ``safe_open(...).get_slice`` reads
just that range, so a rank's peak memory is about its share of the weights and no rank communicates; both
transformers' names (:func:`load_sharded_weights`) and meshtron's (:func:`load_native_sharded`) are served.
See docs/hf.md, 'Reading only this rank's slices'.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from meshtron.config import ConfigError
from meshtron.hf.convert import hf_name, layer_of
from meshtron.hf.io import open_safetensors, weight_map
from meshtron.torch_private import compute_local_shape_and_global_offset


def _local_slice(param: torch.Tensor) -> tuple[slice, ...]:
    """The global index range this rank holds (torch.chunk semantics over every sharded mesh dim)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


class _SliceReader:
    """Reads index ranges of checkpoint tensors through ``safe_open(...).get_slice`` (each file opened once).

    Fused MoE expert parameters (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])
    are assembled from the per-expert ``experts.{e}.{gate,up,down}_proj.weight`` tensors that
    ``save_pretrained`` writes, reading only the requested experts, rows and columns.
    """

    def __init__(self, folder: str | Path):
        self.folder, self.files = folder, weight_map(folder)
        self.path: Path | None = None
        self.handle = None
        self.bytes_read = 0

    def _handle(self, name: str):
        # One file mapped at a time: pages a column slice touches count in RSS while mapped.
        path = self.files[name]  # KeyError: not in the checkpoint
        if path != self.path:
            self.close()
            self.handle, self.path = open_safetensors(path).__enter__(), path
        return self.handle

    def close(self) -> None:
        if self.handle is not None:
            self.handle.__exit__(None, None, None)
            self.handle, self.path = None, None

    def file_of(self, name: str) -> str:
        """Sort key that visits the tensors file by file (fused experts: by their first expert's file)."""
        fused = self._fused(name)
        key = name if name in self.files or fused is None else f"{fused[0]}0.down_proj.weight"
        return str(self.files.get(key, ""))

    def shape(self, name: str) -> list[int]:
        return self._handle(name).get_slice(name).get_shape()

    def raw(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        handle = self._handle(name)
        part = handle.get_slice(name)[index] if index else handle.get_tensor(name)
        self.bytes_read += part.numel() * part.element_size()
        return part

    def has(self, name: str) -> bool:
        return name in self.files or (
            self._fused(name) is not None and f"{self._fused(name)[0]}0.down_proj.weight" in self.files
        )

    @staticmethod
    def _fused(name: str) -> tuple[str, str] | None:
        for suffix in ("experts.gate_up_proj", "experts.down_proj"):
            if name.endswith(suffix):
                return name[: -len(suffix)] + "experts.", suffix.split(".")[1]
        return None

    def read(self, name: str, index: tuple[slice, ...], shape) -> torch.Tensor:
        if name in self.files or self._fused(name) is None:
            return self.raw(name, index)
        prefix, kind = self._fused(name)
        experts, rows, cols = index
        if kind == "down_proj":
            parts = [
                self.raw(f"{prefix}{e}.down_proj.weight", (rows, cols)) for e in range(experts.start, experts.stop)
            ]
            return torch.stack(parts)
        inter = shape[1] // 2  # rows [0, I) are gate_proj's, [I, 2I) up_proj's

        def expert(e: int) -> torch.Tensor:
            gate = slice(min(rows.start, inter), min(rows.stop, inter))
            up = slice(max(rows.start, inter) - inter, max(rows.stop, inter) - inter)
            return torch.cat(
                [
                    self.raw(f"{prefix}{e}.gate_proj.weight", (gate, cols)),
                    self.raw(f"{prefix}{e}.up_proj.weight", (up, cols)),
                ]
            )

        return torch.stack([expert(e) for e in range(experts.start, experts.stop)])


def _copy_local(param: torch.Tensor, part: torch.Tensor, name: str, folder) -> None:
    local = param.to_local() if isinstance(param, DTensor) else param
    if tuple(part.shape) != tuple(local.shape):
        raise ConfigError(
            f"{folder}: {name} slice {tuple(part.shape)} does not fit the local shard "
            f"{tuple(local.shape)}; the checkpoint has another shape than the model."
        )
    local.copy_(part)


def missing_tensors(folder: str | Path, names: Collection[str]) -> list[str]:
    """The state-dict ``names`` the folder cannot give (fused experts count as there when their per-expert
    tensors are)."""
    reader = _SliceReader(folder)
    return [name for name in names if not reader.has(name)]


@torch.no_grad()
def load_sharded_weights(model: nn.Module, folder: str | Path, names: Collection[str] | None = None) -> int:
    """Fill ``model``'s (sharded) parameters from an HF safetensors folder, reading only local slices;
    ``names``: only those (state-dict names), not all.

    Returns the number of tensor bytes read on this rank. A tied lm_head is filled through the
    embedding. No communication.
    """
    wanted = dict(model.named_parameters())  # duplicates (tied weights) listed once
    wanted.update((n, b) for n, b in model.named_buffers() if n in model.state_dict())
    if names is not None:
        wanted = {n: t for n, t in wanted.items() if n in names}
    reader = _SliceReader(folder)
    missing = missing_tensors(folder, wanted)
    if missing:
        raise ConfigError(f"{folder} lacks {missing[:3]} ({len(missing)} tensors): not a checkpoint of this model.")
    try:
        for name in sorted(wanted, key=reader.file_of):
            param = wanted[name]
            _copy_local(param, reader.read(name, _local_slice(param), param.shape), name, folder)
    finally:
        reader.close()
    return reader.bytes_read


_NATIVE_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _read_native(reader: _SliceReader, name: str, index: tuple[slice, ...], tied: bool) -> torch.Tensor:
    """A meshtron tensor's slice; stacked experts ``[E, in, out]`` are transposes of HF's ``[out, in]``."""
    if tied and name == "lm_head.weight":
        name = "embed_tokens.weight"  # HF folders of tied models store only the embedding
    prefix, _, proj = name.rpartition(".")
    if not (prefix.endswith("mlp.experts") and proj in _NATIVE_EXPERT_PROJECTIONS):
        return reader.read(hf_name(name), index, None)
    experts, rows, cols = index  # rows: the projection's input features, cols: its outputs
    hf_prefix = hf_name(prefix)
    if f"{hf_prefix}.0.{proj}.weight" in reader.files:  # per-expert [out, in]
        return torch.stack(
            [reader.raw(f"{hf_prefix}.{e}.{proj}.weight", (cols, rows)).t() for e in range(experts.start, experts.stop)]
        )
    if proj == "down_proj":  # fused [E, H, I]
        return reader.raw(f"{hf_prefix}.down_proj", (experts, cols, rows)).transpose(1, 2)
    fused = f"{hf_prefix}.gate_up_proj"  # [E, 2I, H]: gate rows first, then up
    shift = 0 if proj == "gate_proj" else reader.shape(fused)[1] // 2
    return reader.raw(fused, (experts, slice(cols.start + shift, cols.stop + shift), rows)).transpose(1, 2)


@torch.no_grad()
def load_native_sharded(model: nn.Module, folder: str | Path, tied: bool, fresh_layers: range = range(0)) -> int:
    """Fill a (sharded, possibly pipeline-stage) meshtron model from an HF folder, reading only local slices.

    Parameters the folder lacks raise, but for those of ``fresh_layers`` (multi-token prediction modules, which
    Qwen2 checkpoints lack); those and buffers it lacks (the MoE expert bias) keep their values.
    Returns the tensor bytes read on this rank.
    """
    wanted = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers() if n in model.state_dict()}
    reader = _SliceReader(folder)
    try:
        for name, tensor in {**wanted, **buffers}.items():
            try:
                part = _read_native(reader, name, _local_slice(tensor), tied)
            except KeyError:
                if name in buffers or layer_of(name) in fresh_layers:
                    continue
                raise ConfigError(
                    f"{folder} has no tensor for parameter '{name}': not a checkpoint of this model."
                ) from None
            _copy_local(tensor, part, name, folder)
    finally:
        reader.close()
    return reader.bytes_read
