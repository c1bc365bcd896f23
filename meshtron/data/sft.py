"""Supervised fine-tuning examples: the pieces of each example, and whether their tokens count in the loss.

``[data] format``: ``prompt_response`` records (only the response and the end-of-document id are labels) or
``chat`` messages rendered with the tokenizer's chat template (only what assistant messages add counts). Each
piece is tokenized on its own, so a token never straddles the prompt/response boundary. See docs/data.md, 'SFT'.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from meshtron.data.sources import DataError, iter_records

PROMPT_RESPONSE, CHAT = "prompt_response", "chat"


def example_pieces(path: Path, data, template: ChatTemplate | None) -> Iterator[tuple[str, bool, bool]]:
    """``(text, ends_document, counted)`` for each piece of each example of one file."""
    if path.name.endswith((".txt", ".txt.gz")):
        raise DataError(
            f"[data] format = '{data.format}' reads records; '{path}' is plain text. "
            "Use .jsonl, .parquet or a save_to_disk folder."
        )
    if data.format == PROMPT_RESPONSE:
        keys = (data.prompt_key, data.response_key)
        for where, record in iter_records(path, keys):
            prompt, response = (_text(where, key, record[key]) for key in keys)
            yield prompt, False, False
            yield response, True, True
        return
    for where, record in iter_records(path, (data.messages_key,)):
        pieces = template.pieces(_messages(where, data.messages_key, record[data.messages_key]), where)
        for i, (text, counted) in enumerate(pieces):
            yield text, i == len(pieces) - 1, counted


def _text(where: str, key: str, value) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' is {type(value).__name__}, not text.")
    return value


def _messages(where: str, key: str, value) -> list[dict]:
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )
    if not ok or not value:
        raise DataError(f"{where}: field '{key}' must be a non-empty list of {{role, content}} messages (text).")
    return value


class ChatTemplate:
    """The tokenizer's Jinja chat template, rendered the way transformers renders it."""

    def __init__(self, tokenizer_file: Path):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        config_path = tokenizer_file.with_name("tokenizer_config.json")
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = _template_source(tokenizer_file, config)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except TemplateError as err:
            raise DataError(f"the chat template of '{tokenizer_file}' is not valid Jinja: {err}.") from None
        self._special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        self.fingerprint = hashlib.sha256(source.encode()).hexdigest()[:16]

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._special)

    def pieces(self, messages: list[dict], where: str) -> list[tuple[str, bool]]:
        """``(text, counted)`` pieces whose concatenation is the rendered conversation."""
        pieces: list[tuple[str, bool]] = []
        done = ""
        for i, message in enumerate(messages):
            assistant = message["role"] == "assistant"
            if assistant:  # the header the model is prompted with is not its to predict
                done = self._extend(pieces, done, self.render(messages[:i], True), False, where)
            done = self._extend(pieces, done, self.render(messages[: i + 1], False), assistant, where)
        return pieces

    @staticmethod
    def _extend(pieces: list, done: str, rendered: str, counted: bool, where: str) -> str:
        if not rendered.startswith(done):
            raise DataError(
                f"{where}: the chat template does not render this conversation as an extension of its "
                "prefixes, so the assistant's tokens cannot be told apart; use format = 'prompt_response'."
            )
        pieces.append((rendered[len(done) :], counted))
        return rendered


def _template_source(tokenizer_file: Path, config: dict) -> str:
    beside = tokenizer_file.with_name("chat_template.jinja")
    source = beside.read_text() if beside.is_file() else config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        raise DataError(
            f"[data] format = 'chat' needs a chat template, but '{tokenizer_file.parent}' has neither "
            "chat_template.jinja nor a chat_template in tokenizer_config.json; add one or use "
            "format = 'prompt_response'."
        )
    return source


def _token_text(token) -> str:
    return token.get("content", "") if isinstance(token, dict) else (token or "")


def _raise(message: str):
    raise DataError(f"the chat template refused a conversation: {message}")
