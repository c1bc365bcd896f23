"""Training data: embedded corpus or files, tokenizers, packing, layout-independent global batches.

The train loop's use::

    if rank == 0:
        prepare_tokens(cfg)              # tokenize once into the cache (no-op when cached)
    dist.barrier()
    loader = build_loader(cfg, batch_rank, batch_world, start_step=step)
    input_ids, labels = next(loader)     # [global_batch_size // batch_world, seq_len] on the device

``batch_rank`` / ``batch_world`` are the rank's position in and the size of the dp x ep group;
cp ranks of one batch rank get the same batch and slice the sequence themselves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshtron.config import Config
from meshtron.data.packing import PackedTokens, default_cache_dir, open_tokens, prepare_tokens
from meshtron.data.sampler import DeviceLoader, GlobalBatchSampler
from meshtron.data.sources import BUILTIN_PATH, DOC_SEPARATOR, DataError, source_files
from meshtron.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer


def build_sampler(cfg: Config, cache_dir: str | Path | None = None) -> GlobalBatchSampler:
    return GlobalBatchSampler(open_tokens(cfg, cache_dir), cfg.train.global_batch_size, cfg.train.seed)


def build_loader(
    cfg: Config,
    batch_rank: int = 0,
    batch_world: int = 1,
    start_step: int = 0,
    device: torch.device | str | None = None,
    cache_dir: str | Path | None = None,
) -> DeviceLoader:
    """This rank's batches from ``start_step`` on, on ``device`` (default: this process's device type)."""
    return DeviceLoader(build_sampler(cfg, cache_dir), batch_rank, batch_world, device, start_step)


__all__ = [
    "BUILTIN_PATH", "DOC_SEPARATOR", "ByteTokenizer", "DataError", "DeviceLoader", "GlobalBatchSampler",
    "HFTokenizer", "PackedTokens", "build_loader", "build_sampler", "check_vocab", "default_cache_dir",
    "load_tokenizer", "open_tokens", "prepare_tokens", "source_files",
]
