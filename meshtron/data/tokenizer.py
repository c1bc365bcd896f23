"""Tokenizers: UTF-8 bytes, or a HuggingFace fast tokenizer read from disk (never downloaded).

Byte tokenizer convention: token id = byte value (vocab 256) and id 0, the NUL byte, is the
end-of-document separator. Text never needs NUL, so NUL characters are dropped when encoding:
``decode(encode(text)) == text`` for every text without NUL. See docs/reference.md, '[data]'.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from meshtron.data.sources import DataError

BYTES = "bytes"
# Tried in order when neither [data] eos_token nor the tokenizer's config names one;
# "<|endoftext|>" comes first because GPT-2 and Qwen vocabularies pretrain with it between documents.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class ByteTokenizer:
    vocab_size = 256
    eos_id = 0
    fingerprint = "bytes-v1"

    def encode_batch(self, texts: Sequence[str]) -> list[bytes]:
        return [text.encode("utf-8").replace(b"\0", b"") for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (file, or inside a tokenizer folder) loaded with the ``tokenizers`` library."""

    def __init__(self, path: str | Path, eos_token: str = ""):
        from tokenizers import Tokenizer

        self.file = _tokenizer_file(Path(path).expanduser())
        try:
            self._tok = Tokenizer.from_file(str(self.file))
        except Exception as err:  # noqa: BLE001 - the Rust side raises bare Exceptions
            raise DataError(f"[data] tokenizer '{self.file}' cannot be loaded: {err}.") from None
        # Largest id + 1, not the token count: added tokens may leave gaps in the ids.
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        self.eos_token = eos_token or _default_eos(self._tok, self.file)
        eos_id = self._tok.token_to_id(self.eos_token)
        if eos_id is None:
            raise DataError(
                f"[data] eos_token '{self.eos_token}' is not in the vocabulary of '{self.file}'; "
                "set [data] eos_token to the tokenizer's end-of-document token."
            )
        self.eos_id = eos_id
        digest = hashlib.sha256(self.file.read_bytes()).hexdigest()[:16]
        self.fingerprint = f"hf-{digest}-eos{eos_id}"

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


Tokenizer = ByteTokenizer | HFTokenizer


def _tokenizer_file(path: Path) -> Path:
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(
                f"[data] tokenizer folder '{path.parent}' has no tokenizer.json; only fast "
                "(tokenizers-library) tokenizers are supported."
            )
    elif not path.is_file():
        raise DataError(
            f"[data] tokenizer '{path}' does not exist; use 'bytes', a tokenizer.json file or a folder holding one."
        )
    return path


def _default_eos(tok, file: Path) -> str:
    vocab = tok.get_vocab(with_added_tokens=True)
    configured = _configured_eos(file.with_name("tokenizer_config.json"))
    for token in (_EOS_CANDIDATES[0], configured, *_EOS_CANDIDATES[1:]):
        if token and token in vocab:
            return token
    raise DataError(
        f"[data] tokenizer '{file}' has none of {', '.join(_EOS_CANDIDATES)} and no eos_token in "
        "tokenizer_config.json; set [data] eos_token to its end-of-document token."
    )


def _configured_eos(config: Path) -> str:
    if not config.is_file():
        return ""
    token = json.loads(config.read_text()).get("eos_token") or ""
    return token.get("content", "") if isinstance(token, dict) else token


def load_tokenizer(spec: str, eos_token: str = "") -> Tokenizer:
    """``[data] tokenizer``: "bytes" or a path to a tokenizer.json file or folder."""
    if spec == BYTES:
        if eos_token:
            raise DataError("[data] eos_token applies to file tokenizers; the byte tokenizer's is id 0.")
        return ByteTokenizer()
    return HFTokenizer(spec, eos_token)


def check_vocab(tokenizer: Tokenizer, spec: str, vocab_size: int) -> None:
    """Every token id must have a row in the embedding."""
    if tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"[data] tokenizer '{spec}' has {tokenizer.vocab_size} tokens but [model] vocab_size is "
            f"{vocab_size}; raise [model] vocab_size to at least {tokenizer.vocab_size} or use a "
            "smaller [data] tokenizer."
        )
