"""Pipeline parallelism for transformers models: the model-specific part, on meshtron's own pipeline.

:func:`prune_hf_to_stage` keeps this rank's chunks of blocks (in an ``nn.ModuleDict`` under their global index,
so names and checkpoints stay transformers'), the embedding on the first stage and norm, head and loss on the
last; :func:`_stage_forward` runs a chunk through the model itself so that its hooks fire, and
:class:`HFPipelineRunner` drives it with the native schedules and executor. A model whose forward does more around
its blocks than a stage reproduces is refused. See docs/hf.md, 'cp and pp for HF models'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from types import MethodType

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron import env
from meshtron.config import ConfigError, ParallelConfig
from meshtron.hf.discover import HFParts, block_call, embedding_rescaling, hf_parts, set_stage_parts
from meshtron.hf.router import PipelineRouterLoss, check_router_loss
from meshtron.mesh import dense_data_mesh
from meshtron.models.qwen2 import LMHead
from meshtron.parallel.pipeline.pipelined_runner import PipelineRunner
from meshtron.parallel.pipeline.schedules import V_SHAPED
from meshtron.parallel.pipeline.split import chunk_layer_ranges, chunk_rank
from meshtron.parallel.pipeline.stage import check_pipeline_layout
from meshtron.parallel.vocab_loss import parallel_token_loss_sum


def _replace(model: nn.Module, old: nn.Module, new: nn.Module | None) -> None:
    """Put ``new`` where ``model`` holds ``old`` (found by identity, wherever the layout keeps it)."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return
    raise AssertionError(f"{type(old).__name__} is not a submodule of {type(model).__name__}")


def stage_chunks(blocks: int, pp_rank: int, pp: int, virtual: int = 1, v_shape: bool = False) -> dict[int, range]:
    """``{global stage: block range}`` of pp-rank ``pp_rank``'s chunks of ``blocks`` decoder blocks, in
    virtual-stage order (``v_shape``: the placement of ``zbv`` / ``dualpipev``)."""
    ranges = chunk_layer_ranges(blocks, pp, virtual)
    return {s: r for s, r in enumerate(ranges) if chunk_rank(s, pp, v_shape) == pp_rank}


def prune_hf_to_stage(model: nn.Module, chunks: dict[int, range], num_stages: int) -> None:
    """Drop from ``model`` (in place) everything but the blocks of ``chunks`` (:func:`stage_chunks`), the
    embedding unless it holds global stage 0, and the final norm and head unless it holds the last."""
    parts = hf_parts(model)
    blocks = nn.ModuleDict({str(i): parts.blocks[i] for r in chunks.values() for i in r})
    _replace(model, parts.blocks, blocks)
    first, last = 0 in chunks, num_stages - 1 in chunks
    if not first:
        _replace(model, parts.embed, None)
    if not last:
        if not (first and parts.norm is parts.embed_norm):  # NanoChat's norm also runs on the embeddings
            _replace(model, parts.norm, None)
        _replace(model, parts.head, None)
    set_stage_parts(
        model,
        dataclasses.replace(
            parts,
            blocks=blocks,
            embed=parts.embed if first else None,
            embed_norm=parts.embed_norm if first else None,
            norm=parts.norm if last else None,
            head=parts.head if last else None,
        ),
    )


@contextlib.contextmanager
def whole_sequences() -> Iterator[None]:
    """Within: transformers' mask builders take each row of a batch for one sequence without asking the device.

    Given position_ids and no attention mask, they look for several sequences packed into a row
    (``masking_utils.find_packed_sequence_indices``) and decide by reading the device: one host sync per
    forward. On a dry run's fake tensors they cannot read, take the step for a traced graph and build a
    packed-sequence mask [batch, 1, seq, seq] that every attention then applies, with GQA's key/value heads
    repeated: memory in every layer that a real step does not hold. meshtron hands
    a transformers model whole sequences only (``with_hf_model`` refuses document masks): none is packed."""
    from transformers import masking_utils

    found = getattr(masking_utils, "find_packed_sequence_indices", None)
    if found is None:  # a transformers without the check: nothing to answer
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = found


def _masks(
    model: nn.Module, h: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]
) -> dict[str, torch.Tensor | None]:
    """The masks of ``kinds`` transformers builds for its blocks (None where sdpa's causal flag or the ring
    does it). Only shape, dtype and device of the stand-in embeddings are read: under SP ``h`` holds a slice."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    shape = dict(
        config=model.config,
        inputs_embeds=h.new_empty(*position_ids.shape, 0),
        attention_mask=None,
        past_key_values=None,
        position_ids=position_ids,
    )
    build = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    with whole_sequences():
        return {kind: build[kind](**shape) for kind in kinds}


def _mask_kind(model: nn.Module, block: nn.Module, index: int) -> str:
    """Block ``index``'s mask, as the decoder picks it: ``config.layer_types`` (Qwen2-MoE's sliding_window
    is 0 with every layer full), else the block's own ``attention_type`` (Gemma2 ...), else the model's
    (Mistral, Phi3 ...)."""
    types = getattr(model.config, "layer_types", None)
    if types and types[index] in ("full_attention", "sliding_attention"):
        return types[index]
    default = "sliding_attention" if getattr(model.config, "sliding_window", None) is not None else "full_attention"
    return getattr(block, "attention_type", default)


def _position_embeddings(
    rotary: nn.Module, h: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) per mask kind, as the decoder computes them: one rotary embedding for every block, or,
    where its forward takes a ``layer_type`` (Gemma 3: a local RoPE base on sliding layers), one per type."""
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return {kind: rotary(h, position_ids, layer_type=kind) for kind in kinds}
    return dict.fromkeys(kinds, rotary(h, position_ids))


def _softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The causal LM's final-logit soft-capping, for a head that is not fused with the loss."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _stage_forward(
    self,
    x: torch.Tensor,
    position_ids: torch.Tensor,
    layers: range,
    first: bool,
    last: bool,
    labels: torch.Tensor | None = None,
    **_,
) -> torch.Tensor:
    """One chunk of a pruned stage model: hidden states, or on the last chunk the summed token loss of
    ``labels`` (next-token targets). Extra keywords (a KV cache turned off by hooks) are not used."""
    parts = hf_parts(self)
    h = parts.embed(x) if first else x  # a scaled embedding (Gemma) scales in its own forward
    if first and parts.embed_norm is not None:
        h = parts.embed_norm(h)
    kinds = {i: _mask_kind(self, parts.blocks[str(i)], i) for i in layers}
    masks = _masks(self, h, position_ids, set(kinds.values()))
    rope = _position_embeddings(parts.rotary, h, position_ids, set(kinds.values()))
    for i in layers:
        block = parts.blocks[str(i)]
        out = block(
            h,
            attention_mask=masks[kinds[i]],
            position_ids=position_ids,
            position_embeddings=rope[kinds[i]],
            use_cache=False,
        )
        h = out[0] if isinstance(out, tuple) else out
    if not last:
        return h
    # What the causal LM's forward does between its head and the loss (Gemma 2/3).
    cap = getattr(self.config, "final_logit_softcapping", None)
    if isinstance(parts.head, LMHead):  # fused head + loss: the logits never exist whole
        return parts.head(parts.norm(h), labels, softcap=cap)
    return parallel_token_loss_sum(_softcapped(parts.head(parts.norm(h)), cap), labels)


class HFStageChunk:
    """:class:`~meshtron.parallel.pipeline.stage.StageChunk`'s interface over a pruned HF stage model."""

    def __init__(self, model: nn.Module, stage: int, layers: range, num_stages: int):
        self.model, self.stage, self.layers = model, stage, layers
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1

    def modules(self) -> list[nn.Module]:
        parts = hf_parts(self.model)
        mods = [parts.blocks[str(i)] for i in self.layers]
        if self.is_first:
            mods[:0] = [parts.embed] + ([parts.embed_norm] if parts.embed_norm is not None else [])
        if self.is_last:
            mods += [m for m in (parts.norm, parts.head) if m not in mods]
        return mods

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(x, position_ids, layers=self.layers, first=self.is_first, last=self.is_last, labels=labels)


# What a decoder or causal-LM forward does (these config keys) that a stage would skip, so it is refused:
# the fused loss takes soft-capping only, and the stage builds causal masks only.
_REFUSED_CONFIG = {
    "logit_scale": "scaled logits (Cohere)",
    "logits_scaling": "scaled logits (Granite)",
    "use_bidirectional_attention": "bidirectional attention",
}


# What a stage's forward hands each block (_stage_forward), and what it may leave out: caches, which training
# turns off, and attention outputs, which it never asks for.
_STAGE_BLOCK_INPUTS = {"attention_mask", "position_ids", "position_embeddings", "use_cache"}
_UNUSED_BLOCK_INPUTS = {"cache", "past_key_values", "layer_past", "cache_position", "output_attentions"}


def _check_block_inputs(parts: HFParts) -> None:
    """Refuse a decoder that hands its blocks more than a stage does: state computed outside the blocks or by
    an earlier block (Gemma 4's per-layer inputs and shared key/values, HY-V4's top-k indices) is not on
    every stage, and a block would run without it."""
    call = block_call(parts)
    if call is None:
        return
    positional, keywords = call
    extra = [f"{positional - 1} more positional argument(s)"] if positional > 1 else []
    extra += [k for k in keywords if k not in _STAGE_BLOCK_INPUTS | _UNUSED_BLOCK_INPUTS]
    if extra:
        raise ConfigError(
            f"parallelize_hf_model: pp > 1 does not support {type(parts.decoder).__name__}'s forward handing its "
            f"blocks {', '.join(extra)} beyond the hidden states, masks and positions a pipeline stage gives "
            "them (state computed outside the blocks or by an earlier block); use pp = 1."
        )


def _check_hf_pipeline(model: nn.Module, mesh: DeviceMesh, p: ParallelConfig) -> None:
    cfg, parts = model.config, hf_parts(model)
    check_pipeline_layout(p, len(parts.blocks), "parallelize_hf_model:")
    _check_block_inputs(parts)
    if rescale := embedding_rescaling(parts):  # read from the decoder's forward (Granite's embedding_multiplier)
        raise ConfigError(
            f"parallelize_hf_model: pp > 1 does not support {type(parts.decoder).__name__}'s forward "
            f"rescaling the embeddings outside its embedding module ('{rescale}'); use pp = 1."
        )
    shared = parts.embed_norm is parts.norm and any(True for _ in parts.norm.parameters())
    if shared:  # a copy on the first and on the last stage, their gradients never summed
        raise ConfigError(
            f"parallelize_hf_model: pp > 1 does not support {type(parts.decoder).__name__}'s final norm "
            f"'{parts.norm_path}' also normalising the embeddings with its own weights; use pp = 1."
        )
    for key, what in _REFUSED_CONFIG.items():
        if getattr(cfg, key, None):
            raise ConfigError(
                f"parallelize_hf_model: pp > 1 does not support {what} (config.{key} = "
                f"{getattr(cfg, key)!r}); use pp = 1."
            )
    if getattr(cfg, "output_router_logits", False):
        check_router_loss(model)
    if not isinstance(parts.rotary, nn.Module):
        raise ConfigError(
            f"parallelize_hf_model: pp > 1 needs one rotary embedding module; "
            f"{type(model).__name__} has none. Use pp = 1."
        )


def _compute_dtype(model: nn.Module, mesh: DeviceMesh, dtype: str) -> str:
    """The dtype of the activations between stages: the data-parallel wrapper's compute dtype, which
    casts only when the data mesh has more than one rank; else the model's own."""
    if dense_data_mesh(mesh).size() > 1:
        return dtype
    return str(next(model.parameters()).dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class HFStage:
    """What :class:`HFPipelineRunner` needs of a stage model that :func:`cut_to_stage` cut: the layout,
    ``{global stage: block range}`` of this rank's chunks, whether embedding and head share a weight,
    and the boundary tensors' (hidden size, dtype)."""

    parallel: ParallelConfig
    chunks: dict[int, range]
    tied: bool
    boundary: tuple[int, str]


_STAGE = "_meshtron_hf_stage"


def plan_stage(
    model: nn.Module, mesh: DeviceMesh, schedule: str, microbatches: int, virtual_stages: int, sp: bool, dtype: str
) -> HFStage:
    """Check the pipelined layout (before any collective) and work out this pp-rank's stage of ``model``."""
    p = ParallelConfig(
        pp=mesh["pp"].size(),
        cp=mesh["cp"].size(),
        tp=mesh["tp"].size(),
        sp=sp,
        schedule=schedule,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
    )
    _check_hf_pipeline(model, mesh, p)
    parts = hf_parts(model)
    tied = parts.embed.weight is parts.head.weight
    boundary = (model.config.hidden_size, _compute_dtype(model, mesh, dtype))
    chunks = stage_chunks(
        len(parts.blocks), mesh["pp"].get_local_rank(), p.pp, p.virtual_stages, p.schedule in V_SHAPED
    )
    return HFStage(p, chunks, tied, boundary)


def cut_to_stage(model: nn.Module, stage: HFStage) -> None:
    """Prune ``model`` in place to ``stage`` (:func:`plan_stage`), recording it; the other dimensions are
    applied after."""
    prune_hf_to_stage(model, stage.chunks, stage.parallel.pp * stage.parallel.virtual_stages)
    setattr(model, _STAGE, stage)


def stage_block(model: nn.Module, index: int, h: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Block ``index`` of a stage model on ``h`` (as a stage holds its input), with the masks and position
    embeddings the stage's forward builds for it."""
    return _stage_forward(model, h, position_ids, layers=range(index, index + 1), first=False, last=False)


def run_as_stage(model: nn.Module) -> None:
    """The parallelized stage model's forward becomes one chunk's (the whole-model forward cannot run on a stage)."""
    model.forward = MethodType(_stage_forward, model)


class HFPipelineRunner(PipelineRunner):
    """The pipelined runner for a transformers causal LM (``mesh['pp'] > 1``).

    ``model`` is the stage model ``parallelize_hf_model`` returns with pp > 1 (its schedule, micro-batches
    and virtual stages are the ones given there). ``forward_backward(input_ids, labels)`` takes this data
    rank's whole sequences and their next-token targets (``labels[:, t]`` is the token after position
    ``t``; -100 ignored), runs ``microbatches`` micro-batches through the schedule and accumulates the
    gradients of the global mean token loss; it returns that loss on every rank. ``module`` is
    ``model``, this rank's stage.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh):
        stage = model.__dict__.get(_STAGE)
        if stage is None:
            raise ConfigError(
                "HFPipelineRunner: pass the stage model that parallelize_hf_model returns for a mesh with pp > 1."
            )
        p = stage.parallel
        chunks = {s: HFStageChunk(model, s, r, p.pp * p.virtual_stages) for s, r in stage.chunks.items()}
        parts = hf_parts(model)
        self._start(
            model,
            chunks,
            mesh,
            p,
            stage.boundary,
            env.local_device(),
            (parts.embed, parts.head) if stage.tied else None,
            has_moe=False,
        )
        if getattr(model.config, "output_router_logits", False):
            self.relay = PipelineRouterLoss(model, self.data_group, self.device)

    def forward_backward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The step's global loss; with ``output_router_logits`` it includes ``router_aux_loss_coef`` x
        the aux loss of every micro-batch, as the causal LM's own forward adds it to each."""
        if self.relay is None:
            return super().forward_backward(input_ids, labels, position_ids)
        self.relay.start()
        return super().forward_backward(input_ids, labels, position_ids) + self.relay.step_loss()

    def _chunk_forward(self, micro: list, stage: int, x: torch.Tensor, mb: int) -> torch.Tensor:
        if self.relay is None or not torch.is_grad_enabled():  # evaluation: the token loss only
            return super()._chunk_forward(micro, stage, x, mb)
        with self.relay.recording() as logits:
            out = super()._chunk_forward(micro, stage, x, mb)
        return self.relay.attach(out, logits, stage, mb, self.chunks[stage].is_last)


__all__ = [
    "HFPipelineRunner",
    "HFStage",
    "HFStageChunk",
    "cut_to_stage",
    "plan_stage",
    "prune_hf_to_stage",
    "run_as_stage",
    "stage_block",
    "stage_chunks",
    "whole_sequences",
]
