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
from meshtron.testing import run_checks

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


def test_schedule_p2p_replays_without_hang_or_mismatch():
    run_checks([check_schedules_on_four_ranks, check_schedules_on_pp2_sub_meshes], 4, timeout=120)
