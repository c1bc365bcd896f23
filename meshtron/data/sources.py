"""Where training text comes from: the embedded corpus, a .txt/.jsonl/.parquet/.arrow file, a folder of them,
or a folder written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.

Every source follows the same document rules and is streamed in pieces of about 1 MiB cut at line ends, so a
huge document never has to fit in memory. See docs/data.md.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshtron.config import ConfigError

DOC_SEPARATOR = "\x1e"
BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).with_name("stdlib_docs.txt.gz")
SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz", ".parquet", ".arrow")
_TABLE_SUFFIXES = (".parquet", ".arrow")
_ROWS_PER_BATCH = 1024
_PIECE_CHARS = 1 << 20


class DataError(ConfigError):
    """The data source or tokenizer cannot be used; the message names the path and the fix."""


@dataclass(frozen=True, kw_only=True)  # built from recipe keys: fields by name, never by position
class SourceSpec:
    """One source: a ``[data] source`` path or one entry of ``[data] sources``."""

    path: str
    weight: float = 1.0
    text_key: str = "text"


def data_sources(data) -> list[SourceSpec]:
    """The sources of a ``[data]`` section: its ``sources`` mixture, else its one ``source``.
    (Entries were checked by ``config.validate``; ``text_key`` defaults to ``[data] text_key``.)"""
    if not data.sources:
        return [SourceSpec(path=data.source, text_key=data.text_key)]
    return [
        SourceSpec(path=e["path"], weight=float(e["weight"]), text_key=e.get("text_key", data.text_key))
        for e in data.sources
    ]


def source_files(source: str) -> list[Path]:
    """The files a ``[data] source`` stands for, in the order they are read."""
    if source == BUILTIN:
        return [BUILTIN_PATH]
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(
            f"[data] source '{source}' does not exist; give 'builtin', a .txt, .jsonl or .parquet file, "
            "a folder of them, or a datasets save_to_disk folder."
        )
    if not path.is_dir():
        _check_suffix(path)
        return [path]
    if (path / "dataset_dict.json").is_file():
        path = _train_split(path)
    if (path / "state.json").is_file():
        return _saved_dataset_files(path)
    # Not is_file(): a broken link or unreadable entry must fail loudly, not vanish from the data.
    files = sorted(p for p in path.rglob("*") if p.name.endswith(SUFFIXES) and not p.is_dir())
    if not files:
        raise DataError(f"[data] source folder '{source}' holds no {', '.join(SUFFIXES)} files.")
    return files


def _train_split(folder: Path) -> Path:
    splits = _read_json(folder / "dataset_dict.json").get("splits", [])
    if "train" not in splits:
        raise DataError(
            f"[data] source '{folder}' is a DatasetDict without a 'train' split (splits: {', '.join(splits)}); "
            "point the source at one split's folder, e.g. '" + str(folder / (splits[0] if splits else "SPLIT")) + "'."
        )
    return folder / "train"


def _saved_dataset_files(folder: Path) -> list[Path]:
    """The shards of a ``save_to_disk`` folder, in the order its ``state.json`` lists them."""
    shards = _read_json(folder / "state.json").get("_data_files", [])
    files = [folder / shard["filename"] for shard in shards]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise DataError(
            f"[data] source folder '{folder}' has a state.json whose data files are missing "
            f"({', '.join(missing) or 'none listed'}); save the dataset again with save_to_disk."
        )
    return files


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"[data] source file '{path}' cannot be read as JSON ({err}).") from None


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
    if path.name.endswith((".txt", ".txt.gz")):
        with _read_errors(path), _open_text(path) as lines:
            yield from _txt_pieces(lines)
        return
    for where, record in iter_records(path, (text_key,)):
        text = record[text_key]
        if text is not None and not isinstance(text, str):
            raise DataError(f"{where}: field '{text_key}' is {type(text).__name__}, not text.")
        yield text or "", True


def iter_records(path: Path, keys: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """Yield ``(where, {key: value})`` for each record of a .jsonl(.gz), .parquet or .arrow file;
    ``where`` ("file:line" or "file:row") locates the record in error messages."""
    if path.name.endswith(_TABLE_SUFFIXES):
        yield from _table_records(path, keys)
        return
    with _read_errors(path), _open_text(path) as lines:
        yield from _jsonl_records(lines, path, keys)


@contextlib.contextmanager
def _read_errors(path: Path):
    try:
        yield
    except UnicodeDecodeError as err:
        raise DataError(f"[data] source file '{path}' is not UTF-8 text ({err.reason}).") from None
    except (OSError, EOFError) as err:
        reason = getattr(err, "strerror", None) or err
        raise DataError(f"[data] source file '{path}' cannot be read: {reason}.") from None


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _jsonl_records(lines, path: Path, keys: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg}).") from None
        fields = list(record) if isinstance(record, dict) else [type(record).__name__]
        _check_fields(where, keys, fields)
        yield where, record


def _check_fields(where: str, keys: tuple[str, ...], fields: list[str]) -> None:
    missing = [k for k in keys if k not in fields]
    if missing:
        raise DataError(
            f"{where}: no field '{missing[0]}' (found: {', '.join(fields)}); set the [data] key that names "
            "it (text_key, or prompt_key / response_key / messages_key for SFT) to the field that holds it."
        )


def _table_records(path: Path, keys: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """Rows of a parquet or Arrow file, read one record batch of the needed columns at a time."""
    import pyarrow as pa

    try:
        batches = _record_batches(path, keys)
        row = 0
        for batch in batches:
            columns = [batch.column(k).to_pylist() for k in keys]
            for values in zip(*columns):
                yield f"{path}:row {row}", dict(zip(keys, values))
                row += 1
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"[data] source file '{path}' cannot be read as {path.suffix[1:]}: {err}.") from None


def _record_batches(path: Path, keys: tuple[str, ...]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        parquet = pq.ParquetFile(path)
        _check_fields(str(path), keys, parquet.schema_arrow.names)
        return parquet.iter_batches(batch_size=_ROWS_PER_BATCH, columns=list(keys))
    source = pa.memory_map(str(path))
    try:  # save_to_disk writes the IPC stream format; Arrow's own tools default to the file format
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        file_reader = pa.ipc.open_file(source)
        reader = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        _check_fields(str(path), keys, file_reader.schema.names)
        return reader
    _check_fields(str(path), keys, reader.schema.names)
    return reader


def _txt_pieces(lines) -> Iterator[tuple[str, bool]]:
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
