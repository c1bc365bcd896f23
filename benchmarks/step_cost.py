"""Cost of one training step at one rank, meshtron's trainer next to transformers: host calls and device work.

On one GPU a small model's step waits on the host (docs/benchmarks.md, 'Performance on GPUs'), and the host's
work is the Python it runs, which does not depend on tensor sizes: so it is measured here on tiny real tensors
with each shape's real structure (layers, heads, KV heads, tied embeddings) and tiny widths. Per step:

* Python calls (``sys.setprofile`` "call" events), by phase: forward + backward, clipping, optimizer, the rest
  (zero_grad, the non-finite guard); forward + backward split by the file called into: the model, the loss,
  data parallelism (FSDP2 and ``meshtron/parallel/data_parallel.py``), DTensor, autograd and dispatch, other;
* host CPU seconds (``time.process_time``), the median of ``--steps`` steps after one warm-up step.

Rows: meshtron's ``training_step`` as ``benchmarks/mfu.py`` runs it (``NoPipelineRunner`` on a 1-rank mesh,
FSDP2 bf16 mixed precision, ``build_optimizer``); the same with torch's fused AdamW over the DTensor parameters
(the optimizer before ``meshtron.optim.LocalAdamW``); transformers' ``Qwen2ForCausalLM`` as ``mfu.py`` runs it
(bf16 autocast, fused AdamW, ``clip_grad_norm_``).

A second table takes the same two steps at each shape's real size (1 x ``--seq`` tokens) on fake tensors: GEMM
and attention FLOPs, and of the other ops that launch a kernel their count and the bytes they read and write, by
the site that issued them (data parallelism, loss, optimizer, clipping, model, backward).

Run: ``PYTHONPATH=. python benchmarks/step_cost.py`` (writes benchmarks/results/step_cost.{md,json});
``--tiny`` runs one 2-layer shape (a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from benchmarks.mfu import shapes, step_config
from meshtron.config import ModelConfig
from meshtron.dryrun import FakeStore
from meshtron.dryrun.counting import is_attention, moved_bytes, op_flops
from meshtron.host import fake_tensors, simulated
from meshtron.mesh import build_mesh, exit_process, init_default_group
from meshtron.models import build_model
from meshtron.optim import build_optimizer
from meshtron.parallel.runner import NoPipelineRunner
from meshtron.parallel.step import training_step
from meshtron.torch_private import (
    GROUPED_MM,
    TorchDispatchMode,
    fake_tensor_mode_class,
    is_traceable_wrapper_subclass,
    op_packet,
    pytree,
)

RESULTS = Path(__file__).parent / "results"
HEAD_DIM, INTERMEDIATE, VOCAB, SEQ = 8, 64, 512, 64
PHASES = ("forward + backward", "clipping", "optimizer", "rest")
# Where a call made in forward + backward lands, by the file called into (the first pattern that matches).
SITES = (
    ("data parallel", ("torch/distributed/fsdp/", "meshtron/parallel/data_parallel.py")),
    ("DTensor", ("torch/distributed/tensor/",)),
    ("loss", ("meshtron/models/chunked_loss.py", "transformers/loss/", "torch/nn/modules/loss.py")),
    ("model", ("meshtron/models/", "transformers/", "torch/nn/modules/", "torch/nn/functional.py")),
    ("autograd and dispatch", ("torch/autograd/", "torch/_ops.py", "torch/utils/", "torch/_tensor.py")),
)
OTHER = "other"


def tiny_widths(cfg: ModelConfig) -> ModelConfig:
    """The shape's structure (layers, heads, KV heads, tied embeddings) at tiny widths."""
    return dataclasses.replace(
        cfg,
        hidden_size=cfg.num_attention_heads * HEAD_DIM,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ * 2,
    )


class CallCounter:
    """Python calls while active, by phase (set by :meth:`phase`) and, in forward + backward, by site."""

    def __init__(self):
        self.current = "rest"
        self.by_phase = dict.fromkeys(PHASES, 0)
        self.by_site = dict.fromkeys([name for name, _ in SITES] + [OTHER], 0)

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        self.by_phase[self.current] += 1
        if self.current == PHASES[0]:
            path = frame.f_code.co_filename.replace("\\", "/")
            site = next((name for name, parts in SITES if any(p in path for p in parts)), OTHER)
            self.by_site[site] += 1

    def wrap(self, owner, name: str, phase: str) -> None:
        """Count the calls made inside ``owner.name`` as ``phase``."""
        original = getattr(owner, name)

        def phased(*args, **kwargs):
            outer, self.current = self.current, phase
            try:
                return original(*args, **kwargs)
            finally:
                self.current = outer

        setattr(owner, name, phased)

    def count(self, step) -> None:
        sys.setprofile(self._profile)
        try:
            step()
        finally:
            sys.setprofile(None)

    def record(self) -> dict:
        return {
            "total": sum(self.by_phase.values()),
            "by_phase": self.by_phase,
            "forward_backward_by_site": self.by_site,
        }


def meshtron_step(model_cfg: ModelConfig, batch: torch.Tensor, optimizer: str, counter: CallCounter):
    cfg = step_config(model_cfg, "bfloat16", batch.shape[0], batch.shape[1] - 1)
    with torch.device("meta"):
        model = build_model(cfg.model)
    runner = NoPipelineRunner(model, build_mesh(), cfg, torch.device("cpu"))
    if optimizer == "LocalAdamW":
        adamw = build_optimizer(runner.module, cfg.train)
    else:
        groups = build_optimizer(runner.module, cfg.train).param_groups
        adamw = torch.optim.AdamW(
            [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
            lr=groups[0]["lr"],
            betas=groups[0]["betas"],
            fused=True,
        )
    counter.wrap(runner, "forward_backward", PHASES[0])
    counter.wrap(runner, "clip_grad_norm", PHASES[1])
    counter.wrap(adamw, "step", PHASES[2])
    ids, labels = batch[:, :-1], batch[:, 1:]
    return lambda: training_step(runner, adamw, ids, labels, cfg.train.max_grad_norm)


def transformers_step(model_cfg: ModelConfig, batch: torch.Tensor, counter: CallCounter):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshtron.hf import hf_config_dict

    model = Qwen2ForCausalLM(Qwen2Config.from_dict(hf_config_dict(model_cfg), attn_implementation="sdpa")).train()
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    ids = batch[:, :-1]

    def forward_backward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    def clip():
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    parts = SimpleNamespace(forward_backward=forward_backward, clip=clip)
    counter.wrap(parts, "forward_backward", PHASES[0])
    counter.wrap(parts, "clip", PHASES[1])
    counter.wrap(adamw, "step", PHASES[2])

    def step():
        adamw.zero_grad(set_to_none=True)
        loss = parts.forward_backward()
        parts.clip()
        adamw.step()
        return loss.detach()

    return step


def measure(name: str, model_cfg: ModelConfig, args) -> list[dict]:
    cfg = tiny_widths(model_cfg)
    batch = torch.randint(0, cfg.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(0))
    rows = []
    for run in ("meshtron trainer", "meshtron trainer, torch fused AdamW", "transformers"):
        counter = CallCounter()
        if run == "transformers":
            step = transformers_step(cfg, batch, counter)
        else:
            step = meshtron_step(cfg, batch, "LocalAdamW" if run == "meshtron trainer" else "torch", counter)
        step()  # warm-up: optimizer state, FSDP's lazy initialization
        counter.count(step)
        cpu = []
        for _ in range(args.steps):
            start = time.process_time()
            step()
            cpu.append(time.process_time() - start)
        parameters = sum(1 for _ in build_model(cfg).parameters())
        rows.append(
            {
                "shape": name,
                "run": run,
                "layers": cfg.num_hidden_layers,
                "parameters": parameters,
                "python_calls": counter.record(),
                "cpu_seconds": cpu,
                "median_cpu_seconds": statistics.median(cpu),
            }
        )
    return rows


GEMMS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm, GROUPED_MM}
# The site an op is charged to: the innermost frame of the Python stack matching one of these (inner first).
DEVICE_SITES = (
    ("optimizer", ("torch/optim/", "meshtron/optim.py")),
    ("clipping", ("meshtron/parallel/grad_norm.py", "torch/nn/utils/clip_grad.py")),
    ("data parallel", ("torch/distributed/fsdp/", "meshtron/parallel/data_parallel.py")),
    ("loss", ("meshtron/models/chunked_loss.py", "transformers/loss/", "torch/nn/functional.py:cross_entropy")),
    ("model", ("meshtron/models/", "transformers/models/")),
    ("backward", ("torch/autograd/",)),
)


class DeviceCost(TorchDispatchMode):
    """Per op on plain tensors (a DTensor's local ops reach it in turn): GEMM FLOPs, attention FLOPs, and of
    the other ops that launch a kernel their count and the bytes of their tensors (inputs and outputs), each
    charged to the site that issued it (:data:`DEVICE_SITES`)."""

    def __init__(self):
        super().__init__()
        self.gemm_flops = self.attention_flops = 0
        self.kernels: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in pytree.tree_leaves((args, kwargs))):
            return NotImplemented
        out = func(*args, **kwargs)
        moved = moved_bytes(func, args, kwargs, out)  # what the dry run's roofline counts, op by op
        if moved is None:
            return out
        if op_packet(func) in GEMMS:
            self.gemm_flops += op_flops(func, args, kwargs, out)
            return out
        if is_attention(func):
            self.attention_flops += op_flops(func, args, kwargs, out)
            return out
        site = _site()
        self.kernels[site] = self.kernels.get(site, 0) + 1
        self.bytes[site] = self.bytes.get(site, 0) + moved
        return out

    def record(self) -> dict:
        return {
            "gemm_tflop": self.gemm_flops / 1e12,
            "attention_tflop": self.attention_flops / 1e12,
            "kernels": sum(self.kernels.values()),
            "non_gemm_gb": sum(self.bytes.values()) / 1e9,
            "kernels_by_site": dict(sorted(self.kernels.items())),
            "non_gemm_gb_by_site": {k: v / 1e9 for k, v in sorted(self.bytes.items())},
        }


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/") + ":" + frame.f_code.co_name
        for name, parts in DEVICE_SITES:
            if any(part in path for part in parts):
                return name
        frame = frame.f_back
    return OTHER


def meshtron_device_cost(model_cfg: ModelConfig, seq: int) -> dict:
    """meshtron's one-rank trainer step (as mfu.py runs it) at the shape's real size on fake tensors."""
    cfg = step_config(model_cfg, "bfloat16", 1, seq)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        with simulated():
            with torch.device("meta"):
                model = build_model(cfg.model)
            runner = NoPipelineRunner(model, build_mesh(), cfg, torch.device("cpu"))
            with fake_tensors():
                optimizer = build_optimizer(runner.module, cfg.train)
                ids = torch.randint(0, cfg.model.vocab_size, (1, seq))
                training_step(runner, optimizer, ids, ids, cfg.train.max_grad_norm)  # warm-up: the state
                with DeviceCost() as cost:
                    training_step(runner, optimizer, ids, ids, cfg.train.max_grad_norm)
    finally:
        dist.destroy_process_group()
    return cost.record()


def transformers_device_cost(model_cfg: ModelConfig, seq: int) -> dict:
    """transformers' step as mfu.py runs it (bf16 autocast, fused AdamW, clipping) on fake tensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from meshtron.hf import hf_config_dict

    config = Qwen2Config.from_dict(hf_config_dict(model_cfg), attn_implementation="sdpa")
    with fake_tensor_mode_class()(allow_non_fake_inputs=True):
        model = Qwen2ForCausalLM(config).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        ids = torch.randint(0, model_cfg.vocab_size, (1, seq))

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

        step()
        with DeviceCost() as cost:
            step()
    return cost.record()


def measure_device(name: str, model_cfg: ModelConfig, seq: int) -> list[dict]:
    """Both steps at the shape's real size, 1 x ``seq`` tokens, on fake tensors."""
    return [
        {"shape": name, "run": run, "seq": seq, **cost(model_cfg, seq)}
        for run, cost in (("meshtron trainer", meshtron_device_cost), ("transformers", transformers_device_cost))
    ]


def device_line(row: dict, theirs: dict) -> str:
    by = row["non_gemm_gb_by_site"]
    sites = " | ".join(f"{by.get(site, 0.0):.2f}" for site in ("data parallel", "loss", "optimizer", "clipping"))
    return (
        f"| {row['shape']} | {row['run']} | {row['gemm_tflop']:.2f} | {row['attention_tflop']:.2f} | "
        f"{row['non_gemm_gb']:.1f} | {row['non_gemm_gb'] / theirs['non_gemm_gb']:.2f} | {row['kernels']:,} | "
        f"{row['kernels'] / theirs['kernels']:.2f} | {sites} |"
    )


def device_theirs(rows: list[dict]) -> dict[str, dict]:
    return {r["shape"]: r for r in rows if r["run"] == "transformers"}


def ratios(rows: list[dict]) -> dict[tuple[str, str], float]:
    """Each meshtron row's Python calls over transformers' for the same shape."""
    theirs = {r["shape"]: r["python_calls"]["total"] for r in rows if r["run"] == "transformers"}
    return {(r["shape"], r["run"]): r["python_calls"]["total"] / theirs[r["shape"]] for r in rows}


def table_line(row: dict, ratio: float) -> str:
    calls = row["python_calls"]
    phases = " | ".join(f"{calls['by_phase'][p]:,}" for p in PHASES)
    sites = calls["forward_backward_by_site"]
    return (
        f"| {row['shape']} | {row['run']} | {calls['total']:,} | {ratio:.2f} | {phases} | "
        f"{sites['data parallel']:,} | {sites['DTensor']:,} | {row['median_cpu_seconds'] * 1e3:.1f} |"
    )


def write_results(rows: list[dict], device_rows: list[dict], args) -> str:
    by = ratios(rows)
    lines = [
        "# Host cost of one training step at one rank: meshtron vs transformers",
        "",
        *(["**Smoke run (`--tiny`): checks that the script works; not a result.**", ""] if args.tiny else []),
        f"Tiny real tensors with each shape's structure (layers, heads, KV heads, tied embeddings; head dim "
        f"{HEAD_DIM}, intermediate {INTERMEDIATE}, vocabulary {VOCAB}, 1 x {SEQ} tokens), bf16, one rank. Python "
        f"calls of one step after a warm-up step (`sys.setprofile`), by phase, and of forward + backward the calls "
        f"into FSDP2 / meshtron's data parallelism and into DTensor; ratio = calls over transformers'; host CPU ms: "
        f"median of {args.steps} steps (`time.process_time`). Produced by `benchmarks/step_cost.py`.",
        "",
        "| shape | run | Python calls | ratio | forward + backward | clipping | optimizer | rest | of f + b: data "
        "parallel | of f + b: DTensor | host CPU ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(table_line(r, by[r["shape"], r["run"]]) for r in rows),
        "",
        "## Device work of the same step at real size",
        "",
        f"Each shape at its real size, 1 x {args.seq:,} tokens, bf16, on fake tensors (shapes only): GEMM and "
        "attention TFLOP, and of every other op that launches a kernel (no views or allocations) the count and "
        "the GB of its tensors read and written, the latter also by the site that issued it (data parallel: "
        "FSDP2's casts, copies and reductions). ratio = over transformers'.",
        "",
        "| shape | run | GEMM TFLOP | attention TFLOP | non-GEMM GB | ratio | kernels | ratio | GB: data parallel "
        "| GB: loss | GB: optimizer | GB: clipping |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(device_line(r, device_theirs(device_rows)[r["shape"]]) for r in device_rows),
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    record = {"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "device_rows": device_rows}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="one 2-layer shape: a smoke test")
    parser.add_argument("--steps", type=int, default=5, help="steps whose host CPU time is taken")
    parser.add_argument("--layers-7b", type=int, default=8, help="layers of the Qwen2.5-7B shape (as mfu.py)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens of the real-size step (as mfu.py)")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_cost", help="results path without suffix")
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.seq = 2, 128
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(1)  # host work: one thread, so the CPU time is the Python's and the tiny kernels'
    own_group = not dist.is_initialized()
    init_default_group()
    try:
        rows = [row for name, cfg in shapes(args).items() for row in measure(name, cfg, args)]
    finally:
        if own_group:
            dist.destroy_process_group()
    device_rows = [row for name, cfg in shapes(args).items() for row in measure_device(name, cfg, args.seq)]
    text = write_results(rows, device_rows, args)
    print(text)
    return text


if __name__ == "__main__":
    main()
    exit_process(0)
