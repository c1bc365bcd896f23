"""``python -m meshtron.train --recipe R --dry-run N``: one real-size training step, simulated in this process.

A fake process group of world size N, the model and optimizer on fake tensors at the recipe's real sizes,
stepped by the training path's own code; each distinct rank's second step is traced (peak bytes, FLOPs,
collectives and their bytes) next to :mod:`meshtron.plan`'s prediction for the same rank. Beside this module:
``counting.py`` what the trace counts per op, ``nccl_rules.py`` the rules NCCL holds every traced collective
to, ``fake_cuda.py`` the fake CUDA runtime. See docs/planner.md, "Dry run at real scale".
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtron import env
from meshtron.config import Config, ConfigError, infer_dp, load_config
from meshtron.dryrun.counting import OpCounter, storage_tracker
from meshtron.dryrun.fake_cuda import cuda_build, driver_environment, fake_cuda, fake_factories, guard, refusal
from meshtron.dryrun.nccl_rules import NcclRules, unmatched_p2p
from meshtron.hf.runner import with_hf_model
from meshtron.host import declared, fake_tensors, simulated
from meshtron.mesh import batch_mesh, expert_hsdp_mesh, expert_meshes, group_names, recipe_mesh
from meshtron.optim import build_optimizer
from meshtron.parallel.float8 import fits_fp8
from meshtron.parallel.step import training_step
from meshtron.plan.communication import COMM_DIMS, communication, cp_a2a_ranks
from meshtron.plan.memory import GIB, Assumptions, rank_breakdown
from meshtron.plan.parameters import Coords, state_bytes
from meshtron.plan.recipes import RecipeHardware, recipe_hardware
from meshtron.plan.speed import Hardware, predict_step_time
from meshtron.runner import build_runner
from meshtron.torch_private import counting_sharding_propagations, fake_store_class, mem_tracker_class
from meshtron.watch.syncs import HostSyncCounter, not_a_caller

not_a_caller(__file__)  # it waits on behalf of the code it traces or checks

# Imported now, not where they are used: each rank's process forks from a server that has imported this
# module (dry_run, meshtron.testing), and would otherwise import them itself, once per rank.
FakeStore, _ = fake_store_class(), mem_tracker_class()
# call sites are named relative to the repository root (this file is meshtron/dryrun/__init__.py)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep

# The trace holds what the step allocates: no CUDA context, no allocator slack.
TRACE_ASSUMPTIONS = Assumptions(reserved_gib=0.0, fragmentation=0.0)


@dataclasses.dataclass
class RankTrace:
    """One simulated rank's traced step next to the planner's prediction."""

    rank: int
    coords: dict[str, int]
    traced_gib: float
    planned_gib: float
    collectives: dict[str, int]  # calls per op
    comm: dict[str, tuple[int, int]]  # "kind/group" -> (bytes sent traced, planned) per step
    flops: int
    compute_seconds: float  # the traced step's roofline on the target device
    step_seconds: float  # meshtron.plan's step time with that compute time
    seconds: float  # the dry run's own wall time for this rank
    syncs: dict[str, int] = dataclasses.field(default_factory=dict)  # "op at file:line in function" -> per step
    host_peak_gib: float = 0.0  # on a CUDA device: the peak of the tensors the step keeps on the host, apart
    p2p: list = dataclasses.field(default_factory=list)  # (direction, peer, shape, dtype) in order (nccl_rules)
    host_gib: float = 0.0  # what [parallel] offload keeps in host memory, counted on the step's objects
    planned_host_gib: float = 0.0  # meshtron.plan's offloaded fp32 state (Breakdown.host's params, grads, optimizer)

    @property
    def ratio(self) -> float:
        return self.traced_gib / self.planned_gib


def distinct_ranks(cfg: Config) -> list[int]:
    """Global ranks whose step differs: in each pipeline stage, the first rank (in mesh order) of each
    distinct set of local shard sizes, told apart by ``meshtron.plan``'s exact state bytes for the rank
    (``torch.chunk``'s uneven dim-0 shards over a data mesh that does not divide a dimension, vocab
    or expert splits that leave the last ranks less). Rank 0 of a stage comes first; a rank whose
    state differs from one already chosen by less than 1 % of the stage's planned peak adds nothing
    to trace (a router row more or less, a few empty shards at 1024 ranks)."""
    p = cfg.parallel
    inner = (p.dp, p.cp, p.mesh_ep, p.tp)
    out = []
    for stage in range(p.pp):
        small = rank_breakdown(cfg, Coords(stage), TRACE_ASSUMPTIONS).total / 100
        chosen: list[int] = []
        for offset, index in enumerate(itertools.product(*map(range, inner))):
            state = sum(state_bytes(cfg, Coords(stage, *index)).values())
            if all(abs(state - other) > small for other in chosen):
                chosen.append(state)
                out.append(stage * math.prod(inner) + offset)
    return out


def _local_batch(cfg: Config, mesh, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch, as the data loader gives them (values never read)."""
    rows = cfg.train.global_batch_size // batch_mesh(mesh).size()
    ids = torch.zeros(rows, cfg.train.seq_len, dtype=torch.long, device=device)
    return ids, ids.clone()


def trace_rank(
    cfg: Config,
    world_size: int,
    rank: int,
    routing: str = "balanced",
    hw: Hardware = Hardware(),  # noqa: B008 - a frozen dataclass
    per_node: int = 8,
) -> RankTrace:
    """Build and step rank ``rank`` of a ``world_size``-rank run of ``cfg`` on fake tensors, MoE routing
    assumed ``routing`` (``meshtron.host.ROUTINGS``), its roofline on ``hw``; on CUDA
    (``env.device_type()``) on fake devices, ``per_node`` of them per node."""
    start = time.perf_counter()
    with device_runtime(rank % per_node, per_node):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            mesh = recipe_mesh(cfg)
            coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
            (peak, host_peak), counter, syncs, host = _traced_step(cfg, mesh, routing, hw)
            comm = compare_comm(counter.sent, planned_comm(cfg, mesh), group_names(mesh))
        finally:
            dist.destroy_process_group()
    plan = rank_breakdown(cfg, Coords(**coords), TRACE_ASSUMPTIONS)
    planned_host = sum(plan.host[k] for k in ("params", "grads", "optimizer"))  # what offloaded_bytes counts
    # On CPU ranks the offloaded state stays in the one memory the trace measures.
    planned = (
        rank_breakdown(_one_memory(cfg), Coords(**coords), TRACE_ASSUMPTIONS).total
        if env.device_type() == "cpu"
        else plan.total
    )
    step = predict_step_time(cfg, hw, counter.roofline_seconds).seconds
    per_site: dict[str, int] = {}
    for sync in syncs.syncs:
        site = f"{sync.op} at {sync.where.removeprefix(_ROOT)}"
        per_site[site] = per_site.get(site, 0) + 1
    return RankTrace(
        rank,
        coords,
        peak / GIB,
        planned / GIB,
        counter.calls,
        comm,
        counter.flops,
        counter.roofline_seconds,
        step,
        time.perf_counter() - start,
        syncs=per_site,
        host_peak_gib=host_peak / GIB,
        p2p=counter.rules.p2p,
        host_gib=host / GIB,
        planned_host_gib=planned_host / GIB,
    )


def _one_memory(cfg: Config) -> Config:
    """``cfg`` without host offload: what a rank whose host and device are one memory holds."""
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, offload="none", offload_activations=False)
    )


def offloaded_bytes(cfg: Config, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes ``[parallel] offload = "optimizer"`` keeps in host memory after a step: each parameter's local
    shard and gradient and the optimizer's state tensors (0 without offload)."""
    if cfg.parallel.offload != "optimizer":
        return 0
    held = [t for p in module.parameters() for t in (p, p.grad) if t is not None]
    held += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(_local(t).numel() * _local(t).element_size() for t in held)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _traced_step(
    cfg: Config, mesh, routing: str, hw: Hardware
) -> tuple[tuple[int, int], OpCounter, HostSyncCounter, int]:
    """This rank's runner and optimizer built on fake tensors, a warm-up step, then the traced one under
    NCCL's rules: ((its peak bytes on its device, on the host apart: :func:`device_and_host_peaks`), its
    counter, its host syncs, only those :mod:`meshtron.host` declares, the bytes its host offload holds)."""
    device = env.local_device()
    rules = NcclRules(device, group_names(mesh))  # names read from the mesh's real rank table
    # On CUDA the fake factories stay for the steps too: FSDP2's lazy init pins the offloaded shards again.
    with simulated(routing), fake_factories(fake_tensors()) if device.type == "cuda" else contextlib.nullcontext():
        runner = build_runner(cfg, mesh, device)
        with fake_tensors():
            optimizer = build_optimizer(runner.module, cfg.train)
            ids, labels = _local_batch(cfg, mesh, device)
            with checked_syncs():
                _warm_up(cfg, runner, optimizer, ids, labels)
            memory = storage_tracker()
            memory.track_external(runner.module, optimizer, ids, labels)
            counter = OpCounter(hw.peak_tflops * 1e12, hw.memory_tbps * 1e12, rules)
            # The memory tracker, entered after the counter, sees each op before it: DTensor ops whole, as
            # it always has; the counter declines those and counts their local ops. The sync counter,
            # entered last, sees a host read before the fake tensors refuse it.
            with ShapeInferences() as inferred, counter, memory, checked_syncs() as syncs:
                training_step(runner, optimizer, ids, labels, cfg.train.max_grad_norm)
            if inferred.count:
                raise RuntimeError(
                    f"the traced step of rank {dist.get_rank()} inferred {inferred.count} DTensor output "
                    "shapes its warm-up did not: its peak would count their placeholders"
                )
    peaks = device_and_host_peaks(memory.get_tracker_snapshot("peak"), device)
    return peaks, counter, syncs, offloaded_bytes(cfg, runner.module, optimizer)


def device_and_host_peaks(peaks: dict[torch.device, dict[str, int]], device: torch.device) -> tuple[int, int]:
    """(peak bytes on ``device``, on any other) of a memory tracker's per-device peaks. On a CPU rank both
    are one; on a CUDA rank a tensor the step keeps on the host does not take the GPU's memory, which the
    planner predicts (the shipped recipes' steps keep none: the fused AdamW's step counts are on the device)."""
    other = sum(per_device.get("Total", 0) for where, per_device in peaks.items() if where != device)
    return peaks.get(device, {}).get("Total", 0), other


class HostSyncRefusal(RuntimeError):
    """The traced step waits for the device where :mod:`meshtron.host` declares no read."""


@contextlib.contextmanager
def checked_syncs():
    """A :class:`HostSyncCounter` over the block that refuses the host syncs :mod:`meshtron.host` does not
    declare, naming each call site; a failure they precede (the fake tensors' refusal of ``.item()``)
    is chained to the refusal. Every tensor a real step would read on its device is fake here, so every
    such read is a dispatched op (``HostSyncCounter(methods=False)``)."""
    with HostSyncCounter(methods=False) as syncs:
        try:
            yield syncs
        except Exception as err:
            _refuse_undeclared(syncs, err)
            raise
    _refuse_undeclared(syncs)


def _refuse_undeclared(syncs: HostSyncCounter, failure: Exception | None = None) -> None:
    sites: dict[str, int] = {}
    for sync in syncs.syncs:
        if not declared(sync):
            sites[f"{sync.op} at {sync.where}"] = sites.get(f"{sync.op} at {sync.where}", 0) + 1
    if sites:
        raise HostSyncRefusal(
            f"the training step waits for the device {sum(sites.values())} times where meshtron.host "
            "declares no read: " + "; ".join(f"{n} x {site}" for site, n in sites.items())
        ) from failure


@contextlib.contextmanager
def device_runtime(local_rank: int, per_node: int):
    """The device a dry-run rank sees: on CUDA, ``cuda:local_rank`` of a node of ``per_node`` fake GPUs
    whose runtime :func:`meshtron.dryrun.fake_cuda.fake_cuda` answers (``LOCAL_RANK`` set as torchrun sets
    it, so the step finds its device as a real run does); the CPU as it is."""
    if env.device_type() != "cuda":
        yield
        return
    previous = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(local_rank)
    try:
        with fake_cuda(per_node, local_rank):
            yield
    finally:
        if previous is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = previous


def _warm_up(cfg: Config, runner, optimizer, ids: torch.Tensor, labels: torch.Tensor) -> None:
    """The untraced first step: it creates the optimizer state and FSDP's lazy state, and lets DTensor
    infer every op's output shape (:class:`ShapeInferences`), which the traced step then finds done as
    a real second step does. Without a pipeline, two micro-batches of the traced ones' size do all of
    it (the first accumulates, HSDP, replicate and ``fsdp_gather = "per_step"`` without reducing; the
    last reduces; every parameter gathered and stepped; every op at the traced shapes) at a fraction of
    the host work of all the recipe's micro-batches. A pipeline's schedule is built for its micro-batch
    count, so it runs the whole step."""
    micro = cfg.parallel.microbatches
    if cfg.parallel.pp > 1 or micro <= 2:
        training_step(runner, optimizer, ids, labels, cfg.train.max_grad_norm)
        return
    whole, rows = runner.cfg, ids.shape[0] // micro * 2
    runner.cfg = dataclasses.replace(whole, parallel=dataclasses.replace(whole.parallel, microbatches=2))
    try:
        training_step(runner, optimizer, ids[:rows], labels[:rows], cfg.train.max_grad_norm)
    finally:
        runner.cfg = whole


class ShapeInferences:
    """Counts DTensor's uncached sharding propagations while entered. Each infers an op's global output
    shape by running it on global-shape placeholders, which the memory tracker counts (a phantom at the
    peak when the warm-up ran other shapes: docs/planner.md): a traced step must find every one done by
    its warm-up, as a real second step does. torch without the hook counts nothing."""

    def __init__(self):
        self.count = 0
        self._hooked = counting_sharding_propagations(self._add)

    def _add(self) -> None:
        self.count += 1

    def __enter__(self):
        self._hooked.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooked.__exit__(*exc)


# The planner's collective kinds, as the trace's are summed into them.
_PLANNED_KIND = {
    "all_gather": "all_gather+reduce_scatter",
    "reduce_scatter": "all_gather+reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
    "send": "p2p",
}


def planned_comm(cfg: Config, mesh) -> dict[tuple[str, tuple[int, ...]], float]:
    """``meshtron.plan``'s bytes sent per step, keyed like the trace: (kind, this rank's group's ranks)."""
    out: dict[tuple[str, tuple[int, ...]], float] = {}
    for key, nbytes in communication(cfg, mesh["pp"].get_local_rank()).items():
        kind, dims = key.split("/")
        group = _group_of(cfg, mesh, COMM_DIMS[dims])
        out[kind, group] = out.get((kind, group), 0.0) + nbytes
    return out


def _group_of(cfg: Config, mesh, dims: tuple[str, ...]) -> tuple[int, ...]:
    """Global ranks of this rank's group over ``dims`` (the experts' groups: from their own meshes)."""
    if dims in (("ep",), ("etp",)):
        sub = expert_meshes(mesh).model[dims[0]]
    elif dims == ("edp",):
        sub = expert_meshes(mesh).data
    elif dims[0].startswith("edp_"):
        sub = expert_hsdp_mesh(mesh)[dims[0]]
    elif dims in (("cp_ring",), ("cp_a2a",)):  # a2a+p2p's split of cp: groups of a consecutive ranks, rings across
        ranks, index, a = mesh["cp"].mesh.flatten().tolist(), mesh["cp"].get_local_rank(), cp_a2a_ranks(cfg)
        start = index // a * a
        return tuple(ranks[start : start + a] if dims == ("cp_a2a",) else ranks[index % a :: a])
    else:
        sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    return tuple(sub.mesh.flatten().tolist())


def compare_comm(
    traced: dict[tuple[str, tuple[int, ...]], int],
    planned: dict[tuple[str, tuple[int, ...]], float],
    names: dict[tuple[int, ...], str],
) -> dict[str, tuple[int, int]]:
    """{"kind/group name": (traced bytes, planned bytes)} over every group either side sends on."""
    totals: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    for (kind, group), nbytes in traced.items():
        if len(group) > 1:
            totals.setdefault((_PLANNED_KIND[kind], group), [0, 0])[0] += nbytes
    for (kind, group), nbytes in planned.items():
        if len(group) > 1:
            totals.setdefault((kind, group), [0, 0])[1] += nbytes
    return {
        f"{kind}/{names.get(group, list(group))}": (int(t), round(p))
        for (kind, group), (t, p) in sorted(totals.items())
    }


def dry_run(
    cfg: Config,
    world_size: int,
    routing: str = "balanced",
    hw: Hardware = Hardware(),  # noqa: B008 - a frozen dataclass
    per_node: int = 8,
) -> list[RankTrace]:
    """Every distinct rank of ``cfg`` (validated for ``world_size`` ranks) traced, each in a process of
    its own (a process holds one default process group, and meshes cache its sub-groups), as many at a
    time as there are CPUs; on CUDA, nodes of ``per_node`` fake devices."""
    ranks = distinct_ranks(cfg)
    workers = min(len(ranks), os.cpu_count() or 1)
    context = multiprocessing.get_context("forkserver" if sys.platform == "linux" else "spawn")
    if sys.platform == "linux":  # each rank's process forks from a server that has imported torch once
        context.set_forkserver_preload(["torch", "torch.distributed", "meshtron.dryrun"])
    # A fresh process per rank, in chunks of one: a pool's task is a chunk of its inputs, and a second rank
    # in one process finds the first one's process groups gone.
    with rank_environment(per_node), context.Pool(workers, maxtasksperchild=1) as pool:
        results = pool.starmap(
            _trace_or_error, [(cfg, world_size, rank, routing, hw, per_node) for rank in ranks], chunksize=1
        )
    for rank, result in zip(ranks, results):
        if isinstance(result, ConfigError):
            raise result
        if isinstance(result, str):
            raise DryRunError(f"rank {rank} of the dry run failed:\n{result}")
    unmatched = unmatched_p2p({t.rank: t.p2p for t in results})
    if unmatched:
        raise DryRunError("point-to-point messages NCCL would leave waiting: " + "; ".join(unmatched))
    return results


@contextlib.contextmanager
def rank_environment(per_node: int):
    """The environment the rank processes start in: on CUDA, the fake driver's
    (:func:`meshtron.dryrun.fake_cuda.driver_environment`), its device guard built here first, once; the
    parent's own environment restored after."""
    if env.device_type() != "cuda":
        yield
        return
    guard()
    saved = dict(os.environ)
    os.environ.update(driver_environment(per_node))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class DryRunError(RuntimeError):
    """A simulated rank failed; the message holds its traceback."""


def _trace_or_error(
    cfg: Config, world_size: int, rank: int, routing: str, hw: Hardware, per_node: int
) -> RankTrace | ConfigError | str:
    """:func:`trace_rank` in a worker: an error comes back as a value (a ConfigError as it is, anything
    else as its traceback text), since not every exception crosses a process boundary."""
    try:
        return trace_rank(cfg, world_size, rank, routing, hw, per_node)
    except ConfigError as err:
        return ConfigError(str(err))
    except Exception:  # noqa: BLE001 - reported by the parent, naming the rank
        return traceback.format_exc()


def layout_text(cfg: Config) -> str:
    p = cfg.parallel
    experts = f" (experts: ep{p.ep} x etp{p.etp}{', folded' if p.fold_ep else ''})" if p.etp > 1 or p.fold_ep else ""
    return f"pp{p.pp} x dp{p.dp} x cp{p.cp} x ep{p.mesh_ep} x tp{p.tp}{experts}"


def tokens_per_second_per_device(cfg: Config, world_size: int, traces: list[RankTrace]) -> float:
    """Predicted throughput: the step's tokens over its slowest traced rank's step time, per device."""
    return cfg.train.global_batch_size * cfg.train.seq_len / max(t.step_seconds for t in traces) / world_size


def report(
    cfg: Config, world_size: int, traces: list[RankTrace], as_json: bool, seconds: float, routing: str = "balanced"
) -> str:
    speed = tokens_per_second_per_device(cfg, world_size, traces)
    if as_json:
        return json.dumps(
            {
                "world_size": world_size,
                "layout": layout_text(cfg),
                "microbatches": cfg.parallel.microbatches,
                "routing": routing,
                "seconds": round(seconds, 1),
                "tokens_per_second_per_device": round(speed, 1),
                "ranks": [
                    {
                        "rank": t.rank,
                        "coords": t.coords,
                        "traced_gib": round(t.traced_gib, 3),
                        "planned_gib": round(t.planned_gib, 3),
                        "ratio": round(t.ratio, 3),
                        "host_gib": round(t.host_gib, 3),
                        "planned_host_gib": round(t.planned_host_gib, 3),
                        "host_peak_gib": round(t.host_peak_gib, 4),
                        "collectives": t.collectives,
                        "host_syncs": t.syncs,
                        "flops": t.flops,
                        "compute_seconds": round(t.compute_seconds, 4),
                        "step_seconds": round(t.step_seconds, 4),
                        "comm_bytes": {
                            key: {"traced": traced, "planned": planned} for key, (traced, planned) in t.comm.items()
                        },
                    }
                    for t in traces
                ],
            }
        )
    lines = [
        f"dry run: {world_size} ranks, {layout_text(cfg)}, {cfg.parallel.schedule}, "
        f"{cfg.train.dtype}, seq {cfg.train.seq_len}, global batch {cfg.train.global_batch_size} in "
        f"{cfg.parallel.microbatches} microbatches" + (f", {routing} MoE routing" if cfg.model.is_moe else ""),
        f"{'rank':>6} {'pp':>3} {'traced GiB':>11} {'planned GiB':>12} {'ratio':>6} {'TFLOP':>8} "
        f"{'roofline s':>10} {'step s':>7}  collectives",
    ]
    for t in traces:
        calls = ", ".join(f"{op} {n} x" for op, n in sorted(t.collectives.items()))
        lines.append(
            f"{t.rank:>6} {t.coords['pp']:>3} {t.traced_gib:>11.2f} {t.planned_gib:>12.2f} {t.ratio:>6.3f} "
            f"{t.flops / 1e12:>8.1f} {t.compute_seconds:>10.3f} {t.step_seconds:>7.3f}  {calls}"
        )
        lines += [
            f"{'':>11} sent {key}: {traced / GIB:.3f} GiB traced, {planned / GIB:.3f} planned"
            for key, (traced, planned) in t.comm.items()
        ]
        if t.host_gib or t.planned_host_gib:
            lines.append(
                f"{'':>11} host memory (offload): {t.host_gib:.2f} GiB traced, {t.planned_host_gib:.2f} planned"
            )
        lines.append(
            f"{'':>11} host syncs per step: {sum(t.syncs.values())}"
            + "".join(f"; {n} x {where}" for where, n in t.syncs.items())
        )
        if t.host_peak_gib:
            lines.append(
                f"{'':>11} kept on the host: {t.host_peak_gib:.3f} GiB at its peak (apart from the traced GiB)"
            )
    lines.append(
        f"predicted: {speed:,.0f} tokens/s per device (roofline compute on {_device_text()}, the planner's "
        f"exposed communication and bubble)"
    )
    lines.append(f"planned: meshtron.plan's terms without the reserve and slack; {seconds:.0f} s in all")
    return "\n".join(lines)


def _device_text(hw: Hardware = Hardware()) -> str:  # noqa: B008 - a frozen dataclass
    return f"{hw.peak_tflops:g} TFLOP/s, {hw.memory_tbps:g} TB/s"


# Why a dry run cannot trace torch.compile, found on torch 2.14.1 (CUDA) and 2.13 (CPU): dynamo skips every
# frame while a dispatch mode that is not one of torch's own is active ("non-infra torch dispatch mode
# present"), and the trace's memory tracker, collective counter and host-sync recorder are such modes, so a
# block compiled with fullgraph fails ("found no compiled frames"); without them, dynamo itself asks the CUDA
# runtime for its RNG state, graph capture and device properties, and inductor's kernels would run on memory
# that fake tensors do not have.
COMPILE_REFUSAL = (
    "--dry-run cannot trace [parallel] compile = true: torch.compile skips every frame under the "
    "dry run's memory, collective and host-sync tracers (dispatch modes) and its kernels need real "
    "device memory. Add --parallel.compile false (meshtron.plan counts a compiled block's memory as "
    "the eager one's)."
)


def _check_traceable(cfg: Config) -> None:
    """What the fake tensors cannot run: fake CUDA devices without a CUDA build of torch; compiled blocks
    (:data:`COMPILE_REFUSAL`); torch's shape function of grouped_mm (the experts) in another dtype than bf16, as
    the experts' emulated FP8 GEMM hands it (float32) on the CPU path (fake CUDA devices, an H100's compute
    capability, run the float8 kernel: ``meshtron.parallel.float8.runs_float8_kernel``)."""
    if env.device_type() == "cuda" and not cuda_build():
        raise ConfigError(refusal())
    if cfg.parallel.compile:
        raise ConfigError(COMPILE_REFUSAL)
    if cfg.model.is_moe and cfg.train.dtype != "bfloat16":
        raise ConfigError(
            f"--dry-run traces MoE experts in bfloat16 only (torch's grouped_mm shape check), but [train] "
            f"dtype = '{cfg.train.dtype}'. Add --train.dtype bfloat16."
        )
    m = cfg.model
    emulated = env.device_type() != "cuda"
    fp8_experts = cfg.train.fp8 != "none" and fits_fp8((m.hidden_size, m.moe_intermediate_size), cfg.train.fp8)
    if emulated and m.is_moe and fp8_experts:
        # Float8GroupedMatmul hands grouped_mm the float8 values dequantized to float32 (it emulates the kernel).
        raise ConfigError(
            f"--dry-run traces MoE experts in bfloat16 only (torch's grouped_mm shape check), but [train] "
            f"fp8 = '{cfg.train.fp8}' runs them through an emulated float8 GEMM on float32 operands. "
            "Add --train.fp8 none, trace on fake CUDA devices (MESHTRON_DEVICE=cuda, which run the float8 "
            "kernel), or trace an expert width FP8 leaves in bfloat16 (not a multiple of 16)."
        )


def _hardware(recipe: str) -> RecipeHardware:
    """The recipe's ``# Hardware:`` line; without one, nodes of 8 devices of 80 GB."""
    try:
        return recipe_hardware(recipe)
    except (ConfigError, OSError):
        return RecipeHardware(nodes=1, per_node=8, device="cuda", memory_gib=80.0)


def main(
    recipe: str,
    overrides: list[str],
    *,
    world_size: int,
    as_json: bool,
    gpu_memory_gib: float | None,
    routing: str = "balanced",
) -> int:
    """The ``--dry-run`` command: bad input gets the training launch's one-line error and exit 2 before
    anything is traced; a layout that would not fit ``gpu_memory_gib`` (default: the recipe's stated
    hardware) ends with the pre-flight refusal and exit 2 after the report."""
    from meshtron.parallel.layout import validate_layout
    from meshtron.plan.fit import check_memory

    hardware = _hardware(recipe)
    memory = gpu_memory_gib or hardware.memory_gib
    source = f"--gpu-memory {gpu_memory_gib:g}" if gpu_memory_gib else f"the recipe's # Hardware line: {memory:g} GB"

    start = time.perf_counter()
    try:
        cfg = with_hf_model(infer_dp(load_config(recipe, overrides), world_size))
        validate_layout(cfg, world_size)
        _check_traceable(cfg)
    except ConfigError as err:
        print(f"meshtron: {err}", file=sys.stderr)
        return 2
    try:
        traces = dry_run(cfg, world_size, routing, hardware.hardware(), hardware.per_node)
    except ConfigError as err:
        print(f"meshtron: {err}", file=sys.stderr)
        return 2
    print(report(cfg, world_size, traces, as_json, time.perf_counter() - start, routing), flush=True)
    try:
        # The stated hardware's host memory, not this machine's, for a CUDA target: the machine running the
        # dry run is not the node it plans, and its host memory would refuse layouts that fit there.
        host = hardware.hardware().host_memory_gib * GIB if hardware.device == "cuda" else None
        check_memory(
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, memory_check="error")),
            world_size,
            hardware.device,
            (memory * GIB, source),
            hardware.per_node,
            host,
        )
    except ConfigError as err:
        print(f"meshtron: {err}", file=sys.stderr)
        return 2
    return 0


__all__ = ["DryRunError", "RankTrace", "distinct_ranks", "dry_run", "report", "main", "storage_tracker", "trace_rank"]
