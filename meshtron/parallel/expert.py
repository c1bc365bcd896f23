"""Expert parallelism (EP): routed experts split over the ``ep`` mesh dimension, tokens moved by all-to-all.

Owns the experts' DTensor layout on the (ep, etp) mesh, the token dispatch (:class:`ExpertDispatch`), its
tp slicing, and the global router statistics and capacity ranking. See
docs/expert_parallel.md#expert-weights-and-token-dispatch and the sections after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from meshtron.config import ConfigError
from meshtron.host import even_split, split_sizes
from meshtron.mesh import batch_mesh, dense_data_mesh, expert_meshes, expert_split
from meshtron.models.moe import (
    GroupedExperts,
    SharedWork,
    StatsReducer,
    count_ids,
    grouped_matmul,
    grouped_swiglu,
    moe_layers,
    permute_tokens,
    sort_by_group,
    unpermute_tokens,
    unsort,
)
from meshtron.parallel.context import sequence_index
from meshtron.torch_private import flatten_mesh

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the same way.

    With ``pending`` (a list) the forward is asynchronous: its work handle is appended there and the
    caller must wait on it before reading the output. (``torch.distributed.nn.functional.
    all_to_all_single`` also differentiates uneven splits on gloo, as we checked, but it is
    deprecated in torch 2.13 and has no asynchronous form to overlap the shared expert with.)
    """

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, pending: list | None):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(
            out, x.contiguous(), out_splits, in_splits, group=group, async_op=pending is not None
        )
        if pending is not None:
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None, None


class _SliceTokens(torch.autograd.Function):
    """This tp rank's slice of tokens replicated over tp; backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.view(size, -1, *x.shape[1:])[rank].clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.group), None


class _GatherTokens(torch.autograd.Function):
    """All-gather token slices over tp; backward keeps this rank's slice of the replicated gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.reshape(size, -1, *grad.shape[1:])[rank].clone(), None


class _Uneven(torch.autograd.Function):
    """Rows of uneven size over ``group`` (``sizes[r]`` rows owned by rank r). ``gather``: every rank's
    rows concatenated in rank order, and backward sums each rank's gradient rows back to it;
    otherwise the reverse (rows ordered by owner, summed into the owner's ``sizes[rank]`` rows)."""

    @staticmethod
    def forward(ctx, x, sizes: list[int], group, gather: bool):
        ctx.sizes, ctx.group, ctx.gather = sizes, group, gather
        return (_gather_uneven if gather else _reduce_scatter_uneven)(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter_uneven if ctx.gather else _gather_uneven)(grad, ctx.sizes, ctx.group), None, None, None


def _gather_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    # An all-to-all sending our rows to every peer: uneven all-gathers exist neither on gloo nor as
    # one NCCL call, while uneven all-to-alls run on both.
    out = x.new_empty((sum(sizes), *x.shape[1:]))
    copies = x.contiguous().repeat(len(sizes), *([1] * (x.dim() - 1)))
    dist.all_to_all_single(out, copies, sizes, [x.shape[0]] * len(sizes), group=group)
    return out


def _reduce_scatter_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    mine = sizes[dist.get_rank(group)]
    parts = x.new_empty((len(sizes) * mine, *x.shape[1:]))
    dist.all_to_all_single(parts, x.contiguous(), [mine] * len(sizes), sizes, group=group)
    return parts.view(len(sizes), mine, *x.shape[1:]).sum(0)


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def _scaled_copies(sorted_x: torch.Tensor, order: torch.Tensor, weights: torch.Tensor):
    """Token copies (sorted by expert, ``order`` from ``permute_tokens``) each scaled by its routing weight,
    and the weights of 1 that then sum the expert outputs unweighted. Rows padded over tp have weight 0:
    they enter as zeros (and are dropped after the gather anyway)."""
    scaled = sorted_x * weights.flatten()[order].unsqueeze(-1).to(sorted_x.dtype)
    return scaled, torch.ones_like(weights)


def shard_experts(full: torch.Tensor, mesh: DeviceMesh, etp_dim: int | None = None) -> DTensor:
    """This rank's block of ``full`` as a DTensor on the experts' (ep, etp) ``mesh``, without
    communication (meta works too): ``Shard(0)`` over ep, ``Shard(etp_dim)`` over etp."""
    ep, etp = mesh["ep"], mesh["etp"]
    local = full.detach().chunk(ep.size())[ep.get_local_rank()]
    if etp.size() > 1:
        if etp_dim is None:
            raise ConfigError(
                f"[parallel] etp = {etp.size()}: these experts have no dimension to split over etp; use etp = 1."
            )
        local = local.chunk(etp.size(), etp_dim)[etp.get_local_rank()]
    placements = [Shard(0), Shard(etp_dim if etp_dim is not None else 0)]
    return DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


class ExpertDispatch(nn.Module):
    """The all-to-all token dispatch (docs/expert_parallel.md#expert-weights-and-token-dispatch), for any
    module that holds a rank's experts; subclasses own the weights and hand them to :meth:`local_weights`.

    ``mesh``: the experts' (ep, etp) mesh (``meshtron.mesh.expert_meshes``). ``tp_mesh`` with
    ``split_tokens_over_tp``: the tokens are replicated over tp (no sequence parallelism), so each tp
    rank dispatches only 1/tp of them. With a one-rank ``mesh`` nothing is exchanged: the experts run
    on the local (tp-split) tokens. ``scale_inputs``: the routing weights scale the token copies
    before the experts instead of their outputs after (docs/expert_parallel.md#expert-weights-and-token-dispatch).
    """

    def __init__(
        self,
        num_experts: int,
        mesh: DeviceMesh,
        tp_mesh: DeviceMesh | None = None,
        split_tokens_over_tp: bool = True,
        scale_inputs: bool = False,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.scale_inputs = scale_inputs
        self.mesh = mesh
        self.ep, self.etp = mesh["ep"].size(), mesh["etp"].size()
        self.ep_group, self.etp_group = mesh["ep"].get_group(), mesh["etp"].get_group()
        self.tp_group = tp_mesh.get_group() if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.split_tokens = self.tp_group is not None and split_tokens_over_tp
        # Bytes of token rows this rank put into the dispatch all-to-all in the last forward.
        self.last_dispatch_bytes = 0
        # Token copies this rank's experts computed in the last forward.
        self.last_rows = 0
        # The experts' grouped GEMMs (gate/up, down): in float8 where [train] fp8 converted the experts
        # (GroupedExperts.matmul).
        self.matmul = self.down_matmul = grouped_matmul

    def own(self, full: torch.Tensor, etp_dim: int | None = None) -> torch.Tensor:
        """A full ``[E, ...]`` expert weight as this module holds it: split over ep (dim 0) and etp
        (``etp_dim``), or kept as is on a one-rank mesh."""
        if self.mesh.size() == 1:
            return full
        return nn.Parameter(shard_experts(full, self.mesh, etp_dim), requires_grad=full.requires_grad)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep

    def local_weights(self) -> tuple[torch.Tensor, ...]:
        """This rank's expert weights (via :meth:`local`) as :meth:`run_experts` takes them: by default gate,
        up ``[E/ep, H, I/etp]`` and down ``[E/ep, I/etp, H]``."""
        raise NotImplementedError

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on rows sorted by local expert (``counts[g]`` rows for expert g): SwiGLU."""
        return grouped_swiglu(x, counts, *self.local_weights(), matmul=self.matmul, down_matmul=self.down_matmul)

    @staticmethod
    def local(param: torch.Tensor) -> torch.Tensor:
        """A weight's local block (plain tensors pass through)."""
        return param.to_local() if isinstance(param, DTensor) else param

    def dispatch(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, shared: SharedWork | None = None
    ) -> torch.Tensor:
        """x [T, H], routing ``weights`` / chosen ``experts`` [T, k] -> weighted expert outputs (+ ``shared()``);
        with ``scale_inputs`` the outputs of the weighted inputs, summed."""
        tokens = x.shape[0]
        if self.split_tokens:
            x, weights, experts = self._slice_over_tp(x, weights, experts)
        sorted_x, order, counts = permute_tokens(x, experts, self.num_experts)
        if self.scale_inputs:
            sorted_x, weights = _scaled_copies(sorted_x, order, weights)
        if self.mesh.size() == 1:
            side = shared() if shared is not None else None
            self.last_rows = sorted_x.shape[0]
            y = self.run_experts(sorted_x, counts)
        else:
            y, side = self._exchange_and_run(sorted_x, counts, shared)
        out = unpermute_tokens(y, order, weights)
        if self.split_tokens:
            out = _GatherTokens.apply(out, self.tp_group)[:tokens]
        return out + side if side is not None else out

    def _exchange_and_run(self, sorted_x: torch.Tensor, counts: torch.Tensor, shared: SharedWork | None):
        """Steps 2-5 of docs/expert_parallel.md#expert-weights-and-token-dispatch: rows out to their experts'
        ranks and the outputs back."""
        send, recv, slice_rows, sources = self._exchange_counts(counts, sorted_x.shape[0])
        pending: list = []
        received = _AllToAll.apply(sorted_x, recv, send, self.ep_group, pending) if self.ep > 1 else sorted_x
        self.last_dispatch_bytes = sorted_x.numel() * sorted_x.element_size() if self.ep > 1 else 0
        side = shared() if shared is not None else None  # overlaps the dispatch in flight
        for work in pending:
            work.wait()
        if self.etp > 1:
            received = _Uneven.apply(received, slice_rows, self.etp_group, True)
        self.last_rows = sum(slice_rows)
        y = self._run_local_experts(received, sources, self.last_rows)
        if self.etp > 1:
            y = _Uneven.apply(y, slice_rows, self.etp_group, False)
        if self.ep > 1:
            y = _AllToAll.apply(y, send, recv, self.ep_group, None)
        return y, side

    def _slice_over_tp(self, x, weights, experts):
        """This tp rank's share of the replicated tokens; a token count that tp does not divide is
        padded with rows of routing weight 0 (they add nothing and get no gradient)."""
        size, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        pad = -x.shape[0] % size
        if pad:
            x, weights = F.pad(x, (0, 0, 0, pad)), F.pad(weights, (0, 0, 0, pad))
            experts = F.pad(experts, (0, 0, 0, pad))
        chunk = x.shape[0] // size
        return (
            _SliceTokens.apply(x, self.tp_group),
            _SliceTokens.apply(weights, self.tp_group),
            experts[rank * chunk : (rank + 1) * chunk],
        )

    def _exchange_counts(self, counts: torch.Tensor, rows: int):
        """Split sizes as host ints: rows sent to / received from each ep peer, rows each etp peer
        received (the expert slice's rows after the etp gather); and on the device the rows per
        (source, local expert) of those, [etp x ep, E/ep], in the order they are gathered."""
        received = counts.view(1, -1)
        if self.ep > 1:
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.ep_group)
            received = received.view(self.ep, self.local_experts)
        sources = _all_gather_rows(received, self.etp_group) if self.etp > 1 else received
        sizes = torch.cat([counts.view(self.ep, -1).sum(1), received.sum(1), sources.view(self.etp, -1).sum(1)])
        host = split_sizes(sizes, lambda routing: self._assumed_sizes(rows, routing))  # the one sync
        return host[: self.ep], host[self.ep : 2 * self.ep], host[2 * self.ep :], sources

    def _assumed_sizes(self, rows: int, routing: str) -> list[int]:
        """What a dry run takes for the split sizes (``meshtron.host.split_sizes``): ``balanced``
        routing, or ``skewed``: every rank's copies sent to ep rank 0."""
        if routing == "balanced":
            return even_split(rows, self.ep) * 2 + [rows] * self.etp
        first = self.ep == 1 or dist.get_rank(self.ep_group) == 0
        received = rows if first else 0  # from each ep peer
        return [rows] + [0] * (self.ep - 1) + [received] * self.ep + [received * self.ep] * self.etp

    def _run_local_experts(self, received: torch.Tensor, sources: torch.Tensor, rows: int) -> torch.Tensor:
        """Regroup rows (by source rank, then local expert) by local expert, run them, restore the order."""
        local = torch.arange(self.local_experts, device=received.device).repeat(sources.shape[0])
        expert_of_row = torch.repeat_interleave(local, sources.flatten(), output_size=rows)
        regroup, local_counts = sort_by_group(expert_of_row, self.local_experts)
        return unsort(self.run_experts(received[regroup], local_counts), regroup)


# Dimension of each projection that etp splits: gate/up by columns [E, H, I], down by rows [E, I, H].
_ETP_DIM = {"gate_proj": 2, "up_proj": 2, "down_proj": 1}


class ExpertParallelExperts(ExpertDispatch):
    """Drop-in for :class:`GroupedExperts` holding this rank's slice of the experts (E/ep experts, I/etp
    columns) and dispatching by all-to-all (arguments as :class:`ExpertDispatch`)."""

    def __init__(
        self,
        experts: GroupedExperts,
        mesh: DeviceMesh,
        tp_mesh: DeviceMesh | None = None,
        split_tokens_over_tp: bool = True,
    ):
        super().__init__(experts.num_experts, mesh, tp_mesh, split_tokens_over_tp)
        self.matmul = self.down_matmul = experts.matmul
        if self.etp > 1 and hasattr(experts.matmul, "split_over"):  # float8: scales over the whole expert
            self.matmul = experts.matmul.split_over(self.etp_group, "out")  # gate/up: columns split
            self.down_matmul = experts.matmul.split_over(self.etp_group, "in")  # down: rows split
        for name in _PROJECTIONS:
            setattr(self, name, self.own(getattr(experts, name), _ETP_DIM[name]))

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self.local(getattr(self, name)) for name in _PROJECTIONS)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, shared: SharedWork | None = None
    ) -> torch.Tensor:
        return self.dispatch(x, weights, experts, shared)


def router_stats_reducer(group) -> StatsReducer:
    """Router statistics summed over ``group`` (a copy; counts carry no gradient): the global counts
    :func:`set_global_router_stats` installs, and those of transformers' aux loss (:mod:`meshtron.hf.router`)."""

    def reduce(stats: torch.Tensor) -> torch.Tensor:
        stats = stats.clone()
        dist.all_reduce(stats, group=group)
        return stats

    return reduce


def token_mesh(mesh: DeviceMesh, sequence_parallel: bool = False) -> DeviceMesh:
    """The ranks holding different tokens of one step: dp x cp x ep, and tp when it splits the sequence."""
    if sequence_parallel and mesh["tp"].size() > 1:
        return flatten_mesh(mesh[("dp", "cp", "ep", "tp")], "dp_cp_ep_tp")
    return dense_data_mesh(mesh)


def set_global_router_stats(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Make every MoE's router statistics global (see ``MoE._router_losses``): one small all-reduce
    per MoE call over :func:`token_mesh`. A no-op when a single rank holds all tokens."""
    tokens = token_mesh(mesh, sequence_parallel)
    reducer = router_stats_reducer(tokens.get_group()) if tokens.size() > 1 else None
    for moe in moe_layers(model):
        moe.stats_reducer = reducer


class GlobalCapacityRanker:
    """A MoE's :data:`~meshtron.models.moe.CapacityRanker` on a mesh: capacity and first-come order
    over the global micro-batch.

    Token order is (sample in the global micro-batch, position in the global sequence). A rank's
    tokens are its dp x ep rows (samples ``rank * B`` to ``rank * B + B - 1``), of each row the cp
    chunks ``i`` and ``2cp-1-i`` (``meshtron.parallel.context``) and, under SP, this tp rank's slice
    of those: per row at most two runs of consecutive positions, already in order. Each rank
    all-gathers, per run, its first token's key, its length and its copies per expert (``[2B, 2 + E]``
    integers) over the token holders; the copies of an expert that come before one of ours are our
    earlier ones (counted by the model) plus those of the other ranks' runs that start before ours.
    One small all-gather per MoE call, no host sync.
    """

    def __init__(self, mesh: DeviceMesh, sequence_parallel: bool, num_experts: int):
        self.num_experts = num_experts
        holders = token_mesh(mesh, sequence_parallel)
        self.group, self.holder_rank, self.holders = holders.get_group(), holders.get_local_rank(), holders.size()
        self.batch_rank = batch_mesh(mesh).get_local_rank()
        self.cp_rank, self.cp = mesh["cp"].get_local_rank(), mesh["cp"].size()
        split_tp = sequence_parallel and mesh["tp"].size() > 1
        self.tp_rank, self.tp = (mesh["tp"].get_local_rank(), mesh["tp"].size()) if split_tp else (0, 1)
        self._keys: dict[tuple[int, int, str], torch.Tensor] = {}

    def keys(self, rows: int, seq: int, device) -> torch.Tensor:
        """[rows, seq] global order keys of this rank's tokens (``seq``: the positions it holds per row).

        Built once per micro-batch shape: every MoE layer of every micro-batch reuses them.
        """
        shape = (rows, seq, str(device))
        if shape not in self._keys:
            self._keys[shape] = self._build_keys(rows, seq, device)
        return self._keys[shape]

    def _build_keys(self, rows: int, seq: int, device) -> torch.Tensor:
        full = seq * self.tp * self.cp
        mine = slice(self.tp_rank * seq, (self.tp_rank + 1) * seq)
        if self.cp > 1:
            positions = sequence_index(full, self.cp_rank, self.cp, device=device)[mine]
        else:
            positions = torch.arange(full, device=device)[mine]
        samples = self.batch_rank * rows + torch.arange(rows, device=device)
        return samples[:, None] * full + positions[None, :]

    def __call__(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, seq, k = experts.shape
        e, runs = self.num_experts, 2 * rows
        keys = self.keys(rows, seq, experts.device).flatten()
        starts_run = torch.ones_like(keys, dtype=torch.bool)
        starts_run[1:] = keys[1:] != keys[:-1] + 1
        run = torch.cumsum(starts_run, 0) - 1
        run_key = keys.new_full((runs,), torch.iinfo(torch.long).max).scatter_reduce(0, run, keys, "amin")
        run_len = count_ids(run, runs)
        copies = (run[:, None] * e + experts.view(-1, k)).flatten()
        table = torch.cat([run_key[:, None], run_len[:, None], count_ids(copies, runs * e).view(runs, e)], dim=1)
        every = _all_gather_rows(table, self.group)
        other = torch.arange(self.holders, device=keys.device).repeat_interleave(runs) != self.holder_rank
        before = (every[None, :, 0] < run_key[:, None]) & other[None, :]
        # float64 matmul: exact for any count below 2**53, and integer matmuls do not exist on every device.
        earlier_per_run = (before.double() @ every[:, 2:].double()).long()
        earlier = earlier_per_run[run[:, None], experts.view(-1, k)]
        return earlier.view(rows, seq, k), every[:, 1].sum()


def set_global_capacity(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Give every MoE with ``moe_capacity_factor`` a :class:`GlobalCapacityRanker` (none when one rank
    holds all tokens), so the same token copies are dropped on every layout."""
    spread = token_mesh(mesh, sequence_parallel).size() > 1
    rankers: dict[int, GlobalCapacityRanker] = {}  # one per expert count: the layers share its cached keys
    for moe in moe_layers(model):
        if spread and moe.capacity_factor and moe.num_experts not in rankers:
            rankers[moe.num_experts] = GlobalCapacityRanker(mesh, sequence_parallel, moe.num_experts)
        moe.capacity_ranker = rankers.get(moe.num_experts) if spread and moe.capacity_factor else None


def ep_does_not_divide(num_experts: int, ep: int) -> str:
    """The rule's words when ``ep`` does not divide ``num_experts``; each caller adds the valid values."""
    return f"[parallel] ep = {ep} does not divide [model] num_experts = {num_experts}"


def check_expert_divisible(num_experts: int, ep: int) -> None:
    if num_experts % ep:
        valid = [v for v in range(1, num_experts + 1) if num_experts % v == 0]
        raise ConfigError(f"{ep_does_not_divide(num_experts, ep)}; valid ep values: {', '.join(map(str, valid))}.")


def check_expert_tp_divisible(intermediate: int, etp: int) -> None:
    if intermediate % etp:
        valid = [v for v in range(1, min(intermediate, 64) + 1) if intermediate % v == 0]
        raise ConfigError(
            f"[parallel] etp = {etp} does not divide the experts' [model] moe_intermediate_size = {intermediate}; "
            f"valid etp values (that also divide tp): {', '.join(map(str, valid))}."
        )


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Split every MoE's routed experts over the experts' (ep, etp) mesh and make router statistics global.

    Works on a meta-device model (materialise afterwards with ``materialize_sharded``, which computes each rank's
    experts from the deterministic initial weights) and on a materialised one (each rank keeps its block of the full
    weights, which must be identical on all ranks). With tp > 1 the experts are wrapped even at ep = etp = 1 (weights
    then stay plain tensors), so the tp ranks split the experts' tokens instead of all computing all of them.
    ``sequence_parallel``: whether tensor parallelism splits the MoE's tokens over tp (then they are
    not split again here). Returns ``model``.
    """
    layers = moe_layers(model)
    split = expert_split(mesh)
    used = [
        f"{k} = {v}"
        for k, v, on in (
            ("ep", split.ep, split.ep > 1),
            ("etp", split.etp, split.etp > 1),
            ("fold_ep", "true", split.fold),
        )
        if on
    ]
    if used and not layers:
        raise ConfigError(
            f"[parallel] {', '.join(used)} needs an MoE model (num_experts > 0); this model has no "
            "MoE layer. Use dp instead."
        )
    for moe in layers:
        check_expert_divisible(moe.num_experts, split.ep)
        check_expert_tp_divisible(moe.experts.gate_proj.shape[-1], split.etp)
    set_global_router_stats(model, mesh, sequence_parallel)
    set_global_capacity(model, mesh, sequence_parallel)
    tp_mesh = mesh["tp"]
    if split.ep * split.etp == 1 and tp_mesh.size() == 1:
        return model
    experts_mesh = expert_meshes(mesh).model
    for moe in layers:
        moe.experts = ExpertParallelExperts(
            moe.experts, experts_mesh, tp_mesh, split_tokens_over_tp=not sequence_parallel
        )
    return model


__all__ = [
    "ExpertDispatch",
    "ExpertParallelExperts",
    "GlobalCapacityRanker",
    "apply_expert_parallel",
    "check_expert_divisible",
    "check_expert_tp_divisible",
    "ep_does_not_divide",
    "router_stats_reducer",
    "set_global_capacity",
    "set_global_router_stats",
    "shard_experts",
    "token_mesh",
]
