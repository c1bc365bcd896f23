"""The parameters a pipeline rank holds and their fp32 state, exactly (the State terms of
:mod:`meshtron.plan.memory`): each tensor's full shape, how tp / ep / etp split it, its FSDP unit, the
shard FSDP leaves this rank, and the units' sizes gathered.

Apart from the activation and schedule models because these figures are exact (``tests/test_plan.py``
checks them against a parallelized meta-device model's DTensor shards) and the step-time model reads them
as well. See docs/planner.md, 'Memory model'.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from meshtron.config import Config, ModelConfig
from meshtron.mesh import ExpertSplit, expert_hsdp_shards
from meshtron.parallel.data_parallel import data_shard_dim
from meshtron.parallel.float8 import fits_fp8, float8_all_gather
from meshtron.parallel.pipeline.schedules import V_SHAPED
from meshtron.parallel.pipeline.split import chunk_rank, split_layers
from meshtron.parallel.tensor import kv_heads_split

FP32 = 4


class Coords(NamedTuple):
    """A rank's index along each mesh dimension (the planner reports the busiest: index 0 of each)."""

    pp: int = 0
    dp: int = 0
    cp: int = 0
    ep: int = 0
    tp: int = 0


@dataclass(frozen=True)
class Param:
    """One parameter tensor of the model: its full shape and how tp / ep split it."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None  # dim split over tp (experts: over etp; None: whole on every tp rank)
    expert: bool = False  # routed experts: dim 0 split over ep, data mesh edp
    unit: str = "root"  # FSDP unit: "block.<i>", "experts.<i>", "embed", "head" or "root"


def memo_by_key(fn):
    """Cache ``fn(key, *args)`` by ``key`` alone: configs are unhashable dataclasses, and the planner
    evaluates hundreds of layouts of one model, so inventories are built once per key."""
    cache: dict = {}

    @functools.wraps(fn)
    def cached(key, *args):
        if key not in cache:
            cache[key] = fn(key, *args)
        return cache[key]

    return cached


def chunk_size(n: int, parts: int, index: int) -> int:
    """Elements of ``torch.chunk``'s piece ``index`` when ``n`` is cut into ``parts`` (DTensor Shard, FSDP2)."""
    step = -(-n // parts)
    return max(0, min(step, n - index * step))


def _layer_params(m: ModelConfig, layer: int, tp: int) -> list[Param]:
    h, d = m.hidden_size, m.head_size
    kv_dim = 0 if kv_heads_split(m.kv_heads, tp) else None
    unit = f"block.{layer}"
    p = f"layers.{layer}."
    out = [Param(p + "input_layernorm.weight", (h,), unit=unit)]
    for proj, rows, split in (
        ("q", m.num_attention_heads * d, 0),
        ("k", m.kv_heads * d, kv_dim),
        ("v", m.kv_heads * d, kv_dim),
    ):
        out.append(Param(f"{p}self_attn.{proj}_proj.weight", (rows, h), split, unit=unit))
        if m.attention_bias:
            out.append(Param(f"{p}self_attn.{proj}_proj.bias", (rows,), split, unit=unit))
    out.append(Param(p + "self_attn.o_proj.weight", (h, m.num_attention_heads * d), 1, unit=unit))
    out.append(Param(p + "post_attention_layernorm.weight", (h,), unit=unit))
    if not m.is_moe_layer(layer):
        return out + _mlp_params(p + "mlp.", h, m.intermediate_size, unit)
    e, i = m.num_experts, m.moe_intermediate_size
    out.append(Param(p + "mlp.gate.weight", (e, h), unit=unit))
    experts = f"experts.{layer}"
    for name, shape, etp_dim in (("gate_proj", (e, h, i), 2), ("up_proj", (e, h, i), 2), ("down_proj", (e, i, h), 1)):
        out.append(Param(f"{p}mlp.experts.{name}", shape, etp_dim, expert=True, unit=experts))
    if m.shared_expert_intermediate_size:
        out += _mlp_params(p + "mlp.shared_expert.", h, m.shared_expert_intermediate_size, unit)
        out.append(Param(p + "mlp.shared_expert_gate.weight", (1, h), unit=unit))
    return out


def layer_params(cfg: Config, layer: int) -> list[Param]:
    """Decoder layer ``layer``'s parameters: full shapes, and how tp / ep split them."""
    return _layer_params(cfg.model, layer, cfg.parallel.tp)


def _mlp_params(prefix: str, h: int, inner: int, unit: str) -> list[Param]:
    return [
        Param(prefix + "gate_proj.weight", (inner, h), 0, unit=unit),
        Param(prefix + "up_proj.weight", (inner, h), 0, unit=unit),
        Param(prefix + "down_proj.weight", (h, inner), 1, unit=unit),
    ]


def stage_params(cfg: Config, pp_rank: int) -> tuple[Param, ...]:
    """Parameters pipeline rank ``pp_rank`` holds (all of them when pp = 1), as ``prune_to_stage`` keeps.

    Tied embeddings: one parameter in the root unit where one rank holds both ends (pp = 1, or the
    V of ``zbv`` / ``dualpipev``); otherwise the first stage's embedding and the last stage's LM head
    are separate copies, each an FSDP unit of its own.
    """
    p = cfg.parallel
    return _stage_params((repr(cfg.model), p.tp, p.pp, p.virtual_stages, _v_shape(cfg), pp_rank), cfg.model)


@memo_by_key
def _stage_params(key: tuple, m: ModelConfig) -> tuple[Param, ...]:
    _, tp, pp, virtual, v_shape, pp_rank = key
    vocab = (m.vocab_size, m.hidden_size)
    layers = [i for r in split_layers(m.num_hidden_layers, pp, virtual, v_shape)[pp_rank] for i in r]
    last = pp_rank == _last_stage_rank(pp, virtual, v_shape)
    tied_root = m.tie_word_embeddings and pp_rank == 0 and last
    out = []
    if pp_rank == 0:
        out.append(Param("embed_tokens.weight", vocab, 0, unit="root" if tied_root else "embed"))
    for layer in layers:
        out += _layer_params(m, layer, tp)
    if last:
        out.append(Param("norm.weight", (m.hidden_size,)))
        if not tied_root:
            out.append(Param("lm_head.weight", vocab, 0, unit="head"))
        for layer in m.mtp_layers:
            out += _layer_params(m, layer, tp) + _mtp_params(m, layer)
    return tuple(out)


def _mtp_params(m: ModelConfig, layer: int) -> list[Param]:
    """A multi-token prediction module's own parameters beside its block's, whole on every tp rank."""
    h, unit, p = m.hidden_size, f"block.{layer}", f"layers.{layer}."
    norms = [Param(f"{p}{norm}.weight", (h,), unit=unit) for norm in ("enorm", "hnorm", "norm")]
    return [*norms, Param(p + "eh_proj.weight", (h, 2 * h), unit=unit)]


class ExpertCoords(NamedTuple):
    """A rank's place in its stage's expert split (``meshtron.mesh.expert_meshes``)."""

    edp: int  # ranks holding the same expert slice
    edp_index: int
    ep_index: int
    etp_index: int


def expert_coords(cfg: Config, c: Coords) -> ExpertCoords:
    p = cfg.parallel
    edp = p.dp * p.cp * p.mesh_ep * p.tp // (p.ep * p.etp)
    if p.fold_ep:  # the stage's ranks in mesh order (tp innermost) reshaped into (edp, ep, etp)
        flat = (c.dp * p.cp + c.cp) * p.tp + c.tp
        return ExpertCoords(edp, flat // (p.ep * p.etp), flat // p.etp % p.ep, flat % p.etp)
    rest = p.tp // p.etp  # edp = (dp, cp, tp / etp) in mesh order
    return ExpertCoords(edp, (c.dp * p.cp + c.cp) * rest + c.tp // p.etp, c.ep, c.tp % p.etp)


def data_shards(cfg: Config, coords: Coords, expert: bool) -> tuple[int, int]:
    """(shard count, this rank's shard index) of the data-parallel sharding (``parallel/data_parallel.py``)."""
    p, c = cfg.parallel, coords
    if p.data_parallel == "replicate":
        return 1, 0
    if expert:
        e = expert_coords(cfg, c)
        if p.data_parallel == "hsdp":  # replicate over dp slices, shard inside one
            shards = expert_hsdp_shards(dict(cp=p.cp, ep=p.mesh_ep, tp=p.tp), ExpertSplit(p.ep, p.etp, p.fold_ep))
            return shards, e.edp_index % shards
        return e.edp, e.edp_index
    ep = p.mesh_ep
    if p.data_parallel == "hsdp":  # replicate over dp, shard over cp x ep
        return p.cp * ep, c.cp * ep + c.ep
    return p.dp * p.cp * ep, (c.dp * p.cp + c.cp) * ep + c.ep


def model_parallel_shape(param: Param, cfg: Config, coords: Coords) -> list[int]:
    """The tensor this rank holds after tp and ep (experts: ep and etp), before data-parallel sharding."""
    p = cfg.parallel
    shape = list(param.shape)
    if param.expert:
        e = expert_coords(cfg, coords)
        shape[0] = chunk_size(shape[0], p.ep, e.ep_index)
        if param.tp_dim is not None:
            shape[param.tp_dim] = chunk_size(shape[param.tp_dim], p.etp, e.etp_index)
    elif param.tp_dim is not None:
        shape[param.tp_dim] = chunk_size(shape[param.tp_dim], p.tp, coords.tp)
    return shape


def _uneven_split_dims(param: Param, cfg: Config) -> set[int]:
    """The dim tp (experts: ep, etp) splits unevenly, as ``parallel.data_parallel.uneven_split_dims`` finds it."""
    p = cfg.parallel
    splits = {0: p.ep} if param.expert else {}
    if param.tp_dim is not None:
        splits[param.tp_dim] = p.etp if param.expert else p.tp
    return {d for d, n in splits.items() if param.shape[d] % n}


def local_numel(param: Param, cfg: Config, coords: Coords) -> int:
    """Elements of ``param``'s DTensor local shard on the rank at ``coords``."""
    shape = model_parallel_shape(param, cfg, coords)
    shards, index = data_shards(cfg, coords, param.expert)
    dim = fsdp_shard_dim(param, cfg, shape, shards)
    shape[dim] = chunk_size(shape[dim], shards, index)
    return math.prod(shape)


def fsdp_shard_dim(param: Param, cfg: Config, shape: list[int], shards: int) -> int:
    """The dim of ``param``'s model-parallel ``shape`` FSDP shards over ``shards`` ranks
    (``parallel.data_parallel.data_shard_dim``: not one tp / ep left uneven; experts the first ``shards`` divides)."""
    return data_shard_dim(shape, _uneven_split_dims(param, cfg), shards, prefer_even=param.expert)


def state_bytes(cfg: Config, coords: Coords = Coords()) -> dict[str, int]:  # noqa: B008 - a NamedTuple
    """Exact fp32 ``params``, ``grads`` and ``optimizer`` bytes of the rank at ``coords``: AdamW keeps two
    moments and a step count per tensor; Muon one momentum and a step count per matrix it takes."""
    elements, tensors = _local_elements((layout_key(cfg), coords), cfg)
    muon_elements = 0
    if cfg.train.optimizer == "muon":
        muon_elements, _ = _local_elements((layout_key(cfg), coords, "muon"), cfg, muon_param)
    return {
        "params": FP32 * elements,
        "grads": FP32 * elements,
        "optimizer": 2 * FP32 * (elements - muon_elements) + FP32 * muon_elements + FP32 * tensors,
    }


def muon_param(param: Param) -> bool:
    """Whether Muon takes ``param`` (``meshtron.optim.muon_matrices`` on the model): the blocks' projection
    matrices and expert stacks, not a router or a one-output gate."""
    return (
        param.name.startswith("layers.")
        and len(param.shape) >= 2
        and param.shape[-2] > 1
        and not param.name.endswith((".mlp.gate.weight", "shared_expert_gate.weight"))
    )


def layout_key(cfg: Config) -> tuple:
    """What the parameter figures depend on (the planner caches them by it)."""
    p = cfg.parallel
    return (
        repr(cfg.model),
        p.pp,
        p.dp,
        p.cp,
        p.ep,
        p.tp,
        p.etp,
        p.fold_ep,
        p.virtual_stages,
        _v_shape(cfg),
        p.data_parallel,
    )


def _v_shape(cfg: Config) -> bool:
    return cfg.parallel.schedule in V_SHAPED


def holds_last_stage(cfg: Config, pp_rank: int) -> bool:
    """Whether ``pp_rank`` runs the last stage (final norm, LM head, loss): rank pp - 1, or rank 0 of a V."""
    p = cfg.parallel
    return pp_rank == _last_stage_rank(p.pp, p.virtual_stages, _v_shape(cfg))


def _last_stage_rank(pp: int, virtual: int, v_shape: bool) -> int:
    return chunk_rank(pp * virtual - 1, pp, v_shape)


def _stage_layer_ranges(cfg: Config, pp_rank: int) -> list[range]:
    """The layer range of each chunk (virtual stage) pipeline rank ``pp_rank`` runs, in its order."""
    p = cfg.parallel
    return split_layers(cfg.model.num_hidden_layers, p.pp, p.virtual_stages, _v_shape(cfg))[pp_rank]


@memo_by_key
def _local_elements(key: tuple, cfg: Config, keep=None) -> tuple[int, int]:
    """(elements, tensors) of the rank at ``key[1]``'s parameters, those ``keep`` takes if given."""
    coords = key[1]
    params = [q for q in stage_params(cfg, coords.pp) if keep is None or keep(q)]
    return sum(local_numel(q, cfg, coords) for q in params), len(params)


def unit_elements(cfg: Config, pp_rank: int) -> dict[str, int]:
    """Unsharded elements (after tp / ep) of each FSDP unit on ``pp_rank``."""
    return dict(_unit_elements((layout_key(cfg), pp_rank), cfg))


@memo_by_key
def _unit_elements(key: tuple, cfg: Config) -> tuple[tuple[str, int], ...]:
    return _per_unit(stage_params(cfg, key[1]), lambda q: math.prod(model_parallel_shape(q, cfg, Coords())))


def unit_gathered_bytes(cfg: Config, pp_rank: int) -> dict[str, float]:
    """Bytes of each FSDP unit on ``pp_rank`` once all-gathered: the compute dtype's per element, 1 for the
    weights FSDP gathers in float8 (:func:`fp8_gathered_weights`), which torchao's float8 all-gather hands
    the block as float8 tensors: a gathered block of such weights holds half its bf16 bytes."""
    return dict(_unit_gathered_bytes((layout_key(cfg), cfg.train.dtype, cfg.train.fp8, pp_rank), cfg))


@memo_by_key
def _unit_gathered_bytes(key: tuple, cfg: Config) -> tuple[tuple[str, float], ...]:
    pp_rank, c = key[-1], compute_bytes(cfg)
    params = stage_params(cfg, pp_rank)
    float8 = {q.name for q in fp8_gathered_weights(cfg, params)}
    return _per_unit(
        params, lambda q: (1 if q.name in float8 else c) * math.prod(model_parallel_shape(q, cfg, Coords()))
    )


def compute_bytes(cfg: Config) -> int:
    return 2 if cfg.train.dtype == "bfloat16" else 4


def fp8_weights(cfg: Config, params) -> list:
    """Of ``params`` (``memory.Param``), the weights ``[train] fp8`` computes with in float8
    (``meshtron.parallel.float8``): the blocks' attention and MLP projections (the shared expert's too;
    not the routed experts, the router or the gates) whose dims are multiples of 16."""
    if cfg.train.fp8 == "none":
        return []
    return [
        q
        for q in params
        if q.unit.startswith("block")
        and not q.expert
        and q.name.endswith("_proj.weight")
        and fits_fp8(q.shape, cfg.train.fp8)
    ]


def fp8_gathered_weights(cfg: Config, params) -> list:
    """The :func:`fp8_weights` FSDP all-gathers in float8 (1 byte an element): those of the recipes with
    torchao's float8 all-gather, at tp 1 over more than one data rank, the shards on the device
    (``meshtron.parallel.float8.float8_all_gather``)."""
    p = cfg.parallel
    gathered = float8_all_gather(cfg.train.fp8, p.tp, p.dp * p.cp * p.mesh_ep, p.offload != "none")
    return fp8_weights(cfg, params) if gathered else []


def offloads_optimizer(cfg: Config) -> bool:
    return cfg.parallel.offload == "optimizer"


def _unit_grad_bytes(cfg: Config, coords: Coords) -> dict[str, float]:
    """Sharded fp32 gradient bytes of each FSDP unit on the rank at ``coords``."""
    return dict(_unit_shard_bytes((layout_key(cfg), coords), cfg))


@memo_by_key
def _unit_shard_bytes(key: tuple, cfg: Config) -> tuple[tuple[str, float], ...]:
    coords = key[1]
    return _per_unit(stage_params(cfg, coords.pp), lambda q: FP32 * local_numel(q, cfg, coords))


def _per_unit(params, value) -> tuple[tuple[str, float], ...]:
    """``value(param)`` summed per FSDP unit, in the parameters' order (memoizable: a tuple of pairs)."""
    units: dict[str, float] = {}
    for q in params:
        units[q.unit] = units.get(q.unit, 0) + value(q)
    return tuple(units.items())


def largest_layer_unit(cfg: Config, pp_rank: int) -> int:
    """Elements of the rank's largest decoder-layer unit (a block's or a layer's experts; 0 without any)."""
    return max((n for u, n in unit_elements(cfg, pp_rank).items() if u.startswith(("block.", "experts."))), default=0)
