"""Data parallelism over the data meshes: FSDP2, HSDP or replication, with mixed precision.

Owns the FSDP units and their data meshes, the summed (not averaged) gradient reduction, what each
micro-batch gathers and reduces (:class:`MicrobatchSync`), prefetch, the optimizer's host offload policy and
the FSDP calls the pipeline executor needs. See docs/training.md#data-parallelism.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from meshtron.config import DATA_PARALLEL_MODES, DTYPES, OFFLOADS, ParallelConfig, not_one_of
from meshtron.mesh import dense_data_mesh, expert_data_mesh, expert_hsdp_mesh, expert_split
from meshtron.models.moe import MoE, moe_layers
from meshtron.parallel.expert import ExpertDispatch
from meshtron.parallel.recompute import hooks_outside_op_record
from meshtron.torch_private import (
    ReplicateModule,
    concatenate_meshes,
    flatten_mesh,
    fsdp_post_backward,
    fsdp_root_final_callback,
    replicate,
)

_DTYPES = {name: getattr(torch, name) for name in DTYPES}
# FSDP2's no-offload policy: the one instance every default shares (a call in the signature would be B008).
_NO_OFFLOAD = OffloadPolicy()


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction for ``bfloat16``; no casting for ``float32``."""
    if dtype not in _DTYPES:
        raise ValueError(not_one_of("[train] dtype", dtype, DTYPES))
    if dtype == "float32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=_DTYPES[dtype], reduce_dtype=torch.float32)


def offload_policy(offload: str, mode: str, device_type: str) -> OffloadPolicy:
    """FSDP2's policy for ``[parallel] offload`` (docs/training.md#host-memory-offload): pinned host
    memory on CUDA only."""
    if offload not in OFFLOADS:
        raise ValueError(not_one_of("[parallel] offload", offload, OFFLOADS))
    if offload == "none":
        return OffloadPolicy()
    if mode == "replicate":
        raise ValueError(
            "[parallel] offload = 'optimizer' needs sharded data parallelism (fsdp or hsdp), not replicate."
        )
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def data_meshes(mesh: DeviceMesh, mode: str) -> tuple[DeviceMesh, DeviceMesh]:
    """(dense mesh, expert mesh) for ``mode``: 1-D for fsdp/replicate, (replicate, shard) for hsdp."""
    if mode not in DATA_PARALLEL_MODES:
        raise ValueError(not_one_of("[parallel] data_parallel", mode, DATA_PARALLEL_MODES))
    if mode != "hsdp":
        return dense_data_mesh(mesh), expert_data_mesh(mesh)
    # Joining dp with the flattened (cp, ep) mesh; slicing a flattened dim out of the root mesh
    # is deprecated. DeviceMesh flattens dims in mesh order (pp, dp, cp, ep, tp), hence "cp_ep".
    shard = flatten_mesh(mesh[("cp", "ep")], "cp_ep")
    return concatenate_meshes([mesh["dp"], shard]), expert_hsdp_mesh(mesh)


def data_shard_dim(shape: Sequence[int], split_unevenly: Collection[int], shards: int, prefer_even: bool) -> int:
    """The dim of a parameter's local ``shape`` that FSDP shards over ``shards`` ranks: dim 0 (with
    ``prefer_even``, the first dim ``shards`` divides), never a dim a model-parallel split left uneven.

    Experts split by EP hold E/ep local experts, often fewer than the expert data ranks (e.g. 64
    experts, ep = 8, dp x cp = 16): sharding that dim again would be uneven and strided, which DTensor
    cannot redistribute, so they prefer an even dim. A vocabulary tp does not divide (GPT-2's 50,257 at
    tp 2) must not be sharded again either: torch's offsets for such a strided shard are wrong, which
    would misplace initial weights and checkpoint slices.
    """
    dims = [d for d in range(len(shape)) if d not in split_unevenly] or [0]
    if prefer_even:
        return next((d for d in dims if shape[d] % shards == 0), dims[0])
    return dims[0]


def uneven_split_dims(param: torch.Tensor) -> set[int]:
    """Dims of a DTensor ``param`` that a Shard placement splits unevenly over its mesh dimension."""
    if not isinstance(param, DTensor):
        return set()
    return {
        p.dim
        for p, n in zip(param.placements, param.device_mesh.shape)
        if isinstance(p, Shard) and param.shape[p.dim] % n
    }


def shard_placement(shards: int, prefer_even: bool = False):
    """FSDP's ``shard_placement_fn``: Shard(:func:`data_shard_dim`) of each parameter."""

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(data_shard_dim(local.shape, uneven_split_dims(param), shards, prefer_even))

    return placement


def wrap_data_parallel(
    module: nn.Module | list[nn.Module],
    data_mesh: DeviceMesh,
    mode: str,
    policy: MixedPrecisionPolicy,
    prefer_even: bool = False,
    offload: OffloadPolicy = _NO_OFFLOAD,
) -> FSDPModule:
    """One FSDP2 (or replicate) unit whose gradients are summed over ``data_mesh``, not averaged:
    each rank's loss is already its share of the global loss. A list of modules (FSDP only) is one unit:
    gathered before the first of them runs, freed after the last."""
    if mode == "replicate":
        unit = replicate(module, mesh=data_mesh, mp_policy=policy)
    else:
        placement = shard_placement(data_mesh.size(data_mesh.ndim - 1), prefer_even)  # the shard dim (last for HSDP)
        unit = fully_shard(
            module, mesh=data_mesh, mp_policy=policy, shard_placement_fn=placement, offload_policy=offload
        )
    members = unit if isinstance(unit, list) else [unit]
    if data_mesh.size() > 1:
        # On one rank the sum is the gradient itself, and the factor would cost a pass: FSDP2's one-rank
        # path copies the gradient divided by any factor set, even 1 (benchmarks/results/mfu_profile.txt).
        members[0].set_gradient_divide_factor(1.0)  # the members of a list share one state
    members[0].set_force_sum_reduction_for_comms(True)  # a factor alone becomes PREMUL_SUM, which gloo lacks
    for member in members:
        hooks_outside_op_record(member)  # a unit in (or of) a checkpointed block: its hooks replay unevenly
    return unit


def _untied_vocab_modules(embed: nn.Module | None, head: nn.Module | None) -> list[nn.Module]:
    """Embedding and lm_head as units of their own, unless tied (one parameter needs one unit).

    The root unit stays gathered from forward to the end of backward; keeping the two largest
    matrices out of it frees them between uses (about 2 GiB of bf16 for Qwen2.5-7B).
    """
    if embed is not None and head is not None and embed.weight is head.weight:
        return []
    return [m for m in (embed, head) if m is not None]


def wrap_units(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    experts: Sequence[nn.Module],
    vocab: tuple[nn.Module | None, nn.Module | None],
    meshes: tuple[DeviceMesh, DeviceMesh],
    mode: str,
    policy: MixedPrecisionPolicy,
    offload: OffloadPolicy = _NO_OFFLOAD,
    dense: bool = True,
) -> None:
    """The data-parallel units of ``model`` (meshtron's or a transformers model, whole or a pipeline
    stage), innermost first since a unit takes the parameters no unit inside it holds: the ``experts``
    modules on the expert data mesh of ``meshes`` (dense, expert), then, with ``dense``, the ``blocks``,
    the ``vocab`` (embedding, lm_head) unless tied and the root on the dense one. Which modules are
    units is decided here only: :func:`apply_data_parallel` and the HF path (``hf/parallelize.py``) call it."""
    dense_mesh, expert_mesh = meshes
    for module in experts:
        wrap_data_parallel(module, expert_mesh, mode, policy, prefer_even=True, offload=offload)
    if dense:
        for unit in _sharing_groups([*blocks, *_untied_vocab_modules(*vocab)]):
            if len(unit) == 1 or mode != "replicate":  # replicate takes one module: the root holds the group
                wrap_data_parallel(unit if len(unit) > 1 else unit[0], dense_mesh, mode, policy, offload=offload)
        wrap_data_parallel(model, dense_mesh, mode, policy, offload=offload)


def _sharing_groups(modules: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """``modules`` grouped so that those sharing a Parameter (weights reused by several decoder layers, as
    Zamba2's hybrid layers reuse their transformer block) are one unit: a Parameter in two units would become
    two copies whose gradients are split and which drift apart."""
    groups: list[tuple[list[nn.Module], set[int]]] = []  # (members, ids of their parameters)
    for module in modules:
        members, ids = [module], {id(p) for p in module.parameters()}
        for group in [g for g in groups if g[1] & ids]:
            groups.remove(group)
            members, ids = group[0] + members, group[1] | ids
        groups.append((members, ids))
    return [members for members, _ in groups]


def _check_experts_split(model: nn.Module, mesh: DeviceMesh) -> None:
    """Expert gradients are reduced over edp only, which holds tp ranks: the experts must be split
    over ep x etp, and under tp their tokens split over tp (each tp rank computing its own share)."""
    split, tp = expert_split(mesh), mesh["tp"].size()
    for name, moe in ((n, m) for n, m in model.named_modules() if isinstance(m, MoE)):
        if tp > 1 and not isinstance(moe.experts, ExpertDispatch):
            raise ValueError(
                f"tp = {tp} but the experts of '{name}' do not split their tokens over tp; their gradients "
                "would be counted once per tp rank. Apply expert parallelism before data parallelism."
            )
        for pname, param in moe.experts.named_parameters():
            if split.ep * split.etp > 1 and not (
                isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ())
            ):
                raise ValueError(
                    f"ep x etp = {split.ep} x {split.etp} but expert weight '{pname}' is not split over the "
                    "experts' mesh; its gradient would miss the other expert ranks' tokens. Apply expert "
                    "parallelism before data parallelism."
                )


def _execution_order(model: nn.Module) -> list[list[FSDPModule]]:
    """FSDP units in forward order, one entry per step of the chain: [embedding], each block with its
    experts' units, [LM head]. A new run starts wherever the layer index does not follow on."""
    runs: list[list[list[FSDPModule]]] = []
    separate = {
        id(m) for m in _untied_vocab_modules(model.embed_tokens, model.lm_head)
    }  # tied ones live in the root unit
    embed = model.embed_tokens if id(model.embed_tokens) in separate else None
    head = model.lm_head if id(model.lm_head) in separate else None
    last_layer = model.config.num_hidden_layers - 1
    previous = None
    for key, block in sorted(model.layers.items(), key=lambda item: int(item[0])):
        index = int(key)
        if previous is None or index != previous + 1:
            runs.append([[embed]] if index == 0 and embed is not None else [])
        runs[-1].append([block, *(m.experts for m in moe_layers(block))])
        if index == last_layer and head is not None:
            runs[-1].append([head])
        previous = index
    return runs


def set_prefetch(model: nn.Module, depth: int) -> None:
    """Explicit forward/backward prefetch of the next/previous ``depth`` blocks (docs/training.md#data-parallelism)."""
    if depth < 0:
        raise ValueError(f"[parallel] fsdp_prefetch must be >= 0 (blocks gathered ahead), got {depth}.")
    if depth == 0:
        return
    for run in _execution_order(model):
        for i, units in enumerate(run):
            ahead = [u for step in run[i + 1 : i + 1 + depth] for u in step]
            behind = [u for step in reversed(run[max(i - depth, 0) : i]) for u in step]
            if ahead:
                units[0].set_modules_to_forward_prefetch(ahead)
            if behind:
                units[0].set_modules_to_backward_prefetch(behind)


# What the pipeline executor (``meshtron.parallel.pipeline.executor``) and, without a pipeline,
# :class:`MicrobatchSync` need of FSDP to gather and reduce each unit once per step; FSDP's private
# calls stay in this module.


def hold_unsharded(unit: nn.Module, hold: bool) -> None:
    """Hold ``unit`` gathered with its gradients unreduced (``hold``), or let its next backward
    reduce-scatter, reshard and finish the step's reductions (``is_last_backward`` is shared by
    all units of the root; setting it early only waits for reductions sooner)."""
    unit.set_requires_gradient_sync(not hold, recurse=False)
    unit.set_reshard_after_backward(not hold, recurse=False)
    if not isinstance(unit, ReplicateModule):  # replicas are never sharded: nothing to gather or free
        unit.set_reshard_after_forward(not hold, recurse=False)
    unit.set_is_last_backward(not hold)


def gathers_once_per_step(p: ParallelConfig) -> bool:
    """Whether a step without a pipeline holds every unit gathered from its first forward to its last
    backward (``[parallel] fsdp_gather = "per_step"``; replication has nothing to gather)."""
    return p.fsdp_gather == "per_step" and p.data_parallel != "replicate"


def reduces_gradients(p: ParallelConfig, microbatch: int, microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` of ``microbatches``' backward (pp = 1) reduces gradients over
    the data ranks: full sharding gathered per micro-batch reduce-scatters every one, so unsharded
    gradients never pile up; otherwise the full gradients accumulate and the last micro-batch reduces."""
    every = p.data_parallel == "fsdp" and not gathers_once_per_step(p)
    return every or microbatch == microbatches - 1


class MicrobatchSync:
    """What each micro-batch of a step without a pipeline gathers and reduces (docs/training.md#data-parallelism): call
    :meth:`forward` before the forward of micro-batch ``microbatch`` of the step's ``microbatches`` and
    :meth:`backward` before its backward."""

    def __init__(self, module: nn.Module, p: ParallelConfig):
        self.module, self.p = module, p
        once = gathers_once_per_step(p)
        self.held = [m for m in module.modules() if isinstance(m, FSDPModule)] if once else []

    def forward(self, microbatch: int, microbatches: int) -> None:
        if self.held:
            if microbatch == 0:
                for unit in self.held:
                    hold_unsharded(unit, True)
        elif isinstance(self.module, FSDPModule):  # a transformers model on one data rank is not wrapped
            self.module.set_requires_gradient_sync(reduces_gradients(self.p, microbatch, microbatches))

    def backward(self, microbatch: int, microbatches: int) -> None:
        # Released after the last forward, not before: resharding after it would gather again in backward.
        if self.held and microbatch == microbatches - 1:
            for unit in self.held:
                hold_unsharded(unit, False)


def finish_split_backward(units: Sequence[nn.Module], released: Sequence[nn.Module]) -> None:
    """FSDP2's end of backward for a ``W`` that restarted autograd inside the graph, where the
    module-input hooks that run it never fire (only some output hooks may): every param group of the
    chunk's ``units`` (and of the ``released`` ones) folds its new gradients into its accumulator or,
    once released, reduce-scatters them; after a release, the root's final callback waits for those
    reductions, as it does after a whole backward. FSDP2 has no public call for this; these are the
    private methods ``torch.distributed.pipelining``'s stages call for their own split backward."""
    for unit in {id(u): u for u in [*units, *released]}.values():
        fsdp_post_backward(unit)
    if released:
        fsdp_root_final_callback(released[0])


def apply_data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    mode: str = "fsdp",
    dtype: str = "float32",
    prefetch: int = 1,
    offload: str = "none",
) -> nn.Module:
    """Shard or replicate ``model`` (a full model or a pipeline stage) over the data meshes, in place.

    Call last, after TP/EP/CP, activation checkpointing and compilation; works on meta-device and
    materialised models. Gradients are summed over data ranks (docs/training.md#data-parallelism).
    ``prefetch``: blocks all-gathered ahead of use; ``offload``: ``[parallel] offload``
    (docs/training.md#host-memory-offload).
    """
    policy = mixed_precision(dtype)
    host = offload_policy(offload, mode, mesh.device_type)
    _check_experts_split(model, mesh)
    blocks = list(model.layers.values())
    experts = [moe.experts for block in blocks for moe in moe_layers(block)]
    vocab = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    wrap_units(model, blocks, experts, vocab, data_meshes(mesh, mode), mode, policy, host)
    if mode != "replicate":
        set_prefetch(model, prefetch)
    return model
