"""The values of the recipe's choice keys, and the rules and messages that go with a choice.

Defined once here, below every other module: :mod:`meshtron.config.checks` checks a recipe against them,
and the modules that implement the choices (the pipeline schedules, data parallelism, recomputation,
FP8) import them from :mod:`meshtron.config`. See docs/extending.md, 'A recipe key'.
"""

from __future__ import annotations

from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev")  # built by parallel/pipeline/schedules.py
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank, placed down the ranks and back up
VIRTUAL = ("interleaved",) + V_SHAPED  # the schedules that run more than one virtual stage per rank
DTYPES = ("float32", "bfloat16")
FP8_RECIPES = (
    "none",
    "tensorwise",
    "rowwise",
    "rowwise_with_gw_hp",
    "mxfp8",
)  # torchao's names; meshtron/parallel/float8.py
DATA_PARALLEL_MODES = ("fsdp", "hsdp", "replicate")
FSDP_GATHERS = ("per_microbatch", "per_step")  # how often FSDP gathers a unit under accumulation
ACTIVATION_CHECKPOINTING = ("none", "full", "selective", "op")
AC_POLICIES = ("save_matmuls", "alternate_matmuls", "parts")
AC_PARTS = ("core_attn", "mlp", "moe_experts")  # [parallel] ac_parts; meshtron/parallel/recompute.py
OFFLOADS = ("none", "optimizer")  # [parallel] offload; meshtron/parallel/data_parallel.py
NONFINITE_POLICIES = ("stop", "skip")
WANDB_MODES = ("offline", "online")  # [track] wandb_mode
MEMORY_CHECKS = ("error", "warn", "off")
OPTIMIZERS = ("adamw", "muon")  # [train] optimizer; meshtron/optim.py
MUON_SCALES = ("adamw_rms", "spectral")  # [train] muon_scale


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


def fewest_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches ``schedule`` runs on ``pp`` stages: one per stage, one per chunk for the
    V-shaped schedules (their warm-up fills both chunks of every rank). Owned here for the pipeline's
    checks (``parallel/pipeline/schedules.py``) and ``microbatches = 0``."""
    if pp == 1:
        return 1
    return 2 * pp if schedule in V_SHAPED else pp


def microbatch_multiple(schedule: str, pp: int) -> int:
    """What the micro-batch count must be a multiple of: pp for ``interleaved``, which feeds each chunk
    micro-batches in groups of pp; 1 otherwise."""
    return pp if schedule == "interleaved" and pp > 1 else 1


MIXTURE_KEYS = ("path", "weight", "text_key")  # the keys of a [data] sources table
DATA_FORMATS = ("text", "prompt_response", "chat")
