"""Context parallelism for transformers models: meshtron's ring attention behind transformers' attention interface.

:data:`RING` is registered with ``transformers.AttentionInterface`` and runs a
:class:`~meshtron.parallel.context.RingAttention` over ``mesh['cp']`` on the q, k, v the model computed; a forward
pre-hook shards the inputs, global positions and next-token targets in the native load-balanced layout. What the
causal ring cannot honour (padding masks, dropout, soft-capping, sinks, short sliding windows) is refused.
See docs/hf.md, 'cp and pp for HF models'.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtron.config import ConfigError
from meshtron.hf.discover import calls_attention_interface, hf_parts, layer_heads
from meshtron.parallel.context import RingAttention, cp_comm, cp_groups, shard_batch
from meshtron.parallel.tensor import local_heads

RING = "meshtron_ring"


def _ring_attention(
    module: nn.Module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    **_,
):
    """transformers' attention-function signature: q [B, H, S, D], k/v [B, Hkv, S, D] -> ([B, S, H, D], None)."""
    if dropout or softcap is not None or s_aux is not None:
        raise ConfigError("context parallelism (cp > 1): attention dropout, soft-capping and sinks are not supported.")
    head_dim = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, head_dim**-0.5):
        query = query * (scaling * math.sqrt(head_dim))  # the ring scales by 1/sqrt(head_dim)
    out = module.cp_ring(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(RING, _ring_attention)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of the blocks that runs transformers' attention function, found by what its forward
    calls, not by its name; blocks without one (mamba, convolution layers) have nothing the ring serves."""
    return [
        module
        for _, block in hf_parts(model).block_items()
        for module in block.modules()
        if calls_attention_interface(module)
    ]


def check_hf_context_parallel(model: nn.Module) -> None:
    """ConfigError for what the ring cannot compute (before any collective)."""
    cfg = model.config
    for key in ("attn_logit_softcapping", "attention_dropout"):
        if getattr(cfg, key, None):
            raise ConfigError(
                f"parallelize_hf_model: cp > 1 does not support config.{key} = {getattr(cfg, key)}; "
                "use cp = 1 for this model."
            )
    for attn in _attention_modules(model):
        if isinstance(getattr(attn, "sinks", None), torch.Tensor):
            raise ConfigError(
                f"parallelize_hf_model: cp > 1 does not support attention sinks ({type(attn).__name__}."
                "sinks); use cp = 1 for this model."
            )


def check_sliding_window(config, seq_len: int) -> None:
    """A sliding window shorter than the sequence would mask keys the ring attends to."""
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ["sliding_attention"])
    if window is not None and sliding and window < seq_len:
        raise ConfigError(
            f"parallelize_hf_model: cp > 1 does not support sliding-window attention: sliding_window = {window} is "
            f"shorter than the sequence ({seq_len} tokens). Use sequences of at most {window} tokens, or cp = 1."
        )


def _common_local_heads(model: nn.Module, tp: int) -> tuple[int, int]:
    """The greatest (query, key/value) head counts dividing every block's local ones: the a2a groups split
    the heads of each (per-layer configs give blocks their own counts)."""
    counts = [local_heads(*layer_heads(model.config, i), tp) for i, _ in hf_parts(model).block_items()]
    return math.gcd(*(q for q, _ in counts)), math.gcd(*(kv for _, kv in counts))


def use_ring_attention(model: nn.Module, mesh: DeviceMesh, comm_type: str = "p2p", a2a_size: int = 0) -> None:
    """Make every block's attention meshtron's over ``mesh['cp']`` (in place): ``comm_type`` is
    ``[parallel] cp_comm_type`` (the ring ``p2p``, ``a2a``, ``allgather``, ``a2a+p2p``), ``a2a_size``
    the a2a+p2p group (0: the cp ranks of one node). The all-to-all types split each tp rank's heads."""
    _register()
    heads, kv = _common_local_heads(model, mesh["tp"].size())
    ring, a2a = cp_groups(mesh, comm_type, a2a_size, heads, kv)
    for attn in _attention_modules(model):
        attn.cp_ring = RingAttention(ring, a2a=a2a, allgather=cp_comm(comm_type).allgather)
    model.set_attn_implementation(RING)


def shard_hf_batch(mesh: DeviceMesh, config, batch: dict) -> dict:
    """This cp rank's part of a batch of whole sequences (dim 1), global positions added; ConfigError
    when the length does not split into 2 x cp chunks or a sliding window is active."""
    seq_len = batch["input_ids"].shape[1]
    check_sliding_window(config, seq_len)
    try:
        return shard_batch(batch, mesh)
    except ValueError as err:
        raise ConfigError(f"parallelize_hf_model: {err}") from None


def next_token_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Targets of every position (the next token's label; the last position has none)."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _shard_inputs(mesh: DeviceMesh):
    """Forward pre-hook: the caller's whole sequences -> this cp rank's tokens, positions and targets."""

    def hook(model, args, kwargs):
        kwargs = {**dict(zip(("input_ids", "attention_mask"), args)), **kwargs}
        if kwargs.get("attention_mask") is not None:
            raise ConfigError(
                "parallelize_hf_model: with cp > 1 pass no attention_mask (the ring attention is causal); "
                "right padding needs none, give its positions the label -100."
            )
        if kwargs.get("input_ids") is None:
            raise ConfigError("parallelize_hf_model: with cp > 1 pass input_ids (inputs_embeds are not sharded).")
        batch = {k: kwargs.pop(k) for k in ("input_ids", "position_ids") if kwargs.get(k) is not None}
        labels, targets = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        if targets is None and labels is not None:
            targets = next_token_labels(labels)
        if targets is not None:
            batch["shift_labels"] = targets
        local = shard_hf_batch(mesh, model.config, batch)
        if targets is not None:  # the loss reads shift_labels; labels only has to be present
            local["labels"] = local["shift_labels"]
        return (), {**kwargs, **local, "use_cache": False}

    return hook


def apply_hf_context_parallel(
    model: nn.Module, mesh: DeviceMesh, shard_inputs: bool = True, comm_type: str = "p2p", a2a_size: int = 0
) -> None:
    """Attention over ``mesh['cp']`` of ``comm_type`` (:func:`use_ring_attention`) and, with
    ``shard_inputs``, the input-sharding hook (in place)."""
    check_hf_context_parallel(model)
    use_ring_attention(model, mesh, comm_type, a2a_size)
    if shard_inputs:
        model.register_forward_pre_hook(_shard_inputs(mesh), with_kwargs=True)


__all__ = ["RING", "apply_hf_context_parallel", "next_token_labels", "shard_hf_batch", "use_ring_attention"]
