"""tp_overlap on CPU: one decoder layer's forward + backward under SP, its collectives as p2p rings
overlapped with the GEMMs (``meshtron/parallel/tensor_overlap.py``) against the plain all-gathers and
reduce-scatters.

For tp = 2 and 4 (that many gloo ranks, one thread each), one layer of the shape of
``benchmarks/tensor_parallel.py`` with a longer sequence, float32, measures per rank:

* bytes sent over the tp group per layer step: the plain path's collectives counted as a ring sends
  them ((t - 1) / t of the gathered tensor per all-gather or reduce-scatter), the overlapped path's
  sends as they are; both must equal 10 x (t - 1) / t x b*s*h (the SP count: 4 gathers, 4
  reduce-scatters, 2 re-gathers; checked here before anything is written);
* the step's wall time, median of ``REPEATS`` after ``WARMUP``. This is a CPU figure on a shared
  2-core machine, not a GPU one: gloo's sends are copies done by its own threads, which compete with the
  GEMMs for the same cores, so it shows the chunked path's overhead (more, smaller GEMMs and messages),
  not the overlap a GPU with NVLink and copy engines gets.

Run: ``PYTHONPATH=. python benchmarks/tp_overlap.py`` (writes benchmarks/results/tp_overlap.{md,json}).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from meshtron import env
from meshtron.checkpoint import load_full_state_dict
from meshtron.config import ModelConfig
from meshtron.models import InitialWeights, build_model
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.parallel.tensor_overlap import apply_overlapped_tensor_parallel
from meshtron.testing import count_calls, run_checks

TPS = (2, 4)
BATCH, SEQ = 1, 1024
CFG = dict(
    vocab_size=512,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=1,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=48,
    rope_theta=10000.0,
)
WARMUP, REPEATS = 2, 7
RESULTS = Path(__file__).parent / "results"


def _block(tp: int, overlap: bool):
    cfg = ModelConfig(**CFG)
    with torch.device("meta"):
        model = build_model(cfg)
    apply = apply_overlapped_tensor_parallel if overlap else apply_tensor_parallel
    apply(model, init_device_mesh(env.device_type(), (tp,), mesh_dim_names=("tp",))["tp"], True)
    model.to_empty(device=env.local_device())
    with torch.no_grad():
        load_full_state_dict(model, InitialWeights(cfg, seed=0))
    return model, cfg


def _collective_bytes(comm: CommDebugMode, shard_bytes: int, tp: int) -> int:
    """Ring bytes of the layer's SP collectives: an all-gather of [b, s / t, h] shards sends its shard to
    t - 1 peers, a reduce-scatter of [b, s, h] (t - 1) / t of it: (t - 1) shards either way."""
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    return sum(counts.get(op, 0) for op in ("all_gather_into_tensor", "reduce_scatter_tensor")) * (tp - 1) * shard_bytes


def _measure(tp: int, overlap: bool) -> dict:
    model, cfg = _block(tp, overlap)
    block, rank = model.layers["0"], dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=gen).chunk(tp, dim=1)[rank].clone().requires_grad_()
    grad = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=gen).chunk(tp, dim=1)[rank].clone()
    rope = model.rotary(torch.arange(SEQ).expand(BATCH, -1), x.dtype)
    shard_bytes = x.numel() * x.element_size()
    times = []
    for _i in range(WARMUP + REPEATS):
        dist.barrier()
        with CommDebugMode() as comm, count_calls(dist, "batch_isend_irecv") as exchanges:
            start = time.perf_counter()
            block(x, rope).backward(grad)
            times.append(time.perf_counter() - start)
    sent = sum(
        op.tensor.numel() * op.tensor.element_size() for ops, *_ in exchanges for op in ops if op.op is dist.isend
    )
    return dict(
        tp=tp,
        overlap=overlap,
        seconds=statistics.median(times[WARMUP:]),
        sent_bytes=sent + _collective_bytes(comm, shard_bytes, tp),
        analytic_bytes=10 * (tp - 1) * shard_bytes,
        sends=len(exchanges),
    )


def measure(tp: int, out_dir: str) -> None:
    rows = [_measure(tp, overlap) for overlap in (False, True)]
    for row in rows:  # the ring counts are the SP collectives' bytes, both ways
        assert row["sent_bytes"] == row["analytic_bytes"], row
    if dist.get_rank() == 0:
        Path(out_dir, f"tp{tp}.json").write_text(json.dumps(rows))


def _markdown(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        "# tp_overlap on CPU: one decoder layer, forward + backward under SP",
        "",
        f"Layer: hidden {CFG['hidden_size']}, {CFG['num_attention_heads']} heads ({CFG['num_key_value_heads']} KV, "
        f"head_dim {CFG['head_dim']}), SwiGLU {CFG['intermediate_size']}; batch {BATCH} x seq {SEQ}, float32; "
        f"tp gloo ranks of one thread each on a shared 2-core CPU; median of {REPEATS} steps after {WARMUP}. "
        "Sent bytes per rank: both paths equal the analytic 10 x (tp - 1) / tp x b*s*h (checked by the script).",
        "",
        "| tp | path | p2p exchanges | sent / rank (MiB) | analytic (MiB) | step (ms) | vs plain |",
        "|---:|:--|---:|---:|---:|---:|---:|",
    ]
    for tp in TPS:
        plain, over = (r for r in rows if r["tp"] == tp)
        for r in (plain, over):
            lines.append(
                f"| {tp} | {'overlapped rings' if r['overlap'] else 'all-gather / reduce-scatter'} "
                f"| {r['sends']} | {r['sent_bytes'] / mib:.2f} | {r['analytic_bytes'] / mib:.2f} "
                f"| {r['seconds'] * 1e3:.1f} | {r['seconds'] / plain['seconds']:.2f} |"
            )
    lines += [
        "",
        "Not a GPU figure. On this CPU gloo's sends are memory copies by threads that share the two cores with "
        "the GEMMs, so the rings cannot hide anything: the ratio is the chunked path's cost (tp smaller GEMMs "
        "per projection, tp - 1 exchanges per ring, the chunks concatenated) that an overlap must win back. "
        "On GPUs the planner charges one chunk's send per ring plus what a chunk's send takes beyond its GEMM "
        "(`meshtron/plan/speed.py`, `overlapped_tp_seconds`); that remains to be measured with NCCL.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in TPS:
            run_checks([measure], tp, tp, tmp, timeout=1200)
            rows += json.loads(Path(tmp, f"tp{tp}.json").read_text())
    (RESULTS / "tp_overlap.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "tp_overlap.md").write_text(_markdown(rows))
    print(_markdown(rows))


if __name__ == "__main__":
    main()
