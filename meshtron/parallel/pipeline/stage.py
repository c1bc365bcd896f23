"""This rank's pipeline stage: prune the (meta-device) model to its layers, run chunks of it.

A pp-rank keeps one model holding all its virtual stages' layers under their global indices (layout-free
checkpoints), pruned on the meta device before anything is allocated; a :class:`StageChunk` is a view that runs
one chunk's layer range and owns no parameters. See docs/pipeline.md, 'Stages and placement'.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config import Config, ConfigError, ParallelConfig
from meshtron.parallel.pipeline.schedules import check_schedule
from meshtron.parallel.pipeline.split import chunk_layer_ranges, chunk_rank


def check_pipeline(cfg: Config) -> None:
    """Raise :class:`ConfigError` for a pipeline layout that cannot run (no process group needed)."""
    check_pipeline_layout(cfg.parallel, cfg.model.num_hidden_layers, "[parallel]")


def check_pipeline_layout(p: ParallelConfig, num_layers: int, where: str) -> None:
    """:func:`check_pipeline` for ``num_layers`` blocks; ``where`` starts the message."""
    try:
        check_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
        chunk_layer_ranges(num_layers, p.pp, p.virtual_stages)
    except ValueError as err:
        raise ConfigError(f"{where} {err}") from None


class StageChunk:
    """Runs model chunk ``stage`` (a consecutive layer range) of a pruned stage model.

    The first chunk embeds token ids, the last applies the final norm and the LM head; the others
    take and return hidden states ``[B, S, H]``. With tied embeddings the first and last stages hold
    separate copies of the shared weight (the runner keeps them equal).
    """

    def __init__(self, model: nn.Module, stage: int, layers: range, num_stages: int):
        self.model, self.stage, self.layers = model, stage, layers
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1

    def modules(self) -> list[nn.Module]:
        """The modules whose parameters this chunk uses (for per-chunk gradient-sync control); the stage
        model's own parameters (e.g. the final norm) belong to the last chunk."""
        mods = [self.model.layers[str(i)] for i in self.layers]
        if self.is_first:
            mods.insert(0, self.model.embed_tokens)
        if self.is_last:
            mods += [self.model.norm, self.model.lm_head]
        return mods

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states, or on the last chunk with ``labels`` the summed token loss."""
        # Through the stage model's own call, so hooks on it (FSDP's root unit, TP's) run per chunk.
        return self.model(x, position_ids, layers=self.layers, labels=labels)


def prune_to_stage(
    model: nn.Module, pp_rank: int, pp: int, virtual: int = 1, v_shape: bool = False
) -> dict[int, range]:
    """Drop from ``model`` (in place) everything pp-rank ``pp_rank`` does not run (``v_shape``: the
    placement of ``zbv`` / ``dualpipev``, see ``split.chunk_rank``).

    Returns ``{global stage: layer range}`` for this rank's chunks, in model order.
    """
    ranges = chunk_layer_ranges(len(model.layers), pp, virtual)
    mine = {s: r for s, r in enumerate(ranges) if chunk_rank(s, pp, v_shape) == pp_rank}
    keep = {str(i) for r in mine.values() for i in r}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if 0 not in mine:
        model.embed_tokens = None
    if len(ranges) - 1 not in mine:
        model.norm = None
        model.lm_head = None
    return mine


def build_chunks(model: nn.Module, stages: dict[int, range], num_stages: int) -> dict[int, StageChunk]:
    return {s: StageChunk(model, s, r, num_stages) for s, r in stages.items()}
