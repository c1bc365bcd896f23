"""Run one pp-rank's schedule (``schedules.py``): compute actions and batched p2p.

:class:`PipelineExecutor` owns the p2p posting and waiting, the boundary buffers, the split backward
(``B`` / ``W``) and the FSDP units held unsharded through the step; :class:`Relay` carries a small tensor
alongside every boundary tensor. See docs/pipeline.md#the-executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.distributed.tensor import DTensor

from meshtron.host import completed
from meshtron.parallel.data_parallel import finish_split_backward, hold_unsharded
from meshtron.parallel.pipeline.schedules import (
    P2P,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    Entry,
    F,
    last_weight_passes,
    split_backwards,
)
from meshtron.parallel.pipeline.simulate import Span

# forward(stage, x, mb) -> output: x is the stage's input (token ids or hidden states).
ForwardFn = Callable[[int, torch.Tensor, int], torch.Tensor]
# loss(output of the last stage, mb) -> scalar whose backward starts the pipeline's backward.
LossFn = Callable[[torch.Tensor, int], torch.Tensor]


class Relay(Protocol):
    """A small tensor of ``shape`` and ``dtype`` travelling with every boundary tensor
    (docs/pipeline.md#the-executor, 'Relayed statistics')."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def message(self, kind: str, stage: int, mb: int) -> torch.Tensor:
        """What ``stage`` sends with its output (``kind`` SEND_F) or its input gradient (SEND_B)."""

    def arrived(self, kind: str, stage: int, mb: int, message: torch.Tensor) -> None:
        """What came to ``stage`` with its input (``kind`` RECV_F) or its output gradient (RECV_B)."""


class PipelineExecutor:
    """Executes ``entries`` (one rank's schedule) over ``num_stages`` chunks.

    ``group`` is the pp process group (``mesh["pp"].get_group()``); schedule peers are pp-group
    ranks and are mapped to global ranks once. ``grad_group`` (same ranks, another communicator)
    carries the gradients, so activations and gradients between two ranks are two streams, each
    matched in its own posting order (``simulate.match_p2p``); the V-shaped schedules need that,
    the others also run with one group for both (the default). ``chunk_units`` maps each local
    stage to the FSDP2 units (``FSDPModule``) whose parameters it uses, held unsharded through the
    step (docs/pipeline.md#the-executor, 'Gradient accumulation and FSDP'). ``unsplit`` stages run each
    backward whole at ``B`` even where the schedule splits it (activation checkpointing, compiled blocks:
    docs/pipeline.md#zero-bubble-schedules).
    """

    def __init__(
        self,
        entries: Sequence[Entry],
        num_stages: int,
        group,
        chunk_units: Mapping[int, Sequence[nn.Module]] | None = None,
        grad_group=None,
        unsplit: Collection[int] = (),
    ):
        self.entries, self.num_stages, self.group = list(entries), num_stages, group
        self.grad_group = group if grad_group is None else grad_group
        self.rank = dist.get_rank(group)
        self._local_stages = {entry.stage for entry in self.entries if isinstance(entry, Action)}
        self._split = {key for key in split_backwards(self.entries) if key[0] not in unsplit}
        self.peers = {
            op.peer: dist.get_global_rank(group, op.peer)
            for entry in self.entries
            if isinstance(entry, P2P)
            for op in entry.ops
        }
        self._chunk_units = dict(chunk_units or {})
        self._units, self._release = _release_points(self.entries, self._chunk_units)
        self.record = False
        self.spans: list[Span] = []
        self.peak_live = 0
        self._relay: Relay | None = None
        self._reset()

    def _reset(self) -> None:
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        # What a split backward's W still needs, and tensors handed to a stage on this rank.
        self._deferred: dict[tuple[int, int], _Deferred] = {}
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        self._outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        # The relay's messages, by the key of the boundary tensor they travel with (same three roles).
        self._relay_local: dict[tuple[str, int, int], torch.Tensor] = {}
        self._relay_outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self._relay_inbox: dict[tuple[str, int, int], tuple[torch.Tensor, list]] = {}
        # Posted receives: key -> (buffer, the works to wait for before reading it).
        self._inbox: dict[tuple[str, int, int], tuple[torch.Tensor, list]] = {}
        # Posted sends not known to be complete: (work, tensor kept alive until then).
        self._sending: list[tuple[object, torch.Tensor]] = []

    def live(self) -> int:
        """Micro-batch activations this rank holds now (stage outputs kept for their backward)."""
        return len(self._outputs)

    def run(
        self,
        forward: ForwardFn,
        first_inputs: Sequence[torch.Tensor],
        loss: LossFn,
        boundary: tuple[tuple[int, ...], torch.dtype],
        relay: Relay | None = None,
    ) -> torch.Tensor:
        """Run every entry; returns the sum of this rank's last-stage losses (0 elsewhere), detached.

        ``first_inputs[mb]`` feeds stage 0; ``boundary`` is the (shape, dtype) of every tensor
        crossing a stage boundary; ``relay`` sends a message along with each (docs/pipeline.md#the-executor).
        """
        self._reset()
        self._relay = relay
        self.spans, self.peak_live = [], 0
        for unit in self._units:
            hold_unsharded(unit, True)
        total = torch.zeros((), device=first_inputs[0].device)
        try:
            for i, entry in enumerate(self.entries):
                if isinstance(entry, P2P):
                    self._exchange(entry, boundary, first_inputs[0].device)
                elif entry.kind == F:
                    value = self._forward(entry, forward, first_inputs, loss)
                    if value is not None:
                        total += value
                elif entry.kind == B:
                    self._backward(i, entry)
                else:
                    self._weight(i, entry)
            for work, _ in self._sending:
                work.wait()
        finally:
            leftovers = self.live() + len(self._inbox) + len(self._outbox) + len(self._local)
            leftovers += len(self._relay_inbox) + len(self._relay_outbox) + len(self._relay_local)
            self._reset()
            self._relay = None
        if leftovers:
            raise RuntimeError(f"pipeline rank {self.rank}: {leftovers} tensors left over after the schedule")
        return total

    @torch.no_grad()
    def forward_only(
        self,
        forward: ForwardFn,
        first_inputs: Sequence[torch.Tensor],
        boundary: tuple[tuple[int, ...], torch.dtype],
    ) -> torch.Tensor:
        """Every micro-batch through this rank's stages without gradients (docs/pipeline.md#the-executor,
        'Forward only'); returns the
        sum of the last stage's outputs on its rank (0 elsewhere)."""
        shape, dtype = boundary
        device = first_inputs[0].device
        peer = {stage: self.peers[rank] for stage, rank in _neighbour_ranks(self.entries).items()}
        total = torch.zeros((), device=device)
        sending, handed = [], {}
        for stage in sorted(self._local_stages):
            for mb, first in enumerate(first_inputs):
                if stage == 0:
                    x = first
                elif stage - 1 in self._local_stages:  # the turn of a V
                    x = handed.pop((stage, mb))
                else:
                    x = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(x, peer[stage - 1], group=self.group)
                out = forward(stage, x, mb)
                if stage == self.num_stages - 1:
                    total += out
                    continue
                _check_boundary(out, shape, dtype, Action(F, mb, stage))
                if stage + 1 in self._local_stages:
                    handed[(stage + 1, mb)] = out
                else:
                    sending.append((dist.isend(out, peer[stage + 1], group=self.group), out))
        for work, _ in sending:
            work.wait()
        return total

    def _timed(self, action: Action, fn: Callable[[], torch.Tensor | None]):
        if not self.record:
            return fn()
        _sync()
        start = time.perf_counter()
        out = fn()
        _sync()
        self.spans.append(Span(self.rank, action.kind, action.mb, start, time.perf_counter(), action.stage))
        return out

    def _forward(self, a: Action, forward: ForwardFn, first_inputs, loss: LossFn) -> torch.Tensor | None:
        """Runs F; returns the detached loss on the last stage."""
        key, last = (a.stage, a.mb), a.stage == self.num_stages - 1
        x = first_inputs[a.mb] if a.stage == 0 else self._input((RECV_F, *key), a.stage - 1).requires_grad_()

        def compute() -> torch.Tensor:
            out = forward(a.stage, x, a.mb)
            return loss(out, a.mb) if last else out

        out = self._timed(a, compute)
        if not last:
            self._output((SEND_F, *key), a.stage + 1, out.detach())
        if a.stage > 0:
            self._inputs[key] = x
        self._outputs[key] = out
        self.peak_live = max(self.peak_live, self.live())
        return out.detach() if last else None

    def _backward(self, index: int, a: Action) -> None:
        """The full backward, or of a split one (a ``W`` follows) only the gradient w.r.t. the stage
        input: what the previous stage waits for (docs/pipeline.md#the-executor, 'Split backward')."""
        key, split = (a.stage, a.mb), (a.stage, a.mb) in self._split
        if not split:
            self._release_units(index)
        out = self._outputs[key] if split else self._outputs.pop(key)
        grad = None if a.stage == self.num_stages - 1 else self._input((RECV_B, *key), a.stage + 1)
        # F821: ruff reads the del below as leaving out and grad undefined in the lambdas; _timed calls them first.
        if not split:
            self._timed(a, lambda: torch.autograd.backward(out, grad))  # noqa: F821
        else:
            x = self._inputs.get(key)
            self._deferred[key] = self._timed(a, lambda: _backward_input(out, grad, x))  # noqa: F821
        del out, grad
        if a.stage > 0:
            x = self._inputs.pop(key)
            self._output((SEND_B, *key), a.stage - 1, x.grad)
            x.grad = None  # sent or handed over: a whole-backward W must not accumulate into it
            del x

    def _weight(self, index: int, a: Action) -> None:
        """Weight gradients of a split backward, accumulated into ``.grad``; frees the micro-batch's
        graph and saved activations."""
        key = (a.stage, a.mb)
        if key not in self._split:  # its B ran the whole backward: only the units' release is left
            self._timed(a, lambda: self._finish_weights(index, a.stage))
            return
        out, deferred = self._outputs.pop(key), self._deferred.pop(key)

        # F821: ruff reads the del below as leaving out and deferred undefined in compute; _timed calls it first.
        def compute() -> None:
            if not deferred.restarts:  # noqa: F821 - a whole backward: FSDP's own hooks reduce released units
                self._release_units(index)
                deferred.run(out)  # noqa: F821
                return
            # FSDP hooks reached inside the restarted passes (a unit's pre-backward, the root's final
            # callback) must not reduce before the last pass: release only after them.
            deferred.run(out)  # noqa: F821
            self._finish_weights(index, a.stage)

        self._timed(a, compute)
        del out, deferred

    def _finish_weights(self, index: int, stage: int) -> None:
        """After a ``W`` that ran no whole backward: FSDP's end of backward, by hand."""
        self._release_units(index)
        finish_split_backward(self._chunk_units.get(stage, []), self._release.get(index, []))

    def _release_units(self, index: int) -> None:
        for unit in self._release.get(index, ()):
            hold_unsharded(unit, False)

    def _input(self, key: tuple[str, int, int], source_stage: int) -> torch.Tensor:
        """A stage's input activation or output gradient: handed over by a stage on this rank (the
        turn of a V) or received."""
        local = source_stage in self._local_stages
        tensor = self._local.pop(key) if local else self._received(key)
        if self._relay is not None:
            message = self._relay_local.pop(key) if local else _waited(*self._relay_inbox.pop(key))
            self._relay.arrived(*key, message)
        return tensor

    def _output(self, key: tuple[str, int, int], target_stage: int, tensor: torch.Tensor | None) -> None:
        """Queue ``tensor`` for its send, or hand it to the target stage when that runs here."""
        if target_stage in self._local_stages:
            if tensor is None:
                raise RuntimeError(
                    f"stage {key[1]}: the stage input has no gradient (does the chunk's output depend on it?)"
                )
            self._local[(RECV_F if key[0] == SEND_F else RECV_B, target_stage, key[2])] = tensor
        else:
            self._outbox[key] = tensor
        if self._relay is not None:
            message = self._relay.message(*key)
            if target_stage in self._local_stages:
                self._relay_local[(RECV_F if key[0] == SEND_F else RECV_B, target_stage, key[2])] = message
            else:
                self._relay_outbox[key] = message

    def _received(self, key: tuple[str, int, int]) -> torch.Tensor:
        return _waited(*self._inbox.pop(key))

    def _exchange(self, entry: P2P, boundary, device: torch.device) -> None:
        """Posts the batch (activations on ``group``, gradients on ``grad_group``: one batch per
        communicator); receives are waited for by their consumer, sends by later batches."""
        shape, dtype = boundary
        batches: dict[int, tuple[list, list]] = {}
        for op in entry.ops:
            key = (op.kind, op.stage, op.mb)
            kind = dist.isend if op.kind in (SEND_F, SEND_B) else dist.irecv
            if kind is dist.isend:
                tensor = self._outbox.pop(key)
                _check_boundary(tensor, shape, dtype, op)
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            group = self.group if op.kind in (SEND_F, RECV_F) else self.grad_group
            ops, posted = batches.setdefault(id(group), ([], []))
            ops.append(dist.P2POp(kind, tensor, self.peers[op.peer], group))
            posted.append((kind, key, tensor, self._inbox))
            if self._relay is not None:  # right behind its boundary tensor: matched in the same order
                relay = self._relay
                message = (
                    self._relay_outbox.pop(key)
                    if kind is dist.isend
                    else torch.empty(relay.shape, dtype=relay.dtype, device=device)
                )
                ops.append(dist.P2POp(kind, message, self.peers[op.peer], group))
                posted.append((kind, key, message, self._relay_inbox))
        self._sending = [(w, t) for w, t in self._sending if not completed(w)]
        for ops, posted in batches.values():
            works = dist.batch_isend_irecv(ops)
            # Backends without coalescing return one work per op; NCCL one work for the whole batch.
            per_op = [[w] for w in works] if len(works) == len(ops) else [list(works)] * len(ops)
            for (kind, key, tensor, inbox), op_works in zip(posted, per_op):
                if kind is dist.isend:
                    self._sending += [(w, tensor) for w in op_works]
                else:
                    inbox[key] = (tensor, op_works)


def _waited(tensor: torch.Tensor, works: list) -> torch.Tensor:
    """A received tensor, once the works that fill it are done."""
    for work in works:
        work.wait()
    return tensor


def _neighbour_ranks(entries: Sequence[Entry]) -> dict[int, int]:
    """The pp-rank of every stage this rank exchanges tensors with, read off the schedule's p2p ops
    (``SEND_F`` / ``RECV_B`` of stage s talk to stage s + 1, ``RECV_F`` / ``SEND_B`` to s - 1)."""
    ranks = {}
    for entry in entries:
        if isinstance(entry, P2P):
            for op in entry.ops:
                ranks[op.stage + 1 if op.kind in (SEND_F, RECV_B) else op.stage - 1] = op.peer
    return ranks


def _release_points(entries: Sequence[Entry], chunk_units: Mapping[int, Sequence[nn.Module]]):
    """(every unit once, {entry index: units to release before that entry}).

    A unit is released at the last weight-gradient pass (a ``W`` or an unsplit ``B``) of the last
    chunk using it: its gradients are complete only then (the stage root's hooks run with every
    chunk, so it waits for the rank's last one).
    """
    last_weights = last_weight_passes(entries)
    units, release_at = {}, {}
    for stage, chunk in chunk_units.items():
        for unit in chunk:
            units[id(unit)] = unit
            release_at[id(unit)] = max(release_at.get(id(unit), -1), last_weights[stage])
    release: dict[int, list[nn.Module]] = {}
    for key, index in release_at.items():
        release.setdefault(index, []).append(units[key])
    return list(units.values()), release


class _Deferred:
    """A split backward's pending weight work: the graph nodes on the path from the stage output
    to its input that also feed weights, the output gradients they received in ``B``, and the
    weights each one leads to."""

    def __init__(self, grad: torch.Tensor | None, nodes: list[tuple[object, tuple, list]] | None):
        self.grad, self.nodes = grad, nodes

    @property
    def restarts(self) -> bool:
        """Whether ``W`` restarts at the captured nodes; else (the first stage, whose ``B`` is empty;
        a weight reached from two nodes) it runs the whole backward from the output, hooks included."""
        return self.nodes is not None

    def run(self, out: torch.Tensor) -> None:
        """Accumulate the weight gradients into ``.grad`` (:attr:`restarts` says how)."""
        if self.nodes is None:
            torch.autograd.backward(out, self.grad)  # also recomputes the input gradient, which nobody reads
            return
        for node, grads, leaves in self.nodes:
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if not edges or not leaves:
                continue
            weights = torch.autograd.grad(
                [e for e, _ in edges],
                [GradientEdge(leaf, 0) for leaf in leaves],
                [g for _, g in edges],
                allow_unused=True,
            )
            for leaf, dw in zip(leaves, weights):
                if dw is not None:
                    param = leaf.variable
                    param.grad = dw if param.grad is None else param.grad + dw


def _backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None) -> _Deferred:
    """``B``: the gradient w.r.t. ``x`` into ``x.grad``, keeping the graph, and what ``W`` needs:
    every node on a path from ``out`` to ``x`` with an edge off that path (into a weight's gradient)
    gets a pre-hook that records the gradient it receives; ``W`` restarts from there.
    """
    if x is None:  # the first stage: no input gradient to compute, W runs the whole backward
        return _Deferred(grad, None)
    target = x.view_as(x).grad_fn.next_functions[0][0]  # x's gradient accumulator
    on_path = _nodes_reaching(out.grad_fn, target)
    branching = [n for n in on_path if any(c is not None and c not in on_path for c, _ in n.next_functions)]
    captured: dict[object, tuple] = {}
    handles = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, g)) for n in branching]
    try:
        torch.autograd.backward(out, grad, inputs=[x], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    # The engine's order, the same on every rank: a W pass may hold a collective (a weight's
    # gradient summed over tp), so ranks must run the passes alike; ``branching`` is a set's order.
    nodes = [(n, grads, _weight_leaves(n, on_path)) for n, grads in captured.items()]
    leaves = [leaf for _, _, found in nodes for leaf in found]
    if len(set(leaves)) < len(leaves):  # a weight fed from two nodes: per-node passes would miss the sum's order
        return _Deferred(grad, None)
    return _Deferred(grad, nodes)


def _nodes_reaching(root, target) -> set:
    """Autograd nodes from which ``target`` is reachable (``root``'s graph, iterative DFS)."""
    reaches: dict[object, bool] = {}
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in reaches:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if expanded:
            reaches[node] = node is target or any(reaches.get(c, False) for c in children)
        else:
            stack.append((node, True))
            stack += [(c, False) for c in children if c not in reaches]
    return {n for n, r in reaches.items() if r}


def _weight_leaves(node, on_path: set) -> list:
    """Gradient accumulators of the weights below ``node``'s edges that leave ``on_path``."""
    leaves, seen = [], set()
    stack = [c for c, _ in node.next_functions if c is not None and c not in on_path]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if hasattr(n, "variable"):
            leaves.append(n)
        stack += [c for c, _ in n.next_functions if c is not None and c not in on_path]
    return leaves


def _sync() -> None:
    """Wait for queued kernels so recorded spans time the work, not its launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _check_boundary(tensor: torch.Tensor | None, shape, dtype, op: Action) -> None:
    if tensor is None:
        raise RuntimeError(f"{op}: the stage input has no gradient (does the chunk's output depend on it?)")
    if isinstance(tensor, DTensor):
        raise TypeError(
            f"{op}: stage boundary tensors must be plain tensors, got a DTensor with {tensor.placements}; "
            "make the parallel plan return local tensors at the block outputs"
        )
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise RuntimeError(
            f"{op}: sending {tuple(tensor.shape)} {tensor.dtype}, but receivers expect {tuple(shape)} {dtype} "
            "([micro-batch, local sequence, hidden] in the compute dtype)"
        )
