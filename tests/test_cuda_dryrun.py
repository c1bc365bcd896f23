"""The dry run on fake CUDA devices (``MESHTRON_DEVICE=cuda python -m meshtron.train --dry-run N``).

It needs a CUDA build of torch, which the project's own environment never holds (the README installs
the CPU wheel): these tests run the CUDA environment's python as a subprocess where one exists
(``MESHTRON_CUDA_VENV``, default ``~/.cache/meshtron/venv-cuda``, made by benchmarks/cuda_dry_run.sh)
and skip with the reason otherwise. What the CPU build can check runs everywhere: its one-line refusal.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("MESHTRON_CUDA_VENV", Path.home() / ".cache" / "meshtron" / "venv-cuda"))
PYTHON = VENV / "bin" / "python"


def _cuda_python_missing() -> str | None:
    """Why the CUDA dry run cannot run here, or None."""
    if not PYTHON.exists():
        return f"no CUDA environment at {VENV} (benchmarks/cuda_dry_run.sh makes one; MESHTRON_CUDA_VENV names another)"
    probe = subprocess.run(
        [str(PYTHON), "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True
    )
    if probe.returncode or probe.stdout.strip() in ("", "None"):
        return f"{PYTHON} has no CUDA build of torch: {probe.stdout.strip() or probe.stderr.strip()[-200:]}"
    return None


_MISSING = _cuda_python_missing()  # once: each probe starts the CUDA environment's python and its torch
needs_cuda_python = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


def cuda_dry_run(*args: str) -> dict:
    """The ``--json`` report of a dry run on fake CUDA devices, run by the CUDA environment's python."""
    done = subprocess.run(
        [str(PYTHON), "-m", "meshtron.train", "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "MESHTRON_DEVICE": "cuda", "PYTHONPATH": str(ROOT)},
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build: it has nothing to refuse")
def test_a_cpu_build_refuses_a_cuda_dry_run(capsys, monkeypatch):
    """With the CPU wheel, MESHTRON_DEVICE=cuda gets one line saying what to install, before anything is traced."""
    from meshtron.train import main

    monkeypatch.setenv("MESHTRON_DEVICE", "cuda")
    assert main(["--recipe", "recipes/debug_dense.toml", "--dry-run", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("meshtron: a dry run on CUDA (MESHTRON_DEVICE=cuda) needs a CUDA build of torch")
        and "pip install torch==" in err
        and err.count("\n") == 1
    ), err


def test_compiled_blocks_are_refused_in_one_line(capsys):
    """torch.compile cannot run under the dry run's tracers (meshtron.dryrun.COMPILE_REFUSAL says why): one
    line naming the key and the fix, before anything is traced, on the CPU path as on fake CUDA."""
    from meshtron.dryrun import COMPILE_REFUSAL
    from meshtron.train import main

    assert main(["--recipe", "recipes/debug_dense.toml", "--dry-run", "2", "--parallel.compile", "true"]) == 2
    assert capsys.readouterr().err == f"meshtron: {COMPILE_REFUSAL}\n"
    assert "[parallel] compile = true" in COMPILE_REFUSAL and "--parallel.compile false" in COMPILE_REFUSAL


@needs_cuda_python
def test_shipped_recipe_traces_on_fake_cuda():
    """Qwen2.5-0.5B's widths at its stated 8 GPUs (FSDP over 8), 4 of its layers at sequence 2048 in one
    micro-batch, with ``[parallel] offload = "optimizer"`` (about 15 s on an idle machine; the whole recipe
    without offload is held to the plan by its stored trace below) on fake ``cuda:0``: FSDP2's streams, events
    and pinned host shards, the device guard and SDPA's kernel choice answered by the stand-ins; the GPU's peak
    within 5 % of the offloaded plan (0.986), the host's fp32 state equal to the plan's (0.365 GiB), the bytes
    sent equal to it; every collective on ``cuda:0`` as NCCL takes it (the dry run refuses any other) and
    only the offload's declared waits: FSDP2's for each gradient's copy to the host at the end of backward,
    and three values crossing to and from the host's optimizer (meshtron.host.copy_to: the norm's host sum,
    the clipping coefficient, the skip flag; one copy each, not one per gradient)."""
    report = cuda_dry_run(
        "--recipe",
        "recipes/qwen2p5_0p5b.toml",
        "--dry-run",
        "8",
        "--model.num_hidden_layers",
        "4",
        "--train.seq_len",
        "2048",
        "--parallel.offload",
        "optimizer",
        "--parallel.microbatches",
        "1",
    )
    (rank,) = report["ranks"]
    assert 0.95 <= rank["ratio"] <= 1.05 and rank["host_peak_gib"] > 0, rank
    assert abs(rank["host_gib"] - rank["planned_host_gib"]) <= 0.01 * rank["planned_host_gib"], rank
    waits = {site.split(" at ")[1].split(":")[0]: n for site, n in rank["host_syncs"].items()}
    assert waits == {"torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py": 50, "meshtron/host.py": 3}, rank
    for key, sent in rank["comm_bytes"].items():
        assert abs(sent["traced"] - sent["planned"]) <= 64, (key, sent)


@needs_cuda_python
def test_offload_with_two_microbatches_traces_with_its_declared_host_accumulation():
    """The same offloaded 0.5B (4 layers) with 2 micro-batches: the second accumulates its reduce-scattered
    gradient shards into those already on the host, which FSDP2 copies there blocking (issue 46), one wait per
    parameter tensor of the rank (50: 4 layers x 12 and the tied embedding and final norm), declared in
    meshtron.host.TORCH_WAITS; the other waits as with one micro-batch, nothing undeclared."""
    report = cuda_dry_run(
        "--recipe",
        "recipes/qwen2p5_0p5b.toml",
        "--dry-run",
        "8",
        "--model.num_hidden_layers",
        "4",
        "--train.seq_len",
        "2048",
        "--parallel.offload",
        "optimizer",
        "--parallel.microbatches",
        "2",
        "--train.global_batch_size",
        "16",
    )
    (rank,) = report["ranks"]
    waits = {site.split(" at ")[1].split(":")[0]: n for site, n in rank["host_syncs"].items()}
    assert waits == {
        "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py": 50,
        "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py": 50,
        "meshtron/host.py": 3,
    }, rank
    assert abs(rank["host_gib"] - rank["planned_host_gib"]) <= 0.01 * rank["planned_host_gib"], rank


@needs_cuda_python
def test_transformers_model_traces_on_fake_cuda(tmp_path):
    """``[model] hf_model`` on fake CUDA (dp 2 x tp 2): transformers' model is built on the meta device and then
    faked on ``cuda:0`` (built under the fake mode, its constants were copied from the host to the real device,
    which has no driver); every collective on ``cuda:0`` as NCCL takes it and no host sync. With both host
    offloads: FSDP2's pinned host shards and the blocks' saved tensors on the host, only the offload's declared
    waits (FSDP2's for each gradient's copy to the host, meshtron.host.copy_to)."""
    import transformers

    folder = tmp_path / "qwen2"
    transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(folder)
    report = cuda_dry_run(
        "--recipe",
        "recipes/debug_dense.toml",
        "--model.hf_model",
        str(folder),
        "--dry-run",
        "4",
        "--parallel.dp",
        "2",
        "--parallel.tp",
        "2",
        "--train.seq_len",
        "256",
    )
    (rank,) = report["ranks"]
    assert rank["collectives"] and rank["host_syncs"] == {} and rank["traced_gib"] > 0, rank
    report = cuda_dry_run(
        "--recipe",
        "recipes/debug_dense.toml",
        "--model.hf_model",
        str(folder),
        "--dry-run",
        "4",
        "--parallel.dp",
        "2",
        "--parallel.tp",
        "2",
        "--train.seq_len",
        "256",
        "--parallel.offload",
        "optimizer",
        "--parallel.offload_activations",
        "true",
    )
    (rank,) = report["ranks"]
    waits = {site.split(" at ")[1].split(":")[0] for site in rank["host_syncs"]}
    assert waits == {"torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "meshtron/host.py"}, rank
    assert rank["host_peak_gib"] > 0, rank


# What benchmarks/cuda_dry_run.sh traced on fake CUDA devices: per case, each distinct rank's peak on its GPU
# (the host's apart, ``host_peak_gib``), at the recipe's stated layout for the shipped recipes.
TRACED_CUDA = ROOT / "benchmarks" / "results" / "cuda_dry_run.json"
SHIPPED = (
    "qwen2p5_0p5b",
    "qwen2p5_1p5b",
    "qwen2p5_3b",
    "qwen2p5_7b",
    "qwen2p5_14b",
    "qwen2p5_32b",
    "qwen2p5_72b",
    "qwen1p5_moe_a2p7b",
    "qwen2_57b_a14b",
)


def test_every_shipped_recipe_has_a_stored_cuda_trace():
    """Every shipped recipe (without host offload) traced on fake CUDA (its GPU peak against the plan:
    :func:`test_plan_holds_to_every_stored_cuda_trace`), nothing kept on the host (the fused AdamW's step
    counts are on the device). Reads the stored traces: runs without the CUDA environment."""
    store = json.loads(TRACED_CUDA.read_text())
    for recipe in SHIPPED:
        assert store[recipe] and all("error" not in row for row in store[recipe]), (recipe, store[recipe])
        assert all(row["host_peak_gib"] == 0 for row in store[recipe]), (recipe, store[recipe])


def _stored_cases() -> list[str]:
    return sorted(json.loads(TRACED_CUDA.read_text()))


def _benchmark():
    """benchmarks/cuda_dry_run.py, whose own code builds each case's configuration and plans its traces."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cuda_dry_run", ROOT / "benchmarks" / "cuda_dry_run.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


def _case_config(case: str):
    """The configuration benchmarks/cuda_dry_run.py traced ``case`` with."""
    return _benchmark()._case(case)[0]


@pytest.mark.parametrize("case", _stored_cases())
def test_plan_holds_to_every_stored_cuda_trace(case):
    """Every case benchmarks/cuda_dry_run.sh traced (recipes, layouts, levers), its configuration built as the
    benchmark builds it: each rank's GPU peak within 5 % of today's plan (1 MiB for the debug models' 10 MiB).
    The 72B offload recipe was at 1.054 and op recompute with it at 1.082 until the plan counted the LM head's
    all-gather output FSDP2 holds through the loss. Transformers models too (Qwen2.5-0.5B's shapes at 1.544 and
    1.700 until the plan counted their head's logits and loss, and their traces stopped building a packed-sequence
    mask a real step does not build: meshtron.hf.pipeline.whole_sequences). Not a case the dry run refuses (compile).
    With host offload, the host's peak within 5 % of the plan's offloaded state and saved tensors (114.9 GiB of 99.4 for
    the 7B when a tensor several ops saved was copied once per op; 98.2 since views of one storage share one copy)."""
    from meshtron.dryrun import TRACE_ASSUMPTIONS
    from meshtron.plan.memory import GIB, rank_breakdown
    from meshtron.plan.parameters import Coords

    rows = json.loads(TRACED_CUDA.read_text())[case]
    if "refused" in rows[0]:
        pytest.skip(f"{case}: {rows[0]['refused']}")
    assert all("error" not in row for row in rows), rows
    benchmark = _benchmark()
    cfg = benchmark._case(case)[0]
    benchmark.replan(rows)  # today's plan for each traced rank, as the table's --replan sets it
    for row in rows:
        planned = row["planned_gib"]
        assert abs(row["traced_gib"] - planned) <= max(0.05 * planned, 2**-10), (
            case,
            row["rank"],
            row["traced_gib"],
            planned,
        )
        host = rank_breakdown(cfg, Coords(**row["coords"]), TRACE_ASSUMPTIONS).host
        offloaded = sum(host[k] for k in ("params", "grads", "optimizer", "activations")) / GIB
        assert abs(row["host_peak_gib"] - offloaded) <= 0.05 * offloaded, (
            case,
            row["rank"],
            row["host_peak_gib"],
            offloaded,
        )


def test_stored_offload_recipe_trace_has_only_declared_waits():
    """recipes/qwen2p5_72b_8gpu.toml at its earlier layout's 8 micro-batches as the CUDA dry run traced it (issue 46):
    FSDP2's end-of-backward wait per parameter tensor of the rank (963: 80 layers x 12, embedding, final norm, LM head),
    its blocking copy of each tensor's gradient shard in each of micro-batches 2-8 (7 x 963), which it adds into the
    gradient on the host, and the three values crossing to the host's optimizer; nothing else (the dry run refuses an
    undeclared wait). The host's offloaded state within 1 % of today's plan."""
    from meshtron.dryrun import TRACE_ASSUMPTIONS
    from meshtron.plan.memory import GIB, rank_breakdown
    from meshtron.plan.parameters import Coords

    rows = json.loads(TRACED_CUDA.read_text())["72b 8gpu offload, 8 micro-batches"]
    cfg = _case_config("72b 8gpu offload, 8 micro-batches")
    assert cfg.parallel.microbatches == 8 and rows and all("error" not in row for row in rows), rows
    for row in rows:
        waits = {site.split(" at ")[1].split(":")[0]: n for site, n in row["syncs"].items()}
        assert waits == {
            "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py": 963,
            "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py": 7 * 963,
            "meshtron/host.py": 3,
        }, row["syncs"]
        host = rank_breakdown(cfg, Coords(**row["coords"]), TRACE_ASSUMPTIONS).host
        planned = sum(host[k] for k in ("params", "grads", "optimizer")) / GIB
        assert abs(row["host_gib"] - planned) <= 0.01 * planned, (row["host_gib"], planned)


# What the dry run on fake CUDA found under [parallel] offload = "optimizer", checked where the CPU path sees it.


def test_clipping_copies_its_coefficient_once_per_device_and_dtype():
    """``scale_grads_`` copied the clipping coefficient to each gradient's device and dtype, one copy per
    gradient: with host-offloaded gradients each was a wait for the device (963 a step of
    recipes/qwen2p5_72b_8gpu.toml on fake CUDA). Ten bf16 gradients and an fp32 norm: one copy."""
    from meshtron.parallel.grad_norm import scale_grads_
    from meshtron.torch_private import TO_COPY, TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func.overloadpacket is TO_COPY
            return func(*args, **(kwargs or {}))

    params = [torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(10)]
    for p in params:
        p.grad = torch.full((3,), 2.0, dtype=torch.bfloat16)
    with Copies():
        scale_grads_(params, 1.0, torch.tensor(4.0))
    assert Copies.count == 1
    assert all(torch.allclose(p.grad.float(), torch.full((3,), 0.5), atol=1e-3) for p in params)


def test_host_sync_counting_of_copies_to_the_host_and_torch_waits():
    """A non-blocking copy to the host lands in pinned memory torch allocates: no wait until the reader
        synchronizes (FSDP2's offloaded gradients), a blocking one waits; FSDP2's wait for them at the end of
        backward and its blocking copy of a micro-batch's gradient shard that accumulates on the host are the torch
    waits meshtron.host declares, each named by torch's own frame and op."""
    from meshtron.host import declared
    from meshtron.torch_private import fake_tensor_mode_class
    from meshtron.watch.syncs import HostSyncCounter, Sync

    with fake_tensor_mode_class()():
        device_tensor = torch.empty(4, device="meta")  # any other device than the host's
        with HostSyncCounter() as syncs:
            device_tensor.to("cpu", non_blocking=True)
            device_tensor.to("cpu")
    assert syncs.by_op() == {"_to_copy": 1}, syncs
    fsdp = "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:797 in finalize_backward"
    assert declared(Sync("Event.synchronize", fsdp))
    assert not declared(Sync("Event.synchronize", fsdp.replace("finalize_backward", "post_backward")))
    assert not declared(Sync("_to_copy", fsdp))  # only the wait torch makes there
    # A micro-batch after the first: FSDP2 copies its reduce-scattered shard to the host blocking, to add it
    # to the gradient there (issue 46); declared in foreach_reduce for that copy only.
    reduce = "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:737 in foreach_reduce"
    assert declared(Sync("_to_copy", reduce))
    assert not declared(Sync("_local_scalar_dense", reduce))
    assert not declared(Sync("_to_copy", reduce.replace("foreach_reduce", "foreach_all_gather")))


def test_stored_offload_trace_holds_the_planned_host_bytes():
    """recipes/qwen2p5_72b_8gpu.toml's offload at its earlier layout as the CUDA dry run traced it (one
    micro-batch of its size, benchmarks/results/cuda_dry_run.md): what the
    offload keeps on the host, counted on the step's objects, within 1 % of today's plan for the rank."""
    from meshtron.dryrun import TRACE_ASSUMPTIONS
    from meshtron.plan.memory import GIB, rank_breakdown
    from meshtron.plan.parameters import Coords

    (row,) = json.loads(TRACED_CUDA.read_text())["72b 8gpu offload, 1 micro-batch"]
    cfg = _case_config("72b 8gpu offload, 1 micro-batch")
    host = rank_breakdown(cfg, Coords(**row["coords"]), TRACE_ASSUMPTIONS).host
    planned = sum(host[k] for k in ("params", "grads", "optimizer")) / GIB
    assert abs(row["host_gib"] - planned) <= 0.01 * planned, (row["host_gib"], planned)
