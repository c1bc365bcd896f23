"""Training a transformers model from a recipe: ``[model] hf_model = "folder"``.

The folder's ``config.json`` defines the architecture (the recipe's other ``[model]`` keys are not
used for it; :func:`with_hf_model` copies the sizes the layout checks, the memory estimate and the
FLOP count read). Weights come from the folder's safetensors when it has any, else from the model's
own initialisation seeded with ``[train] seed``. The runner implements the trainer's
:class:`~meshtron.parallel.step.Runner` interface: :class:`HFStepRunner` without a pipeline, the
:class:`~meshtron.hf.pipeline.HFPipelineRunner` with one; both through :func:`parallelize_hf_model`.
Checkpoints are meshtron's (DCP, any layout); ``export_hf`` writes the model's own transformers folder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config import Config, ConfigError
from meshtron.hf.io import read_hf_config, write_safetensors_folder
from meshtron.hf.parallelize import parallelize_hf_model
from meshtron.mesh import batch_mesh
from meshtron.parallel.grad_norm import clip_grad_norm_
from meshtron.parallel.step import Runner, full_state_dict


def with_hf_model(cfg: Config) -> Config:
    """``cfg`` with ``[model]`` read from ``hf_model``'s config.json (unchanged without ``hf_model``)."""
    folder = cfg.model.hf_model
    if not folder:
        return cfg
    if cfg.checkpoint.init_from_hf:
        raise ConfigError("[checkpoint] init_from_hf cannot be combined with [model] hf_model: hf_model's folder "
                          "already gives the weights (its safetensors); drop init_from_hf.")
    _refuse_native_only(cfg)
    model = dataclasses.replace(read_hf_config(folder), hf_model=folder)
    return dataclasses.replace(cfg, model=model)


def _refuse_native_only(cfg: Config) -> None:
    """Recipe features the HF runners do not run yet (native models only), each one clear error."""
    native_only = {
        "[data] eval_source": cfg.data.eval_source,
        "[data] document_mask": cfg.data.document_mask,
        "[parallel] cp_comm_type other than p2p": cfg.parallel.cp_comm_type != "p2p",
    }
    for key, used in native_only.items():
        if used:
            raise ConfigError(f"{key} is not supported with [model] hf_model yet (native models only); "
                              "unset it or train a native model.")


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def build_hf_model(cfg: Config, device: torch.device) -> nn.Module:
    """The whole model on ``device``: the folder's weights, or transformers' init seeded with [train] seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(cfg.model.hf_model)
    torch.manual_seed(cfg.train.seed)
    if _has_weights(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    return model.to(device).train()


class HFStepRunner:
    """One global-batch step of a parallelized transformers model without a pipeline (pp == 1).

    The rank's rows are split into ``parallel.microbatches`` micro-batches whose gradients accumulate;
    every micro-batch's loss is its token-loss sum over dp x ep x cp divided by the token count of the
    whole step (``num_items_in_batch``), so the summed gradient is the global mean loss's.
    """

    def __init__(self, model: nn.Module, mesh, cfg: Config):
        self.module, self.cfg = model, cfg
        self.batch_group = batch_mesh(mesh).get_group()  # ranks with different rows (cp ranks share theirs)
        self.moes: list = []

    def forward_backward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # position_ids come only with [data] document_mask, which with_hf_model refuses.
        p = self.cfg.parallel
        tokens = (labels != -100).sum().to(torch.float32)
        dist.all_reduce(tokens, group=self.batch_group)
        total = torch.zeros((), device=input_ids.device)
        for i, (ids, targets) in enumerate(zip(input_ids.chunk(p.microbatches), labels.chunk(p.microbatches))):
            if hasattr(self.module, "set_requires_gradient_sync"):  # wrapped when the data mesh has > 1 rank
                self.module.set_requires_gradient_sync(p.data_parallel == "fsdp" or i == p.microbatches - 1)
            # labels only switch the loss on: targets are already next-token labels (shift_labels).
            loss = self.module(input_ids=ids, labels=targets, shift_labels=targets, num_items_in_batch=tokens).loss
            loss.backward()
            total += loss.detach()
        return total

    def aux_loss(self) -> torch.Tensor | None:
        return None

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(self.module.parameters(), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return full_state_dict(self.module)


def build_hf_runner(cfg: Config, mesh, device: torch.device) -> Runner:
    """The recipe's transformers model, parallelized over ``mesh``, as a step runner."""
    p = cfg.parallel
    options = dict(sp=p.sp, data_parallel=p.data_parallel, ac=p.activation_checkpointing, ac_every=p.ac_every,
                   dtype=cfg.train.dtype)
    model = build_hf_model(cfg, device)
    if p.pp > 1:
        return parallelize_hf_model(model, mesh, schedule=p.schedule, microbatches=p.microbatches,
                                    virtual_stages=p.virtual_stages, **options)
    return HFStepRunner(parallelize_hf_model(model, mesh, **options), mesh, cfg)


def export_hf_model(runner: Runner, cfg: Config, folder: str) -> None:
    """Write the trained transformers model to ``folder`` from rank 0 (collective: every rank calls it)."""
    state = runner.full_state_dict()
    if dist.get_rank() == 0:
        config = json.loads((Path(cfg.model.hf_model) / "config.json").read_text())
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # transformers folders of tied models store the embedding only
        write_safetensors_folder(state, config, folder)
    dist.barrier()


__all__ = ["HFStepRunner", "build_hf_model", "build_hf_runner", "export_hf_model", "with_hf_model"]
