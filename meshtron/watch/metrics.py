"""Step metrics: a compact console line with progress, ``metrics.jsonl`` and optionally TensorBoard
event files (rank 0 only); the ``torch.profiler`` window of ``[train] profile_steps`` (every rank)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from meshtron import env

if TYPE_CHECKING:
    from meshtron.watch.trackers import Trackers

# NVIDIA's datasheets: dense (no sparsity) bf16 tensor-core peak in TFLOP/s and memory bandwidth in TB/s,
# by a substring of torch.cuda.get_device_name; checked in order, so the more specific names come first.
# The one table of these figures (meshtron.plan's Hardware defaults to the H100 SXM row).
DATASHEET = (
    ("H100 NVL", 835.0, 3.9),
    ("H100 PCIe", 756.0, 2.0),
    ("H100", 989.0, 3.35),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200 NVL", 835.0, 4.8),
    ("H200", 989.0, 4.8),  # SXM
    ("A100", 312.0, 2.039),  # SXM 80 GB
)


def datasheet(device_name: str) -> tuple[float, float] | None:
    """(dense bf16 TFLOP/s, memory TB/s) of a listed card, None for an unlisted one."""
    return next(((tflops, tbps) for key, tflops, tbps in DATASHEET if key in device_name), None)


def datasheet_peak_flops(device_name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The card's datasheet dense bf16 peak in FLOP/s (None for another dtype or an unlisted card)."""
    listed = datasheet(device_name)
    if dtype != torch.bfloat16 or listed is None:
        return None
    return listed[0] * 1e12


def peak_flops_per_device(dtype: str) -> float | None:
    """Dense matmul peak used for MFU: the datasheet figure of a listed card, else measured once on
    this device (None on CPU, where MFU is not meaningful)."""
    if env.device_type() != "cuda":
        return None
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    listed = datasheet_peak_flops(torch.cuda.get_device_name(), torch_dtype)
    return listed if listed is not None else matmul_flops(torch.device("cuda"), torch_dtype)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 8192, reps: int = 20) -> float:
    """Measured FLOP/s of an ``n x n`` matmul on ``device`` (the achievable dense peak for MFU)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU, where it has already run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        enabled: bool,
        resume_step: int = 0,
        tensorboard: bool = False,
        trackers: Trackers | None = None,
    ):
        """``resume_step``: keep the records up to that step. A run resumed after a crash repeats the
        steps since its checkpoint, whose old records are dropped so each step appears once (in the
        TensorBoard files too). ``tensorboard``: also write event files to ``<output_dir>/tensorboard``;
        ``trackers`` (:mod:`meshtron.watch.trackers`) get the same scalars."""
        self.enabled = enabled
        self.trackers = trackers
        self.total_steps = total_steps
        self.path = Path(output_dir) / "metrics.jsonl"
        self.board = None
        self.behind: int | None = None  # the rank behind at the previous log (see straggler)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = self._records_through(resume_step) if resume_step > 0 else []
            self.path.write_text("".join(line + "\n" for line in kept))
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.board = SummaryWriter(Path(output_dir) / "tensorboard", purge_step=resume_step + 1)

    def _records_through(self, step: int) -> list[str]:
        if not self.path.is_file():
            return []
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        # A record cut short by the crash fails to parse and is dropped with the repeated steps.
        return [line for line in lines if _step_of(line) <= step]

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = board_scalars(record)
        if self.board is not None:
            for tag, value in scalars.items():
                self.board.add_scalar(tag, value, record["step"])
            self.board.flush()  # a crashed run keeps what it logged
        if self.trackers is not None:
            self.trackers.log(scalars, record["step"])
        print(self._line(record, self.straggler(record)), flush=True)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.trackers is not None:
            self.trackers.close()

    def straggler(self, record: dict[str, Any]) -> int | None:
        """The rank to name as a straggler: behind (:func:`is_straggling`) at this log and at the one
        before. A rank its host deschedules, or a garbage collection, holds back once, at random; a
        straggler stays behind (docs/training.md)."""
        behind = record["slowest_rank"] if is_straggling(record) else None
        named = behind if behind is not None and behind == self.behind else None
        self.behind = behind
        return named

    def _line(self, r: dict[str, Any], straggler: int | None) -> str:
        width = 20
        done = int(width * r["step"] / self.total_steps)
        bar = "#" * done + "." * (width - done)
        parts = [
            f"[{bar}] step {r['step']}/{self.total_steps}",
            f"loss {r['loss']:.4f}",
            f"gnorm {r['grad_norm']:.3f}",
            f"lr {r['lr']:.2e}",
            f"{r['tokens_per_sec']:.0f} tok/s",
            f"{r['step_time']:.2f}s",
        ]
        if r.get("eval_loss") is not None:
            parts.append(f"eval {r['eval_loss']:.4f} (ppl {r['eval_ppl']:.2f})")
        if r.get("mtp_losses"):
            parts.append("mtp " + " ".join(f"{loss:.4f}" for loss in r["mtp_losses"]))
        if r.get("aux_loss") is not None:
            parts.append(f"aux {r['aux_loss']:.4f}")
        if r.get("mfu") is not None:
            parts.append(f"mfu {100 * r['mfu']:.1f}%")
        if r.get("memory_gib") is not None:
            parts.append(f"mem {r['memory_gib']:.1f}GiB")
        if straggler is not None:
            parts.append(f"straggler rank {straggler} ({r['rank_time_max']:.2f}s, median {r['rank_time_median']:.2f}s)")
        return " | ".join(parts)


STRAGGLER_SPREAD = 0.2
# Below this a rank is not called behind, whatever the ratio: ranks share CPU cores with each other
# and with other work, and a rank descheduled for a few time slices falls behind by a fraction of this in
# a healthy step (docs/training.md). On CPU the ranks' own times are small (most of a step waits in gloo),
# so a ratio alone would flag that noise.
STRAGGLER_FLOOR_S = 0.25


def is_straggling(record: dict[str, Any]) -> bool:
    """The slowest rank's own time per step is more than 20 % over the median rank's, and more than
    ``STRAGGLER_FLOOR_S`` seconds over it."""
    if record.get("rank_time_max") is None:
        return False
    behind = record["rank_time_max"] - record["rank_time_median"]
    return behind > max(STRAGGLER_SPREAD * record["rank_time_median"], STRAGGLER_FLOOR_S)


# TensorBoard tags of the record's numbers; the MoE entries are {layer: value or per-expert list}.
_BOARD_TAGS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/perplexity",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "aux_loss": "train/aux_loss",
    "tokens_per_sec": "perf/tokens_per_sec",
    "step_time": "perf/step_time",
    "mfu": "perf/mfu",
    "memory_gib": "perf/memory_gib",
    "rank_time_max": "perf/rank_time_max",
    "rank_time_median": "perf/rank_time_median",
    "slowest_rank": "perf/slowest_rank",
}


def board_scalars(record: dict[str, Any]) -> dict[str, float]:
    """{tag: value} of one metrics record: the scalars above, each MTP module's loss (``train/mtp_loss_<k>``),
    every MoE layer's share of routed tokens
    per expert (``moe/<layer>/load/expert_NNN``) and its dropped fraction (``moe/<layer>/dropped``)."""
    scalars = {tag: record[key] for key, tag in _BOARD_TAGS.items() if record.get(key) is not None}
    for depth, loss in enumerate(record.get("mtp_losses") or (), start=1):
        scalars[f"train/mtp_loss_{depth}"] = loss
    for layer, loads in record.get("moe_load", {}).items():
        scalars.update({f"moe/{layer}/load/expert_{e:03d}": share for e, share in enumerate(loads)})
    for layer, dropped in record.get("moe_dropped", {}).items():
        scalars[f"moe/{layer}/dropped"] = dropped
    return scalars


class StepProfiler:
    """``torch.profiler`` over steps ``first..last`` (1-based, inclusive), each step a named range;
    the trace (Chrome / Perfetto JSON) goes to ``<output_dir>/profile/rank-R.json``. Inactive when
    ``steps`` is empty."""

    def __init__(self, steps: list[int], output_dir: str | Path, rank: int):
        self.first, self.last = steps if steps else (0, -1)
        self.path = Path(output_dir) / "profile" / f"rank-{rank}.json"
        self._profile = None

    def step(self, step: int):
        """Context manager around step ``step`` (1-based)."""
        if not self.first <= step <= self.last:
            return contextlib.nullcontext()
        if self._profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if env.device_type() == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profile.start()
        return self._range(step)

    @contextlib.contextmanager
    def _range(self, step: int):
        with torch.profiler.record_function(f"meshtron step {step}"):
            yield
        if step == self.last:
            self._profile.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._profile.export_chrome_trace(str(self.path))
            self._profile = None


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
