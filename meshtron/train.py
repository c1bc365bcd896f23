"""``torchrun --nproc_per_node N -m meshtron.train --recipe recipes/X.toml [--section.key value ...]``.

One step: every rank takes its (dp x ep) share of the global batch and its cp slice of the sequence,
runs forward/backward over the micro-batches (pipelined when pp > 1), and the optimizer steps. The
loss is the sum of token losses divided by the global number of counted tokens, so gradients summed
over ranks equal the single-process gradient of the same global batch on every layout.
See docs/training.md, 'Training' (its numbered steps) and 'Gradients are summed over data ranks'.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtron import env
from meshtron.checkpoint import (
    CheckpointMismatch,
    CheckpointWriter,
    check_model_shape,
    latest_checkpoint,
    load_checkpoint,
    read_marker,
)
from meshtron.config import Config, ConfigError, config_to_dict, infer_dp, load_config, model_differences
from meshtron.data import SourceSpec, to_device
from meshtron.faults import inject_fault, install_stall, slow_down
from meshtron.hf import CheckpointError
from meshtron.hf.runner import export_hf, fp8_start_note, with_hf_model
from meshtron.host import ROUTINGS
from meshtron.mesh import batch_mesh, exit_process, group_names, init_default_group, recipe_mesh
from meshtron.models import flops_per_token
from meshtron.models.moe import MoE
from meshtron.optim import build_optimizer, lr_at, set_lr
from meshtron.parallel.layout import validate_layout
from meshtron.parallel.step import training_step
from meshtron.plan.fit import check_memory
from meshtron.runner import build_runner
from meshtron.torch_private import default_store
from meshtron.watch import collective_log
from meshtron.watch.metrics import MetricsLogger, StepProfiler, peak_flops_per_device
from meshtron.watch.report import record_cause, report_consequence, report_once
from meshtron.watch.trackers import Trackers
from meshtron.watch.watchdog import Watchdog


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m meshtron.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="TOML recipe (see recipes/)")
    parser.add_argument(
        "--dry-run",
        type=int,
        metavar="N",
        default=0,
        help="simulate one step of an N-rank run in this process on fake tensors (meshtron.dryrun)",
    )
    parser.add_argument("--json", action="store_true", help="--dry-run: print the report as JSON")
    parser.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GiB",
        help="--dry-run: memory per device the layout must fit (default: the recipe's # Hardware line)",
    )
    parser.add_argument(
        "--dry-run-routing",
        choices=ROUTINGS,
        default="balanced",
        help="--dry-run: MoE routing assumed; skewed sends every rank's token copies to the "
        "first ep rank (the traced one), the most it can receive",
    )
    args, overrides = parser.parse_known_args(argv)
    return args, overrides


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


# Bad input: reported as one message (no traceback) with exit code 2.
USER_ERRORS = (ConfigError, CheckpointError, CheckpointMismatch)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/Inf and ``[train] on_nonfinite = "stop"``."""


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    recipe = args.recipe
    if args.dry_run:
        from meshtron.dryrun import main as dry_run_main

        return dry_run_main(
            recipe,
            overrides,
            world_size=args.dry_run,
            as_json=args.json,
            gpu_memory_gib=args.gpu_memory,
            routing=args.dry_run_routing,
        )
    inject_fault(int(os.environ.get("RANK", "0")), 0)
    try:
        cfg = with_hf_model(infer_dp(load_config(recipe, overrides), _world_size()))
        validate_layout(cfg, _world_size())
        preflight(cfg)
        check_memory(cfg, _world_size(), env.device_type())  # before any allocation or collective
    except USER_ERRORS as err:
        # Every rank reads the same files and reaches the same verdict: one copy of the message is enough.
        report_once(f"meshtron: {err}")
        return 2
    timeout = timedelta(seconds=cfg.train.collective_timeout_s)
    init_default_group(timeout)
    try:
        check_same_config(cfg)  # before the mesh: ranks with other layouts would build other meshes
        mesh = recipe_mesh(cfg, timeout)
        _write_pid_file(cfg)
        Trainer(cfg, mesh).fit()
    except Exception as err:  # noqa: BLE001 - every failure ends the job with one report
        code = _report_failure(err)
        if dist.get_world_size() > 1:
            # Peers may wait in a collective for this rank: exit at once (no process-group teardown,
            # which could itself wait) so the launcher stops them instead of the collective timeout.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        dist.destroy_process_group()
        return code
    dist.destroy_process_group()
    return 0


def _on_every_rank(err: Exception) -> Exception:
    """Mark an error that every rank raises identically, so only rank 0 reports it."""
    err.on_every_rank = True
    return err


def _report_failure(err: Exception) -> int:
    """Print the failure once for the job; returns the exit code (2: bad input, 1: anything else)."""
    rank = dist.get_rank()
    who = f"rank {rank}: " if dist.get_world_size() > 1 else ""
    if getattr(err, "on_every_rank", False):
        report_once(f"meshtron: {err}")
    elif _is_collective_failure(err):
        # A peer died or a collective timed out: unless that peer recorded its own error, say so.
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        report_consequence(f"meshtron: {who}stopped, a collective failed ({first_line})")
    elif isinstance(err, USER_ERRORS):
        record_cause(f"meshtron: {who}{err}")
    else:
        traceback.print_exc()
        record_cause(f"meshtron: {who}failed with {type(err).__name__}: {err}")
    return 2 if isinstance(err, USER_ERRORS) else 1


def _is_collective_failure(err: Exception) -> bool:
    # Gloo reports a lost peer or a timed-out wait as a plain RuntimeError naming its source file.
    return isinstance(err, dist.DistError) or (type(err) is RuntimeError and "gloo" in str(err))


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.output_dir) / "checkpoints")


def preflight(cfg: Config) -> None:
    """Checks of the input files, run by every rank before any process group exists (nothing can hang).

    Raises :class:`ConfigError` / :class:`CheckpointError` / :class:`CheckpointMismatch` naming the
    file and the fix. Reading the data itself (e.g. an empty dataset) is checked later, while the token
    cache is built (by one process per cache folder, the others polling its lock).
    """
    from meshtron.data import check_vocab, data_sources, load_tokenizer, source_files

    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "[train] tensorboard = true needs the tensorboard package: pip install tensorboard "
            "(or meshtron[tensorboard]), or set tensorboard = false."
        )
    for tracker, on in (("wandb", cfg.track.wandb), ("mlflow", cfg.track.mlflow)):
        if on and importlib.util.find_spec(tracker) is None:
            raise ConfigError(
                f"[track] {tracker} = true needs the {tracker} package: pip install 'meshtron[{tracker}]', or set "
                f"{tracker} = false."
            )
    for spec in data_sources(cfg.data):
        source_files(spec.path)
    if cfg.data.eval_source:
        with naming_eval_source():
            source_files(cfg.data.eval_source)
    check_vocab(load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token), cfg.data.tokenizer, cfg.model.vocab_size)
    latest = latest_checkpoint(checkpoint_root(cfg)) if cfg.checkpoint.resume else None
    if latest is not None:
        check_model_shape(read_marker(latest), cfg.model, latest)
    elif cfg.checkpoint.init_from_hf:
        from meshtron.hf import check_hf_files, read_hf_config

        folder = cfg.checkpoint.init_from_hf
        _check_hf_matches(read_hf_config(folder), cfg, folder)
        check_hf_files(folder)


def config_digest(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(config_to_dict(cfg), sort_keys=True).encode()).hexdigest()[:12]


def check_same_config(cfg: Config) -> None:
    """All ranks must train the same recipe; compared once at start-up by a hash of the config."""
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, config_digest(cfg))
    ranks: dict[str, list[int]] = {}
    for rank, digest in enumerate(digests):
        ranks.setdefault(digest, []).append(rank)
    if len(ranks) > 1:
        groups = "; ".join(f"ranks {r} have config {d}" for d, r in ranks.items())
        raise _on_every_rank(
            ConfigError(
                f"the ranks were launched with different configs ({groups}). Give every rank the same "
                "recipe file contents and the same --section.key overrides."
            )
        )


def _write_pid_file(cfg: Config) -> None:
    """``<output_dir>/pids/rank-R.pid``: lets an operator (or a test) find and signal one rank's process."""
    folder = Path(cfg.train.output_dir) / "pids"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{dist.get_rank()}.pid").write_text(f"{os.getpid()}\n")


class Trainer:
    def __init__(self, cfg: Config, mesh):
        from meshtron.data import TokenDataset

        self.cfg, self.mesh = cfg, mesh
        self.batch_mesh = batch_mesh(mesh)
        self.rank = dist.get_rank()
        self.device = env.local_device()
        torch.manual_seed(cfg.train.seed)
        # No collective until every rank has the data: a long tokenization cannot hit the collective timeout.
        self.dataset = TokenDataset.open(cfg, progress=sys.stdout)  # only the building process prints
        self.eval_dataset = None
        if cfg.data.eval_source:
            with naming_eval_source():
                self.eval_dataset = TokenDataset.open(cfg, sources=[eval_source(cfg)], progress=sys.stdout)
        self.runner = build_runner(cfg, mesh, self.device)
        if self.rank == 0 and (note := fp8_start_note(cfg)):
            print(note, flush=True)
        self.optimizer = build_optimizer(self.runner.module, cfg.train)
        self.start_step = self._restore()
        trackers = (
            Trackers(cfg.track, cfg.train.output_dir, config_to_dict(cfg), resumed=self.start_step > 0)
            if self.rank == 0
            else None
        )
        self.logger = MetricsLogger(
            cfg.train.output_dir, cfg.train.steps, self.rank == 0, self.start_step, cfg.train.tensorboard, trackers
        )
        self.profiler = StepProfiler(cfg.train.profile_steps, cfg.train.output_dir, self.rank)
        self.peak_flops = peak_flops_per_device(cfg.train.dtype)
        self.checkpoints = CheckpointWriter(checkpoint_root(cfg), cfg.checkpoint.keep, cfg.checkpoint.async_save)
        collective_log.install()
        self.step = self.start_step
        self.own_seconds: list[float] = []  # since the last log: step time less the time waited in collectives
        self.unread: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, grad norm) not yet read
        self.window: tuple[float, float] | None = None  # the clocks at the start of the unread steps
        install_stall(self.runner.module, self.rank, lambda: self.step)

    def _restore(self) -> int:
        """Initial weights: latest checkpoint (resume), else an HF folder, else seeded random init."""
        ckpt = self.cfg.checkpoint
        latest = latest_checkpoint(checkpoint_root(self.cfg)) if ckpt.resume else None
        if latest is not None:
            saved = load_checkpoint(latest, self.runner.module, self.optimizer, self.cfg)
            self.dataset.load_state_dict(saved["train_state"]["data"])
            if self.rank == 0:
                print(f"meshtron: resumed from {latest} (step {saved['step']})", flush=True)
            return saved["step"]
        if ckpt.init_from_hf:
            from meshtron.hf import load_native_sharded, read_hf_config

            hf_cfg = read_hf_config(ckpt.init_from_hf)
            _check_hf_matches(hf_cfg, self.cfg, ckpt.init_from_hf)
            # Each rank reads only its slices of the safetensors files, never the whole model.
            mtp = self.cfg.model.mtp_layers
            load_native_sharded(self.runner.module, ckpt.init_from_hf, hf_cfg.tie_word_embeddings, fresh_layers=mtp)
            if mtp and self.rank == 0:
                print(
                    f"meshtron: init_from_hf: the {len(mtp)} multi-token prediction modules (layers "
                    f"{mtp[0]}..{mtp[-1]}) start from the seeded initialization where the folder has no weights "
                    "for them.",
                    flush=True,
                )
        return 0

    def fit(self) -> None:
        t = self.cfg.train
        with self._watchdog() as watchdog:
            for step in range(self.start_step, t.steps):
                watchdog.step_started(step + 1)
                self._run_step(step)
                watchdog.step_finished()  # a checkpoint save may take longer than steps: not timed
                if self._checkpoint_due(step + 1):
                    self.checkpoints.save(
                        step + 1, self.runner.module, self.optimizer, self.cfg, {"data": self.dataset.state_dict()}
                    )
        self.checkpoints.wait()
        if self.cfg.checkpoint.export_hf:
            export_hf(self.runner, self.cfg, self.cfg.checkpoint.export_hf)
        self.logger.close()

    def _watchdog(self) -> Watchdog:
        t = self.cfg.train
        return Watchdog(
            default_store(),
            self.rank,
            dist.get_world_size(),
            t.output_dir,
            t.hang_timeout_s,
            t.collective_timeout_s,
            group_names(self.mesh),
        )

    def _run_step(self, step: int) -> None:
        t = self.cfg.train
        self.step = step + 1
        inject_fault(self.rank, step + 1)
        with self.profiler.step(step + 1):
            record = self.train_step(step)
            if record is not None and self._eval_due(step + 1):
                record.update(self.evaluate())
        if record is not None and self._log_due(step + 1):
            if t.tensorboard and self.runner.moes:
                record.update(self._moe_stats())
            record.update(self._stragglers())
            self.logger.log(record)

    def _stragglers(self) -> dict:
        """The slowest rank and the max / median over ranks of each rank's own time per step since the
        last log (step time less the time waited in collectives: the wall times are equal, the
        collectives even them out). One small all-gather (collective: every rank calls it)."""
        mine = torch.tensor([sum(self.own_seconds) / max(len(self.own_seconds), 1)], device=self.device)
        self.own_seconds.clear()
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        seconds = torch.cat(every).tolist()
        return {
            "slowest_rank": max(range(len(seconds)), key=seconds.__getitem__),
            "rank_time_max": max(seconds),
            "rank_time_median": statistics.median(seconds),
        }

    def _log_due(self, step: int) -> bool:
        t = self.cfg.train
        return step % t.log_every == 0 or step == t.steps or self._eval_due(step)

    def _read_due(self, step: int) -> bool:
        """The steps whose scalars the host reads: logged ones, and checkpointed ones (a run that must stop at a
        non-finite step never saves the steps after it). The host runs ahead of the device between them."""
        return self._log_due(step) or self._checkpoint_due(step)

    def _eval_due(self, step: int) -> bool:
        """Every ``eval_every`` steps and after the final step, when there is held-out data."""
        every = self.cfg.train.eval_every
        return self.eval_dataset is not None and ((every and step % every == 0) or step == self.cfg.train.steps)

    def evaluate(self) -> dict[str, float]:
        """Mean token loss over the first ``eval_steps`` global batches of the held-out data (the same
        batches every time, on every layout) and its perplexity."""
        total, tokens = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for index in range(self.cfg.train.eval_steps):
            batch = self.eval_dataset.batch_for_step(
                index, self.batch_mesh.get_local_rank(), self.batch_mesh.size(), self.cfg.parallel.microbatches
            )
            loss_sum, count = self.runner.evaluate(*to_device(batch, self.device))
            total, tokens = total + loss_sum, tokens + count
        (loss,) = read_scalars(total / tokens)
        return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 700 else math.inf}

    def _moe_stats(self) -> dict[str, dict]:
        """Every MoE layer's share of routed tokens per expert and dropped fraction in the step's last
        micro-batch (global counts), gathered on rank 0 from the pipeline stages holding the layers
        (collective: every rank calls it)."""
        local = {}
        for name, moe in self.runner.module.named_modules():
            if isinstance(moe, MoE) and moe.last_tokens_per_expert is not None:
                counts = moe.last_tokens_per_expert.float()
                dropped = moe.last_dropped_fraction
                local[name] = ((counts / counts.sum()).tolist(), None if dropped is None else float(dropped))
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if self.rank != 0:
            return {}
        layers = {name: stats for part in gathered for name, stats in part.items()}
        order = sorted(layers, key=_layer_order)
        return {
            "moe_load": {n: layers[n][0] for n in order},
            "moe_dropped": {n: layers[n][1] for n in order if layers[n][1] is not None},
        }

    def _checkpoint_due(self, step: int) -> bool:
        """Every ``every`` steps, and the final step whenever checkpointing is on."""
        every = self.cfg.checkpoint.every
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    def train_step(self, step: int) -> dict | None:
        """Queue one step; on a step whose scalars are read (:meth:`_read_due`), read every unread step's loss and
        gradient norm in one copy and return the step's record, else None (no host sync, no barrier)."""
        t = self.cfg.train
        if self.window is None:
            self.window = _start_step_clock()
        slow_down(self.rank, step + 1)
        lr = lr_at(step, t)
        set_lr(self.optimizer, lr)
        batch = self.dataset.batch_for_step(
            step, self.batch_mesh.get_local_rank(), self.batch_mesh.size(), self.cfg.parallel.microbatches
        )
        input_ids, labels, *positions = to_device(batch, self.device)
        loss, grad_norm = training_step(self.runner, self.optimizer, input_ids, labels, t.max_grad_norm, *positions)
        self.unread.append((step + 1, loss, grad_norm))
        if not self._read_due(step + 1):
            return None
        return self._read_window(lr)

    def _read_window(self, lr: float) -> dict:
        """The last step's record, from one device-to-host read of every unread step's scalars taken after the
        whole window is queued; its times are the window's per step (the device finishing its work included)."""
        t = self.cfg.train
        steps = [s for s, _, _ in self.unread]
        mtp = self.runner.mtp_losses()
        depths = [] if mtp is None else list(mtp.unbind())
        *values, aux = read_scalars(
            *(v for _, loss, norm in self.unread for v in (loss, norm)), *depths, self.runner.aux_loss()
        )
        if depths:  # in the same read: one device-to-host copy per window
            values, mtp = values[: -len(depths)], values[-len(depths) :]
        self.unread.clear()
        # Losses and gradient norms are global values, so every rank takes the same branches.
        nonfinite = [
            (s, loss, norm)
            for s, loss, norm in zip(steps, values[::2], values[1::2])
            if not (math.isfinite(loss) and math.isfinite(norm))
        ]
        for s, loss, norm in nonfinite:
            self._on_nonfinite(s, loss, norm, read_at=steps[-1])
        start, waited_before = self.window
        self.window = None
        # Waited read before the clock stops: its interval lies inside the window's, so 0 <= waited <= elapsed.
        waited = collective_log.LOG.waited() - waited_before
        elapsed = (time.perf_counter() - start) / len(steps)
        self.own_seconds.append(elapsed - waited / len(steps))
        tokens = t.global_batch_size * t.seq_len
        record = {
            "step": steps[-1],
            "loss": values[-2],
            "grad_norm": values[-1],
            "lr": lr,
            "tokens_per_sec": tokens / elapsed,
            "step_time": elapsed,
            "aux_loss": aux,
        }
        if mtp is not None:
            record["mtp_losses"] = mtp
        if nonfinite and nonfinite[-1][0] == steps[-1]:
            record["skipped"] = True
        if self.peak_flops:
            record["mfu"] = (
                flops_per_token(self.cfg.model, t.seq_len)
                * tokens
                / elapsed
                / (self.peak_flops * dist.get_world_size())
            )
            record["memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return record

    def _on_nonfinite(self, step: int, loss: float, grad_norm: float, read_at: int) -> None:
        """Stop with the step (1-based) and, while its gradients are still held (it is the step read at), the
        first offending parameter named; or report the update the device skipped."""
        if step == read_at:
            where = _first_nonfinite_grad(self.runner.module)
            found = f"first non-finite gradient: {where}" if where else "every gradient is finite (the loss is not)"
        else:
            found = (
                f"found at the read of step {read_at}, when its gradients were gone; with [train] log_every = 1 "
                "every step is read and the first non-finite gradient named"
            )
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}; {found}"
        if self.cfg.train.on_nonfinite == "stop":
            raise _on_every_rank(
                NonFiniteError(
                    f'{what}. Lower [train] lr, check the data, or set [train] on_nonfinite = "skip" to skip such '
                    "steps."
                )
            )
        self.optimizer.zero_grad(set_to_none=True)  # the update itself was skipped on the device
        if self.rank == 0:
            print(f"meshtron: skipped the update of {what}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def naming_eval_source():
    """The data pipeline's errors name ``[data] source``; for the held-out data the key is eval_source."""
    from meshtron.data import DataError

    try:
        yield
    except DataError as err:
        renamed = DataError(str(err).replace("[data] source", "[data] eval_source"))
        renamed.on_every_rank = getattr(err, "on_every_rank", False)
        raise renamed from None


def _layer_order(name: str) -> tuple:
    """Sort key of module names by their numbers ("layers.10.mlp" after "layers.9.mlp")."""
    return tuple(int(part) if part.isdigit() else -1 for part in name.split("."))


def eval_source(cfg: Config) -> SourceSpec:
    """The held-out data as one source, tokenized into its own cache the same way (never a mixture)."""
    return SourceSpec(path=cfg.data.eval_source, text_key=cfg.data.text_key)


def _start_step_clock() -> tuple[float, float]:
    """The step's start on this rank's clock and on its collective-wait clock, taken as every rank leaves
    one barrier (collective: every rank calls it). Every rank's step window then opens at the same moment,
    so each rank's own time (window less waits, see ``Trainer._stragglers``) measures one common window:
    without it a rank that entered its step early would be charged the work it did while the others had
    not started, and rank 0's step time would include waiting for late ranks (docs/training.md). On CUDA
    the barrier waits for the device, which the previous step's read of its scalars left idle: it costs
    one small all-reduce's latency."""
    dist.barrier()
    return time.perf_counter(), collective_log.LOG.waited()


def read_scalars(*values: torch.Tensor | float | None) -> list[float | None]:
    """Device scalars as floats with one device-to-host copy (floats and ``None`` pass through)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.float().reshape(()) for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else v for v in values]


def _first_nonfinite_grad(module: torch.nn.Module) -> str | None:
    """Name of the first parameter (lowest rank first, then module order) whose gradient has a NaN/Inf.

    Each rank checks its own shards; the answer is gathered so all ranks name the same parameter.
    """
    local = None
    for name, param in module.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        grad = grad.to_local() if isinstance(grad, DTensor) else grad
        if not torch.isfinite(grad).all():
            local = name
            break
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, local)
    return next((name for name in found if name is not None), None)


def _check_hf_matches(hf_cfg, cfg: Config, folder: str) -> None:
    details = model_differences(
        cfg.model,
        dataclasses.asdict(hf_cfg),
        "config.json",
        ignore=("router_aux_loss_coef", "initializer_range", "max_position_embeddings"),
    )
    if details:
        raise ConfigError(f"checkpoint.init_from_hf = '{folder}' does not match [model] ({details}).")


if __name__ == "__main__":
    exit_process(main())
