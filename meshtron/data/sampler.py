"""Global batches that do not depend on the parallel layout, and a loader that moves them to the device.

The sample stream is a pure function of the seed: sample ``g`` (counting from the first step) is
window ``perm(epoch)[g % n]`` with ``epoch = g // n`` and ``perm(epoch)`` a permutation of the ``n``
windows drawn from ``(seed, epoch)``. Step ``k``'s global batch is samples
``k * global_batch_size .. (k + 1) * global_batch_size - 1``, and batch rank ``r`` of ``w`` (the
dp x ep position) takes the ``r``-th contiguous slice of it. So every layout sees the same global
batch in the same order, and resuming at step ``k`` needs nothing but ``k``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from meshtron.config import ConfigError
from meshtron.data.packing import PackedTokens
from meshtron.env import local_device


def _epoch_seed(seed: int, epoch: int) -> int:
    # Hashing keeps (seed, epoch) pairs apart that any linear mix would make collide.
    digest = hashlib.sha256(f"meshtron-data/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class GlobalBatchSampler:
    def __init__(self, tokens: PackedTokens, global_batch_size: int, seed: int):
        if global_batch_size < 1:
            raise ConfigError(f"[train] global_batch_size must be >= 1, got {global_batch_size}.")
        self.tokens = tokens
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

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

    def window_ids(self, step: int, batch_rank: int = 0, batch_world: int = 1) -> torch.Tensor:
        """The windows of one rank's share of step ``step``'s global batch."""
        local = self.local_batch_size(batch_world)
        if not 0 <= batch_rank < batch_world:
            raise ValueError(f"batch_rank {batch_rank} is outside 0..{batch_world - 1}.")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        first = step * self.global_batch_size + batch_rank * local
        samples = torch.arange(first, first + local)
        epochs, positions = samples // self.num_windows, samples % self.num_windows
        ids = torch.empty_like(samples)
        for epoch in epochs.unique().tolist():
            mask = epochs == epoch
            ids[mask] = self._perm(epoch)[positions[mask]]
        return ids

    def local_batch_size(self, batch_world: int) -> int:
        if self.global_batch_size % batch_world:
            raise ConfigError(
                f"[train] global_batch_size = {self.global_batch_size} is not divisible by the "
                f"{batch_world} batch ranks (dp x ep); make it a multiple of {batch_world}."
            )
        return self.global_batch_size // batch_world

    def local_windows(self, step: int, batch_rank: int = 0, batch_world: int = 1) -> torch.Tensor:
        """int64 ``[global_batch_size // batch_world, seq_len + 1]`` on the CPU."""
        return self.tokens.windows(self.window_ids(step, batch_rank, batch_world))

    def batch_for_step(
        self, step: int, batch_rank: int = 0, batch_world: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, int64 ``[global_batch_size // batch_world, seq_len]`` on the CPU."""
        windows = self.local_windows(step, batch_rank, batch_world)
        # Contiguous, so that consumers may .view() them (e.g. labels.view(-1) for the loss).
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class DeviceLoader:
    """Iterates one rank's batches from ``start_step`` on, already on ``device``.

    On CUDA the batch is read into pinned memory and copied with ``non_blocking=True``, so the
    copy runs behind the host work that follows. ``step`` is the next step to be served;
    :meth:`state_dict` records it with what the stream depends on, and :meth:`load_state_dict`
    refuses a checkpoint taken on other data.
    """

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        batch_rank: int = 0,
        batch_world: int = 1,
        device: torch.device | str | None = None,
        start_step: int = 0,
    ):
        sampler.local_batch_size(batch_world)  # fail on a bad layout before any step
        self.sampler = sampler
        self.batch_rank, self.batch_world = batch_rank, batch_world
        self.device = torch.device(device) if device is not None else local_device()
        self.pin = self.device.type == "cuda"
        self.step = start_step

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.sampler.batch_for_step(self.step, self.batch_rank, self.batch_world)
        self.step += 1
        if self.pin:
            batch = tuple(t.pin_memory() for t in batch)
        input_ids, labels = (t.to(self.device, non_blocking=True) for t in batch)
        return input_ids, labels

    def state_dict(self) -> dict[str, Any]:
        s = self.sampler
        return {
            "step": self.step,
            "seed": s.seed,
            "global_batch_size": s.global_batch_size,
            "seq_len": s.tokens.seq_len,
            "num_windows": s.num_windows,
            "tokens_sha256": s.tokens.sha256,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        current = self.state_dict()
        changed = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in current.items()
                   if k != "step" and state.get(k) != v]
        if changed:
            raise ConfigError(
                "the data stream differs from the checkpoint's, so resuming would not continue it ("
                + "; ".join(changed)
                + "). Restore the recipe's [data], seed, seq_len and global_batch_size, or start fresh."
            )
        self.step = int(state["step"])
