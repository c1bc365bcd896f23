"""What the dry run counts on a traced step, op by op: FLOPs, the roofline time, collectives and the bytes
each sends, and the live tensor bytes (:func:`storage_tracker`).

:mod:`meshtron.dryrun` builds and runs the step and enters these around it; what is counted, and how, is
here on its own (``tests/test_dryrun.py`` checks it).
See docs/planner.md, 'Dry run at real scale: ``python -m meshtron.train --dry-run N``'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import flop_registry

from meshtron.dryrun.nccl_rules import NcclRules
from meshtron.torch_private import (
    ATTENTION_KERNELS,
    FLASH_ATTENTION,
    FLASH_ATTENTION_BACKWARD,
    FLASH_ATTENTION_CPU,
    FLASH_ATTENTION_CPU_BACKWARD,
    GROUPED_MM,
    UNSAFE_VIEW,
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    mem_tracker,
    op_argument_names,
    op_name,
    op_packet,
    process_group_class,
    pytree,
    resolve_group,
)
from meshtron.watch.syncs import not_a_caller

not_a_caller(__file__)  # it waits on behalf of the code it traces or checks


class _NoModules:
    """Stands in for MemTracker's ``ModTracker``: its per-module gradient hooks keep module inputs and
    outputs (and so their whole autograd graph) alive until those hooks fire, which a split backward
    (B with ``inputs=``, W restarted inside the graph) never does, so they pin the zero-bubble stages'
    activations through the step (docs/planner.md), and they refuse a module called once per micro-batch.
    Without module tracking every forward and backward tensor counts as ``ACT`` (only the total peak is
    read)."""

    is_bw = False
    parents: set = set()

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module) -> str:
        return ""

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        pass


def storage_tracker():
    """torch's MemTracker with its per-storage accounting and peak (updated after every op, FSDP2's
    ``resize_`` frees included) and no per-module tracking (:class:`_NoModules`)."""
    return mem_tracker(_NoModules())


class OpCounter(TorchDispatchMode):
    """FLOPs (torch's flop formulas, plus :data:`_MORE_FLOPS`), the step's roofline time, calls per
    collective op (c10d and functional) and the bytes this rank sends per (collective kind, group),
    counted as a ring sends them (:func:`sent_bytes`).

    Roofline: every op that moves data takes the larger of its FLOPs over ``peak_flops`` and the bytes
    of its tensors (inputs and outputs) over ``memory_bandwidth``; the step's compute time is their sum,
    the bound of kernels that each reach the peak or the bandwidth, one after another.

    Everything is counted on plain tensors, at the shapes this rank computes: an op on a tensor subclass
    (a DTensor) is left to the subclass, whose ops on its local shards reach this mode in turn. Counted
    on the DTensor, a tp rank's linears would count at their global size and the optimizer's FSDP-sharded
    state at its unsharded bytes (docs/planner.md).

    torch's FlopCounterMode and CommDebugMode count the same but track modules with hooks: the
    former's keep every activation of the step alive, the latter's fail on a module called once per
    micro-batch. This mode tracks none."""

    def __init__(self, peak_flops: float, memory_bandwidth: float, rules: NcclRules | None = None):
        super().__init__()
        self.peak_flops, self.memory_bandwidth, self.rules = peak_flops, memory_bandwidth, rules
        self.flops = 0
        self.roofline_seconds = 0.0
        self.calls: dict[str, int] = {}
        self.sent: dict[tuple[str, tuple[int, ...]], int] = {}  # (kind, group's global ranks) -> bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in pytree.tree_leaves((args, kwargs))):
            return NotImplemented  # the subclass runs the op on plain tensors, counted as they come
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional"):
            if op_name(func) not in ("wait_tensor", "barrier"):
                self._count_collective(op_name(func), args)
            return out
        flops = op_flops(func, args, kwargs, out)
        self.flops += flops
        moved = moved_bytes(func, args, kwargs, out)
        if moved is not None:
            self.roofline_seconds += max(flops / self.peak_flops, moved / self.memory_bandwidth)
        return out

    def _count_collective(self, name: str, args) -> None:
        if self.rules is not None:
            self.rules.check(name, args, _group(args))
        self.calls[name] = self.calls.get(name, 0) + 1
        kind, nbytes, group = sent_bytes(name, args)
        if kind is not None:
            self.sent[kind, group] = self.sent.get((kind, group), 0) + nbytes


def op_flops(func, args, kwargs, out) -> int:
    """One op's FLOPs on plain tensors: torch's formulas plus :data:`_MORE_FLOPS`, attention at the share of
    its query-key pairs a causal kernel computes."""
    count = flop_registry.get(op_packet(func)) or _MORE_FLOPS.get(op_packet(func))
    return 0 if count is None else round(count(*args, **kwargs, out_val=out) * _causal_share(func, args, kwargs))


def moved_bytes(func, args, kwargs, out) -> int | None:
    """The bytes of an op's tensors, inputs and outputs, as a kernel reads and writes them; None for an op
    that launches no kernel (a collective, a view, an allocation)."""
    if func.namespace not in ("aten", "fsdp") or func.is_view or op_packet(func) in _NO_DATA:
        return None
    return sum(
        t.numel() * t.element_size() for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
    )


def is_attention(func) -> bool:
    return op_packet(func) in _ATTENTION


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args, out_val=None, **kwargs) -> int:
    """The grouped matmul: the groups' matmuls, whichever operand is split into groups."""
    if a.dim() == 2 and b.dim() == 3:  # rows grouped, a weight per group: [T, K] x [G, K, N]
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:  # the contracted rows grouped (weight gradients): [K, T] x [T, N]
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


# FLOPs of ops torch's registry lacks: the CPU flash attention (counted as the CUDA one, whose
# arguments it shares), the experts' grouped matmul and the in-place addmm (tp_overlap's rings
# accumulate their weight gradients chunk by chunk with it).
_MORE_FLOPS = {
    torch.ops.aten.addmm_: flop_registry[torch.ops.aten.addmm],
    FLASH_ATTENTION_CPU: flop_registry[FLASH_ATTENTION],
    FLASH_ATTENTION_CPU_BACKWARD: flop_registry[FLASH_ATTENTION_BACKWARD],
    GROUPED_MM: _grouped_mm_flops,
}
# Attention kernels, which under a causal mask compute only the query-key pairs it leaves (they skip the
# masked blocks; torch's formulas count the whole square, 2 x the FLOPs for a sequence attending to itself).
_ATTENTION = ATTENTION_KERNELS


def _causal_share(func, args, kwargs) -> float:
    """The share of its query-key pairs an op computes: all but for an :data:`_ATTENTION` op with
    ``is_causal``, whose mask (top-left aligned, as torch's) leaves query i its first i + 1 keys."""
    if op_packet(func) not in _ATTENTION:
        return 1.0
    given = {**dict(zip(op_argument_names(func), args)), **kwargs}
    if not given.get("is_causal"):
        return 1.0
    queries, keys = given["query"].shape[-2], given["key"].shape[-2]
    diagonal = min(queries, keys)
    return (diagonal * (diagonal + 1) // 2 + (queries - diagonal) * keys) / (queries * keys)


# Ops that allocate or reinterpret without moving data (views are skipped by their schema).
_NO_DATA = {
    UNSAFE_VIEW,
    torch.ops.aten.empty,
    torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty,
    torch.ops.aten.new_empty_strided,
    torch.ops.aten.lift_fresh,
}


# op -> (kind, index of the argument holding what this rank contributes)
_KINDS = {
    "allgather_": ("all_gather", 1),
    "_allgather_base_": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "allreduce_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0),
    "send": ("send", 0),
}


def sent_bytes(op: str, args) -> tuple[str | None, int, tuple[int, ...]]:
    """(kind, bytes this rank sends, group's global ranks) of one collective, counted as a ring sends:
    an all-gather sends its shard to n - 1 peers, a reduce-scatter (n - 1) / n of its input, an
    all-reduce twice that, an all-to-all all its rows but its own, a send its tensor; (None, 0, ()) for
    what sends nothing (a receive)."""
    if op not in _KINDS:
        return None, 0, ()
    kind, at = _KINDS[op]
    ranks = tuple(dist.get_process_group_ranks(_group(args)))
    n, mine = len(ranks), sum(t.numel() * t.element_size() for t in _tensors([args[at]]))
    if kind == "all_gather":
        return kind, mine * (n - 1), ranks
    if kind == "reduce_scatter":
        return kind, mine * (n - 1) // n, ranks
    if kind == "all_reduce":
        return kind, 2 * mine * (n - 1) // n, ranks
    if kind == "all_to_all":
        splits = args[4] if op == "alltoall_base_" else args[2]
        own = splits[ranks.index(dist.get_rank())] / sum(splits) if splits and sum(splits) else 1 / n
        return kind, round(mine * (1 - own)), ranks
    return kind, mine, ranks


def _group(args) -> dist.ProcessGroup:
    """The process group of a c10d op (a boxed ProcessGroup argument) or a functional one (its name)."""
    ProcessGroup = process_group_class()
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(arg)
            except RuntimeError:  # the op's other boxed argument (a ReduceOp)
                continue
    return resolve_group(next(a for a in reversed(args) if isinstance(a, str)))


def _tensors(args) -> list[torch.Tensor]:
    """The first tensor argument (or list of them, flattened)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return [arg]
        if isinstance(arg, (list, tuple)) and arg:
            flat = [t for item in arg for t in (item if isinstance(item, (list, tuple)) else [item])]
            if all(isinstance(t, torch.Tensor) for t in flat):
                return flat
    return []
