"""Training data: embedded corpus or files, tokenizers, packing, layout-independent global batches.

The train loop's use::

    dataset = TokenDataset.open(cfg)  # every rank; one process per cache folder tokenizes, under a file lock
    input_ids, labels = dataset.batch_for_step(step, batch_rank, batch_world)  # CPU, int64
    input_ids, labels = to_device((input_ids, labels), device)  # pinned + non_blocking on CUDA

or ``DeviceLoader(dataset, batch_rank, batch_world, start_step=step)`` to iterate on the device.
``batch_rank`` / ``batch_world`` are the rank's position in and the size of the dp x ep group;
the cp ranks of one batch rank get the same batch and slice the sequence themselves.
``dataset.state_dict()`` goes into checkpoints; ``load_state_dict`` refuses other data on resume.
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
