"""Training data: embedded corpus or files, tokenizers, packing, layout-independent global batches.

The train loop opens a :class:`TokenDataset` on every rank and asks it for ``batch_for_step(step, batch_rank,
batch_world)`` (the rank's place in dp x ep), or iterates a :class:`DeviceLoader`; its ``state_dict`` goes into
checkpoints. See docs/data.md, 'Windows and batches'.
"""

from __future__ import annotations

from meshtron.data.packing import PackedTokens, default_cache_dir, open_tokens, prepare_tokens
from meshtron.data.sampler import DeviceLoader, TokenDataset, mixture_assign, to_device
from meshtron.data.sources import BUILTIN_PATH, DOC_SEPARATOR, DataError, SourceSpec, data_sources, source_files
from meshtron.data.tokenizer import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer

__all__ = [
    "BUILTIN_PATH",
    "DOC_SEPARATOR",
    "ByteTokenizer",
    "DataError",
    "DeviceLoader",
    "HFTokenizer",
    "PackedTokens",
    "SourceSpec",
    "TokenDataset",
    "check_vocab",
    "data_sources",
    "default_cache_dir",
    "load_tokenizer",
    "mixture_assign",
    "open_tokens",
    "prepare_tokens",
    "source_files",
    "to_device",
]
