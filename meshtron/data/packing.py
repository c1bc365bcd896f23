"""Tokenize a source once into a flat token file; every rank then memory-maps it read-only.

The cache (``tokens-<key>.bin`` and its ``.json``, keyed by everything the tokens depend on) is written under
temporary names and renamed, JSON last, so a reader never sees half of it; one builder holds the ``flock``. Windows
of ``seq_len + 1`` tokens overlap by one, so every token is a label exactly once; :func:`pack_documents` restarts
positions at each document. See docs/data.md, 'Pre-tokenizing' and 'Windows and batches'.
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch

from meshtron.config import Config
from meshtron.data.sft import CHAT, PROMPT_RESPONSE, ChatTemplate, example_pieces
from meshtron.data.sources import DataError, SourceSpec, data_sources, file_stamp, iter_pieces, source_files
from meshtron.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, check_vocab, load_tokenizer

FORMAT = 1
# (largest vocabulary, array typecode, torch dtype); array's "i" is 4 bytes on every platform torch runs on.
_DTYPES = ((1 << 8, "B", torch.uint8), (1 << 16, "H", torch.uint16), (1 << 31, "i", torch.int32))
_ENCODE_CHARS = 4 << 20  # characters handed to the tokenizer per batch
POLL_S = 1.0  # how often a process waiting for another's build looks for the finished cache


def default_cache_dir(cfg: Config) -> Path:
    return Path(cfg.data.cache_dir or Path(cfg.train.output_dir) / "token_cache").expanduser()


def _typecode(vocab_size: int) -> str:
    return next(code for limit, code, _ in _DTYPES if vocab_size <= limit)


def _dtype(typecode: str) -> torch.dtype:
    return next(dtype for _, code, dtype in _DTYPES if code == typecode)


class _Cache:
    """The token cache of a source before any text is read (its files, tokenizer, key and the paths of its
    files): cheap enough for every rank to compute."""

    def __init__(self, cfg: Config, cache_dir: str | Path | None, source: SourceSpec | None):
        data = cfg.data
        source = source or _only_source(cfg)
        self.files = source_files(source.path)
        self.tokenizer: Tokenizer = load_tokenizer(data.tokenizer, data.eos_token)
        check_vocab(self.tokenizer, data.tokenizer, cfg.model.vocab_size)
        self.source, self.text_key = source.path, source.text_key
        self.data, self.masked = data, data.format != "text"
        self.template = _chat_template(self.tokenizer) if data.format == CHAT else None
        identity = {
            "format": FORMAT,
            "files": [file_stamp(f) for f in self.files],
            "text_key": source.text_key,
            "tokenizer": self.tokenizer.fingerprint,
            "examples": _example_identity(data, self.template),
        }
        self.key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]
        folder = Path(cache_dir) if cache_dir is not None else default_cache_dir(cfg)
        self.bin = folder / f"tokens-{self.key}.bin"
        self.meta = folder / f"tokens-{self.key}.json"
        self.mask = folder / f"tokens-{self.key}.mask"
        self.lock = folder / f"tokens-{self.key}.lock"
        self.error = folder / f"tokens-{self.key}.error"
        self.tokenizer_spec = (data.tokenizer, data.eos_token)

    def pieces(self, path: Path) -> Iterator[tuple[str, bool, bool]]:
        """``(text, ends_document, counted)``: with plain text every token counts as a label."""
        if not self.masked:
            return ((text, ends, True) for text, ends in iter_pieces(path, self.text_key))
        return example_pieces(path, self.data, self.template)


def _chat_template(tokenizer: Tokenizer) -> ChatTemplate:
    if not isinstance(tokenizer, HFTokenizer):
        raise DataError(
            "[data] format = 'chat' needs a tokenizer.json with a chat template; the byte tokenizer has none."
        )
    return ChatTemplate(tokenizer.file)


def _example_identity(data, template: ChatTemplate | None) -> list:
    """What SFT tokens and masks depend on besides the files and the tokenizer."""
    keys = {"text": [], PROMPT_RESPONSE: [data.prompt_key, data.response_key], CHAT: [data.messages_key]}
    return [data.format, *keys[data.format], template.fingerprint if template else ""]


def _only_source(cfg: Config) -> SourceSpec:
    specs = data_sources(cfg.data)
    if len(specs) > 1:
        raise ValueError("the recipe has a [data] sources mixture: pass the source to tokenize.")
    return specs[0]


class _TokenWriter:
    """Writes encoded pieces of documents into the flat file, an end-of-document id after each document."""

    def __init__(self, out, mask_out, eos_id: int, typecode: str):
        self.out, self.mask_out = out, mask_out
        self.eos = array.array(typecode, [eos_id]).tobytes()
        self.doc_tokens = 0
        self.num_tokens = 0
        self.num_documents = 0
        self.digest = hashlib.sha256()

    def write(self, encoded: list[bytes], ends: list[bool], counted: list[bool]) -> None:
        for data, ends_document, counts in zip(encoded, ends, counted):
            self._write(data, counts)
            self.doc_tokens += len(data) // len(self.eos)
            if ends_document and self.doc_tokens:  # an empty document gets no separator
                self._write(self.eos, counts)  # the end of a response is part of it
                self.num_documents += 1
                self.doc_tokens = 0

    def _write(self, data: bytes, counts: bool) -> None:
        tokens = len(data) // len(self.eos)
        self.out.write(data)
        self.digest.update(data)
        if self.mask_out is not None:
            mask = bytes([counts]) * tokens
            self.mask_out.write(mask)
            self.digest.update(mask)
        self.num_tokens += tokens


def _chunks(cache: _Cache) -> Iterator[tuple[list[str], list[bool], list[bool], int]]:
    """``(texts, ends_document, counted, files_done)``: the source's pieces in batches of about
    ``_ENCODE_CHARS`` characters, each with the number of files read completely before it."""
    texts: list[str] = []
    ends: list[bool] = []
    counted: list[bool] = []
    chars = 0
    for number, path in enumerate(cache.files):
        for text, ends_document, counts in cache.pieces(path):
            texts.append(text)
            ends.append(ends_document)
            counted.append(counts)
            chars += len(text)
            if chars >= _ENCODE_CHARS:
                yield texts, ends, counted, number
                texts, ends, counted, chars = [], [], [], 0
    yield texts, ends, counted, len(cache.files)


def _encode(tokenizer: Tokenizer, typecode: str, texts: list[str]) -> list[bytes]:
    return [array.array(typecode, ids).tobytes() for ids in tokenizer.encode_batch(texts)]


_worker: tuple[Tokenizer, str] | None = None


def _start_worker(spec: str, eos_token: str, typecode: str) -> None:
    global _worker
    # One thread per worker: the processes are the parallelism (tokenizers' thread pool would oversubscribe).
    os.environ["RAYON_NUM_THREADS"] = "1"
    _worker = (load_tokenizer(spec, eos_token), typecode)


def _encode_in_worker(texts: list[str]) -> list[bytes]:
    tokenizer, typecode = _worker
    return _encode(tokenizer, typecode, texts)


def _encoded(cache: _Cache, typecode: str, workers: int) -> Iterator[tuple[list[bytes], list[bool], list[bool], int]]:
    """The chunks of :func:`_chunks`, encoded in order; by ``workers`` processes when more than one.

    This process reads the files; at most two chunks per worker are in flight, so memory stays
    bounded however large the source is.
    """
    if workers <= 1 or isinstance(cache.tokenizer, ByteTokenizer):  # bytes: encoding costs less than shipping text
        for texts, *rest in _chunks(cache):
            yield _encode(cache.tokenizer, typecode, texts), *rest
        return
    # fork: a spawned worker would import torch and transformers (meshtron's package imports) before
    # its first chunk, which costs more than the chunk; the workers touch neither torch nor threads.
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, _start_worker, (*cache.tokenizer_spec, typecode)) as pool:
        pending: collections.deque = collections.deque()
        for texts, *rest in _chunks(cache):
            pending.append((pool.apply_async(_encode_in_worker, (texts,)), rest))
            if len(pending) >= 2 * workers:
                result, rest = pending.popleft()
                yield result.get(), *rest
        while pending:
            result, rest = pending.popleft()
            yield result.get(), *rest


class _Progress:
    """A progress line (bar by bytes of files read, tokens, tokens/s) to ``stream``; ``None``: silent."""

    def __init__(self, stream: TextIO | None, cache: _Cache, workers: int):
        self.stream, self.source, self.workers = stream, cache.source, workers
        self.sizes = [path.stat().st_size for path in cache.files]
        self.tty = stream is not None and stream.isatty()
        self.start = self.last = time.perf_counter()

    def update(self, tokens: int, files_done: int, final: bool = False) -> float:
        """Print the line when due (every second on a terminal, every 10 s in a log); returns tokens/s."""
        now = time.perf_counter()
        rate = tokens / max(now - self.start, 1e-9)
        if self.stream is None or not (final or now - self.last >= (1 if self.tty else 10)):
            return rate
        self.last = now
        share = sum(self.sizes[:files_done]) / max(sum(self.sizes), 1)
        bar = "#" * int(share * 20)
        self.stream.write(
            f"{chr(13) if self.tty else ''}meshtron: tokenizing '{self.source}' [{bar:<20}] {share:4.0%}, files "
            f"{files_done}/{len(self.sizes)}, {tokens / 1e6:.2f}M tokens, {rate / 1e6:.3f}M tokens/s, "
            f"{self.workers} worker(s){chr(10) if final or not self.tty else ''}"
        )
        self.stream.flush()
        return rate


def prepare_tokens(
    cfg: Config,
    cache_dir: str | Path | None = None,
    source: SourceSpec | None = None,
    workers: int = 1,
    progress: TextIO | None = None,
) -> Path:
    """Tokenize ``source`` (default: the recipe's one source) with ``cfg.data``'s tokenizer into the
    cache unless it is already there; returns the JSON's path.

    Every rank may call this at once: the first process to take the cache's file lock builds it
    (with ``workers`` processes, writing a progress line to ``progress``) while the others poll for
    the finished cache, outside any collective, so no collective timeout runs while tokenizing. Each
    folder that the ranks do not share gets its own build. A build that fails on bad data leaves
    its message in ``tokens-<key>.error`` and the waiting processes raise it too.
    """
    cache = _Cache(cfg, cache_dir, source)
    cache.bin.parent.mkdir(parents=True, exist_ok=True)
    waited = False
    while not cache.meta.is_file():
        with open(cache.lock, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waited = True
                time.sleep(POLL_S)
                continue
            if cache.meta.is_file():  # built between the check and the lock
                break
            if waited and cache.error.is_file():
                raise DataError(cache.error.read_text())
            cache.error.unlink(missing_ok=True)  # left by an earlier run; this build decides afresh
            try:
                _build(cfg, cache, workers, progress)
            except DataError as err:
                _write_atomic(cache.error, str(err))
                raise
    _check_length(_read_meta(cache.meta), cache.source, cfg.train.seq_len)
    return cache.meta


def _build(cfg: Config, cache: _Cache, workers: int, stream: TextIO | None) -> None:
    typecode = _typecode(cache.tokenizer.vocab_size)
    progress = _Progress(stream, cache, workers)
    tmp = cache.bin.with_name(f".{cache.bin.name}.{uuid.uuid4().hex}")
    tmp_mask = cache.mask.with_name(f".{cache.mask.name}.{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as out, open(tmp_mask, "wb") if cache.masked else contextlib.nullcontext() as mask_out:
            writer = _TokenWriter(out, mask_out, cache.tokenizer.eos_id, typecode)
            for encoded, ends, counted, files_done in _encoded(cache, typecode, workers):
                writer.write(encoded, ends, counted)
                progress.update(writer.num_tokens, files_done)
        rate = progress.update(writer.num_tokens, len(cache.files), final=True)
        meta = {
            "format": FORMAT,
            "key": cache.key,
            "source": cache.source,
            "files": len(cache.files),
            "tokenizer": cache.tokenizer.fingerprint,
            "vocab_size": cache.tokenizer.vocab_size,
            "eos_id": cache.tokenizer.eos_id,
            "typecode": typecode,
            "num_tokens": writer.num_tokens,
            "num_documents": writer.num_documents,
            "masked": cache.masked,
            "sha256": writer.digest.hexdigest(),
            "build": {
                "workers": 1 if isinstance(cache.tokenizer, ByteTokenizer) else workers,
                "seconds": round(time.perf_counter() - progress.start, 3),
                "tokens_per_s": round(rate),
            },
        }
        if writer.num_tokens == 0:
            raise DataError(f"[data] source '{cache.source}' holds no text; point it at a non-empty dataset.")
        _check_length(meta, cache.source, cfg.train.seq_len)
        if cache.masked:
            os.replace(tmp_mask, cache.mask)
        os.replace(tmp, cache.bin)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_mask.unlink(missing_ok=True)
    _write_atomic(cache.meta, json.dumps(meta, indent=1))


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
    """The cached token stream, memory-mapped read-only, cut into windows of ``seq_len + 1``; with SFT
    data also the per-token mask of which tokens count as labels."""

    def __init__(self, meta_path: str | Path, seq_len: int):
        self.meta_path = Path(meta_path)
        self.meta = _read_meta(self.meta_path)
        _check_length(self.meta, self.meta["source"], seq_len)
        self.seq_len = seq_len
        self.tokens = self._map(".bin", _dtype(self.meta["typecode"]))
        self.mask = self._map(".mask", torch.bool) if self.meta.get("masked") else None
        # Overlapping rows as strided views: selecting rows copies whole runs instead of gathering single
        # tokens.
        self._rows = self.tokens.as_strided((len(self), seq_len + 1), (seq_len, 1))
        self._mask_rows = None if self.mask is None else self.mask.as_strided(self._rows.shape, self._rows.stride())
        self.sha256 = self.meta["sha256"]
        self.eos_id = self.meta["eos_id"]

    def _map(self, suffix: str, dtype: torch.dtype) -> torch.Tensor:
        """One of the cache's files, mapped."""
        path = self.meta_path.with_suffix(suffix)
        expected = self.meta["num_tokens"] * dtype.itemsize
        if not path.is_file() or path.stat().st_size != expected:
            raise DataError(f"token cache '{path}' is missing or not {expected} bytes; delete {self.meta_path}.")
        # shared=False maps the file privately from a read-only descriptor: pages are read on first
        # touch, so a rank reads only the windows it samples.
        return torch.from_file(str(path), shared=False, size=self.meta["num_tokens"], dtype=dtype)

    def __len__(self) -> int:
        """Number of windows."""
        return (self.meta["num_tokens"] - 1) // self.seq_len

    def windows(self, ids: torch.Tensor) -> torch.Tensor:
        """Windows ``ids`` as an int64 tensor ``[len(ids), seq_len + 1]``."""
        return self._rows.index_select(0, ids).to(torch.int64)

    def counted(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Which tokens of windows ``ids`` count as labels (bool, same shape); None: all of them."""
        return None if self._mask_rows is None else self._mask_rows.index_select(0, ids)


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


def open_tokens(cfg: Config, cache_dir: str | Path | None = None, source: SourceSpec | None = None) -> PackedTokens:
    """Open the cache :func:`prepare_tokens` wrote for ``source`` (on every rank, after the barrier)."""
    cache = _Cache(cfg, cache_dir, source)
    if not cache.meta.is_file():
        raise DataError(
            f"no token cache for [data] source '{cache.source}' at '{cache.meta}'; run prepare_tokens "
            "or python -m meshtron.data.prepare first."
        )
    return PackedTokens(cache.meta, cfg.train.seq_len)
