"""Training a transformers model from a recipe: ``[model] hf_model = "folder"``.

The folder's ``config.json`` defines the architecture (:func:`with_hf_model` copies the sizes the layout checks,
the memory estimate and the FLOP count read); its safetensors, or the model's own seeded initialisation, give
the weights. :class:`HFNoPipelineRunner` (or :class:`~meshtron.hf.pipeline.HFPipelineRunner` under pp) is the
trainer's :class:`~meshtron.parallel.step.Runner`, chosen from :data:`HF_RUNNERS` as for native models.
See docs/hf.md, 'From a recipe'.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtron.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from meshtron.hf.discover import hf_parts, key_value_heads
from meshtron.hf.experts import hf_expert_modules
from meshtron.hf.io import save_hf, write_safetensors_folder
from meshtron.hf.parallelize import parallelize_hf_model
from meshtron.hf.pipeline import HFPipelineRunner, whole_sequences
from meshtron.host import fake_tensors, simulating
from meshtron.mesh import batch_mesh
from meshtron.parallel.data_parallel import MicrobatchSync
from meshtron.parallel.float8 import fits_fp8, fp8_note, high_precision_linears, high_precision_note
from meshtron.parallel.runner import Runners
from meshtron.parallel.step import Runner, WholeModelRunner, global_token_count


def with_hf_model(cfg: Config) -> Config:
    """``cfg`` with ``[model]`` read from ``hf_model``'s config.json (unchanged without ``hf_model``)."""
    folder = cfg.model.hf_model
    if not folder:
        return cfg
    if cfg.checkpoint.init_from_hf:
        raise ConfigError(
            "[checkpoint] init_from_hf cannot be combined with [model] hf_model: hf_model's folder "
            "already gives the weights (its safetensors); drop init_from_hf."
        )
    _refuse_native_only(cfg)
    return dataclasses.replace(cfg, model=hf_model_config(folder))


def hf_model_config(folder: str) -> ModelConfig:
    """The sizes of any family's transformers folder in meshtron's terms, read through its config
    class, whose aliases map names like GPT-2's ``n_embd`` / ``n_head`` onto the common ones."""
    from transformers import AutoConfig

    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(
            f"[model] hf_model = {folder!r} has no config.json; pass a folder written by "
            "save_pretrained (config.json, and safetensors for trained weights)."
        )
    hf = AutoConfig.from_pretrained(folder)
    if getattr(hf, "is_heterogeneous", False):
        varying = sorted(
            {
                key
                for layer in hf.per_layer_config
                for key, value in vars(layer).items()
                if key != "skip" and vars(hf).get(key) != value
            }
        )
        raise ConfigError(
            f"[model] hf_model = {folder!r}: its config gives layers their own {', '.join(varying)} "
            "(per_layer_config), and a recipe's plan, memory and FLOP figures describe one layer shape, so "
            "meshtron.train does not run it yet; parallelize_hf_model does (docs/hf.md, 'Layers read as they are')."
        )
    hidden, experts = hf.hidden_size, getattr(hf, "num_experts", None) or 0
    intermediate = getattr(hf, "intermediate_size", None) or 4 * hidden  # GPT-2's n_inner default
    optional = {
        key: getattr(hf, key)
        for key in (
            "rms_norm_eps",
            "decoder_sparse_step",
            "mlp_only_layers",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
            "router_aux_loss_coef",
        )
        if getattr(hf, key, None) is not None
    }
    return ModelConfig(
        hf_model=folder,
        vocab_size=hf.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=key_value_heads(hf),
        head_dim=getattr(hf, "head_dim", None) or 0,
        max_position_embeddings=getattr(hf, "max_position_embeddings", None) or ModelConfig.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        num_experts=experts,
        num_experts_per_tok=getattr(hf, "num_experts_per_tok", 0) if experts else 0,
        moe_intermediate_size=(getattr(hf, "moe_intermediate_size", None) or intermediate) if experts else 0,
        **optional,
    )


def _refuse_native_only(cfg: Config) -> None:
    """Recipe features the HF runners do not run yet (native models only), each one clear error."""
    native_only = {
        "[data] document_mask": cfg.data.document_mask,
    }
    for key, used in native_only.items():
        if used:
            raise ConfigError(
                f"{key} is not supported with [model] hf_model yet (native models only); "
                "unset it or train a native model."
            )


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def build_hf_model(cfg: Config, device: torch.device) -> nn.Module:
    """The whole model on ``device``: the folder's weights, or transformers' init seeded with [train] seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(cfg.model.hf_model)
    torch.manual_seed(cfg.train.seed)
    if simulating():  # a dry run builds the model's shapes only (config.json is enough)
        return _fake_hf_model(AutoConfig.from_pretrained(folder), device)
    if _has_weights(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    return model.to(device).train()


def _fake_hf_model(config, device: torch.device) -> nn.Module:
    """The transformers model of ``config`` on the meta device, then as fake tensors on ``device``. Built
    under the fake mode in a ``torch.device(device)`` context, transformers finds that context's device by
    making ``torch.tensor([])`` in it, made on the host and copied to the real device: a fake CUDA device
    has no driver to take the copy."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with fake_tensors():
        return model.to_empty(device=device).train()


class HFNoPipelineRunner(WholeModelRunner):
    """One global-batch step of a parallelized transformers model without a pipeline (pp == 1).

    The rank's rows are split into ``parallel.microbatches`` micro-batches whose gradients accumulate;
    every micro-batch's loss is its token-loss sum over dp x ep x cp divided by the token count of the
    whole step (``num_items_in_batch``), so the summed gradient is the global mean loss's. The model
    keeps its cp share of each micro-batch itself (:mod:`meshtron.hf.context`), so the rows stay whole
    here and the count runs over the ranks with different rows.
    """

    def __init__(self, model: nn.Module, mesh, cfg: Config):
        self.module, self.cfg = model, cfg
        self.batch_group = batch_mesh(mesh).get_group()  # ranks with different rows (cp ranks share theirs)
        self.moes: list = []
        self.sync = MicrobatchSync(model, cfg.parallel)

    def _microbatches(self, input_ids: torch.Tensor, labels: torch.Tensor) -> list:
        m = self.cfg.parallel.microbatches
        return [(ids, lab, None) for ids, lab in zip(input_ids.chunk(m), labels.chunk(m))]

    def _loss(self, ids: torch.Tensor, targets: torch.Tensor, tokens, **options) -> torch.Tensor:
        # labels only switch the loss on: targets are already next-token labels (shift_labels).
        with whole_sequences():
            return self.module(
                input_ids=ids, labels=targets, shift_labels=targets, num_items_in_batch=tokens, **options
            ).loss

    def forward_backward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        # position_ids come only with [data] document_mask, which with_hf_model refuses.
        micro = self._microbatches(input_ids, labels)
        tokens = global_token_count(micro, self.batch_group)
        total = torch.zeros((), device=input_ids.device)
        for i, (ids, targets, _) in enumerate(micro):
            self.sync.forward(i, len(micro))
            loss = self._loss(ids, targets, tokens)
            self.sync.backward(i, len(micro))
            loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss, counted tokens) of the global batch, without gradients, on every rank."""
        micro = self._microbatches(input_ids, labels)
        tokens = global_token_count(micro, self.batch_group)
        one = torch.ones((), device=input_ids.device)  # the loss divided by one is the global sum
        # The held-out loss is the token loss (as the pipeline's): no MoE aux loss added to the sum.
        options = {"output_router_logits": False} if getattr(self.module.config, "output_router_logits", False) else {}
        total = sum(self._loss(ids, targets, one, **options) for ids, targets, _ in micro)
        return total, tokens

    def aux_loss(self) -> torch.Tensor | None:
        return None

    def mtp_losses(self) -> torch.Tensor | None:
        return None  # a transformers model trains on its next-token loss (meshtron.config.checks)


def parallelize_options(p: ParallelConfig, train: TrainConfig | None = None) -> dict:
    """:func:`parallelize_hf_model`'s options from a layout and the ``[train]`` keys it reads (default ones if
    not given): what the training runner passes."""
    train = train or TrainConfig()
    return dict(
        sp=p.sp,
        data_parallel=p.data_parallel,
        ac=p.activation_checkpointing,
        ac_every=p.ac_every,
        ac_policy=p.ac_policy,
        dtype=train.dtype,
        schedule=p.schedule,
        microbatches=p.microbatches,
        virtual_stages=p.virtual_stages,
        cp_comm_type=p.cp_comm_type,
        cp_a2a_size=p.cp_a2a_size,
        prove_blocks=p.prove_blocks,
        offload=p.offload,
        offload_activations=p.offload_activations,
        fp8=train.fp8,
    )


def _no_pipeline_runner(model: nn.Module, mesh, cfg: Config, device: torch.device) -> Runner:
    return HFNoPipelineRunner(
        parallelize_hf_model(model, mesh, **parallelize_options(cfg.parallel, cfg.train)), mesh, cfg
    )


def _pipeline_runner(model: nn.Module, mesh, cfg: Config, device: torch.device) -> Runner:
    return HFPipelineRunner(parallelize_hf_model(model, mesh, **parallelize_options(cfg.parallel, cfg.train)), mesh)


# build_model_runner's choice for a transformers model (built whole by build_hf_model).
HF_RUNNERS = Runners(no_pipeline=_no_pipeline_runner, pipeline=_pipeline_runner)


def fp8_start_note(cfg: Config) -> str | None:
    """The start-up line naming what ``[train] fp8`` leaves in the training dtype: block linears and routed
    experts whose dims FP8 cannot take, in meshtron's model or the ``[model] hf_model`` folder's (built on the
    meta device), and a transformers model's experts in a layout meshtron's dispatch does not run (they run
    as transformers' own module)."""
    if not cfg.model.hf_model or cfg.train.fp8 == "none":
        return high_precision_note(cfg.model, cfg.train.fp8)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.hf_model), dtype=torch.float32)
    return hf_fp8_note(model, cfg.train.fp8)


def hf_fp8_note(model: nn.Module, recipe: str) -> str | None:
    """:func:`fp8_start_note` of a transformers ``model`` (meta or real) under ``recipe``."""
    parts = hf_parts(model)
    names = high_precision_linears(model, recipe, parts.block_items(), parts.blocks_path)
    with warnings.catch_warnings():  # the dispatch's own warning names the experts it leaves out
        warnings.simplefilter("ignore")
        dispatched = hf_expert_modules(model, ep=1)
    for name, (experts, cls) in dispatched.items():
        hidden, intermediate = cls.dims(experts)
        if not fits_fp8((hidden, intermediate), recipe):
            names.append(f"{_block_pattern(name, parts.blocks_path)} [{hidden} -> {intermediate}]")
    note = fp8_note(recipe, list(dict.fromkeys(names)))
    undispatched = sorted(
        {
            _block_pattern(name, parts.blocks_path)
            for name, module in model.named_modules()
            if name.endswith(".experts") and name not in dispatched and _holds_weights(module)
        }
    )
    if undispatched:
        kept = f"experts meshtron's dispatch does not run stay in the training dtype: {', '.join(undispatched)}"
        note = f"{note}; {kept}" if note else f"meshtron: fp8 = '{recipe}': {kept}"
    return note


def _block_pattern(name: str, blocks_path: str) -> str:
    """``model.layers.3.mlp.experts`` as ``model.layers.*.mlp.experts``."""
    _, _, rest = name.removeprefix(f"{blocks_path}.").partition(".")
    return f"{blocks_path}.*.{rest}"


def _holds_weights(module: nn.Module) -> bool:
    """Parameters of its own: fused expert weights (a list of expert MLPs holds linears, which FP8 converts)."""
    return any(True for _ in module.parameters(recurse=False))


def export_hf(runner: Runner, cfg: Config, folder: str) -> None:
    """Write the trained model to ``folder`` as a transformers folder from rank 0 (collective: every rank
    calls it): a native model under transformers' names (:func:`meshtron.hf.io.save_hf`), a
    transformers model (``[model] hf_model``) with its own config."""
    state = runner.full_state_dict()
    if dist.get_rank() == 0:
        if not cfg.model.hf_model:
            save_hf(state, cfg.model, folder)
        else:
            config = json.loads((Path(cfg.model.hf_model) / "config.json").read_text())
            if config.get("tie_word_embeddings"):
                state.pop("lm_head.weight", None)  # transformers folders of tied models store the embedding only
            write_safetensors_folder(state, config, folder)
    dist.barrier()


__all__ = [
    "HF_RUNNERS",
    "HFNoPipelineRunner",
    "build_hf_model",
    "export_hf",
    "fp8_start_note",
    "hf_fp8_note",
    "hf_model_config",
    "with_hf_model",
]
