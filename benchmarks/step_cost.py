"""Host cost of one training step at one rank: Python calls and CPU seconds, meshtron's trainer next to transformers.

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
from meshtron.mesh import build_mesh, exit_process, init_default_group
from meshtron.models import build_model
from meshtron.optim import build_optimizer
from meshtron.parallel.runner import NoPipelineRunner
from meshtron.parallel.step import training_step

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


def write_results(rows: list[dict], args) -> str:
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
    ]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    record = {"settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="one 2-layer shape: a smoke test")
    parser.add_argument("--steps", type=int, default=5, help="steps whose host CPU time is taken")
    parser.add_argument("--layers-7b", type=int, default=8, help="layers of the Qwen2.5-7B shape (as mfu.py)")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_cost", help="results path without suffix")
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps = 2
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
    text = write_results(rows, args)
    print(text)
    return text


if __name__ == "__main__":
    main()
    exit_process(0)
