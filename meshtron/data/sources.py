"""Where training text comes from: the embedded corpus, a .txt/.jsonl file, or a folder of them.

Document rules, the same for every source:

- ``.jsonl``: one JSON object per line, the text in the field ``[data] text_key``; one document each.
- ``.txt``: the ASCII record separator ``\\x1e`` splits a file into documents; a file without it is
  one document. The embedded corpus is such a file (gzip-compressed).
- ``.gz`` variants of both are read transparently. Folders are searched recursively and their
  files read in sorted path order. Empty documents are dropped.

Text is streamed in pieces of about 1 MiB cut at line ends, so a huge document never has to fit
in memory; tokenizers see each piece separately.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from meshtron.config import ConfigError

DOC_SEPARATOR = "\x1e"
BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).with_name("stdlib_docs.txt.gz")
SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")
_PIECE_CHARS = 1 << 20


class DataError(ConfigError):
    """The data source or tokenizer cannot be used; the message names the path and the fix."""


def source_files(source: str) -> list[Path]:
    """The files a ``[data] source`` stands for, in the order they are read."""
    if source == BUILTIN:
        return [BUILTIN_PATH]
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(
            f"[data] source '{source}' does not exist; give 'builtin', a .txt or .jsonl file, "
            "or a folder of them."
        )
    if not path.is_dir():
        _check_suffix(path)
        return [path]
    # Not is_file(): a broken link or unreadable entry must fail loudly, not vanish from the data.
    files = sorted(p for p in path.rglob("*") if p.name.endswith(SUFFIXES) and not p.is_dir())
    if not files:
        raise DataError(f"[data] source folder '{source}' holds no {', '.join(SUFFIXES)} files.")
    return files


def _check_suffix(path: Path) -> None:
    if not path.name.endswith(SUFFIXES):
        raise DataError(
            f"[data] source '{path}' is neither of {', '.join(SUFFIXES)}; rename it or point "
            "[data] source at a supported file."
        )


def file_stamp(path: Path) -> tuple[str, int, int] | str:
    """What the token cache is keyed on: (path, size, mtime_ns), or for the embedded corpus its
    content hash, since each node's copy of the package has its own path and mtime."""
    if path == BUILTIN_PATH:
        return "builtin-" + hashlib.sha256(path.read_bytes()).hexdigest()
    try:
        st = os.stat(path)
    except OSError as err:
        raise DataError(f"[data] source file '{path}' cannot be read: {err.strerror}.") from None
    return str(path.resolve()), st.st_size, st.st_mtime_ns


def iter_pieces(path: Path, text_key: str) -> Iterator[tuple[str, bool]]:
    """Yield ``(text, ends_document)`` for one file, wrapping read errors with the path.

    Pieces may be empty; a document whose pieces hold no text is dropped by the caller.
    """
    reader = _jsonl_pieces if path.name.endswith((".jsonl", ".jsonl.gz")) else _txt_pieces
    try:
        with _open_text(path) as lines:
            yield from reader(lines, path, text_key)
    except UnicodeDecodeError as err:
        raise DataError(f"[data] source file '{path}' is not UTF-8 text ({err.reason}).") from None
    except (OSError, EOFError) as err:
        reason = getattr(err, "strerror", None) or err
        raise DataError(f"[data] source file '{path}' cannot be read: {reason}.") from None


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _jsonl_pieces(lines, path: Path, text_key: str) -> Iterator[tuple[str, bool]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not valid JSON ({err.msg}).") from None
        if not isinstance(record, dict) or text_key not in record:
            fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(
                f"{path}:{number}: no field '{text_key}' (found: {fields}); set [data] text_key "
                "to the field that holds the text."
            )
        text = record[text_key]
        if not isinstance(text, str):
            raise DataError(f"{path}:{number}: field '{text_key}' is {type(text).__name__}, not text.")
        yield text, True


def _txt_pieces(lines, path: Path, text_key: str) -> Iterator[tuple[str, bool]]:
    buffer: list[str] = []
    size = 0
    for line in lines:
        *finished, line = line.split(DOC_SEPARATOR)
        for tail in finished:
            buffer.append(tail)
            yield "".join(buffer), True
            buffer, size = [], 0
        buffer.append(line)
        size += len(line)
        if size >= _PIECE_CHARS:
            yield "".join(buffer), False
            buffer, size = [], 0
    yield "".join(buffer), True
