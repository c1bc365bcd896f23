"""The one door to torch's private and version-dependent API.

Every name below is private in torch (a leading underscore, or a ``_``-module): any torch release may rename
or remove it without notice. Keeping them here shows at a glance what a torch upgrade must re-check;
tests/test_structure.py fails if any other meshtron module reaches a private torch name (docs/extending.md,
'Imports go one way'). Each entry says why no public API serves. Checked on torch 2.13.0 (CPU, the project's
pin), 2.14.1 (the CUDA wheel of the fake-CUDA dry run) and 2.11 (the lent GPU machines' image).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = [
    # Composable APIs public in all but module name (torchtitan and torch's own tests use them).
    "checkpoint",
    "replicate",
    "ReplicateModule",
    "funcol",
    "pytree",
    "TorchDispatchMode",
    "is_traceable_wrapper_subclass",
    "compute_local_shape_and_global_offset",
]

# --- Device meshes -------------------------------------------------------------------------------
# DeviceMesh has no public way to treat several dims as one (flatten), to split one into several
# (unflatten) or to join slices of different roots into one mesh (concatenate): meshtron's derived
# meshes (FSDP over dp x cp x ep, expert meshes, cp's a2a+p2p groups) need all three.


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims as one dim called ``name`` (registered on the root, so ``root[name]`` works)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim: int | str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """Dim ``dim`` of ``mesh`` split into dims ``names`` of ``sizes`` (row-major). Passed by index: torch
    2.11 refuses every dim given by name (its check is inverted; 2.13 takes both), seen on a lent H100."""
    index = mesh.mesh_dim_names.index(dim) if isinstance(dim, str) else dim
    return mesh._unflatten(index, sizes, names)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are the dims of ``meshes``, in order."""
    return DeviceMesh._concatenate(meshes)


# --- c10d ----------------------------------------------------------------------------------------
# The launcher's TCPStore carries meshtron's print-once keys and the watchdog's heartbeats: the store
# torchrun made is only reachable through the default group's private accessor. Collectives logged by
# name (functional collectives pass group names, not groups) need the name -> group resolution.


def default_store() -> dist.Store:
    """The store the default process group was initialised with (torchrun's TCPStore)."""
    return dist.distributed_c10d._get_default_store()


def default_group() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group a functional collective names by string."""
    return dist.distributed_c10d._resolve_process_group(name)


def process_group_class() -> type:
    """The C++ ProcessGroup type (collectives dispatched as ops carry it as an argument)."""
    from torch._C._distributed_c10d import ProcessGroup

    return ProcessGroup


def fake_store_class() -> type:
    """torch's in-memory store for fake process groups (the dry run's ranks never meet)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore


def script_method(obj: torch.ScriptObject, name: str):
    """Method ``name`` of a TorchScript object (a ReduceOp passed to a dispatched collective), or None."""
    return obj._get_method(name) if obj._has_method(name) else None


# --- Autograd and modules ------------------------------------------------------------------------


def engine_will_execute(node) -> bool:
    """Whether the running backward pass will execute autograd ``node`` (tp's gradient hooks ask, to
    reduce only what this pass computes); raises RuntimeError outside a backward."""
    return torch._C._will_engine_execute_node(node)


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another (compiled blocks must not receive one to edit in place)."""
    return tensor._is_view()


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter slots, writable: assigning a plain tensor there swaps a parameter for
    one call without re-registering it (``setattr`` refuses a non-Parameter under a parameter's name)."""
    return module._parameters


CONV_BASE = nn.modules.conv._ConvNd  # every convolution class derives from it


def adam_init_group(optimizer: torch.optim.Adam, group: dict, params, grads, exp_avgs, exp_avg_sqs, steps) -> bool:
    """torch Adam's own per-group set-up (the lazily created state, the lists its kernels take); reused so a
    subclass stepping other tensors keeps the state torch creates and checkpoints. Returns ``has_complex``."""
    return optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)


def dtensor_local(tensor) -> torch.Tensor:
    """A DTensor's local tensor itself, with no autograd edge (``to_local()`` records one; a saved-tensor
    hook must hand autograd back the very tensor it packed)."""
    return tensor._local_tensor


def view_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a view views (``Tensor._base``), or the tensor itself: a saved-tensor hook must tell a
    parameter's view (a linear saves its weight transposed) from an activation, and no public API says
    which tensor a view was made from."""
    return tensor if tensor._base is None else tensor._base


# --- FSDP2 internals -----------------------------------------------------------------------------
# FSDP2 has no public call to finish a backward that restarted autograd inside the graph (the
# zero-bubble W); torch.distributed.pipelining's own stages call these same private methods.


def fsdp_post_backward(unit: nn.Module) -> None:
    """Every param group of ``unit`` folds its new gradients in (or reduce-scatters them once released)."""
    for group in _unit_state(unit)._fsdp_param_groups:
        group.post_backward()


def fsdp_root_final_callback(unit: nn.Module) -> None:
    """The root's end-of-backward callback: waits for the reductions the units started."""
    _unit_state(unit)._root_post_backward_final_callback()


def _unit_state(unit: nn.Module):
    return (replicate if isinstance(unit, ReplicateModule) else fully_shard).state(unit)


# --- Selective activation checkpointing ------------------------------------------------------------
# torch's selective checkpointing numbers each op's calls in a block's forward and, in the recomputation,
# looks every call up by that number (the saved output, or "recompute"). So every op inside the block
# must run as often in the recomputation as in the forward. FSDP's module hooks do not: a unit nested in
# a checkpointed block (the experts' own unit over edp) runs its full pre-forward in the recomputation
# (it takes itself for the forward's root: one more profiler record, maybe an all-gather), and the
# block's own unit casts its inputs there but not in the forward (its hook ran before the checkpoint's).
# torch has no public way to leave ops out of that record (pytorch PR 196862 proposes a scoped bypass
# around FSDP's internals); these subclasses of its two modes let ops run while ``SacBypass.active``
# go straight through, neither numbered nor replayed, with the other dispatch modes still active.


class SacBypass:
    """Set while ops must bypass selective checkpointing (meshtron.parallel.recompute's hooks)."""

    active = False


class _Bypassable:
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if SacBypass.active:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _RecordingMode(_Bypassable, torch.utils.checkpoint._CachingTorchDispatchMode):
    pass


class _ReplayingMode(_Bypassable, torch.utils.checkpoint._CachedTorchDispatchMode):
    pass


def selective_checkpoint_contexts(policy: Callable) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy)`` whose modes skip the ops
    run while ``SacBypass.active``."""
    storage: dict = collections.defaultdict(dict)
    return _RecordingMode(policy, storage), _ReplayingMode(None, storage)


# --- Tensor-parallel style internals -------------------------------------------------------------


def style_io(style) -> tuple[Callable, Callable]:
    """A Colwise / Rowwise ParallelStyle's input and output preparation bound to its layouts, for a
    subclass that distributes its parameters its own way (a transposed weight)."""
    return (
        functools.partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        functools.partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


# --- DTensor placements --------------------------------------------------------------------------
# FSDP2 over a tp-split dim places the weight as _StridedShard, a private placement: moving such a weight's
# placement to another tensor dim (Muon stacks a layer's matrices) must keep its split factor.


def shard_dim(placement) -> int | None:
    """The tensor dim ``placement`` splits (a Shard or, not its subclass, a _StridedShard), else None."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


def shard_moved_to(placement, dim: int):
    """``placement`` (a Shard or _StridedShard) on tensor dim ``dim`` instead."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return _StridedShard(dim, split_factor=placement.split_factor)
    return Shard(dim)


# --- Private ops ---------------------------------------------------------------------------------
# The flash-attention kernels return the log-sum-exp the ring attention merges with; SDPA's public
# entry does not. The rest are op identities the dry run and the sync counter recognise.
aten = torch.ops.aten
FLASH_ATTENTION = aten._scaled_dot_product_flash_attention
FLASH_ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_backward
FLASH_ATTENTION_CPU = aten._scaled_dot_product_flash_attention_for_cpu
FLASH_ATTENTION_CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward
GROUPED_MM = aten._grouped_mm
UNSAFE_VIEW = aten._unsafe_view
LOCAL_SCALAR_DENSE = aten._local_scalar_dense  # .item(), float(t), bool(t)
TO_COPY = aten._to_copy
UNIQUE2 = aten._unique2
PIN_MEMORY = aten._pin_memory.default  # Tensor.pin_memory(); the fake CUDA run answers it
# The attention kernels SDPA dispatches to (their FLOP formulas count the whole square, causal or not).
_ATTENTION_KERNEL_NAMES = ("flash_attention", "flash_attention_for_cpu", "efficient_attention", "cudnn_attention")
ATTENTION_FORWARD_KERNELS = {getattr(aten, f"_scaled_dot_product_{kernel}") for kernel in _ATTENTION_KERNEL_NAMES}
ATTENTION_KERNELS = ATTENTION_FORWARD_KERNELS | {
    getattr(aten, f"_scaled_dot_product_{kernel}_backward") for kernel in _ATTENTION_KERNEL_NAMES
}


def scaled_grouped_mm(*args, **kwargs) -> torch.Tensor:
    """``torch._scaled_grouped_mm``: the float8 grouped GEMM (CUTLASS, compute capability 9.x) torchao's MoE
    training calls; no public name yet. Looked up at each call (a test stands a CPU version in for it)."""
    return torch._scaled_grouped_mm(*args, **kwargs)


# Multi-tensor kernels: one launch (and one dispatch) for a list of tensors; torch's own gradient
# clipping and optimizers use them, but they have no public name.
foreach_norm = torch._foreach_norm
foreach_mul_ = torch._foreach_mul_


def op_name(func) -> str:
    """An op overload's name without namespace or overload (``all_gather_into_tensor``)."""
    return func._opname


def op_packet(func):
    """The overload packet of an op overload (``aten.mm`` for ``aten.mm.default``)."""
    return func._overloadpacket


def op_argument_names(func) -> list[str]:
    """An op overload's argument names, in schema order."""
    return [a.name for a in func._schema.arguments]


def fake_tensor_mode_class() -> type:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def mem_tracker_class() -> type:
    """torch's MemTracker (imported on first use: it pulls in torch._inductor)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker


def mem_tracker(module_tracker):
    """A MemTracker (per-storage accounting and peak) with its module tracker replaced by
    ``module_tracker`` (MemTracker has no public switch for per-module tracking)."""
    tracker = mem_tracker_class()()
    tracker._mod_tracker = module_tracker
    return tracker


@contextlib.contextmanager
def counting_sharding_propagations(count: Callable[[], None]) -> Iterator[None]:
    """Calls ``count()`` at each uncached DTensor sharding propagation while entered; counts nothing on
    a torch without that method."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if original is None:
        yield
        return

    def counted(propagator, *args, **kwargs):
        count()
        return original(propagator, *args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = counted
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


# --- torchao's float8 training tensor --------------------------------------------------------------
# Its fields have no public accessors; the tp all-gather in float8 sends the bytes and scale and rebuilds
# the tensor on the other side (checked with torchao 0.18). Looked up in sys.modules: torchao is optional.


def _mx_tensor(t: torch.Tensor) -> bool:
    mx = sys.modules.get("torchao.prototype.mx_formats.mx_tensor")
    return mx is not None and isinstance(t, mx.MXTensor)


def float8_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A float8 cast's bytes (``uint8``: gloo has no float8 type) and scale (an MX cast's E8M0 scales as ``uint8``
    too); None for a high-precision tensor."""
    if _mx_tensor(t):
        return t.qdata.view(torch.uint8), t.scale.view(torch.uint8)
    training_tensor = sys.modules.get("torchao.float8.float8_training_tensor")
    if training_tensor is None or not isinstance(t, training_tensor.Float8TrainingTensor):
        return None
    return t._data.view(torch.uint8), t._scale


def float8_from_parts(like: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float8 cast of ``data`` (``uint8`` bytes, as :func:`float8_parts` gives) and ``scale``, cast as ``like``."""
    if _mx_tensor(like):
        return type(like)(
            data.contiguous().view(like.qdata.dtype),
            scale.contiguous().view(like.scale.dtype),
            like.elem_dtype,
            like.block_size,
            like.orig_dtype,
            like.kernel_preference,
            like.act_quant_kwargs,
            like.is_swizzled_scales,
        )
    return type(like)(
        data.view(like._data.dtype),
        scale,
        like._orig_dtype,
        like._linear_mm_config,
        like._gemm_input_role,
        like._axiswise_dim,
    )
