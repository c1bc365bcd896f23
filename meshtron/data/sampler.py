"""Global batches that do not depend on the parallel layout, and moving them to the device.

The sample stream is a pure function of the seed, and batch rank ``r`` takes the ``r``-th contiguous slice of
step ``k``'s global batch, so every layout sees the same global batch in the same order and resuming at step
``k`` needs nothing but ``k``. See docs/data.md, 'Windows and batches'.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from meshtron.config import Config, ConfigError
from meshtron.data.packing import PackedTokens, pack_documents, prepare_tokens
from meshtron.data.sources import SourceSpec, data_sources
from meshtron.env import local_device

IGNORE_INDEX = -100  # the label of a token the loss does not count


def _epoch_seed(seed: int, source: int, epoch: int) -> int:
    # Hashing keeps (seed, source, epoch) triples apart that any linear mix would make collide.
    digest = hashlib.sha256(f"meshtron-data/{seed}/{source}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def mixture_assign(samples: torch.Tensor, weights: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Which source each global sample index draws from, and its index within that source's samples.

    A closed form, so any sample is found from its index alone: source 0 takes the share
    ``q = w_0 / sum(w)`` of the samples, evenly spread (the first ``t`` samples hold
    ``floor(t * q + 1/2)`` of them); the samples it leaves, renumbered, are split the same way
    between source 1 and the rest, and so on. Every prefix of the stream holds each source's share
    to within one sample per source.
    """
    source = torch.full_like(samples, len(weights) - 1)
    index = samples.clone()  # position among the samples still unassigned at this stage
    pending = torch.ones_like(samples, dtype=torch.bool)
    for s in range(len(weights) - 1):
        q = weights[s] / sum(weights[s:])
        t = index[pending].double()
        taken_before = torch.floor(t * q + 0.5).long()
        takes = torch.floor((t + 1) * q + 0.5).long() > taken_before
        where = pending.nonzero().squeeze(1)
        source[where[takes]] = s
        index[where] = torch.where(takes, taken_before, index[where] - taken_before)
        pending[where[takes]] = False
    return source, index


class TokenDataset:
    """The packed token windows of one recipe's sources and their seeded, layout-independent global batches.

    With several sources (a mixture), sample ``g`` comes from source :func:`mixture_assign` gives it,
    as that source's sample ``i``; each source walks its own seeded permutations of its windows.
    """

    def __init__(
        self,
        tokens: Sequence[PackedTokens],
        global_batch_size: int,
        seed: int,
        weights: Sequence[float] = (),
        document_mask: bool = False,
    ):
        if global_batch_size < 1:
            raise ConfigError(f"[train] global_batch_size must be >= 1, got {global_batch_size}.")
        self.tokens = list(tokens)
        self.weights = [float(w) for w in weights] or [1.0] * len(self.tokens)
        if len(self.weights) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} sources but {len(self.weights)} weights.")
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.document_mask = document_mask
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def open(
        cls,
        cfg: Config,
        cache_dir: str | Path | None = None,
        sources: Sequence[SourceSpec] | None = None,
        progress: TextIO | None = None,
    ) -> TokenDataset:
        """Map the token caches of ``sources`` (default: the recipe's ``[data] source`` or
        ``sources``), building a missing one first.

        Every rank may call this at once: one process per cache folder builds (writing a progress
        line to ``progress``) while the others poll the file system for the result, outside any
        collective (see :func:`prepare_tokens`).
        """
        specs = list(sources) if sources is not None else data_sources(cfg.data)
        tokens = [
            PackedTokens(prepare_tokens(cfg, cache_dir, spec, progress=progress), cfg.train.seq_len) for spec in specs
        ]
        return cls(
            tokens, cfg.train.global_batch_size, cfg.train.seed, [spec.weight for spec in specs], cfg.data.document_mask
        )

    @property
    def num_windows(self) -> list[int]:
        """Windows of each source."""
        return [len(tokens) for tokens in self.tokens]

    def _perm(self, source: int, epoch: int) -> torch.Tensor:
        if (source, epoch) not in self._perms:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, source, epoch))
            # A step touches at most a few consecutive epochs of a source; older ones are never needed again.
            self._perms = {(s, e): p for (s, e), p in self._perms.items() if s != source or e > epoch - 2}
            self._perms[source, epoch] = torch.randperm(len(self.tokens[source]), generator=generator)
        return self._perms[source, epoch]

    def window_ids(
        self, step: int, batch_rank: int = 0, batch_world: int = 1, microbatches: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sources, windows)``: the source and window of each sample of one rank's share of step
        ``step``'s global batch.

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
        sources, samples = mixture_assign(
            torch.cat([torch.arange(first, first + local) for first in firsts]), self.weights
        )
        ids = torch.empty_like(samples)
        for source in sources.unique().tolist():
            in_source = sources == source
            n = len(self.tokens[source])
            epochs, positions = samples[in_source] // n, samples[in_source] % n
            picked = torch.empty_like(positions)
            for epoch in epochs.unique().tolist():
                mask = epochs == epoch
                picked[mask] = self._perm(source, epoch)[positions[mask]]
            ids[in_source] = picked
        return sources, ids

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
        labels that do not count (SFT prompts) are ``IGNORE_INDEX``; with ``document_mask`` also the packed
        ``position_ids`` (and the boundary labels ignored)."""
        sources, ids = self.window_ids(step, batch_rank, batch_world, microbatches)
        windows = torch.empty(len(ids), self.tokens[0].seq_len + 1, dtype=torch.int64)
        counted = torch.ones(windows.shape, dtype=torch.bool)
        for source in sources.unique().tolist():
            rows = sources == source
            windows[rows] = self.tokens[source].windows(ids[rows])
            source_counted = self.tokens[source].counted(ids[rows])
            if source_counted is not None:
                counted[rows] = source_counted
        labels = windows[:, 1:].masked_fill(~counted[:, 1:], IGNORE_INDEX).contiguous()
        # Contiguous, so that consumers may .view() them (e.g. labels.view(-1) for the loss).
        inputs = windows[:, :-1].contiguous()
        if not self.document_mask:
            return inputs, labels
        return (inputs, *pack_documents(inputs, labels, self.tokens[0].eos_id))

    def state_dict(self) -> dict[str, Any]:
        """What the sample stream depends on besides the step (JSON-serialisable)."""
        return {
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.tokens[0].seq_len,
            "num_windows": self.num_windows,
            "tokens_sha256": [tokens.sha256 for tokens in self.tokens],
            "weights": self.weights,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint whose data stream this dataset would not continue."""
        changed = [
            f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in self.state_dict().items() if state.get(k) != v
        ]
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
