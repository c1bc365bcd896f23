"""Tokenize a source once into a flat token file; every rank then memory-maps it read-only.

The cache is two files in the cache folder, named by a hash of what the tokens depend on (the
source's files with their sizes and mtimes, the text field, the tokenizer and its end-of-document
id): ``tokens-<key>.bin``, the documents' token ids back to back, each followed by the
end-of-document id, as uint8 / uint16 / int32 (the narrowest that holds the vocabulary, native
byte order); and ``tokens-<key>.json``, its description, with the stream's SHA-256 that a resumed
run checks its data against (so a moved or touched dataset still resumes). Both are written under temporary names
and renamed into place, the JSON last, so a reader never sees half a cache.

Packing: window ``i`` is ``tokens[i * seq_len : i * seq_len + seq_len + 1]``; its first ``seq_len``
tokens are the inputs and its last ``seq_len`` the labels. Windows overlap by one token, so every
token is a label exactly once and the windows' inputs, concatenated, are the token stream.

Documents (``[data] document_mask = true``): a window's document starts are the tokens right after
an end-of-document id (and its first token). :func:`pack_documents` turns a window into packed
positions that restart at 0 at each start (transformers' packed-sequence ``position_ids``) and
ignores the target of each document's last input token (its end-of-document id, whose next token
opens another document), as transformers' ``DataCollatorWithFlattening`` does.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import uuid
from pathlib import Path

import torch

from meshtron.config import Config
from meshtron.data.sources import DataError, file_stamp, iter_pieces, source_files
from meshtron.data.tokenizer import Tokenizer, check_vocab, load_tokenizer

FORMAT = 1
# (largest vocabulary, array typecode, torch dtype); array's "i" is 4 bytes on every platform torch runs on.
_DTYPES = ((1 << 8, "B", torch.uint8), (1 << 16, "H", torch.uint16), (1 << 31, "i", torch.int32))
_ENCODE_CHARS = 4 << 20  # characters handed to the tokenizer per batch


def default_cache_dir(cfg: Config) -> Path:
    return Path(cfg.data.cache_dir or Path(cfg.train.output_dir) / "token_cache").expanduser()


def _typecode(vocab_size: int) -> str:
    return next(code for limit, code, _ in _DTYPES if vocab_size <= limit)


def _dtype(typecode: str) -> torch.dtype:
    return next(dtype for _, code, dtype in _DTYPES if code == typecode)


class _Plan:
    """Everything known before reading any text: cheap enough for every rank to compute."""

    def __init__(self, cfg: Config, cache_dir: str | Path | None):
        data = cfg.data
        self.files = source_files(data.source)
        self.tokenizer: Tokenizer = load_tokenizer(data.tokenizer, data.eos_token)
        check_vocab(self.tokenizer, data.tokenizer, cfg.model.vocab_size)
        self.source, self.text_key = data.source, data.text_key
        identity = {
            "format": FORMAT,
            "files": [file_stamp(f) for f in self.files],
            "text_key": data.text_key,
            "tokenizer": self.tokenizer.fingerprint,
        }
        self.key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]
        folder = Path(cache_dir) if cache_dir is not None else default_cache_dir(cfg)
        self.bin = folder / f"tokens-{self.key}.bin"
        self.meta = folder / f"tokens-{self.key}.json"


class _TokenWriter:
    """Streams pieces of documents through the tokenizer into the flat file."""

    def __init__(self, out, tokenizer: Tokenizer):
        self.out, self.tokenizer = out, tokenizer
        self.typecode = _typecode(tokenizer.vocab_size)
        self.pending: list[tuple[str, bool]] = []
        self.pending_chars = 0
        self.doc_tokens = 0
        self.num_tokens = 0
        self.num_documents = 0
        self.digest = hashlib.sha256()

    def add(self, text: str, ends_document: bool) -> None:
        self.pending.append((text, ends_document))
        self.pending_chars += len(text)
        if self.pending_chars >= _ENCODE_CHARS:
            self.flush()

    def flush(self) -> None:
        encoded = self.tokenizer.encode_batch([text for text, _ in self.pending])
        for ids, (_, ends_document) in zip(encoded, self.pending):
            self._write(ids)
            self.doc_tokens += len(ids)
            if ends_document and self.doc_tokens:  # an empty document gets no separator
                self._write([self.tokenizer.eos_id])
                self.num_documents += 1
                self.doc_tokens = 0
        self.pending, self.pending_chars = [], 0

    def _write(self, ids) -> None:
        data = array.array(self.typecode, ids).tobytes()
        self.out.write(data)
        self.digest.update(data)
        self.num_tokens += len(ids)


def prepare_tokens(cfg: Config, cache_dir: str | Path | None = None) -> Path:
    """Tokenize ``cfg.data`` into the cache unless it is already there; returns the JSON's path.

    Run on one rank (rank 0, or each node's local rank 0 without a shared file system) while the
    others wait at a barrier; concurrent runs are safe, each renames complete files into place.
    """
    plan = _Plan(cfg, cache_dir)
    if plan.meta.is_file():
        _check_length(_read_meta(plan.meta), plan.source, cfg.train.seq_len)
        return plan.meta
    plan.bin.parent.mkdir(parents=True, exist_ok=True)
    tmp = plan.bin.with_name(f".{plan.bin.name}.{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as out:
            writer = _TokenWriter(out, plan.tokenizer)
            for path in plan.files:
                for text, ends_document in iter_pieces(path, plan.text_key):
                    writer.add(text, ends_document)
            writer.flush()
        meta = {
            "format": FORMAT,
            "key": plan.key,
            "source": plan.source,
            "files": len(plan.files),
            "tokenizer": plan.tokenizer.fingerprint,
            "vocab_size": plan.tokenizer.vocab_size,
            "eos_id": plan.tokenizer.eos_id,
            "typecode": writer.typecode,
            "num_tokens": writer.num_tokens,
            "num_documents": writer.num_documents,
            "sha256": writer.digest.hexdigest(),
        }
        if writer.num_tokens == 0:
            raise DataError(f"[data] source '{plan.source}' holds no text; point it at a non-empty dataset.")
        _check_length(meta, plan.source, cfg.train.seq_len)
        os.replace(tmp, plan.bin)
    finally:
        tmp.unlink(missing_ok=True)
    _write_atomic(plan.meta, json.dumps(meta, indent=1))
    return plan.meta


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_meta(path: Path) -> dict:
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise DataError(f"token cache '{path}' has format {meta.get('format')}, expected {FORMAT}; delete it.")
    return meta


def _check_length(meta: dict, source: str, seq_len: int) -> None:
    if meta["num_tokens"] < seq_len + 1:
        raise DataError(
            f"[data] source '{source}' has {meta['num_tokens']} tokens but [train] seq_len = {seq_len} "
            f"needs at least {seq_len + 1}; lower seq_len or add data."
        )


class PackedTokens:
    """The cached token stream, memory-mapped read-only, cut into windows of ``seq_len + 1``."""

    def __init__(self, meta_path: str | Path, seq_len: int):
        self.meta_path = Path(meta_path)
        self.meta = _read_meta(self.meta_path)
        _check_length(self.meta, self.meta["source"], seq_len)
        bin_path = self.meta_path.with_suffix(".bin")
        dtype = _dtype(self.meta["typecode"])
        expected = self.meta["num_tokens"] * dtype.itemsize
        if not bin_path.is_file() or bin_path.stat().st_size != expected:
            raise DataError(f"token cache '{bin_path}' is missing or not {expected} bytes; delete {self.meta_path}.")
        # shared=False maps the file privately from a read-only descriptor: pages are read on first
        # touch, so a rank reads only the windows it samples.
        self.tokens = torch.from_file(str(bin_path), shared=False, size=self.meta["num_tokens"], dtype=dtype)
        self.seq_len = seq_len
        self.sha256 = self.meta["sha256"]
        self.eos_id = self.meta["eos_id"]
        # Overlapping rows as a strided view: selecting rows copies whole runs, ~20x faster than
        # gathering single tokens.
        self._rows = self.tokens.as_strided((len(self), seq_len + 1), (seq_len, 1))

    def __len__(self) -> int:
        """Number of windows."""
        return (self.meta["num_tokens"] - 1) // self.seq_len

    def windows(self, ids: torch.Tensor) -> torch.Tensor:
        """Windows ``ids`` as an int64 tensor ``[len(ids), seq_len + 1]``."""
        return self._rows.index_select(0, ids).to(torch.int64)


def pack_documents(inputs: torch.Tensor, labels: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, position_ids)`` of windows ``[B, S]`` whose documents are masked apart.

    Labels whose input is the end-of-document id become -100 (the target is the next document's
    first token); positions count from each document start.
    """
    ends = inputs == eos_id
    index = torch.arange(inputs.shape[1]).expand_as(inputs)
    starts = torch.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]
    start_of = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return labels.masked_fill(ends, -100), index - start_of


def open_tokens(cfg: Config, cache_dir: str | Path | None = None) -> PackedTokens:
    """Open the cache :func:`prepare_tokens` wrote for ``cfg`` (on every rank, after the barrier)."""
    plan = _Plan(cfg, cache_dir)
    if not plan.meta.is_file():
        raise DataError(
            f"no token cache for [data] source '{plan.source}' at '{plan.meta}'; run prepare_tokens "
            "first (rank 0, before a barrier). A node that cannot see rank 0's files needs its own."
        )
    return PackedTokens(plan.meta, cfg.train.seq_len)
