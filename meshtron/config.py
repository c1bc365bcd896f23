"""Typed recipe configuration: dataclasses, TOML loading and ``--section.key value`` overrides.

A recipe is a TOML file with the sections ``[model]``, ``[parallel]``, ``[train]``, ``[data]`` and
``[checkpoint]``. ``[model]`` keys are the HuggingFace ``config.json`` names so a published config
maps onto a recipe one to one. Every problem is a :class:`ConfigError` that names the file, the key
and the fix, raised before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
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
    # A transformers model folder to train instead of meshtron's model: its config.json defines the
    # architecture and the keys below are then read from it (meshtron/hf/runner.py).
    hf_model: str = ""
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
    # Router options beyond the HF keys (0 turns each off); see meshtron/models/moe.py.
    router_z_loss_coef: float = 0.0  # ST-MoE z-loss weight, mean over MoE layers like the aux loss
    moe_aux_free_bias_rate: float = 0.0  # DeepSeek-V3 aux-loss-free balancing: bias step per update
    moe_capacity_factor: float = 0.0  # capacity = ceil(factor * global micro-batch tokens * top_k / experts)

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


def model_differences(ours: ModelConfig, theirs: dict[str, Any], source: str, ignore: tuple[str, ...]) -> str:
    """The first [model] keys whose values differ from ``theirs`` (a saved or published config, named
    ``source`` in the text), as "key: source X vs recipe Y, ..."; empty when they agree. Keys
    ``theirs`` lacks (configs saved before the key existed) and keys in ``ignore`` are not compared."""
    mine = dataclasses.asdict(ours)
    differing = [k for k in mine if k in theirs and k not in ignore and mine[k] != theirs[k]]
    return ", ".join(f"{k}: {source} {theirs[k]!r} vs recipe {mine[k]!r}" for k in differing[:4])


@dataclass
class ParallelConfig:
    pp: int = 1
    dp: int = 1  # 0: the world size divided by pp x cp x ep x tp (infer_dp)
    cp: int = 1
    ep: int = 1
    tp: int = 1
    sp: bool = False
    # Experts' own split of each stage's ranks (edp x ep x etp): each expert split over etp ranks (a
    # divisor of tp), and with fold_ep = true ep drawn from the dense ranks instead of multiplying them.
    etp: int = 1
    fold_ep: bool = False
    # How cp ranks exchange attention inputs: p2p (ring) | a2a (Ulysses) | allgather | a2a+p2p.
    cp_comm_type: str = "p2p"
    cp_a2a_size: int = 0  # a2a+p2p: cp ranks per all-to-all group; 0: the cp ranks of one node
    schedule: str = "1f1b"  # one of SCHEDULES: gpipe | 1f1b | interleaved | zb1p | zbv | dualpipev
    virtual_stages: int = 1
    microbatches: int = 1
    # How dense params use dp x ep x cp (expert params: dp x cp): "fsdp" shards over all of it,
    # "hsdp" replicates over dp and shards inside (ep x) cp, "replicate" keeps full copies (DDP-like).
    data_parallel: str = "fsdp"
    activation_checkpointing: str = "none"  # none | full (every block) | selective (every ac_every-th block)
    ac_every: int = 2
    compile: bool = False  # torch.compile each transformer block (after TP/EP/CP/AC, before FSDP)
    # FSDP: blocks whose parameters are all-gathered ahead of use (next in forward, previous in backward).
    fsdp_prefetch: int = 1

    @property
    def mesh_ep(self) -> int:
        """ep's factor in the world size and the device mesh: 1 when folded (ep then reuses dense ranks)."""
        return 1 if self.fold_ep else self.ep


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
    # A collective that waits longer than this fails instead of hanging (a dead or stuck peer).
    collective_timeout_s: float = 600.0
    # A step running longer is reported as a hang (meshtron.watchdog): which rank is behind, in which
    # collective the others wait, stacks under <output_dir>/hang/. 0: the larger of 300 s and 10 x the
    # median step, at most half of collective_timeout_s.
    hang_timeout_s: float = 0.0
    on_nonfinite: str = "stop"  # NaN/Inf loss or gradient norm: "stop" the run or "skip" the step
    # Tokens per chunk of the fused lm_head + cross-entropy: its extra memory is ~chunk x vocab / tp floats.
    loss_chunk_tokens: int = 1024
    # Before allocating, compare meshtron.plan's per-rank prediction with the device: error | warn | off.
    memory_check: str = "error"
    # Evaluation on [data] eval_source: every N steps (0: only after the final step), eval_steps global batches.
    eval_every: int = 0
    eval_steps: int = 10
    tensorboard: bool = False  # event files under <output_dir>/tensorboard (needs the tensorboard package)
    profile_steps: list[int] = field(default_factory=list)  # [first, last]: torch.profiler trace of those steps


@dataclass
class DataConfig:
    source: str = "builtin"  # "builtin" or a path to a .txt/.jsonl/.parquet file or folder, or a save_to_disk folder
    sources: list[dict] = field(default_factory=list)  # a mixture: [{path, weight[, text_key]}, ...]
    tokenizer: str = "bytes"  # "bytes" or a path to tokenizer.json / a tokenizer folder
    text_key: str = "text"  # the text field of .jsonl records
    eos_token: str = ""  # document separator of a file tokenizer; empty: found in the tokenizer
    cache_dir: str = ""  # token cache; empty: <train.output_dir>/token_cache
    format: str = "text"  # "text" (pretraining), "prompt_response" or "chat" (SFT: only responses are labels)
    prompt_key: str = "prompt"  # format = "prompt_response": the prompt's field
    response_key: str = "response"  # format = "prompt_response": the response's field
    messages_key: str = "messages"  # format = "chat": the field holding [{role, content}, ...]
    eval_source: str = ""  # held-out data for evaluation, any kind ``source`` accepts; empty: no evaluation
    # Packed windows: positions restart at every document and attention never crosses one.
    document_mask: bool = False


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: <train.output_dir>/checkpoints
    every: int = 0  # 0 disables checkpoints; otherwise every N steps and the final step
    keep: int = 0  # the newest N complete checkpoints are kept; 0 keeps all
    async_save: bool = False  # write in the background (DCP async save) while training continues
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


def _closest(name: Any, options: typing.Iterable[str]) -> str:
    by_lower = {option.lower(): option for option in options}
    match = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean '{by_lower[match[0]]}'?" if match else ""


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


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# The values of the recipe's choice keys, defined once here (below every other module): the checks
# below use them and the modules that implement the choices import them.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev")  # built by parallel/pipeline/schedules.py
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank, placed down the ranks and back up
VIRTUAL = ("interleaved",) + V_SHAPED  # the schedules that run more than one virtual stage per rank
DTYPES = ("float32", "bfloat16")
DATA_PARALLEL_MODES = ("fsdp", "hsdp", "replicate")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
NONFINITE_POLICIES = ("stop", "skip")
MEMORY_CHECKS = ("error", "warn", "off")


def not_one_of(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """The message for a choice ``key`` (e.g. "[parallel] data_parallel") set to another ``value``."""
    return f"{key} must be one of {', '.join(choices)}, got '{value}'."


def needs_virtual_schedule(virtual_stages: int) -> str:
    """Why ``virtual_stages`` > 1 needs one of the ``VIRTUAL`` schedules (recipe and build_schedule)."""
    names = ", ".join(f"'{name}'" for name in VIRTUAL[:-1]) + f" or '{VIRTUAL[-1]}'"
    return f"virtual_stages = {virtual_stages} needs schedule = {names}"


def needs_two_virtual_stages(virtual_stages: int) -> str:
    """Why a ``V_SHAPED`` schedule needs ``virtual_stages = 2`` (recipe and build_schedule)."""
    return f"needs virtual_stages = 2 (rank r runs stages r and 2 pp - 1 - r), got {virtual_stages}"


def _require_choice(source: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{source}: " + not_one_of(key, value, choices) + _closest(value, choices))


def _validate_data_parallel(p: ParallelConfig, source: str) -> None:
    _require_choice(source, "[parallel] data_parallel", p.data_parallel, DATA_PARALLEL_MODES)
    _require_choice(source, "[parallel] activation_checkpointing", p.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    _require(
        p.ac_every >= 1,
        f"{source}: [parallel] ac_every must be >= 1 (checkpoint every N-th block), got {p.ac_every}.",
    )


def _check_numbers(section: str, obj: Any, source: str) -> None:
    """No recipe number may be negative, NaN or infinite (seed is the one signed field)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: [{section}] {f.name} must be a finite number, got {value}.")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0 and f.name != "seed":
            raise ConfigError(f"{source}: [{section}] {f.name} must not be negative, got {value}.")


def _validate_model(m: ModelConfig, source: str) -> None:
    where = f"{source}: [model]"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings"):
        _require(getattr(m, key) > 0, f"{where} {key} must be positive, got {getattr(m, key)}.")
    for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
        _require(getattr(m, key) > 0, f"{where} {key} must be > 0, got {getattr(m, key)}.")
    _require(
        m.num_attention_heads % m.kv_heads == 0,
        f"{where} num_attention_heads ({m.num_attention_heads}) must be a multiple of "
        f"num_key_value_heads ({m.kv_heads}).",
    )
    _require(
        m.head_dim > 0 or m.hidden_size % m.num_attention_heads == 0,
        f"{where} hidden_size ({m.hidden_size}) is not divisible by num_attention_heads "
        f"({m.num_attention_heads}); set head_dim explicitly.",
    )
    _require(m.head_size % 2 == 0, f"{where} head size {m.head_size} must be even for RoPE.")
    _require(m.hidden_act == "silu", f"{where} hidden_act must be 'silu', got '{m.hidden_act}'.")
    bad_layers = [i for i in m.mlp_only_layers if not 0 <= i < m.num_hidden_layers]
    _require(
        not bad_layers,
        f"{where} mlp_only_layers {bad_layers} are not layer indices 0..{m.num_hidden_layers - 1}.",
    )
    if not m.is_moe:
        return
    _require(
        0 < m.num_experts_per_tok <= m.num_experts,
        f"{where} num_experts_per_tok must be in 1..num_experts ({m.num_experts}), got {m.num_experts_per_tok}.",
    )
    _require(m.moe_intermediate_size > 0, f"{where} moe_intermediate_size must be > 0 for MoE.")
    _require(m.decoder_sparse_step >= 1, f"{where} decoder_sparse_step must be >= 1, got {m.decoder_sparse_step}.")
    for key in ("router_aux_loss_coef", "router_z_loss_coef", "moe_aux_free_bias_rate", "moe_capacity_factor"):
        _require(getattr(m, key) >= 0, f"{where} {key} must be >= 0 (0 turns it off), got {getattr(m, key)}.")


def _validate_layout(cfg: Config, source: str) -> None:
    """The [parallel] checks that need no world size: each key, the schedule against virtual_stages
    and the expert keys against the model. Fitting the layout to the world size, the model and the batch
    is :func:`meshtron.parallel.layout.validate_layout`."""
    p = cfg.parallel
    where = f"{source}: [parallel]"
    for key in ("pp", "cp", "ep", "tp", "virtual_stages", "microbatches"):
        _require(getattr(p, key) >= 1, f"{where} {key} must be >= 1, got {getattr(p, key)}.")
    _require_choice(source, "[parallel] schedule", p.schedule, SCHEDULES)
    _require(
        p.virtual_stages == 1 or p.schedule in VIRTUAL, f"{where} {needs_virtual_schedule(p.virtual_stages)}."
    )
    _require(
        p.virtual_stages == 2 or p.schedule not in V_SHAPED,
        f"{where} schedule = '{p.schedule}' {needs_two_virtual_stages(p.virtual_stages)}.",
    )
    _validate_data_parallel(p, source)
    expert_keys = expert_keys_without_experts(p)
    _require(  # an hf_model folder's experts are known later: parallel/layout.py runs this rule again
        not expert_keys or cfg.model.is_moe or cfg.model.hf_model, f"{where} {expert_keys}"
    )


def expert_keys_without_experts(p: ParallelConfig) -> str | None:
    """For a model without experts: what is wrong with the first expert key set (ep, etp, fold_ep).
    The rule's one owner: the recipe check above and ``validate_layout`` (for hf_model) both use it."""
    for key, used in (("ep", p.ep > 1), ("etp", p.etp > 1), ("fold_ep", p.fold_ep)):
        if used:
            value = str(getattr(p, key)).lower()
            return (f"{key} = {value} needs an MoE model (num_experts > 0); "
                    + ("use dp instead." if key == "ep" else f"remove {key}."))
    return None


def infer_dp(cfg: Config, world_size: int) -> Config:
    """``[parallel] dp = 0`` becomes the world size divided by pp x cp x ep x tp (as Megatron infers
    its data-parallel size); any other dp is returned unchanged. Raises :class:`ConfigError` when the
    division is not exact."""
    p = cfg.parallel
    if p.dp != 0:
        return cfg
    others = p.pp * p.cp * p.mesh_ep * p.tp
    _require(
        world_size % others == 0,
        f"[parallel] dp = 0 infers dp as the world size / (pp x cp x ep x tp), but the world size {world_size} is "
        f"not a multiple of pp x cp x ep x tp = {p.pp} x {p.cp} x {p.mesh_ep} x {p.tp} = {others}"
        + (" (folded ep counts 1)" if p.fold_ep else "") + f". Launch a multiple "
        f"of {others} ranks, or set [parallel] dp explicitly.",
    )
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=world_size // others))


MIXTURE_KEYS = ("path", "weight", "text_key")
DATA_FORMATS = ("text", "prompt_response", "chat")


def _validate_mixture(d: DataConfig, source: str) -> None:
    """``[data] sources``: tables of a non-empty path, a positive weight and an optional text_key."""
    _require(
        not d.sources or d.source == "builtin",
        f"{source}: [data] source = '{d.source}' and [data] sources are both set; put every source in sources.",
    )
    for i, entry in enumerate(d.sources):
        where = f"{source}: [data] sources[{i}]"
        for key in entry:
            _require(key in MIXTURE_KEYS, f"{where} has unknown key '{key}'; valid keys: "
                     f"{', '.join(MIXTURE_KEYS)}." + _closest(key, MIXTURE_KEYS))
        _require(isinstance(entry.get("path"), str) and entry["path"] != "",
                 f"{where} needs a path (a string), e.g. {{path = \"data/web\", weight = 0.7}}.")
        weight = entry.get("weight")
        _require(
            isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight) and weight > 0,
            f"{where} weight must be a positive number, got {weight!r}.",
        )
        _require(isinstance(entry.get("text_key", ""), str), f"{where} text_key must be a string.")


def validate(cfg: Config, source: str = "<recipe>") -> None:
    """Checks of single values and choices; :func:`meshtron.parallel.layout.validate_layout` fits the
    layout to the ranks."""
    for name in _SECTION_TYPES:
        _check_numbers(name, getattr(cfg, name), source)
    _validate_model(cfg.model, source)
    t = cfg.train
    _require_choice(source, "[train] dtype", t.dtype, DTYPES)
    for key in ("steps", "global_batch_size", "seq_len", "log_every", "loss_chunk_tokens", "eval_steps"):
        _require(getattr(t, key) >= 1, f"{source}: [train] {key} must be >= 1, got {getattr(t, key)}.")
    _require(t.lr > 0, f"{source}: [train] lr must be > 0, got {t.lr}.")
    _require(
        t.collective_timeout_s > 0,
        f"{source}: [train] collective_timeout_s must be > 0 seconds, got {t.collective_timeout_s}.",
    )
    _require(
        0 <= t.hang_timeout_s < t.collective_timeout_s,
        f"{source}: [train] hang_timeout_s must be >= 0 (0: automatic) and shorter than collective_timeout_s "
        f"({t.collective_timeout_s}), got {t.hang_timeout_s}: a collective that times out first ends the job "
        "before the hang report.",
    )
    _require_choice(source, "[train] on_nonfinite", t.on_nonfinite, NONFINITE_POLICIES)
    _require_choice(source, "[train] memory_check", t.memory_check, MEMORY_CHECKS)
    _require(
        not t.profile_steps or (len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1] <= t.steps),
        f"{source}: [train] profile_steps must be [first, last] with 1 <= first <= last <= steps ({t.steps}), "
        f"got {t.profile_steps}; use [] for no profile.",
    )
    _require(t.min_lr <= t.lr, f"{source}: [train] min_lr ({t.min_lr}) must not exceed lr ({t.lr}).")
    for key in ("beta1", "beta2"):
        _require(getattr(t, key) < 1, f"{source}: [train] {key} must be in [0, 1), got {getattr(t, key)}.")
    _validate_layout(cfg, source)
    d = cfg.data
    _require(bool(d.source), f"{source}: [data] source is empty; use 'builtin' or a path to text.")
    _validate_mixture(d, source)
    _require_choice(source, "[data] format", d.format, DATA_FORMATS)
    _require(
        not t.eval_every or bool(d.eval_source),
        f"{source}: [train] eval_every = {t.eval_every} needs [data] eval_source (held-out data, e.g. a .txt or "
        ".jsonl file); set it, or set eval_every = 0.",
    )
    _require(
        d.tokenizer != "bytes" or cfg.model.vocab_size >= 256,
        f"{source}: [data] tokenizer 'bytes' needs [model] vocab_size >= 256, got {cfg.model.vocab_size}.",
    )
