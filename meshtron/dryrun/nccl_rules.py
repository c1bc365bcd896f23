"""NCCL's rules for a collective, which the dry run holds every traced collective to (CPU and CUDA paths).

gloo and the dry run's fake process group take what NCCL refuses (a tensor on another device than the rank's,
dtypes and reductions NCCL has none for), so :class:`NcclRules` checks each collective as ProcessGroupNCCL would
and records the point-to-point messages for :func:`unmatched_p2p`. See docs/planner.md, 'Dry run at real scale'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtron.torch_private import script_method
from meshtron.watch.syncs import call_site, not_a_caller

not_a_caller(__file__)  # it waits on behalf of the code it traces or checks

# The dtypes ProcessGroupNCCL maps to an NCCL type (bool as uint8; float8 as NCCL's float8 types).
DTYPES = {
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
}
# Of those, what a reduction refuses: the fnuz float8 types ("Unsupported Float8 type for NCCL reduction").
NOT_REDUCED = {torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
# Reduce ops NCCL does not have ("Cannot use ReduceOp.BAND with NCCL"); AVG exists since NCCL 2.10.
NOT_NCCL_OPS = {"BAND", "BOR", "BXOR"}

# c10d and functional ops that reduce, and the point-to-point ones (op -> direction).
_REDUCING = {
    "allreduce_",
    "allreduce_coalesced_",
    "reduce_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
}
_P2P = {"send": "send", "recv_": "recv", "recv_any_source_": "recv"}
_OP_NAMES = {int(v): name for name, v in torch.distributed.ReduceOp.RedOpType.__members__.items()}


class NcclRefusal(RuntimeError):
    """A collective NCCL would refuse: the message names the op, its mesh dimension and its call site."""


class NcclRules:
    """Checks each collective it is shown (:meth:`check`) against NCCL's rules on ``device`` (the rank's
    own); ``names`` maps a group's global ranks to its mesh dimension's name. ``p2p``: the point-to-point
    messages in order, ``(direction, peer's global rank, shape, dtype)``."""

    def __init__(self, device: torch.device, names: dict[tuple[int, ...], str]):
        self.device, self.names = device, names
        self.p2p: list[tuple[str, int, tuple[int, ...], str]] = []

    def check(self, op: str, args, group: dist.ProcessGroup) -> None:
        tensors = [t for t in _flat(args) if isinstance(t, torch.Tensor)]
        ranks = tuple(dist.get_process_group_ranks(group))
        where = f"{op} over {self.names.get(ranks, list(ranks))} at {call_site()}"
        for t in tensors:
            if t.device != self.device:
                raise NcclRefusal(
                    f"{where}: a tensor on {t.device}, where NCCL takes the rank's own device {self.device}"
                )
            if t.is_complex() and op not in (
                "allreduce_",
                "all_reduce",
                "_allgather_base_",
                "allgather_",
                "all_gather_into_tensor",
                "broadcast_",
            ):
                raise NcclRefusal(
                    f"{where}: a {t.dtype} tensor, which NCCL takes only in all-reduce, all-gather and broadcast"
                )
            if not t.is_complex() and t.dtype not in DTYPES:
                raise NcclRefusal(f"{where}: a {t.dtype} tensor, which NCCL has no type for")
        if op in _REDUCING:
            self._check_reduction(op, args, tensors, where)
        if op in _P2P:
            peer = dist.get_global_rank(group, args[2])
            self.p2p += [(_P2P[op], peer, tuple(t.shape), str(t.dtype)) for t in tensors]

    def _check_reduction(self, op: str, args, tensors: list[torch.Tensor], where: str) -> None:
        name = _reduce_op(args)
        if name in NOT_NCCL_OPS:
            raise NcclRefusal(f"{where}: ReduceOp.{name}, which NCCL does not have")
        for t in tensors:
            if t.dtype in NOT_REDUCED:
                raise NcclRefusal(f"{where}: a reduction of {t.dtype}, which NCCL does not reduce")
            if t.dtype == torch.bool and name == "AVG":
                raise NcclRefusal(f"{where}: ReduceOp.AVG of a bool tensor")


def _reduce_op(args) -> str:
    """The reduce op's name: a c10d op's boxed ReduceOp, a functional op's string."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and (op := script_method(arg, "op")) is not None:
            return _OP_NAMES[int(op())]
    return next(a for a in args if isinstance(a, str)).upper()


def _flat(args) -> list:
    out = []
    for arg in args:
        out += _flat(arg) if isinstance(arg, (list, tuple)) else [arg]
    return out


def unmatched_p2p(logs: dict[int, list[tuple[str, int, tuple[int, ...], str]]]) -> list[str]:
    """The traced ranks' point-to-point messages that their traced peers do not match: in order, each
    send of rank a to rank b against b's receives from a (shape and dtype), as NCCL pairs them."""
    problems = []
    for rank, log in logs.items():
        for peer in sorted({p for _, p, _, _ in log} & logs.keys()):
            sent = [(shape, dtype) for kind, p, shape, dtype in log if kind == "send" and p == peer]
            received = [(shape, dtype) for kind, p, shape, dtype in logs[peer] if kind == "recv" and p == rank]
            if sent != received:
                problems.append(
                    f"rank {rank} sends rank {peer} {len(sent)} messages {sent[:3]}..., which receives "
                    f"{len(received)} from it {received[:3]}..."
                )
    return problems


__all__ = ["DTYPES", "NcclRefusal", "NcclRules", "unmatched_p2p"]
