"""Global batches that do not depend on the parallel layout, and moving them to the device.

The sample stream is a pure function of the seed: sample ``g`` (counting from the first step) is
window ``perm(epoch)[g % n]`` with ``epoch = g // n`` and ``perm(epoch)`` a permutation of the ``n``
windows drawn from ``(seed, epoch)``. Step ``k``'s global batch is samples
``k * global_batch_size .. (k + 1) * global_batch_size - 1``, and batch rank ``r`` of ``w`` (the
dp x ep position) takes the ``r``-th contiguous slice of it. So every layout sees the same global
batch in the same order, and resuming at step ``k`` needs nothing but ``k``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshtron.config import Config, ConfigError
from meshtron.data.packing import PackedTokens, pack_documents, prepare_tokens
from meshtron.env import local_device


def _epoch_seed(seed: int, epoch: int) -> int:
    # Hashing keeps (seed, epoch) pairs apart that any linear mix would make collide.
    digest = hashlib.sha256(f"meshtron-data/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TokenDataset:
    """The packed token windows of one recipe and its seeded, layout-independent global batches."""

    def __init__(self, tokens: PackedTokens, global_batch_size: int, seed: int, document_mask: bool = False):
        if global_batch_size < 1:
            raise ConfigError(f"[train] global_batch_size must be >= 1, got {global_batch_size}.")
        self.tokens = tokens
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.document_mask = document_mask
        self._perms: dict[int, torch.Tensor] = {}

    @classmethod
    def open(
        cls,
        cfg: Config,
        on_rank0_first: Callable[[Callable[[], Any]], Any] | None = None,
        cache_dir: str | Path | None = None,
    ) -> TokenDataset:
        """Tokenize into the cache if needed, then map it.

        ``on_rank0_first(fn)`` runs ``fn`` on rank 0, then (after a barrier) on the other ranks, which
        then find the cache ready; without it ``fn`` just runs here. Ranks that cannot see rank 0's
        cache folder build their own copy (concurrent builds are safe).
        """

        def prepare_and_open() -> TokenDataset:
            # prepare_tokens' path, not open_tokens: that would load the tokenizer and stat the files again.
            tokens = PackedTokens(prepare_tokens(cfg, cache_dir), cfg.train.seq_len)
            return cls(tokens, cfg.train.global_batch_size, cfg.train.seed, cfg.data.document_mask)

        return on_rank0_first(prepare_and_open) if on_rank0_first else prepare_and_open()

    @property
    def num_windows(self) -> int:
        return len(self.tokens)

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            # A step touches at most a few consecutive epochs; older ones are never needed again.
            self._perms = {e: p for e, p in self._perms.items() if e > epoch - 2}
            self._perms[epoch] = torch.randperm(self.num_windows, generator=generator)
        return self._perms[epoch]

    def window_ids(self, step: int, batch_rank: int = 0, batch_world: int = 1, microbatches: int = 1) -> torch.Tensor:
        """The windows of one rank's share of step ``step``'s global batch.

        The global batch is cut into ``microbatches`` contiguous global micro-batches and the rank
        takes its contiguous slice of each, so micro-batch m holds the same sequences on every
        layout (the MoE load-balancing loss is computed per global micro-batch).
        """
        local = self.local_batch_size(batch_world * microbatches)
        if not 0 <= batch_rank < batch_world:
            raise ValueError(f"batch_rank {batch_rank} is outside 0..{batch_world - 1}.")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        micro = self.global_batch_size // microbatches
        firsts = [step * self.global_batch_size + m * micro + batch_rank * local for m in range(microbatches)]
        samples = torch.cat([torch.arange(first, first + local) for first in firsts])
        epochs, positions = samples // self.num_windows, samples % self.num_windows
        ids = torch.empty_like(samples)
        for epoch in epochs.unique().tolist():
            mask = epochs == epoch
            ids[mask] = self._perm(epoch)[positions[mask]]
        return ids

    def local_batch_size(self, parts: int) -> int:
        if self.global_batch_size % parts:
            raise ConfigError(
                f"[train] global_batch_size = {self.global_batch_size} is not divisible by the "
                f"{parts} parts (dp x ep x microbatches); make it a multiple of {parts}."
            )
        return self.global_batch_size // parts

    def batch_for_step(
        self, step: int, batch_rank: int = 0, batch_world: int = 1, microbatches: int = 1
    ) -> tuple[torch.Tensor, ...]:
        """``(input_ids, labels)``, int64 ``[global_batch_size // batch_world, seq_len]`` on the CPU;
        with ``document_mask`` also the packed ``position_ids`` (and the boundary labels ignored)."""
        windows = self.tokens.windows(self.window_ids(step, batch_rank, batch_world, microbatches))
        # Contiguous, so that consumers may .view() them (e.g. labels.view(-1) for the loss).
        inputs, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if not self.document_mask:
            return inputs, labels
        return (inputs, *pack_documents(inputs, labels, self.tokens.eos_id))

    def state_dict(self) -> dict[str, Any]:
        """What the sample stream depends on besides the step (JSON-serialisable)."""
        return {
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.tokens.seq_len,
            "num_windows": self.num_windows,
            "tokens_sha256": self.tokens.sha256,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint whose data stream this dataset would not continue."""
        changed = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in self.state_dict().items()
                   if state.get(k) != v]
        if changed:
            raise ConfigError(
                "the data stream differs from the checkpoint's, so resuming would not continue it ("
                + "; ".join(changed)
                + "). Restore the recipe's [data], seed, seq_len and global_batch_size, or start fresh."
            )


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Copy CPU tensors to ``device``; on CUDA through pinned memory with ``non_blocking=True``, so
    the copy runs behind the host work that follows."""
    if device.type == "cuda":
        batch = tuple(t.pin_memory() for t in batch)
    return tuple(t.to(device, non_blocking=True) for t in batch)


class DeviceLoader:
    """Iterates one rank's ``(input_ids, labels)`` from ``start_step`` on, already on ``device``: the
    batches the trainer takes for the same ``microbatches`` (see ``TokenDataset.batch_for_step``).

    ``step`` is the next step to be served; the state dict is the dataset's plus ``step``.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        batch_rank: int = 0,
        batch_world: int = 1,
        device: torch.device | str | None = None,
        start_step: int = 0,
        microbatches: int = 1,
    ):
        dataset.local_batch_size(batch_world)  # fail on a bad layout before any step
        self.dataset = dataset
        self.batch_rank, self.batch_world, self.microbatches = batch_rank, batch_world, microbatches
        self.device = torch.device(device) if device is not None else local_device()
        self.step = start_step

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        batch = self.dataset.batch_for_step(self.step, self.batch_rank, self.batch_world, self.microbatches)
        self.step += 1
        return to_device(batch, self.device)

    def state_dict(self) -> dict[str, Any]:
        return {**self.dataset.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict({k: v for k, v in state.items() if k != "step"})
        self.step = int(state["step"])
