"""Context parallelism's communication types (p2p, a2a, allgather, a2a+p2p) and document masks.

    PYTHONPATH=$PWD python benchmarks/cp_comm_types.py [--repeats 3]

1. Bytes each rank sends per attention layer (forward + backward) for every ``cp_comm_type`` at
   cp 2, 4, 8: counted from the collectives one real layer issues on 8 CPU ranks (every call's
   tensor sizes, with ring-algorithm costs for the collectives) against the analytic formula, and
   the analytic figures for a Qwen2.5-7B-shaped layer.
2. Per-rank causal work max/min with packed documents of mixed lengths, contiguous vs load-balanced:
   the visible (query, key) pairs and the block area the ring's engine computes
   (:func:`meshtron.parallel.context.document_blocks`).
3. Step time of every mode on CPU ranks, side by side in one launch (a tiny model, float32).

Writes ``benchmarks/results/cp_comm_types.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

import meshtron.parallel.context.comm as cp_comm
from meshtron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from meshtron.parallel.context import (
    CP_COMM_TYPES,
    RingAttention,
    a2a_group_size,
    chunk_ids,
    cp_groups,
    document_blocks,
    sequence_index,
    shard_sequence,
    visible_blocks,
)
from meshtron.plan.communication import cp_attention_bytes
from meshtron.testing import run_checks

RESULTS = Path(__file__).parent / "results"
CPS = (2, 4, 8)


# ------------------------------------------------------------------------------- bytes moved


def analytic_bytes(comm: str, cp: int, seq: int, heads: int, kv_heads: int, head_dim: int, elem: int) -> float:
    """Bytes one rank sends per layer, forward + backward, batch 1: the planner's count
    (``meshtron.plan.communication.cp_attention_bytes``, which says how each comm type moves them)."""
    model = ModelConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
    )
    cfg = Config(
        model=model,
        parallel=ParallelConfig(cp=cp, cp_comm_type=comm),
        train=TrainConfig(global_batch_size=1, seq_len=seq, dtype="float32" if elem == 4 else "bfloat16"),
    )
    return sum(forward + backward for forward, backward in cp_attention_bytes(cfg).values())


class _CountingDist:
    """``torch.distributed`` with the bytes this rank sends added up per call kind."""

    def __init__(self):
        self.sent = 0.0

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def _bytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def batch_isend_irecv(self, ops):
        self.sent += sum(self._bytes(op.tensor) for op in ops if op.op is dist.isend)
        return dist.batch_isend_irecv(ops)

    def all_to_all_single(self, out, inp, group=None):
        n = dist.get_world_size(group)
        self.sent += self._bytes(inp) * (n - 1) / n
        return dist.all_to_all_single(out, inp, group=group)

    def all_gather_single(self, out, inp, group=None):
        self.sent += self._bytes(inp) * (dist.get_world_size(group) - 1)
        return dist.all_gather_single(out, inp, group=group)

    def reduce_scatter_single(self, out, inp, group=None):
        self.sent += self._bytes(out) * (dist.get_world_size(group) - 1)
        return dist.reduce_scatter_single(out, inp, group=group)


@contextmanager
def counting():
    counter = _CountingDist()
    cp_comm.dist = counter
    try:
        yield counter
    finally:
        cp_comm.dist = dist


def _cp_mesh(cp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size() // cp, cp), mesh_dim_names=("dp", "cp"))


def _attention(mesh, comm: str, heads: int, kv_heads: int) -> RingAttention:
    ring, a2a = cp_groups(mesh, comm, heads=heads, kv_heads=kv_heads)
    return RingAttention(ring, a2a=a2a, allgather=comm == "allgather", kernel="math")


def check_count_bytes(seq: int, heads: int, kv_heads: int, head_dim: int, out_path: str):
    rows = []
    for cp in CPS:
        mesh = _cp_mesh(cp)
        rank, size = mesh["cp"].get_local_rank(), cp
        gen = torch.Generator().manual_seed(cp)
        q = torch.randn(1, heads, seq, head_dim, generator=gen)
        k, v = (torch.randn(1, kv_heads, seq, head_dim, generator=gen) for _ in range(2))
        for comm in CP_COMM_TYPES:
            attn = _attention(mesh, comm, heads, kv_heads)
            local = [shard_sequence(t, rank, size, dim=2).requires_grad_() for t in (q, k, v)]
            with counting() as counter:
                attn(*local).sum().backward()
            sent = torch.tensor([counter.sent], dtype=torch.float64)
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            low = torch.tensor([counter.sent], dtype=torch.float64)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            rows.append(
                dict(
                    cp=cp,
                    comm=comm,
                    max=sent.item(),
                    min=low.item(),
                    analytic=analytic_bytes(comm, cp, seq, heads, kv_heads, head_dim, 4),
                )
            )
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(rows))


# ------------------------------------------------------------------------------- work with documents


def document_lengths(seq: int, gen: torch.Generator, short: int, long: int) -> torch.Tensor:
    """Packed positions of a window of mixed documents: mostly short ones and some long ones."""
    row = []
    while len(row) < seq:
        n = (
            int(torch.randint(1, long + 1, (1,), generator=gen))
            if torch.rand(1, generator=gen) < 0.3
            else int(torch.randint(1, short + 1, (1,), generator=gen))
        )
        row += range(n)
    return torch.tensor(row[:seq]).unsqueeze(0)


def work_per_rank(positions: torch.Tensor, cp: int, balanced: bool) -> tuple[list[int], list[int]]:
    """(visible pairs, computed block area) of each rank's queries over the whole sequence."""
    seq = positions.shape[1]
    chunks = 2 * cp if balanced else cp
    c = seq // chunks
    visible, area = [], []
    for rank in range(cp):
        mine = chunk_ids(rank, cp, balanced)
        pos = positions[:, sequence_index(seq, rank, cp, balanced)]
        visible.append(int((pos + 1).sum()))  # a query at position p sees p + 1 keys
        starts = (sequence_index(seq, rank, cp, balanced) - pos).reshape(len(mine), c)
        first, last = starts.amin(1).tolist(), starts.amax(1).tolist()
        blocks = document_blocks(visible_blocks(mine, tuple(range(chunks))), mine, tuple(range(chunks)), c, first, last)
        area.append(sum(c * (c + 1) // 2 if causal else c * c for _, _, causal, _ in blocks))
    return visible, area


def work_rows(seq: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, short, long in (
        ("short docs (1-512) + 30% long (1-8192)", 512, 8192),
        ("short docs only (1-1024)", 1024, 1024),
        ("one document (no masks)", seq, seq),
    ):
        positions = torch.arange(seq)[None] if long == seq else document_lengths(seq, gen, short, long)
        docs = int((positions == 0).sum())
        for cp in CPS:
            for balanced in (False, True):
                visible, area = work_per_rank(positions, cp, balanced)
                rows.append(
                    dict(
                        case=label,
                        docs=docs,
                        cp=cp,
                        layout="load-balanced" if balanced else "contiguous",
                        visible=max(visible) / min(visible),
                        area=max(area) / min(area),
                        total_area=sum(area) / seq**2,
                    )
                )
    return rows


# ------------------------------------------------------------------------------- step time


def check_step_times(seq: int, repeats: int, out_path: str):
    from meshtron.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from meshtron.mesh import build_mesh
    from meshtron.models import build_model
    from meshtron.parallel.runner import NoPipelineRunner

    model_cfg = ModelConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=10_000.0,
    )
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, seq), generator=gen)
    labels = ids.roll(-1, 1)
    positions = document_lengths(seq, gen, seq // 16, seq // 2)
    runners = {}
    for comm in CP_COMM_TYPES:
        for documents in (False, True):
            cfg = Config(
                model=model_cfg,
                parallel=ParallelConfig(cp=world, cp_comm_type=comm),
                train=TrainConfig(seq_len=seq),
                data=DataConfig(document_mask=documents),
            )
            with torch.device("meta"):
                model = build_model(model_cfg)
            runners[f"{comm} {documents}"] = NoPipelineRunner(model, build_mesh(cp=world), cfg, torch.device("cpu"))
    times = {name: [] for name in runners}
    for it in range(repeats + 1):  # the first round warms up; modes alternate so load drift hits all
        for name, runner in runners.items():
            dist.barrier()
            t0 = time.perf_counter()
            runner.forward_backward(ids, labels, positions if name.endswith("True") else None)
            dist.barrier()
            if it:
                times[name].append(time.perf_counter() - t0)
    results = {name: statistics.median(t) for name, t in times.items()}
    results["load"] = os.getloadavg()[0]
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))


# ------------------------------------------------------------------------------- report


def _run(check, *args) -> object:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        run_checks([check], 8, *args, path, timeout=1800)
        return json.loads(Path(path).read_text())


def write_markdown(path: Path, args, measured, work, steps) -> None:
    mib = 2**20
    lines = [
        "# Context parallelism: communication types and document masks",
        "",
        f"Generated by `benchmarks/cp_comm_types.py` (torch {torch.__version__}).",
        "",
        "## Bytes sent per rank per attention layer (forward + backward)",
        "",
        f"Counted on 8 CPU ranks from the collectives one layer issues (seq {args.seq}, heads {args.heads}, "
        f"KV heads {args.kv_heads}, head dim {args.head_dim}, fp32, batch 1): every send of the ring, "
        "(n-1)/n of an all-to-all's input, (n-1) x the local shard for the all-gather and the "
        "reduce-scatter (ring algorithms). `analytic` is the planner's count "
        "(`meshtron.plan.communication.cp_attention_bytes`). a2a+p2p uses "
        "the auto group size (largest divisor of cp below cp on one node that divides the heads: "
        "1 at cp 2, 2 at cp 4, 4 at cp 8).",
        "",
        "| cp | cp_comm_type | a2a group | measured max KiB | measured min KiB | analytic KiB | ratio |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in measured:
        a = a2a_group_size(r["comm"], r["cp"], heads=args.heads)
        lines.append(
            f"| {r['cp']} | {r['comm']} | {a} | {r['max'] / 1024:.1f} | {r['min'] / 1024:.1f} | "
            f"{r['analytic'] / 1024:.1f} | {r['max'] / r['analytic']:.2f} |"
        )
    big = dict(seq=32768, heads=28, kv_heads=4, head_dim=128)
    lines += [
        "",
        f"Analytic, Qwen2.5-7B attention shape (seq {big['seq']}, heads 28, KV heads 4, head dim 128, "
        "bf16 activations, fp32 dK/dV), MiB per rank per layer. a2a needs cp to divide the 28 heads "
        "(cp 2 and 4 here; at cp 8 it is refused), a2a+p2p uses the auto group size:",
        "",
        "| cp | " + " | ".join(CP_COMM_TYPES) + " |",
        "|---:|" + "---:|" * len(CP_COMM_TYPES),
    ]
    for cp in CPS:
        cells = []
        for comm in CP_COMM_TYPES:
            a = a2a_group_size(comm, cp, heads=big["heads"])
            ok = big["heads"] % a == 0 and (big["kv_heads"] % a == 0 or a % big["kv_heads"] == 0)
            cells.append(f"{analytic_bytes(comm, cp, elem=2, **big) / mib:.0f}" if ok else "refused")
        lines.append(f"| {cp} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Per-rank causal work with packed documents (analytic, seq 16384)",
        "",
        "Work of each rank's queries over the whole sequence: `visible` counts the (query, key) pairs the "
        "document masks leave (what a variable-length kernel computes); `block area` counts what the "
        "ring's block engine computes (a block no query sees is skipped, a diagonal block without a "
        "document start inside is a triangle, every other block is full). max/min over the cp ranks; "
        "`area / S^2` is the total computed area relative to the full square.",
        "",
        "| documents | cp | layout | visible max/min | block area max/min | area / S^2 |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in work:
        lines.append(
            f"| {r['case']} ({r['docs']} docs) | {r['cp']} | {r['layout']} | {r['visible']:.2f} | "
            f"{r['area']:.2f} | {r['total_area']:.3f} |"
        )
    lines += [
        "",
        "## Step time of each mode (measured, CPU: 8 gloo ranks on a 2-core shared host, cp 8)",
        "",
        f"A 2-layer model (hidden 256, 8 heads, 2 KV heads), one sequence of {args.step_seq} tokens, "
        f"forward + backward, median of {args.repeats} steps (modes alternate step by step). These are CPU "
        f"figures on an oversubscribed host (8 ranks time-slice 2 cores, load average {steps['load']:.0f} when "
        "written, math attention kernel): they compare the modes' host work under heavy noise, not GPU speed.",
        "",
        "| cp_comm_type | no masks ms | document masks ms |",
        "|---|---:|---:|",
    ]
    for comm in CP_COMM_TYPES:
        lines.append(f"| {comm} | {steps[f'{comm} False'] * 1e3:.0f} | {steps[f'{comm} True'] * 1e3:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--step-seq", type=int, default=1024)
    p.add_argument("--work-seq", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    work = work_rows(args.work_seq)
    measured = _run(check_count_bytes, args.seq, args.heads, args.kv_heads, args.head_dim)
    steps = _run(check_step_times, args.step_seq, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    write_markdown(args.out / "cp_comm_types.md", args, measured, work, steps)
    print((args.out / "cp_comm_types.md").read_text())


if __name__ == "__main__":
    main()
