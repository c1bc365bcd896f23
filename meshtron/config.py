"""Typed recipe configuration: dataclasses, TOML loading and ``--section.key value`` overrides.

A recipe is a TOML file with the sections ``[model]``, ``[parallel]``, ``[train]``, ``[data]`` and
``[checkpoint]``. ``[model]`` keys are the HuggingFace ``config.json`` names so a published config
maps onto a recipe one to one. Every problem is a :class:`ConfigError` that names the file, the key
and the fix, raised before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key and the fix."""


@dataclass
class ModelConfig:
    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0 means hidden_size // num_attention_heads
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = True  # Qwen2 has q/k/v biases; Llama-style models do not
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    # Mixture of experts (num_experts == 0 means a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen2-MoE's rule: sparse every ``decoder_sparse_step`` layers unless listed as MLP-only."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass
class ParallelConfig:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    sp: bool = False
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    virtual_stages: int = 1
    microbatches: int = 1


@dataclass
class TrainConfig:
    steps: int = 10
    seed: int = 0
    dtype: str = "float32"  # float32 | bfloat16
    global_batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float = 1.0
    log_every: int = 1
    output_dir: str = "runs/default"


@dataclass
class DataConfig:
    source: str = "builtin"  # "builtin" or a path to a .txt/.jsonl file or folder
    tokenizer: str = "bytes"  # "bytes" or a path to tokenizer.json / a tokenizer folder
    text_key: str = "text"  # the text field of .jsonl records
    eos_token: str = ""  # document separator of a file tokenizer; empty: found in the tokenizer
    cache_dir: str = ""  # token cache; empty: <train.output_dir>/token_cache


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: <train.output_dir>/checkpoints
    every: int = 0  # 0 disables periodic checkpoints
    resume: bool = False
    init_from_hf: str = ""
    export_hf: str = ""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
}


def _closest(name: str, options: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" Did you mean '{match[0]}'?" if match else ""


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a dataclass annotation; ints are accepted where floats are expected."""
    hint = eval(annotation, vars(sys.modules[__name__])) if isinstance(annotation, str) else annotation
    origin = typing.get_origin(hint)
    if origin in (list, typing.List):
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list of {item.__name__}, got {value!r}.")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported annotation {hint}")  # keep config fields simple
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
    cls = _SECTION_TYPES[name]
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: [{name}] must be a table of keys, got {raw!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key '{key}' in [{name}].{_closest(key, fields)} "
                f"Valid keys: {', '.join(fields)}."
            )
        values[key] = _coerce(value, fields[key].type, f"{source}: [{name}] {key}")
    return cls(**values)


def config_from_dict(raw: dict[str, Any], source: str = "<recipe>") -> Config:
    """Build a :class:`Config` from a parsed TOML mapping, rejecting unknown sections and keys."""
    for name in raw:
        if name not in _SECTION_TYPES:
            raise ConfigError(
                f"{source}: unknown section [{name}].{_closest(name, _SECTION_TYPES)} "
                f"Valid sections: {', '.join(_SECTION_TYPES)}."
            )
    cfg = Config(**{n: _section_from_dict(n, raw.get(n, {}), source) for n in _SECTION_TYPES})
    validate(cfg, source)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
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
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"override '{arg}' must look like --section.key value (e.g. --parallel.tp 2).")
        if "=" in arg:
            dotted, text = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' has no value; write {arg} VALUE.")
            dotted, text = arg[2:], args[i + 1]
            i += 2
        section, key = dotted.split(".", 1)
        out.setdefault(section, {})[key] = _parse_override_value(text)
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load a TOML recipe, apply ``--section.key value`` overrides and validate the result."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe '{path}' does not exist; pass --recipe with a path to a .toml file.")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: malformed TOML: {err}. Fix the syntax at that line.") from None
    for section, keys in parse_overrides(overrides or []).items():
        raw.setdefault(section, {})
        if isinstance(raw[section], dict):
            raw[section].update(keys)
        else:
            raw[section] = keys
    return config_from_dict(raw, source=str(path))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config, source: str = "<recipe>") -> None:
    """Checks that need no process group: value ranges and choices. Layout checks live in mesh.py."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        _require(getattr(m, key) > 0, f"{source}: [model] {key} must be positive, got {getattr(m, key)}.")
    _require(m.num_key_value_heads >= 0, f"{source}: [model] num_key_value_heads must be >= 0.")
    _require(
        m.num_attention_heads % m.kv_heads == 0,
        f"{source}: [model] num_attention_heads ({m.num_attention_heads}) must be a multiple of "
        f"num_key_value_heads ({m.kv_heads}).",
    )
    _require(
        m.head_dim > 0 or m.hidden_size % m.num_attention_heads == 0,
        f"{source}: [model] hidden_size ({m.hidden_size}) is not divisible by num_attention_heads "
        f"({m.num_attention_heads}); set head_dim explicitly.",
    )
    _require(m.head_size % 2 == 0, f"{source}: [model] head size {m.head_size} must be even for RoPE.")
    _require(m.hidden_act == "silu", f"{source}: [model] hidden_act must be 'silu', got '{m.hidden_act}'.")
    if m.is_moe:
        _require(
            0 < m.num_experts_per_tok <= m.num_experts,
            f"{source}: [model] num_experts_per_tok must be in 1..num_experts ({m.num_experts}), "
            f"got {m.num_experts_per_tok}.",
        )
        _require(m.moe_intermediate_size > 0, f"{source}: [model] moe_intermediate_size must be > 0 for MoE.")
        _require(m.decoder_sparse_step >= 1, f"{source}: [model] decoder_sparse_step must be >= 1.")
    else:
        _require(m.intermediate_size > 0, f"{source}: [model] intermediate_size must be > 0.")
    for key in ("pp", "dp", "cp", "ep", "tp", "virtual_stages", "microbatches"):
        _require(getattr(p, key) >= 1, f"{source}: [parallel] {key} must be >= 1, got {getattr(p, key)}.")
    schedules = ("gpipe", "1f1b", "interleaved")
    _require(
        p.schedule in schedules,
        f"{source}: [parallel] schedule must be one of {', '.join(schedules)}, got '{p.schedule}'."
        + _closest(p.schedule, schedules),
    )
    _require(
        p.virtual_stages == 1 or p.schedule == "interleaved",
        f"{source}: [parallel] virtual_stages = {p.virtual_stages} needs schedule = 'interleaved'.",
    )
    _require(p.ep == 1 or m.is_moe, f"{source}: [parallel] ep = {p.ep} needs an MoE model (num_experts > 0).")
    dtypes = ("float32", "bfloat16")
    _require(t.dtype in dtypes, f"{source}: [train] dtype must be one of {', '.join(dtypes)}, got '{t.dtype}'.")
    for key in ("steps", "global_batch_size", "seq_len", "log_every"):
        _require(getattr(t, key) >= 1, f"{source}: [train] {key} must be >= 1, got {getattr(t, key)}.")
    _require(t.lr > 0, f"{source}: [train] lr must be > 0, got {t.lr}.")
    _require(cfg.checkpoint.every >= 0, f"{source}: [checkpoint] every must be >= 0.")
