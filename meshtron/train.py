"""``torchrun --nproc_per_node N -m meshtron.train --recipe recipes/X.toml [--section.key value ...]``.

One step: every rank takes its (dp x ep) share of the global batch and its cp slice of the sequence,
runs forward/backward over the micro-batches (pipelined when pp > 1), and the optimizer steps. The
loss is the sum of token losses divided by the global number of counted tokens, so gradients summed
over ranks equal the single-process gradient of the same global batch on every layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron import env
from meshtron.checkpoint import CheckpointMismatch, latest_checkpoint, load_checkpoint, save_checkpoint
from meshtron.config import Config, ConfigError, load_config
from meshtron.hf import CheckpointError
from meshtron.data import to_device
from meshtron.mesh import batch_mesh, build_mesh, validate_layout
from meshtron.metrics import MetricsLogger, peak_flops_per_device
from meshtron.models import build_model, flops_per_token, moe_layers
from meshtron.optim import build_optimizer, lr_at, set_lr


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m meshtron.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="TOML recipe (see recipes/)")
    args, overrides = parser.parse_known_args(argv)
    return args.recipe, overrides


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def main(argv: list[str] | None = None) -> int:
    recipe, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(recipe, overrides)
        validate_layout(cfg, _world_size())
    except ConfigError as err:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank finds it; say it once
            print(f"meshtron: {err}", file=sys.stderr)
        return 2
    p = cfg.parallel
    mesh = build_mesh(pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, tp=p.tp)
    try:
        Trainer(cfg, mesh).fit()
    except (ConfigError, CheckpointError, CheckpointMismatch) as err:
        # Bad input found after start-up (data, checkpoints): every rank raises it; say it once.
        if dist.get_rank() == 0:
            print(f"meshtron: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


class Trainer:
    def __init__(self, cfg: Config, mesh):
        from meshtron.data import TokenDataset
        from meshtron.parallel.runner import build_step_runner

        self.cfg, self.mesh = cfg, mesh
        self.rank = dist.get_rank()
        self.device = env.local_device()
        torch.manual_seed(cfg.train.seed)
        self.dataset = TokenDataset.open(cfg, on_rank0_first=_rank0_first)
        with torch.device("meta"):
            model = build_model(cfg.model)
        self.runner = build_step_runner(model, mesh, cfg, self.device)
        self.optimizer = build_optimizer(self.runner.module, cfg.train)
        self.start_step = self._restore()
        self.logger = MetricsLogger(cfg.train.output_dir, cfg.train.steps, self.rank == 0, append=self.start_step > 0)
        self.peak_flops = peak_flops_per_device(cfg.train.dtype)

    def _checkpoint_root(self) -> Path:
        return Path(self.cfg.checkpoint.dir or Path(self.cfg.train.output_dir) / "checkpoints")

    def _restore(self) -> int:
        """Initial weights: latest checkpoint (resume), else an HF folder, else seeded random init."""
        ckpt = self.cfg.checkpoint
        latest = latest_checkpoint(self._checkpoint_root()) if ckpt.resume else None
        if latest is not None:
            saved = load_checkpoint(latest, self.runner.module, self.optimizer, self.cfg)
            self.dataset.load_state_dict(saved["train_state"]["data"])
            if self.rank == 0:
                print(f"meshtron: resumed from {latest}", flush=True)
            return saved["step"]
        if ckpt.init_from_hf:
            from meshtron.hf import load_native_sharded, read_hf_config

            hf_cfg = read_hf_config(ckpt.init_from_hf)
            _check_hf_matches(hf_cfg, self.cfg, ckpt.init_from_hf)
            # Each rank reads only its slices of the safetensors files, never the whole model.
            load_native_sharded(self.runner.module, ckpt.init_from_hf, hf_cfg.tie_word_embeddings)
        return 0

    def fit(self) -> None:
        t = self.cfg.train
        for step in range(self.start_step, t.steps):
            record = self.train_step(step)
            if (step + 1) % t.log_every == 0 or step + 1 == t.steps:
                self.logger.log(record)
            if self.cfg.checkpoint.every and (step + 1) % self.cfg.checkpoint.every == 0:
                save_checkpoint(self._checkpoint_root(), step + 1, self.runner.module, self.optimizer, self.cfg,
                                {"data": self.dataset.state_dict()})
        if self.cfg.checkpoint.export_hf:
            self.runner.export_hf(self.cfg.checkpoint.export_hf)

    def train_step(self, step: int) -> dict:
        t = self.cfg.train
        start = time.perf_counter()
        lr = lr_at(step, t)
        set_lr(self.optimizer, lr)
        bm = batch_mesh(self.mesh)
        input_ids, labels = self.dataset.batch_for_step(
            step, bm.get_local_rank(), bm.size(), self.cfg.parallel.microbatches
        )
        input_ids, labels = to_device((input_ids, labels), self.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.runner.forward_backward(input_ids, labels)
        grad_norm = self.runner.clip_grad_norm(t.max_grad_norm)
        self.optimizer.step()
        for moe in moe_layers(self.runner.module):
            moe.update_expert_bias()  # aux-loss-free balancing (a no-op unless configured)
        elapsed = time.perf_counter() - start
        tokens = t.global_batch_size * t.seq_len
        record = {
            "step": step + 1,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_sec": tokens / elapsed,
            "step_time": elapsed,
            "aux_loss": self.runner.aux_loss(),
        }
        if self.peak_flops:
            record["mfu"] = flops_per_token(self.cfg.model, t.seq_len) * tokens / elapsed / (
                self.peak_flops * dist.get_world_size()
            )
            record["memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return record


def _rank0_first(fn):
    """Run ``fn`` on rank 0 first (e.g. build a token cache), then on the others.

    Rank 0's outcome is broadcast, so when it fails every rank raises the same error instead of
    waiting for a barrier that never comes.
    """
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            outcome = [err]
            dist.broadcast_object_list(outcome, src=0)
            raise
        dist.broadcast_object_list(outcome, src=0)
        return result
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0]
    return fn()


def _check_hf_matches(hf_cfg, cfg: Config, folder: str) -> None:
    ours, theirs = dataclasses.asdict(cfg.model), dataclasses.asdict(hf_cfg)
    shape_keys = [k for k in ours if k not in ("router_aux_loss_coef", "initializer_range", "max_position_embeddings")]
    differing = [k for k in shape_keys if ours[k] != theirs[k]]
    if differing:
        details = ", ".join(f"{k}: config.json {theirs[k]!r} vs recipe {ours[k]!r}" for k in differing[:4])
        raise ConfigError(f"checkpoint.init_from_hf = '{folder}' does not match [model] ({details}).")


if __name__ == "__main__":
    sys.exit(main())
