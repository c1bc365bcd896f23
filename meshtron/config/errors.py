"""The recipe's error and the two helpers every part of the config package raises it with.

``_require`` and ``_closest`` are package-private: the loading, the checks and the derived values use them,
nothing outside :mod:`meshtron.config` does (tests/test_structure.py reads the messages of ``_require`` calls
as rule messages, so the name stays). See docs/extending.md, 'A recipe key'.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key and the fix."""


def _require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``: one line per rule in the checks."""
    if not ok:
        raise ConfigError(message)


def _closest(name: Any, options: typing.Iterable[str]) -> str:
    """The hint " Did you mean 'X'?" naming the option closest to a mistyped ``name`` (case-insensitive), or
    "" when none is close."""
    by_lower = {option.lower(): option for option in options}
    match = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean '{by_lower[match[0]]}'?" if match else ""
