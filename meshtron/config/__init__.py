"""Typed recipe configuration: the schema, TOML loading and ``--section.key value`` overrides, the checks.

A recipe is a TOML file with the sections ``[model]``, ``[parallel]``, ``[train]``, ``[data]`` and
``[checkpoint]``; every problem is a :class:`ConfigError` naming the file, the key and the fix, raised before any
process group exists. Callers import from ``meshtron.config``; each name has one owner module
(docs/extending.md, 'A recipe key', lists them; docs/reference.md every key).
"""

from meshtron.config.checks import expert_keys_without_experts, validate
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
    fewest_microbatches,
    microbatch_multiple,
    needs_two_virtual_stages,
    needs_virtual_schedule,
    not_one_of,
)
from meshtron.config.derived import infer_dp, infer_microbatches, rank_batch, round_up
from meshtron.config.errors import ConfigError
from meshtron.config.loading import config_from_dict, config_to_dict, load_config, parse_overrides
from meshtron.config.schema import (
    SECTION_TYPES,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    model_differences,
    recipe_key,
)

__all__ = [
    "AC_PARTS",
    "AC_POLICIES",
    "ACTIVATION_CHECKPOINTING",
    "DATA_FORMATS",
    "DATA_PARALLEL_MODES",
    "DTYPES",
    "FP8_RECIPES",
    "FSDP_GATHERS",
    "MEMORY_CHECKS",
    "MIXTURE_KEYS",
    "MUON_SCALES",
    "NONFINITE_POLICIES",
    "OPTIMIZERS",
    "WANDB_MODES",
    "OFFLOADS",
    "SCHEDULES",
    "SECTION_TYPES",
    "V_SHAPED",
    "VIRTUAL",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "config_from_dict",
    "config_to_dict",
    "expert_keys_without_experts",
    "fewest_microbatches",
    "infer_dp",
    "infer_microbatches",
    "load_config",
    "microbatch_multiple",
    "model_differences",
    "needs_two_virtual_stages",
    "needs_virtual_schedule",
    "not_one_of",
    "parse_overrides",
    "rank_batch",
    "recipe_key",
    "round_up",
    "validate",
]
