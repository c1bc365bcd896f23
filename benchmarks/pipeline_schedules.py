"""Our pipeline executor against ``torch.distributed.pipelining`` on the same stages, in one run.

``python benchmarks/pipeline_schedules.py`` (CPU, gloo; PYTHONPATH=. from the repo root) runs on
``--pp`` local ranks:

* sleep stages: every chunk's forward sleeps ``f`` and its backward ``b`` (a custom autograd
  Function; sleeping uses no CPU), so the step time measures the schedule and the executor, not
  the arithmetic. Ours (1F1B, interleaved) and torch's ``Schedule1F1B`` /
  ``ScheduleInterleaved1F1B`` take turns step by step on the very same stage modules, so load on
  the machine hits all of them alike;
* real compute: a small meshtron Transformer, our ``PipelineRunner`` against torch's schedules
  wrapping the runner's own chunks (same parameters, same micro-batches, same loss);
* zero-bubble (``--parts zb``): sleep stages whose backward has an input-gradient path sleeping
  ``b`` and a weight path sleeping ``w``; ours (``zb1p``, ``zbv``, ``dualpipev``) against torch's
  ``ScheduleInterleavedZeroBubble`` (one stage per rank: ZB1P), ``ScheduleZBVZeroBubble`` and
  ``ScheduleDualPipeV``, taking turns step by step. Writes ``pipeline_zb.json``,
  ``pipeline_zb.md`` and ``pipeline_zb_{ours,torch}_{schedule}.png``;
* zero-bubble, real compute (``--parts zbreal``): the same comparison on chunks of a meshtron
  Transformer (``--real-seq`` tokens per micro-batch, ``--real-microbatches``), whose B and W are
  real autograd work; the analytic figures use the F, B, W costs measured in the run, and every
  step's peak of activations saved for backward is recorded. Writes ``pipeline_zbreal.json``, its table into
  ``pipeline_zb.md`` and ``pipeline_zbreal_{ours,torch}_{schedule}.png``.

Writes ``pipeline_{sleep,real}.json``, ``pipeline_table.md`` and timeline PNGs (``show.render_timeline``) to ``--out``.
Step time is the slowest rank's wall time between a barrier and the end of its step; the median
over ``--repeats`` steps after one warm-up is reported. The measured bubble is
``1 - busy / (pp * step time)`` with busy the time spent inside the stages' forward and backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtron.parallel.pipeline.simulate import analytic_bubble

SLEEP_ACTIVATION = (1, 16, 64)  # [micro-batch, sequence, hidden] sent between sleep stages


def _sleep(stage, kind: str, seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    stage.spans.append((kind, start, time.perf_counter()))


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stage):
        ctx.stage = stage
        _sleep(stage, "F", stage.f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.stage, "B", ctx.stage.b)
        return grad.clone(), None


class _SleepWeight(torch.autograd.Function):
    """Identity on the weight whose backward sleeps ``w``: the weight-gradient path of a sleep stage."""

    @staticmethod
    def forward(ctx, weight, stage):
        ctx.stage = stage
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        _sleep(ctx.stage, "W", ctx.stage.w)
        return grad.clone(), None


class SplitSleepStage(nn.Module):
    """A chunk with a splittable backward: the gradient w.r.t. the input sleeps ``b`` (in ``_Sleep``),
    the weight's gradient ``w`` (in ``_SleepWeight``), forward ``f``."""

    def __init__(self, f: float, b: float, w: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.f, self.b, self.w, self.spans = f, b, w, []

    def forward(self, x):
        return _Sleep.apply(x, self) * _SleepWeight.apply(self.weight, self)


class SleepStage(nn.Module):
    """One chunk: forward sleeps ``f`` seconds, backward ``b``; records its compute spans."""

    def __init__(self, f: float, b: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.f, self.b, self.spans = f, b, []

    def forward(self, x):
        return _Sleep.apply(x * self.weight, self)


def _spans(stages: dict[int, SleepStage], rank: int) -> list[tuple]:
    """(rank, kind, mb, start, end, stage); each chunk runs its micro-batches in order per kind."""
    rows = []
    for s, mod in stages.items():
        seen = {"F": 0, "B": 0, "W": 0}
        for kind, start, end in mod.spans:
            rows.append((rank, kind, seen[kind], start, end, s))
            seen[kind] += 1
    return rows


def _timed(step) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    took = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


class _SavedBytes:
    """Live and peak bytes of the distinct storages autograd saves for backward, parameters excluded:
    the activation memory a schedule holds in flight, counted alike for ours and torch's."""

    class _Saved:
        def __init__(self, owner, tensor, key):
            # The data, not the graph: a saved output holding its grad_fn is a cycle only that node's
            # backward breaks, and a split backward's W does not run every node.
            self.owner, self.tensor, self.key = owner, tensor.detach(), key

        def __del__(self):
            self.owner.release(self.key)

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, list] = {}  # storage -> [handles alive, bytes]
        self.live = self.peak = 0

    def pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key in self.params:
            return tensor
        held = self.refs.setdefault(key, [0, tensor.untyped_storage().nbytes()])
        if not held[0]:
            self.live += held[1]
            self.peak = max(self.peak, self.live)
        held[0] += 1
        return self._Saved(self, tensor, key)

    @staticmethod
    def unpack(saved):
        return saved if isinstance(saved, torch.Tensor) else saved.tensor

    def release(self, key) -> None:
        held = self.refs[key]
        held[0] -= 1
        if not held[0]:
            self.live -= held[1]
            del self.refs[key]


def _torch_schedule(kind: str, modules: dict[int, nn.Module], m: int, num_stages: int, loss_fn):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    stages = [PipelineStage(mod, s, num_stages, torch.device("cpu")) for s, mod in sorted(modules.items())]
    # Gradients are already scaled by our losses; torch must not divide them by m again.
    if kind == "1f1b":
        return Schedule1F1B(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)


def _torch_step(schedule, modules, num_stages, batch, target):
    args = (batch,) if 0 in modules else ()
    if num_stages - 1 in modules:
        return lambda: schedule.step(*args, target=target, losses=[])
    return lambda: schedule.step(*args)


def _local_replay(entries, stages, inputs):
    """The rank's compute actions back to back, no p2p: what the actions alone cost on this machine.

    Its excess over the nominal ``v m (f + b) / v`` divided by the ``2 v m`` actions is the
    per-action floor (waking from the sleep, Python, autograd) that no executor can avoid here.
    """
    from meshtron.parallel.pipeline.schedules import Action, F

    def step():
        outputs = {}
        for a in entries:
            if not isinstance(a, Action):
                continue
            if a.kind == F:
                outputs[a.stage, a.mb] = stages[a.stage](inputs[a.mb].clone().requires_grad_())
            else:
                out = outputs.pop((a.stage, a.mb))
                torch.autograd.backward(out, torch.ones_like(out))

    return step


def sleep_benchmark(args) -> dict:
    from meshtron.parallel.pipeline import build_schedule
    from meshtron.parallel.pipeline.executor import PipelineExecutor

    pp, m, rank = args.pp, args.microbatches, dist.get_rank()
    group = dist.group.WORLD
    variants = {}
    for kind, v in (("1f1b", 1), ("interleaved", args.virtual)):
        n = pp * v
        stages = {s: SleepStage(args.f_ms / 1e3 / v, args.b_ms / 1e3 / v) for s in range(rank, n, pp)}
        batch = torch.randn(m * SLEEP_ACTIVATION[0], *SLEEP_ACTIVATION[1:])
        inputs = list(batch.chunk(m))
        executor = PipelineExecutor(build_schedule(kind, pp, m, v)[rank], n, group)

        def ours(stages=stages, executor=executor, inputs=inputs):
            executor.run(
                lambda stage, x, mb: stages[stage](x),
                inputs,
                lambda out, mb: out.mean(),
                (SLEEP_ACTIVATION, torch.float32),
            )

        schedule = _torch_schedule(kind, stages, m, n, lambda out, target: out.mean())
        variants[("floor", kind)] = (stages, _local_replay(executor.entries, stages, inputs), v)
        variants[("ours", kind)] = (stages, ours, v)
        variants[("torch", kind)] = (stages, _torch_step(schedule, stages, n, batch, batch), v)
    times = {key: [] for key in variants}
    busy = {key: [] for key in variants}
    spans = {}
    for rep in range(args.repeats + 1):
        for key, (stages, step, _v) in variants.items():
            for mod in stages.values():
                mod.spans = []
            took = _timed(step)
            rows = _spans(stages, rank)
            work = torch.tensor(sum(r[4] - r[3] for r in rows))
            dist.all_reduce(work)
            if rep:  # the first round warms up (torch infers shapes, gloo connects)
                times[key].append(took)
                busy[key].append(work.item())
            spans[key] = rows
    gathered = [None] * pp if rank == 0 else None
    dist.gather_object(spans, gathered, dst=0)
    result = {}
    for key, (_, _, v) in variants.items():
        step = statistics.median(times[key])
        analytic = (v * m + pp - 1) * (args.f_ms + args.b_ms) / v / 1e3
        result["/".join(key)] = {
            "step_s": step,
            "steps_s": times[key],
            "analytic_step_s": analytic,
            "bubble": 1 - statistics.median(busy[key]) / (pp * step),
            "analytic_bubble": analytic_bubble(pp, m, v),
            "virtual": v,
            "spans": [row for per_rank in gathered for row in per_rank[key]] if rank == 0 else None,
        }
    return result


ZERO_BUBBLE = ("zb1p", "zbv", "dualpipev")
COUNTERPART = {
    "zb1p": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# The real-compute stages: a meshtron Transformer (real_benchmark, and the zbreal part at --real-seq tokens).
REAL_MODEL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
)


def _torch_zero_bubble(kind: str, modules: dict[int, nn.Module], m: int, num_stages: int, loss_fn):
    import torch.distributed.pipelining as pipelining

    stages = [pipelining.PipelineStage(mod, s, num_stages, torch.device("cpu")) for s, mod in sorted(modules.items())]
    return getattr(pipelining, COUNTERPART[kind])(stages, m, loss_fn=loss_fn, scale_grads=False)


def _record_torch_actions(schedule, rank: int, rows: list) -> None:
    """Append every compute call of torch's stages to ``rows`` as (rank, kind, mb, start, end, stage):
    the span our executor records per action (its loss on the last stage is a separate call, not in F)."""
    for stage in schedule._stages:
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            setattr(stage, name, _recording(getattr(stage, name), kind, rank, stage.stage_index, rows))


def _recording(method, kind: str, rank: int, stage: int, rows: list):
    def timed(mb, *args, **kwargs):
        start = time.perf_counter()
        out = method(mb, *args, **kwargs)
        rows.append((rank, kind, mb, start, time.perf_counter(), stage))
        return out

    return timed


def _zero_bubble_stages(args, real: bool, mine: list[int], num_stages: int, v: int):
    """This rank's chunks as modules, stage 0's batch, the targets, the loss(output, target) and the
    boundary tensor: split sleep stages, or (``real``) chunks of a meshtron Transformer whose autograd
    graph the split backward cuts for real."""
    if not real:
        costs = [c / 1e3 / v for c in (args.f_ms, args.b_ms, args.w_ms)]
        batch = torch.randn(args.microbatches * SLEEP_ACTIVATION[0], *SLEEP_ACTIVATION[1:])
        stages = {s: SplitSleepStage(*costs) for s in mine}
        return stages, batch, batch, lambda out, target: out.mean(), (SLEEP_ACTIVATION, torch.float32)
    from meshtron.config import ModelConfig
    from meshtron.models import build_model, materialize, token_loss_sum
    from meshtron.parallel.pipeline.stage import StageChunk, prune_to_stage

    cfg, m, seq = ModelConfig(**REAL_MODEL), args.real_microbatches, args.real_seq
    with torch.device("meta"):
        model = build_model(cfg)
    ranges = prune_to_stage(model, dist.get_rank(), args.pp, v, v_shape=v > 1)
    materialize(model, "cpu")  # the single-process weights, whatever the schedule's placement
    positions = torch.arange(seq).expand(1, -1)
    stages = {s: _ChunkModule(StageChunk(model, s, r, num_stages), positions) for s, r in ranges.items()}
    gen = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, cfg.vocab_size, (m, seq), generator=gen) for _ in range(2))
    tokens = labels.numel()
    return (
        stages,
        ids,
        labels,
        lambda out, lab: token_loss_sum(out, lab) / tokens,
        ((1, seq, cfg.hidden_size), torch.float32),
    )


def zero_bubble_benchmark(args, real: bool = False) -> dict:
    """Ours and torch's zero-bubble schedules on the same split stages, steps taking turns: sleep stages
    (part ``zb``) or real compute (part ``zbreal``, analytic figures from the measured F, B, W)."""
    from meshtron.parallel.pipeline import build_schedule, peak_in_flight, simulate
    from meshtron.parallel.pipeline.executor import PipelineExecutor
    from meshtron.parallel.pipeline.split import chunk_rank

    pp, rank = args.pp, dist.get_rank()
    m, repeats = (args.real_microbatches, args.real_repeats) if real else (args.microbatches, args.repeats)
    group = dist.group.WORLD
    grads = dist.new_group(list(range(pp)))  # gradients on their own communicator (executor doc)
    variants, predicted, torch_rows = {}, {}, []
    for kind in ZERO_BUBBLE:
        v = 1 if kind == "zb1p" else 2
        n = pp * v
        mine = [s for s in range(n) if chunk_rank(s, pp, kind != "zb1p") == rank]
        stages, batch, target, loss, boundary = _zero_bubble_stages(args, real, mine, n, v)
        inputs, targets = list(batch.chunk(m)), list(target.chunk(m))
        schedule = build_schedule(kind, pp, m, v)
        executor = PipelineExecutor(schedule[rank], n, group, grad_group=grads)
        executor.record = True

        def ours(stages=stages, executor=executor, inputs=inputs, targets=targets, loss=loss, boundary=boundary):
            executor.run(
                lambda stage, x, mb: stages[stage](x), inputs, lambda out, mb: loss(out, targets[mb]), boundary
            )

        predicted[kind] = (schedule, [peak_in_flight(entries) for entries in schedule], v)
        variants[("ours", kind)] = (stages, ours, executor)
        theirs = _torch_zero_bubble(kind, stages, m, n, loss)
        if real:
            _record_torch_actions(theirs, rank, torch_rows)
        variants[("torch", kind)] = (stages, _torch_step(theirs, stages, n, batch, target), None)
    times = {key: [] for key in variants}
    busy = {key: [] for key in variants}
    memory = {key: [] for key in variants}
    history = {key: [] for key in variants}  # every measured step's spans, for the F, B, W costs
    spans, peaks, grad_diff, reference = {}, {}, {}, {}
    for rep in range(repeats + 1):
        for key, (stages, step, executor) in variants.items():
            params = [p for mod in stages.values() for p in mod.parameters()]
            for mod in stages.values():
                mod.spans = []
            for p in params:  # each step's gradients alone, for the check below
                p.grad = None
            torch_rows.clear()
            saved = _SavedBytes(params)

            def tracked(step=step, saved=saved):
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    step()

            took = _timed(tracked)
            # ours: the executor's action spans; torch: its compute calls (real) or the sleeps themselves
            rows = (
                [tuple(sp) for sp in executor.spans] if executor else list(torch_rows) if real else _spans(stages, rank)
            )
            work = torch.tensor(sum(r[4] - r[3] for r in rows))
            dist.all_reduce(work)
            if rep:
                times[key].append(took)
                busy[key].append(work.item())
                memory[key].append(saved.peak / 2**20)
                history[key].append(rows)
            else:  # the warm-up steps double as a check that both compute the same gradients
                grads_now = [torch.zeros(()) if p.grad is None else p.grad.clone() for p in params]
                if executor:
                    reference[key[1]] = grads_now
                else:
                    grad_diff[key[1]] = max((a - b).abs().max().item() for a, b in zip(grads_now, reference[key[1]]))
            spans[key] = rows
            if executor:
                peaks[key] = executor.peak_live
    memory = {key: statistics.median(peaks_mib) for key, peaks_mib in memory.items()}
    gathered = [None] * pp if rank == 0 else None
    dist.gather_object((spans, peaks, memory, grad_diff, history), gathered, dst=0)
    if rank:
        return {}
    result = {}
    for key in variants:
        step = statistics.median(times[key])
        schedule, peak, v = predicted[key[1]]
        fbw = {who: _median_costs([g[4][(who, key[1])] for g in gathered]) for who in ("ours", "torch")}
        costs = fbw["ours"] if real else [c / v for c in (args.f_ms, args.b_ms, args.w_ms)]
        sim = simulate(schedule, costs[0], costs[1], 0, w_cost=costs[2], rendezvous=False)
        result["/".join(key)] = {
            "step_s": step,
            "steps_s": times[key],
            "analytic_step_s": sim.makespan / 1e3,
            "fbw_ms": fbw[key[0]],
            "bubble": 1 - statistics.median(busy[key]) / (pp * step),
            "analytic_bubble": sim.bubble,
            "predicted_peak": peak,
            "measured_peak": [g[1].get(key) for g in gathered],
            "peak_mib": [g[2][key] for g in gathered],
            "grad_max_diff": max(g[3][key[1]] for g in gathered),
            "virtual": v,
            "spans": [row for g in gathered for row in g[0][key]],
        }
    return result


def _median_costs(per_rank: list[list[list[tuple]]]) -> list[float]:
    """F, B, W of one chunk in ms: the mean over all ranks' actions of a step (a first stage's B is
    empty, it has no input gradient, and its W is its whole backward), median over the steps."""
    steps = [[row for rank in per_rank for row in rank[i]] for i in range(len(per_rank[0]))]
    return [
        statistics.median(statistics.mean(r[4] - r[3] for r in rows if r[1] == kind) * 1e3 for rows in steps)
        for kind in "FBW"
    ]


def _render(entry: dict, path: Path, name: str, args) -> None:
    """Timeline PNG of one variant's last measured step, in ms from its first action."""
    from meshtron.parallel.pipeline.show import render_timeline

    start = min(r[3] for r in entry["spans"])
    spans = [(r[0], r[1], r[2], (r[3] - start) * 1e3, (r[4] - start) * 1e3, r[5]) for r in entry["spans"]]
    title = f"{name}: pp={args.pp}, m={args.microbatches}, v={entry['virtual']}, time in ms"
    render_timeline(spans, str(path), title, pp=args.pp)


def zero_bubble_report(out: Path) -> str:
    """The tables of the ``zb`` (sleep) and ``zbreal`` (real compute) runs found in ``out``."""
    sections = []
    for part in ("zb", "zbreal"):
        if (out / f"pipeline_{part}.json").is_file():
            sections.append(_zero_bubble_section(out, part, json.loads((out / f"pipeline_{part}.json").read_text())))
    return "\n\n".join(sections)


def _zero_bubble_section(out: Path, part: str, zb: dict) -> str:
    args = argparse.Namespace(**zb["setting"])
    real = part == "zbreal"
    m, repeats = (args.real_microbatches, args.real_repeats) if real else (args.microbatches, args.repeats)
    if real:
        head = (
            f"## Zero-bubble schedules, real compute (CPU, gloo, float32, 1 thread per rank): pp = {args.pp}, m = {m}, "
            f"meshtron Transformer ({REAL_MODEL['num_hidden_layers']} layers, hidden {REAL_MODEL['hidden_size']}, "
            f"micro-batch 1 x {args.real_seq} tokens) split into pp * v chunks"
        )
        analytic = (
            "our schedule simulated with our measured F, B, W of a chunk (table below; a first stage's B "
            "is empty and its W its whole backward)"
        )
        torch_busy = "time inside its stages' compute calls (the last stage's loss is a separate call)"
    else:
        head = (
            f"## Zero-bubble schedules, sleep stages (CPU, gloo): pp = {args.pp}, m = {m}, per rank "
            f"F {args.f_ms:g} ms, B {args.b_ms:g} ms, W {args.w_ms:g} ms (per chunk divided by v)"
        )
        analytic = "our schedule simulated with these costs"
        torch_busy = "time inside the sleeps"
    lines = [
        head,
        "",
        f"Median (and min) of {repeats} steps per variant, ours and torch's taking turns; load average "
        f"{zb['load_average']:.1f} on {os.cpu_count()} CPUs at the end of the run. Analytic: {analytic}. "
        "Bubble: 1 - busy / (pp * step), busy = ours: time inside our F/B/W actions (their Python and autograd "
        f"overhead included); torch: {torch_busy}. "
        "Peak: micro-batch activations (chunks) held at once per rank, ours measured by the executor and "
        "predicted by `peak_in_flight`; peak MiB: most bytes of activations saved for backward held at once "
        "(distinct storages, parameters excluded; highest rank, median over steps), ours and torch's alike. Paired: "
        "median over rounds of ours' step / torch's next step "
        "(steps taken back to back, so slow drifts of the machine's load cancel).",
        "",
        "| schedule | torch counterpart | v | ours step (ms) | torch step (ms) | ours / torch | ours min | torch min "
        "| analytic (ms) | ours / analytic | ours bubble | torch bubble | analytic bubble | ours peak (measured) "
        "| ours peak (predicted) | peak MiB ours | peak MiB torch | paired ours / torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ZERO_BUBBLE:
        ours, theirs = zb[f"ours/{kind}"], zb[f"torch/{kind}"]
        lines.append(
            _step_cells(kind, ours, theirs).replace(f"| {kind} |", f"| {kind} | {COUNTERPART[kind]} |", 1)
            + f" | {ours['analytic_step_s'] * 1e3:.1f} | {_ratio(ours['step_s'], ours['analytic_step_s'], 3)} "
            f"| {ours['bubble']:.3f} | {theirs['bubble']:.3f} | {ours['analytic_bubble']:.3f} "
            f"| {ours['measured_peak']} | {ours['predicted_peak']} | {_peak_mib(ours)} | {_peak_mib(theirs)} "
            f"| {statistics.median(a / b for a, b in zip(ours['steps_s'], theirs['steps_s'])):.3f} |"
        )
        for who in ("ours", "torch"):
            name = f"CPU {'real compute' if real else 'sleep stages'}, {who} {kind}"
            _render(
                zb[f"{who}/{kind}"],
                out / f"pipeline_{part}_{who}_{kind}.png",
                name,
                argparse.Namespace(pp=args.pp, microbatches=m),
            )
    if real:
        lines += [
            "",
            "Measured cost of one chunk's action (ms; mean over the ranks' actions of a step, median over "
            "steps), ours and torch's, and the largest gradient difference ours vs torch after one step on the "
            "same weights and micro-batches:",
            "",
            "| schedule | F ours | F torch | B ours | B torch | W ours | W torch | max abs grad diff |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for kind in ZERO_BUBBLE:
            ours, theirs = zb[f"ours/{kind}"], zb[f"torch/{kind}"]
            costs = [f"{a:.1f} | {b:.1f}" for a, b in zip(ours["fbw_ms"], theirs["fbw_ms"])]
            lines.append(f"| {kind} | " + " | ".join(costs) + f" | {ours['grad_max_diff']:.1e} |")
    lines += ["", "Steps (ms) per variant, in run order:", ""]
    for key, entry in zb.items():
        if "/" in key:
            lines.append(f"- {key}: " + ", ".join(f"{t * 1e3:.1f}" for t in entry["steps_s"]))
    return "\n".join(lines) + "\n"


def _peak_mib(entry: dict) -> str:
    """Highest rank's peak saved activations (runs before they were measured have none)."""
    return f"{max(entry['peak_mib']):.1f}" if "peak_mib" in entry else "n/a"


class _ChunkModule(nn.Module):
    """nn.Module face of one of our StageChunks (torch's PipelineStage needs a module) whose parameters
    are the chunk's own: torch's split backward computes the weight gradients of a stage's parameters."""

    def __init__(self, chunk, positions):
        super().__init__()
        self.parts = nn.ModuleList(chunk.modules())
        self.chunk, self.positions = chunk, positions

    def forward(self, x):
        return self.chunk(x, self.positions[: x.shape[0]])


def real_benchmark(args) -> dict:
    from meshtron.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from meshtron.mesh import build_mesh
    from meshtron.models import build_model, token_loss_sum
    from meshtron.parallel.runner import build_model_runner

    pp, m = args.pp, args.real_microbatches
    model_cfg = ModelConfig(**REAL_MODEL)
    seq, mb = 128, 1
    mesh = build_mesh(pp=pp)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model_cfg.vocab_size, (m * mb, seq), generator=gen)
    labels = torch.randint(0, model_cfg.vocab_size, (m * mb, seq), generator=gen)
    positions = torch.arange(seq).expand(mb, -1)
    variants = {}
    for kind, v in (("1f1b", 1), ("interleaved", args.virtual)):
        cfg = Config(
            model=model_cfg,
            parallel=ParallelConfig(pp=pp, schedule=kind, virtual_stages=v, microbatches=m),
            train=TrainConfig(global_batch_size=m * mb, seq_len=seq),
        )
        with torch.device("meta"):
            meta = build_model(model_cfg)
        runner = build_model_runner(meta, mesh, cfg, torch.device("cpu"))
        runner.executor.record = True
        modules = {s: _ChunkModule(c, positions) for s, c in runner.chunks.items()}
        tokens = (labels != -100).sum()
        schedule = _torch_schedule(
            kind, modules, m, pp * v, lambda out, lab, tokens=tokens: token_loss_sum(out, lab) / tokens
        )
        variants[("ours", kind)] = (lambda runner=runner: runner.forward_backward(ids, labels), runner, v)
        variants[("torch", kind)] = (_torch_step(schedule, modules, pp * v, ids, labels), None, v)
    times = {key: [] for key in variants}
    busy = {key: [] for key in variants}
    for rep in range(args.real_repeats + 1):
        for key, (step, runner, _v) in variants.items():
            took = _timed(step)
            if runner is not None:
                work = torch.tensor(sum(s.end - s.start for s in runner.executor.spans))
                dist.all_reduce(work)
            if rep:
                times[key].append(took)
                if runner is not None:
                    busy[key].append(work.item())
    result = {}
    for key, (_, _runner, v) in variants.items():
        step = statistics.median(times[key])
        result["/".join(key)] = {
            "step_s": step,
            "steps_s": times[key],
            "bubble": 1 - statistics.median(busy[key]) / (pp * step) if busy[key] else None,
            "analytic_bubble": analytic_bubble(pp, m, v),
            "virtual": v,
        }
    return result


def _rank_main(args):
    torch.manual_seed(0)
    for part in args.parts:
        run = {
            "sleep": sleep_benchmark,
            "real": real_benchmark,
            "zb": zero_bubble_benchmark,
            "zbreal": partial(zero_bubble_benchmark, real=True),
        }[part]
        result = run(args)
        if dist.get_rank() == 0:
            result["setting"] = {k: v for k, v in vars(args).items() if k != "parts"}
            result["load_average"] = os.getloadavg()[0]
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"pipeline_{part}.json").write_text(json.dumps(result))


def _ratio(a: float, b: float, digits: int) -> str:
    """a / b, or n/a for the zero-cost stages that measure pure overhead."""
    return f"{a / b:.{digits}f}" if b else "n/a"


def _step_cells(kind: str, ours: dict, theirs: dict) -> str:
    """Table cells shared by both parts: schedule, v, median steps, their ratio, min steps (ms)."""
    return (
        f"| {kind} | {ours['virtual']} | {ours['step_s'] * 1e3:.1f} | {theirs['step_s'] * 1e3:.1f} "
        f"| {ours['step_s'] / theirs['step_s']:.3f} | {min(ours['steps_s']) * 1e3:.1f} "
        f"| {min(theirs['steps_s']) * 1e3:.1f}"
    )


def _span_stats(spans) -> tuple[float, float, float]:
    """Mean forward and backward duration and median gap between a rank's consecutive actions, in ms."""
    f = [r[4] - r[3] for r in spans if r[1] == "F"]
    b = [r[4] - r[3] for r in spans if r[1] == "B"]
    gaps = []
    for rank in {r[0] for r in spans}:
        rows = sorted((r for r in spans if r[0] == rank), key=lambda r: r[3])
        gaps += [nxt[3] - cur[4] for cur, nxt in zip(rows, rows[1:])]
    return statistics.mean(f) * 1e3, statistics.mean(b) * 1e3, statistics.median(gaps) * 1e3


def report(args) -> str:
    out = Path(args.out)
    sleep = json.loads((out / "pipeline_sleep.json").read_text())
    args = argparse.Namespace(**sleep["setting"])
    lines = [
        f"## Sleep stages: pp = {args.pp}, m = {args.microbatches}, per rank forward {args.f_ms:g} ms, "
        f"backward {args.b_ms:g} ms (per chunk divided by v)",
        "",
        f"Median (and min) of {args.repeats} steps per variant; load average {sleep['load_average']:.1f} "
        f"on {os.cpu_count()} CPUs at the end of the run.",
        "",
        "| schedule | v | ours step (ms) | torch step (ms) | ours / torch | ours min | torch min | analytic (ms) "
        "| ours / analytic | ours bubble | torch bubble | analytic bubble | ours / analytic bubble |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("1f1b", "interleaved"):
        ours, theirs = sleep[f"ours/{kind}"], sleep[f"torch/{kind}"]
        lines.append(
            _step_cells(kind, ours, theirs) + f" | {ours['analytic_step_s'] * 1e3:.1f} "
            f"| {_ratio(ours['step_s'], ours['analytic_step_s'], 3)} | {ours['bubble']:.3f} | {theirs['bubble']:.3f} "
            f"| {ours['analytic_bubble']:.3f} | {_ratio(ours['bubble'], ours['analytic_bubble'], 2)} |"
        )
        for who in ("ours", "torch"):
            _render(sleep[f"{who}/{kind}"], out / f"pipeline_{who}_{kind}.png", f"{who} {kind}", args)
    lines += [
        "",
        "Per-action floor of this machine: each rank replays its own compute actions back to back with no "
        "p2p (`floor`). Its excess over the nominal compute, per action, times the 2 (v m + pp - 1) actions "
        "on the critical path, added to the analytic step, is the best step any executor can reach here.",
        "",
        "| schedule | floor replay (ms) | nominal compute (ms) | floor per action (ms) | critical-path actions "
        "| analytic + floor (ms) | ours / that | torch / that |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("1f1b", "interleaved"):
        floor, ours, theirs = (sleep[f"{who}/{kind}"] for who in ("floor", "ours", "torch"))
        v, m = floor["virtual"], args.microbatches
        nominal = m * (args.f_ms + args.b_ms)
        per_action = (floor["step_s"] * 1e3 - nominal) / (2 * v * m)
        critical = 2 * (v * m + args.pp - 1)
        best = ours["analytic_step_s"] * 1e3 + critical * per_action
        lines.append(
            f"| {kind} | {floor['step_s'] * 1e3:.1f} | {nominal:.1f} | {per_action:.3f} | {critical} | {best:.1f} "
            f"| {ours['step_s'] * 1e3 / best:.3f} | {theirs['step_s'] * 1e3 / best:.3f} |"
        )
    lines += [
        "",
        "Where the time beyond the analytic figure goes (last measured step): mean sleep of a forward and a "
        "backward chunk (nominal f/v, b/v) and the median idle gap between consecutive actions on a rank "
        "(p2p plus executor and autograd overhead).",
        "",
        "| variant | mean F (ms) | mean B (ms) | median gap (ms) |",
        "|---|---|---|---|",
    ]
    for key, entry in sleep.items():
        if "/" in key:
            lines.append(f"| {key} | " + " | ".join(f"{x:.3f}" for x in _span_stats(entry["spans"])) + " |")
    lines += ["", "Steps (ms) per variant, in run order:", ""]
    for key, entry in sleep.items():
        if "/" in key:
            lines.append(f"- {key}: " + ", ".join(f"{t * 1e3:.1f}" for t in entry["steps_s"]))
    if (out / "pipeline_real.json").is_file():
        real = json.loads((out / "pipeline_real.json").read_text())
        args = argparse.Namespace(**real["setting"])
        lines += [
            "",
            f"## Real compute: meshtron Transformer (8 layers, hidden 256, seq 128), pp = {args.pp}, "
            f"m = {args.real_microbatches}, float32 on CPU",
            "",
            f"Median (and min) of {args.real_repeats} steps; load average {real['load_average']:.1f} "
            "at the end of the run.",
            "",
            "| schedule | v | ours step (ms) | torch step (ms) | ours / torch | ours min | torch min | ours bubble "
            "| analytic bubble |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for kind in ("1f1b", "interleaved"):
            ours, theirs = real[f"ours/{kind}"], real[f"torch/{kind}"]
            lines.append(_step_cells(kind, ours, theirs) + f" | {ours['bubble']:.3f} | {ours['analytic_bubble']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--virtual", type=int, default=2)
    parser.add_argument("--f-ms", type=float, default=20.0, help="forward time of one rank's share of the model")
    parser.add_argument("--b-ms", type=float, default=40.0, help="backward time of one rank's share")
    parser.add_argument(
        "--w-ms",
        type=float,
        default=20.0,
        help="zb part: weight-gradient time of one rank's share (--b-ms is then the input-gradient "
        "part; the zero-bubble run in the results used --b-ms 20)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--parts", default="sleep,real", help="comma list of sleep, real, zb, zbreal; empty: report only"
    )
    parser.add_argument("--real-microbatches", type=int, default=8)
    parser.add_argument("--real-repeats", type=int, default=9)
    parser.add_argument("--real-seq", type=int, default=128, help="zbreal part: tokens per micro-batch")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if args.parts:
        from meshtron.testing import run_checks

        run_checks([_rank_main], args.pp, args, timeout=1800)
    out = Path(args.out)
    zero_bubble = [part for part in ("zb", "zbreal") if (out / f"pipeline_{part}.json").is_file()]
    if {"zb", "zbreal"} & set(args.parts) or (not args.parts and zero_bubble):
        text = zero_bubble_report(out)
        (out / "pipeline_zb.md").write_text(text)
        print(text)
    if set(args.parts) - {"zb", "zbreal"} or not args.parts:
        text = report(args)
        (out / "pipeline_table.md").write_text(text)
        print(text)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
