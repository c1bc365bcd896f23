"""The values a recipe may leave to meshtron: ``[parallel] dp = 0`` and ``microbatches = 0``, and the
per-rank batch both are fitted to.

dp needs the world size, so :func:`infer_dp` runs at launch; ``microbatches = 0`` is resolved as soon as dp
is known (when the recipe is read, or by :func:`infer_dp`). See docs/extending.md, 'A recipe key'.
"""

from __future__ import annotations

import dataclasses

from meshtron.config.choices import fewest_microbatches, microbatch_multiple
from meshtron.config.errors import ConfigError, _require
from meshtron.config.schema import Config


def infer_dp(cfg: Config, world_size: int) -> Config:
    """``[parallel] dp = 0`` becomes the world size divided by pp x cp x ep x tp (as Megatron infers
    its data-parallel size); any other dp is returned unchanged. Raises :class:`ConfigError` when the
    division is not exact."""
    p = cfg.parallel
    if p.dp != 0:
        return infer_microbatches(cfg)
    others = p.pp * p.cp * p.mesh_ep * p.tp
    _require(
        world_size % others == 0,
        f"[parallel] dp = 0 infers dp as the world size / (pp x cp x ep x tp), but the world size {world_size} is "
        f"not a multiple of pp x cp x ep x tp = {p.pp} x {p.cp} x {p.mesh_ep} x {p.tp} = {others}"
        + (" (folded ep counts 1)" if p.fold_ep else "")
        + f". Launch a multiple "
        f"of {others} ranks, or set [parallel] dp explicitly.",
    )
    return infer_microbatches(dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=world_size // others)))


def rank_batch(cfg: Config) -> int:
    """The sequences of a step each data-parallel (and expert-parallel) rank reads; dp must be known."""
    t, readers = cfg.train, cfg.parallel.dp * cfg.parallel.mesh_ep
    _require(
        t.global_batch_size % readers == 0,
        f"[train] global_batch_size = {t.global_batch_size} must be a multiple of dp x ep = {readers} "
        f"(the batch is split over dp and ep). Use global_batch_size = {round_up(t.global_batch_size, readers)}.",
    )
    return t.global_batch_size // readers


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` not below ``value`` (the fix an error message suggests)."""
    return -(-value // multiple) * multiple


def infer_microbatches(cfg: Config) -> Config:
    """``[parallel] microbatches = 0`` becomes the fewest micro-batches that divide the per-rank batch and
    that the schedule runs: 1 without a pipeline, pp for 1F1B, 2 pp for ``zbv``. The global batch stays as
    set (Megatron also derives its count from the batch sizes), so a recipe written without a pipeline runs
    with one by overriding pp alone. Waits for a concrete dp (:func:`infer_dp` calls it again)."""
    p = cfg.parallel
    if p.microbatches != 0 or p.dp == 0:
        return cfg
    local = rank_batch(cfg)
    fewest, multiple = fewest_microbatches(p.schedule, p.pp), microbatch_multiple(p.schedule, p.pp)
    for count in range(fewest, local + 1):
        if local % count == 0 and count % multiple == 0:
            return dataclasses.replace(cfg, parallel=dataclasses.replace(p, microbatches=count))
    raise ConfigError(
        f"[parallel] microbatches = 0 takes the fewest micro-batches that divide the per-rank batch "
        f"global_batch_size / (dp x ep) = {local} and that schedule = '{p.schedule}' runs on pp = {p.pp} stages "
        f"(at least {fewest}{f', a multiple of {multiple}' if multiple > 1 else ''}); none does. Raise [train] "
        f"global_batch_size, lower pp or dp, or set microbatches."
    )
