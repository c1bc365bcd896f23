"""Checking a recipe: every single value and choice, and the rules between keys that need no world size.

Each rule is one ``_require(ok, message)`` whose message names the file, the key and the fix. Fitting the
layout to the world size, the model and the batch is :func:`meshtron.parallel.layout.validate_layout`.
See docs/extending.md, 'A recipe key'.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any

from meshtron.config.choices import (
    AC_PARTS,
    AC_POLICIES,
    ACTIVATION_CHECKPOINTING,
    DATA_FORMATS,
    DATA_PARALLEL_MODES,
    DTYPES,
    FP8_RECIPES,
    FSDP_GATHERS,
    MEMORY_CHECKS,
    MIXTURE_KEYS,
    MUON_SCALES,
    NONFINITE_POLICIES,
    OFFLOADS,
    OPTIMIZERS,
    SCHEDULES,
    V_SHAPED,
    VIRTUAL,
    WANDB_MODES,
    needs_two_virtual_stages,
    needs_virtual_schedule,
    not_one_of,
)
from meshtron.config.errors import ConfigError, _closest, _require
from meshtron.config.schema import SECTION_TYPES, Config, DataConfig, ModelConfig, ParallelConfig


def _require_choice(source: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    """``key`` (e.g. "[train] dtype") must be one of ``choices``; the message suggests the closest."""
    _require(value in choices, f"{source}: " + not_one_of(key, value, choices) + _closest(value, choices))


def _validate_fp8(cfg: Config, source: str) -> None:
    fp8 = cfg.train.fp8
    _require_choice(source, "[train] fp8", fp8, FP8_RECIPES)
    if fp8 == "none":
        return
    _require(
        importlib.util.find_spec("torchao") is not None,
        f"{source}: [train] fp8 = '{fp8}' needs torchao: pip install 'meshtron[fp8]'.",
    )


def _validate_data_parallel(p: ParallelConfig, source: str) -> None:
    _require_choice(source, "[parallel] data_parallel", p.data_parallel, DATA_PARALLEL_MODES)
    _require_choice(source, "[parallel] fsdp_gather", p.fsdp_gather, FSDP_GATHERS)
    _require_choice(source, "[parallel] activation_checkpointing", p.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    _require(
        p.ac_every >= 1,
        f"{source}: [parallel] ac_every must be >= 1 (checkpoint every N-th block), got {p.ac_every}.",
    )
    _require_choice(source, "[parallel] ac_policy", p.ac_policy, AC_POLICIES)
    _require(
        not (p.compile and p.activation_checkpointing == "op"),
        f"{source}: [parallel] activation_checkpointing = 'op' does not compose with compile = true yet (a "
        "compiled block's recomputation runs its whole graph again, keeping the op outputs as well); use "
        "activation_checkpointing = 'full' or compile = false.",
    )


def _validate_ac_parts(cfg: Config, source: str) -> None:
    p, where = cfg.parallel, f"{source}: [parallel] ac_parts"
    if p.ac_policy != "parts":
        _require(
            not p.ac_parts,
            f"{where} = {p.ac_parts} is read with ac_policy = 'parts' only (got "
            f"'{p.ac_policy}'); set ac_policy = 'parts' or ac_parts = [].",
        )
        return
    _require(
        bool(p.ac_parts),
        f"{where} is empty: ac_policy = 'parts' recomputes the parts it names; name "
        f"some of {', '.join(AC_PARTS)} or use ac_policy = 'save_matmuls'.",
    )
    for part in p.ac_parts:
        _require_choice(source, "[parallel] ac_parts entry", part, AC_PARTS)
    _require(len(set(p.ac_parts)) == len(p.ac_parts), f"{where} = {p.ac_parts} names a part twice.")
    _require(
        not cfg.model.hf_model,
        f"{source}: [parallel] ac_policy = 'parts' is built for meshtron's own "
        "models; [model] hf_model trains without it (ac_policy = 'save_matmuls').",
    )


def _validate_offload(cfg: Config, source: str) -> None:
    """Host-memory offload: FSDP2's CPU offload of the sharded state, per-block activation offload."""
    p, where = cfg.parallel, f"{source}: [parallel]"
    _require_choice(source, "[parallel] offload", p.offload, OFFLOADS)
    if p.offload != "none":
        _require(
            p.data_parallel in ("fsdp", "hsdp"),
            f"{where} offload = '{p.offload}' keeps FSDP's parameter shards in host memory: it needs "
            f"data_parallel = 'fsdp' or 'hsdp', got '{p.data_parallel}'.",
        )
    _require(
        not p.offload_activations or p.activation_checkpointing != "full",
        f"{where} offload_activations = true offloads the blocks activation checkpointing does not recompute, "
        "and activation_checkpointing = 'full' recomputes every block: nothing would move. Use "
        "activation_checkpointing = 'none' or 'selective', or offload_activations = false.",
    )
    _require(
        not (p.offload_activations and p.compile),
        f"{where} offload_activations = true hooks each block's saved tensors, which compile = true would trace "
        "into the compiled graph; set one of them false.",
    )


def _validate_optimizer(cfg: Config, source: str) -> None:
    t = cfg.train
    _require_choice(source, "[train] optimizer", t.optimizer, OPTIMIZERS)
    for key in ("beta1", "beta2", "muon_momentum"):
        _require(getattr(t, key) < 1, f"{source}: [train] {key} must be in [0, 1), got {getattr(t, key)}.")
    if t.optimizer != "muon":
        return
    _require_choice(source, "[train] muon_scale", t.muon_scale, MUON_SCALES)
    _require(t.muon_ns_steps >= 1, f"{source}: [train] muon_ns_steps must be >= 1, got {t.muon_ns_steps}.")
    _require(
        len(t.muon_ns_coefficients) == 3,
        f"{source}: [train] muon_ns_coefficients must be three numbers (a, b, c), got {t.muon_ns_coefficients}.",
    )
    _require(
        not cfg.model.hf_model,
        f"{source}: [train] optimizer = 'muon' runs on meshtron's own model, which names its routers and gates; "
        "with [model] hf_model set, use optimizer = 'adamw'.",
    )
    _require(
        cfg.parallel.offload == "none",
        f"{source}: [train] optimizer = 'muon' steps on the device that holds the parameters' mesh; "
        f"[parallel] offload = '{cfg.parallel.offload}' keeps them in host memory: set offload = 'none' or "
        "optimizer = 'adamw'.",
    )


def _validate_mtp(cfg: Config, source: str) -> None:
    depth = cfg.model.num_nextn_predict_layers
    if not depth:
        return
    where = f"{source}: [model] num_nextn_predict_layers = {depth}"
    _require(
        depth < cfg.train.seq_len,
        f"{where} predicts past the sequence ([train] seq_len = {cfg.train.seq_len}): use fewer modules.",
    )
    _require(
        not cfg.model.hf_model,
        f"{where} builds meshtron's own MTP modules; a [model] hf_model is trained on its next-token loss only: "
        "set num_nextn_predict_layers = 0.",
    )
    _require(
        cfg.train.fp8 == "none",
        f"{where} runs in the training dtype for now; [train] fp8 = '{cfg.train.fp8}' would take the modules' "
        "linears too: set fp8 = 'none' or num_nextn_predict_layers = 0.",
    )
    _require(
        cfg.parallel.pp == 1,
        f"{where} runs without a pipeline for now ([parallel] pp = {cfg.parallel.pp}): the modules would need "
        "the embedding on the last stage. Use pp = 1 or num_nextn_predict_layers = 0.",
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
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
    ):
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
    for key in ("pp", "cp", "ep", "tp", "virtual_stages"):
        _require(getattr(p, key) >= 1, f"{where} {key} must be >= 1, got {getattr(p, key)}.")
    _require_choice(source, "[parallel] schedule", p.schedule, SCHEDULES)
    _require(p.virtual_stages == 1 or p.schedule in VIRTUAL, f"{where} {needs_virtual_schedule(p.virtual_stages)}.")
    _require(
        p.virtual_stages == 2 or p.schedule not in V_SHAPED,
        f"{where} schedule = '{p.schedule}' {needs_two_virtual_stages(p.virtual_stages)}.",
    )
    _validate_data_parallel(p, source)
    _validate_ac_parts(cfg, source)
    _validate_offload(cfg, source)
    _require(
        not p.tp_overlap or (p.sp and p.tp > 1 and not cfg.model.hf_model),
        f"{where} tp_overlap = true overlaps sequence parallelism's collectives with meshtron's own blocks: it "
        f"needs sp = true and tp > 1 (got sp = {str(p.sp).lower()}, tp = {p.tp})"
        + (" and applies to meshtron's own models, not [model] hf_model" if cfg.model.hf_model else "")
        + "; set those or tp_overlap = false.",
    )
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
            return f"{key} = {value} needs an MoE model (num_experts > 0); " + (
                "use dp instead." if key == "ep" else f"remove {key}."
            )
    return None


def _validate_mixture(d: DataConfig, source: str) -> None:
    """``[data] sources``: tables of a non-empty path, a positive weight and an optional text_key."""
    _require(
        not d.sources or d.source == "builtin",
        f"{source}: [data] source = '{d.source}' and [data] sources are both set; put every source in sources.",
    )
    for i, entry in enumerate(d.sources):
        where = f"{source}: [data] sources[{i}]"
        for key in entry:
            _require(
                key in MIXTURE_KEYS,
                f"{where} has unknown key '{key}'; valid keys: "
                f"{', '.join(MIXTURE_KEYS)}." + _closest(key, MIXTURE_KEYS),
            )
        _require(
            isinstance(entry.get("path"), str) and entry["path"] != "",
            f'{where} needs a path (a string), e.g. {{path = "data/web", weight = 0.7}}.',
        )
        weight = entry.get("weight")
        _require(
            isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight) and weight > 0,
            f"{where} weight must be a positive number, got {weight!r}.",
        )
        _require(isinstance(entry.get("text_key", ""), str), f"{where} text_key must be a string.")


def validate(cfg: Config, source: str = "<recipe>") -> None:
    """Checks of single values and choices; :func:`meshtron.parallel.layout.validate_layout` fits the
    layout to the ranks."""
    for name in SECTION_TYPES:
        _check_numbers(name, getattr(cfg, name), source)
    _validate_model(cfg.model, source)
    t = cfg.train
    _require_choice(source, "[train] dtype", t.dtype, DTYPES)
    _validate_fp8(cfg, source)
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
    _require_choice(source, "[track] wandb_mode", cfg.track.wandb_mode, WANDB_MODES)
    _require_choice(source, "[train] memory_check", t.memory_check, MEMORY_CHECKS)
    _require(
        not t.profile_steps or (len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1] <= t.steps),
        f"{source}: [train] profile_steps must be [first, last] with 1 <= first <= last <= steps ({t.steps}), "
        f"got {t.profile_steps}; use [] for no profile.",
    )
    _require(t.min_lr <= t.lr, f"{source}: [train] min_lr ({t.min_lr}) must not exceed lr ({t.lr}).")
    _validate_optimizer(cfg, source)
    _validate_mtp(cfg, source)
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
