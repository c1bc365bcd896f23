"""Replay the schedules' p2p batches with real batch_isend_irecv: no hang, every tensor lands right.

Compute steps are skipped; each send carries the identity of the receive it must meet, so a
pairing that the posting order gets wrong shows up as a wrong payload, and a deadlock as a
timeout. Large payloads keep the backend off any small-message eager path.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from meshtron import env
from meshtron.parallel.pipeline import P2P, RECV_B, RECV_F, SEND_B, SEND_F, build_schedule
from meshtron.parallel.pipeline import executor as executor_module
from meshtron.parallel.pipeline.executor import PipelineExecutor
from meshtron.testing import launch_tests

PAYLOAD = 1 << 16
_KIND_CODE = {RECV_F: 1.0, RECV_B: 2.0}


def _expected_recv(op):
    """(kind, stage, mb) of the receive that a send op meets."""
    if op.kind == SEND_F:
        return RECV_F, op.stage + 1, op.mb
    return RECV_B, op.stage - 1, op.mb


def _replay(steps, group):
    device = env.local_device()
    rank = dist.get_rank(group)
    for step in steps[rank]:
        if not isinstance(step, P2P):
            continue
        p2p_ops, checks = [], []
        for op in step.ops:
            peer = dist.get_global_rank(group, op.peer)
            if op.kind in (SEND_F, SEND_B):
                kind, stage, mb = _expected_recv(op)
                tensor = torch.full((PAYLOAD,), 0.0, device=device)
                tensor[:3] = torch.tensor([_KIND_CODE[kind], stage, mb])
                p2p_ops.append(dist.P2POp(dist.isend, tensor, peer, group))
            else:
                tensor = torch.empty(PAYLOAD, device=device)
                p2p_ops.append(dist.P2POp(dist.irecv, tensor, peer, group))
                checks.append((op, tensor))
        for work in dist.batch_isend_irecv(p2p_ops):
            work.wait()
        for op, tensor in checks:
            got = tensor[:3].tolist()
            assert got == [_KIND_CODE[op.kind], op.stage, op.mb], f"rank {rank}: {op} received {got}"


def check_schedules_on_four_ranks():
    group = dist.group.WORLD
    for name, m, v in [("gpipe", 5, 1), ("1f1b", 9, 1), ("interleaved", 8, 2), ("interleaved", 4, 3)]:
        _replay(build_schedule(name, 4, m, v), group)


def check_schedules_on_pp2_sub_meshes():
    # pp = 2 is the case where both neighbours are the same rank, so activations and gradients
    # share one channel and only the posting order keeps them apart
    mesh = init_device_mesh(env.device_type(), (2, 2), mesh_dim_names=("dp", "pp"))
    group = mesh["pp"].get_group()
    for name, m, v in [("1f1b", 3, 1), ("interleaved", 4, 3), ("interleaved", 2, 2)]:
        _replay(build_schedule(name, 2, m, v), group)


class _Logged(torch.autograd.Function):
    """``x * weight`` that logs its forward (with the input's identity) and backward into ``events``."""

    @staticmethod
    def forward(ctx, x, weight, events, stage, mb):
        ctx.save_for_backward(x, weight)
        ctx.events, ctx.key = events, (stage, mb)
        events.append(("F", stage, mb, id(x)))
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append(("B", *ctx.key))
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum(), None, None, None


class _LoggedWork:
    def __init__(self, work, tensor, events):
        self.work, self.tensor, self.events = work, tensor, events

    def wait(self):
        self.events.append(("wait", id(self.tensor)))
        return self.work.wait()

    def is_completed(self):
        return self.work.is_completed()


def _run_logged(steps, num_stages, group, m, events):
    """Runs the executor on identity stages; logs posts, waits and compute in order."""
    real = executor_module.dist.batch_isend_irecv

    def logged(ops):
        events.append(("post", sum(op.op is dist.irecv for op in ops)))
        return [_LoggedWork(w, op.tensor, events) for w, op in zip(real(ops), ops)]

    weight = torch.ones((), requires_grad=True)
    executor_module.dist.batch_isend_irecv = logged
    try:
        executor = PipelineExecutor(steps, num_stages, group)
        executor.run(
            lambda s, x, mb: _Logged.apply(x, weight, events, s, mb),
            [torch.randn(1, 4, 8) for _ in range(m)],
            lambda out, mb: out.sum(),
            ((1, 4, 8), torch.float32),
        )
    finally:
        executor_module.dist.batch_isend_irecv = real
    return weight.grad


def check_executor_waits_for_a_receive_only_when_its_consumer_starts():
    group, rank = dist.group.WORLD, dist.get_rank()
    for name, m, v in [("1f1b", 8, 1), ("interleaved", 8, 2)]:
        events, num_stages = [], 4 * v
        grad = _run_logged(build_schedule(name, 4, m, v)[rank], num_stages, group, m, events)
        assert grad is not None and grad.abs() > 0
        recvs = sum(e[1] for e in events if e[0] == "post")
        recv_waits = [
            i for i, e in enumerate(events) if e[0] == "wait" and i + 1 < len(events) and events[i + 1][0] in "FB"
        ]
        consumers = [e for e in events if (e[0] == "F" and e[1] > 0) or (e[0] == "B" and e[1] < num_stages - 1)]
        # every consumer starts right after waiting for its own input, and nothing else waits on a receive
        assert len(recv_waits) == len(consumers) == recvs, (name, rank, len(recv_waits), len(consumers), recvs)
        for i in recv_waits:
            if events[i + 1][0] == "F":
                assert events[i][1] == events[i + 1][3], (name, rank, "a forward waited for another tensor")
        overlapped = 0  # receives posted before some other compute ran, i.e. in flight during it
        for i in recv_waits:
            last_post = max(j for j in range(i) if events[j][0] == "post")
            overlapped += any(e[0] in "FB" for e in events[last_post:i])
        if name == "interleaved":  # a slot's gradient arrives while its forward runs
            assert overlapped > 0, (rank, events)


@launch_tests(
    4,
    [
        check_schedules_on_four_ranks,
        check_schedules_on_pp2_sub_meshes,
        check_executor_waits_for_a_receive_only_when_its_consumer_starts,
    ],
    timeout=120,
)
def test_schedule_p2p_replays_without_hang_or_mismatch():
    return ()
