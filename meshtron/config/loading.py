"""Reading a recipe: TOML text and ``--section.key value`` overrides into a checked :class:`Config`.

Each table and key is matched against the schema (:mod:`meshtron.config.schema`) and its value against the
field's type; the result is then checked (:func:`meshtron.config.checks.validate`) and ``microbatches = 0``
resolved where dp is already known (:mod:`meshtron.config.derived`). See docs/extending.md, 'A recipe key'.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

from meshtron.config.checks import validate
from meshtron.config.derived import infer_microbatches
from meshtron.config.errors import ConfigError, _closest
from meshtron.config.schema import SECTION_TYPES, Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against a field's resolved type; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin is list:  # typing.get_origin gives list for list[X] and typing.List[X] alike
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list of {item.__name__}, got {value!r}.")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported annotation {hint}")  # keep config fields simple
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        # TOML integers are 64-bit; larger ones only come from Python callers and break messages.
        raise ConfigError(f"{where} must fit in a signed 64-bit integer, got a {value.bit_length()}-bit value.")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}.")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where} must be an integer, got {value!r}.")
    if not isinstance(value, hint):
        raise ConfigError(f"{where} must be of type {hint.__name__}, got {value!r}.")
    return value


def _section_from_dict(name: str, raw: Any, source: str) -> Any:
    """The ``[name]`` section's dataclass from its TOML table, rejecting unknown keys and wrong types."""
    cls = SECTION_TYPES[name]
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: [{name}] must be a table of keys, got {raw!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    # The schema's annotations are strings (postponed evaluation); this resolves them in the schema's module.
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key '{key}' in [{name}].{_closest(key, fields)} Valid keys: {', '.join(fields)}."
            )
        values[key] = _coerce(value, hints[key], f"{source}: [{name}] {key}")
    return cls(**values)


def config_from_dict(raw: dict[str, Any], source: str = "<recipe>") -> Config:
    """Build a :class:`Config` from a parsed TOML mapping, rejecting unknown sections and keys."""
    for name in raw:
        if name not in SECTION_TYPES:
            raise ConfigError(
                f"{source}: unknown section [{name}].{_closest(name, SECTION_TYPES)} "
                f"Valid sections: {', '.join(SECTION_TYPES)}."
            )
    cfg = Config(**{n: _section_from_dict(n, raw.get(n, {}), source) for n in SECTION_TYPES})
    validate(cfg, source)
    return infer_microbatches(cfg)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The recipe as nested plain dicts and lists (JSON-ready)."""
    return dataclasses.asdict(cfg)


def _parse_override_value(text: str) -> Any:
    """Read a command-line value as TOML (so ``true``, ``2``, ``[1, 3]`` work), else as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """Turn ``["--parallel.tp", "2", "--train.steps=10"]`` into ``{"parallel": {"tp": 2}, ...}``."""
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"override '{arg}' must look like --section.key value (e.g. --parallel.tp 2).")
        if "=" in arg:
            dotted, text = arg[2:].split("=", 1)
            i += 1
        else:
            # A following flag means this one has no value; negative numbers have one dash only.
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"override '{arg}' has no value; write {arg} VALUE or {arg}=VALUE.")
            dotted, text = arg[2:], args[i + 1]
            i += 2
        section, dot, key = dotted.partition(".")
        if not (section and dot and key):
            raise ConfigError(
                f"override '{arg}' must name a section and a key, like --parallel.tp 2 or --train.steps=10."
            )
        out.setdefault(section, {})[key] = _parse_override_value(text)
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load a TOML recipe, apply ``--section.key value`` overrides and validate the result."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe '{path}' is not a file; pass --recipe with a path to a .toml file.")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err}); a recipe must be a UTF-8 TOML file.") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: malformed TOML: {err}. Fix the syntax at that line.") from None
    for section, keys in parse_overrides(overrides or []).items():
        raw.setdefault(section, {})
        if isinstance(raw[section], dict):
            raw[section].update(keys)
        else:
            raw[section] = keys
    return config_from_dict(raw, source=str(path))
