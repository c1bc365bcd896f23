"""Typed recipe configuration: dataclasses, TOML loading and ``--section.key value`` overrides.

A recipe is a TOML file with the sections ``[model]``, ``[parallel]``, ``[train]``, ``[data]`` and
``[checkpoint]``. ``[model]`` keys are the HuggingFace ``config.json`` names so a published config
maps onto a recipe one to one. Every problem is a :class:`ConfigError` that names the file, the key
and the fix, raised before any process group exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key and the fix."""


def recipe_key(default: Any, meaning: str) -> Any:
    """A recipe key's dataclass field: its default and its one-line meaning (Markdown; links are relative to
    docs/), which ``python -m meshtron.config_reference --write`` renders into docs/reference.md."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"meaning": meaning})
    return field(default=default, metadata={"meaning": meaning})


@dataclass
class ModelConfig:
    """The model's architecture: meshtron's Qwen2 / Qwen2-MoE model, or a transformers folder (`hf_model`)."""

    hf_model: str = recipe_key(
        "",
        "a transformers model folder to train instead of meshtron's model: its `config.json` defines the "
        "architecture (the other `[model]` keys are then read from it), weights from its safetensors when "
        "present, else transformers' init seeded with `[train] seed`; runs on pp, dp, cp, ep, tp, sp with "
        "evaluation, checkpoints, resume and `export_hf` (writes the model's own transformers folder); not with "
        "`init_from_hf`; see [Parallelizing a HuggingFace model](hf.md) for the limits "
        "(`meshtron/hf/runner.py`)",
    )
    vocab_size: int = recipe_key(151936, "rows of the embedding and of the output head")
    hidden_size: int = recipe_key(896, "model width")
    intermediate_size: int = recipe_key(4864, "width of the dense SwiGLU MLP (MoE models: of their dense layers)")
    num_hidden_layers: int = recipe_key(24, "decoder layers")
    num_attention_heads: int = recipe_key(14, "query heads; tp must divide it")
    num_key_value_heads: int = recipe_key(
        2,
        "key/value heads (GQA); 0 means as many as query heads; split over tp, or replicated when tp is larger",
    )
    head_dim: int = recipe_key(0, "size of one head; 0 means hidden_size / num_attention_heads")
    max_position_embeddings: int = recipe_key(32768, "longest sequence the model was trained for")
    rope_theta: float = recipe_key(1_000_000.0, "RoPE base frequency")
    rms_norm_eps: float = recipe_key(1e-6, "epsilon of every RMSNorm")
    tie_word_embeddings: bool = recipe_key(False, "share the embedding matrix with the output head")
    attention_bias: bool = recipe_key(
        True, "biases on the q/k/v projections (Qwen2 has them; Llama-style models do not)"
    )
    hidden_act: str = recipe_key("silu", "MLP activation; only `silu` (SwiGLU)")
    initializer_range: float = recipe_key(0.02, "standard deviation of the random initialization")
    num_experts: int = recipe_key(0, "routed experts per MoE layer; 0 makes a dense model")
    num_experts_per_tok: int = recipe_key(0, "experts each token is routed to (top-k)")
    moe_intermediate_size: int = recipe_key(0, "width of one routed expert's MLP")
    shared_expert_intermediate_size: int = recipe_key(
        0, "width of the always-on shared expert (with its sigmoid gate); 0 means none"
    )
    norm_topk_prob: bool = recipe_key(False, "renormalize the top-k routing weights to sum to 1")
    decoder_sparse_step: int = recipe_key(
        1, "layer i is MoE when (i + 1) is a multiple of this (and i is not in mlp_only_layers)"
    )
    mlp_only_layers: list[int] = recipe_key([], "layer indices that keep a dense MLP in an MoE model")
    router_aux_loss_coef: float = recipe_key(
        0.001,
        "weight of the load-balancing auxiliary loss (Switch, per MoE layer, averaged over layers and "
        "micro-batches)",
    )
    router_z_loss_coef: float = recipe_key(
        0.0,
        "weight of the router z-loss (ST-MoE, averaged over MoE layers like the aux loss); 0 turns it off; "
        "not an HF key (`meshtron/models/moe.py`)",
    )
    moe_aux_free_bias_rate: float = recipe_key(
        0.0,
        "DeepSeek-V3 auxiliary-loss-free balancing: per-expert bias step after each optimizer step (skipped "
        "with a skipped non-finite step); 0 turns it off. transformers' Qwen2-MoE has no router bias: HF "
        "export refuses a trained one; not an HF key (`meshtron/models/moe.py`)",
    )
    moe_capacity_factor: float = recipe_key(
        0.0,
        "per-expert capacity = ceil(factor × tokens × top-k / experts) over the global micro-batch (so it "
        "depends on `[parallel] microbatches`, not on the layout); copies over capacity are dropped first come "
        "first served in (sample, position) order, the same copies on every layout; 0 turns it off; not an HF "
        "key (`meshtron/models/moe.py`)",
    )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen2-MoE's rule: sparse every ``decoder_sparse_step`` layers unless listed as MLP-only."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def model_differences(ours: ModelConfig, theirs: dict[str, Any], source: str, ignore: tuple[str, ...]) -> str:
    """The first [model] keys whose values differ from ``theirs`` (a saved or published config, named
    ``source`` in the text), as "key: source X vs recipe Y, ..."; empty when they agree. Keys
    ``theirs`` lacks (configs saved before the key existed) and keys in ``ignore`` are not compared."""
    mine = dataclasses.asdict(ours)
    differing = [k for k in mine if k in theirs and k not in ignore and mine[k] != theirs[k]]
    return ", ".join(f"{k}: {source} {theirs[k]!r} vs recipe {mine[k]!r}" for k in differing[:4])


@dataclass
class ParallelConfig:
    """The layout. pp × dp × cp × ep × tp must equal the number of ranks (ep counts 1 with
    `fold_ep = true`); what pp > 1 requires is in [Pipeline parallelism](pipeline.md)."""

    pp: int = recipe_key(1, "pipeline stages")
    dp: int = recipe_key(
        1,
        "data-parallel replicas (FSDP-sharded); 0 infers it as the world size / (pp × cp × ep × tp), an error "
        "when that is not exact (the debug recipes use 0; `infer_dp`)",
    )
    cp: int = recipe_key(1, "context-parallel ranks splitting each sequence (ring attention)")
    ep: int = recipe_key(
        1,
        "expert-parallel ranks; must divide num_experts; acts as extra data parallelism for dense layers "
        "(unless folded)",
    )
    tp: int = recipe_key(1, "tensor-parallel ranks inside a stage")
    sp: bool = recipe_key(False, "sequence parallelism: shard the activations outside attention and MLP over tp")
    tp_overlap: bool = recipe_key(
        False,
        "with `sp` and tp > 1: each block's SP all-gathers and reduce-scatters run as rings of point-to-point "
        "chunks overlapped with the GEMMs that use them (collective matmul; `meshtron/parallel/tensor_overlap.py`); "
        "meshtron's own models",
    )
    etp: int = recipe_key(
        1,
        "expert tensor parallelism: each expert's gate/up split by columns and down by rows over etp ranks (a "
        "divisor of tp and of moe_intermediate_size); see "
        "[Experts: folding and etp](expert_parallel.md#experts-folding-ep-and-expert-tensor-parallelism)",
    )
    fold_ep: bool = recipe_key(
        False,
        "`true`: ep draws its ranks from each stage's dp × cp × tp ranks instead of multiplying the world size "
        "(world = pp × dp × cp × tp; ep × etp must divide dp × cp × tp)",
    )
    cp_comm_type: str = recipe_key(
        "p2p",
        "how cp ranks exchange attention inputs: `p2p` (ring), `a2a` (Ulysses all-to-all), `allgather` (K/V "
        "gathered), `a2a+p2p` (all-to-all in groups, ring across them); see "
        "[Context parallelism](context_parallel.md)",
    )
    cp_a2a_size: int = recipe_key(
        0,
        "with `a2a+p2p`: cp ranks per all-to-all group; 0: the largest divisor of cp below cp on one node that "
        "divides the heads",
    )
    schedule: str = recipe_key(
        "1f1b",
        "pipeline schedule: `gpipe`, `1f1b`, `interleaved`, or zero-bubble `zb1p`, `zbv`, `dualpipev`",
    )
    virtual_stages: int = recipe_key(
        1, "model chunks per pipeline rank (`interleaved`; `zbv` and `dualpipev` need 2)"
    )
    microbatches: int = recipe_key(
        1,
        "microbatches per step on each data-parallel rank; 0: the fewest that divide the per-rank batch and "
        "that the schedule runs (1 without a pipeline, pp for `1f1b`, 2 pp for `zbv`; `infer_microbatches`)",
    )
    data_parallel: str = recipe_key(
        "fsdp",
        "`fsdp`: shard over dp × ep × cp (experts: over their edp ranks); `hsdp`: replicate over dp, shard "
        "inside ep × cp (experts: their edp ranks inside a dp slice); `replicate`: full copies (DDP-like)",
    )
    activation_checkpointing: str = recipe_key(
        "none",
        "recompute blocks in backward: `none`, `full` (every block), `selective` (every `ac_every`-th block) "
        "or `op` (every block keeps the op outputs `ac_policy` names and recomputes the rest; "
        "[activation checkpointing](training.md#activation-checkpointing))",
    )
    ac_every: int = recipe_key(2, "with `selective`, checkpoint blocks whose global index is a multiple of this")
    ac_policy: str = recipe_key(
        "save_matmuls",
        "with `op`: `save_matmuls` keeps every matmul's, attention's and collective's output and recomputes "
        "norms, RoPE, SwiGLU's activation and residual adds; `alternate_matmuls` (torchtitan's) also "
        "recomputes every second matmul of a block; `parts`: as `save_matmuls`, but the parts `ac_parts` "
        "names are recomputed whole (Megatron's `recompute_modules`)",
    )
    ac_parts: list[str] = recipe_key(
        [],
        "with `ac_policy = \"parts\"`: the parts of each block recomputed whole, of `core_attn` (the attention "
        "kernel), `mlp` (the dense MLPs' and the shared expert's matmuls), `moe_experts` (the routed experts' "
        "grouped matmuls); norms, RoPE and SwiGLU's activation are recomputed under every `op` policy",
    )
    compile: bool = recipe_key(
        False,
        "`torch.compile` each transformer block's forward (inductor), after TP/EP/CP/activation checkpointing "
        "and before FSDP; names and numerics unchanged (`meshtron/parallel/compile.py`)",
    )
    fsdp_prefetch: int = recipe_key(
        1,
        "blocks whose FSDP all-gather is issued ahead of use (next block in forward, previous in backward); 0 "
        "leaves FSDP2's implicit prefetching",
    )
    fsdp_gather: str = recipe_key(
        "per_microbatch",
        "without a pipeline (pipelines always hold their stage per step): `per_microbatch` all-gathers each FSDP "
        "unit in every micro-batch's forward and again in its backward and (`fsdp`) reduce-scatters every "
        "backward; `per_step` gathers each unit once per step and holds it, with its unsharded fp32 gradients, "
        "until the last backward reduces once (more memory, fewer collectives: `meshtron.plan` tries both); no "
        "effect with `replicate`",
    )
    offload: str = recipe_key(
        "none",
        "`optimizer`: keep the fp32 sharded parameters, their gradients and the AdamW state in host memory and "
        "step the optimizer there (FSDP2's `CPUOffloadPolicy`: each unit's shard is copied to the device for its "
        "all-gather, gradients copied back after their reduce-scatter); needs `data_parallel` `fsdp` or `hsdp` "
        "and pp = 1; `none`: all on the device (see [Training](training.md#host-memory-offload))",
    )
    offload_activations: bool = recipe_key(
        False,
        "send the tensors each block saves for backward to host memory after its forward and back in its "
        "backward (on CUDA on a side stream, overlapping compute); blocks recomputed by "
        "`activation_checkpointing` keep their inputs on the device instead; pp = 1",
    )
    prove_blocks: bool = recipe_key(
        True,
        "with `[model] hf_model`: before training, run the first block of each kind split and whole on a probe "
        "batch and refuse the layout when they differ (`meshtron/hf/prove.py`; layouts with tp / SP / ep / cp, "
        "under pp per stage)",
    )

    @property
    def mesh_ep(self) -> int:
        """ep's factor in the world size and the device mesh: 1 when folded (ep then reuses dense ranks)."""
        return 1 if self.fold_ep else self.ep


@dataclass
class TrainConfig:
    """The run: its length and batch, the optimizer, logging, evaluation, profiling and failure handling."""

    steps: int = recipe_key(10, "optimizer steps")
    seed: int = recipe_key(0, "seed for initialization and data order")
    dtype: str = recipe_key("float32", "training dtype: `float32` or `bfloat16`")
    fp8: str = recipe_key(
        "none",
        "FP8 GEMMs in the blocks' attention and MLP linears and routed experts (torchao, the `meshtron[fp8]` "
        "extra): `none`, `tensorwise`, `rowwise` or `rowwise_with_gw_hp`; parameters, embedding, LM head, router "
        "and norms stay in `dtype` (see [FP8](fp8.md))",
    )
    global_batch_size: int = recipe_key(8, "sequences per step over all ranks; divisible by dp × ep × microbatches")
    seq_len: int = recipe_key(128, "tokens per sequence")
    lr: float = recipe_key(3e-4, "peak learning rate")
    min_lr: float = recipe_key(3e-5, "lowest learning rate the schedule decays to")
    warmup_steps: int = recipe_key(2, "linear warm-up steps")
    weight_decay: float = recipe_key(0.1, "AdamW weight decay")
    beta1: float = recipe_key(0.9, "AdamW beta1")
    beta2: float = recipe_key(0.95, "AdamW beta2")
    max_grad_norm: float = recipe_key(1.0, "gradient clipping threshold (global norm)")
    log_every: int = recipe_key(1, "steps between metric lines")
    output_dir: str = recipe_key("runs/default", "where `metrics.jsonl`, checkpoints and `pids/rank-R.pid` go")
    collective_timeout_s: float = recipe_key(
        600.0, "a collective waiting longer than this fails (a dead or stuck rank) instead of hanging"
    )
    hang_timeout_s: float = recipe_key(
        0.0,
        "a step running longer is reported as a hang (`meshtron/watchdog.py`: which rank is behind, in which "
        "collective the others wait, stacks under `<output_dir>/hang/`; see "
        "[Failures and restarts](failures.md)); 0: the larger of 300 s and 10 x the median step, at most half "
        "of `collective_timeout_s`; must be shorter than `collective_timeout_s`",
    )
    on_nonfinite: str = recipe_key(
        "stop",
        "NaN/Inf loss or gradient norm: `stop` (naming the step and the first non-finite gradient) or `skip` "
        "the update",
    )
    loss_chunk_tokens: int = recipe_key(
        1024,
        "tokens per chunk of the fused lm_head + cross-entropy; its extra memory is about chunk × vocab / tp "
        "fp32 values (`meshtron/models/chunked_loss.py`)",
    )
    memory_check: str = recipe_key(
        "error",
        "before allocating, compare `meshtron.plan`'s per-rank memory prediction with the device (CUDA: total "
        "memory; CPU: available host RAM / local ranks): `error` refuses with exit code 2 naming a layout that "
        "fits, `warn` prints it and goes on, `off` skips it",
    )
    eval_every: int = recipe_key(
        0,
        "evaluate on `[data] eval_source` every N steps; 0: only after the final step (evaluation always runs "
        "after the final step when `eval_source` is set)",
    )
    eval_steps: int = recipe_key(
        10,
        "global batches per evaluation: the first N batches of the held-out data, the same ones every time and "
        "on every layout",
    )
    tensorboard: bool = recipe_key(
        False,
        "also write TensorBoard event files to `<output_dir>/tensorboard` (needs `pip install tensorboard`, or "
        "the `meshtron[tensorboard]` extra)",
    )
    profile_steps: list[int] = recipe_key(
        [],
        "`[first, last]`: a `torch.profiler` trace of those steps (1-based, inclusive) per rank, "
        "`<output_dir>/profile/rank-R.json` (Chrome / Perfetto format); `[]` for none",
    )


@dataclass
class DataConfig:
    """What the model reads; see [Data](data.md)."""

    source: str = recipe_key(
        "builtin",
        "`builtin` (the embedded corpus), a path to a .txt/.jsonl(.gz)/.parquet/.arrow file, a folder of them, "
        "or a `datasets` `save_to_disk` folder (a `DatasetDict` reads its `train` split)",
    )
    sources: list[dict] = recipe_key(
        [],
        "a weighted mixture instead of `source`: `[{path = ..., weight = ...[, text_key = ...]}, ...]`; each "
        "sample's source follows from its index alone (layout-independent, exact on resume), see "
        "[Data](data.md)",
    )
    tokenizer: str = recipe_key(
        "bytes", "`bytes` (256-token byte tokenizer) or a path to tokenizer.json or a tokenizer folder"
    )
    text_key: str = recipe_key(
        "text", "field (.jsonl) or column (parquet, arrow) holding the text; one document per record"
    )
    eos_token: str = recipe_key(
        "",
        "end-of-document token of a file tokenizer; empty: found in its vocabulary and tokenizer_config.json "
        "(`meshtron/data/tokenizer.py`)",
    )
    cache_dir: str = recipe_key("", "where tokenized data is cached; empty means `<train.output_dir>/token_cache`")
    format: str = recipe_key(
        "text",
        "`text` (pretraining: every token is a label), `prompt_response` or `chat` (SFT: only response tokens "
        "are labels, prompt labels are -100), see [Data](data.md)",
    )
    prompt_key: str = recipe_key("prompt", "`format = \"prompt_response\"`: the field / column holding the prompt")
    response_key: str = recipe_key(
        "response", "`format = \"prompt_response\"`: the field / column holding the response"
    )
    messages_key: str = recipe_key(
        "messages",
        "`format = \"chat\"`: the field / column holding `[{role, content}, ...]`, rendered with the "
        "tokenizer's chat template",
    )
    eval_source: str = recipe_key(
        "", "held-out data for evaluation (any kind `source` accepts); empty: no evaluation"
    )
    document_mask: bool = recipe_key(
        False,
        "mask the packed documents of a window apart: positions restart at 0 after every end-of-document token "
        "(transformers' packed `position_ids`), attention never crosses a document, and the end-of-document "
        "token's target (the next document's first token) is ignored, as transformers' "
        "`DataCollatorWithFlattening` does; off: one causal sequence per window, as before (see "
        "[Context parallelism](context_parallel.md))",
    )


@dataclass
class CheckpointConfig:
    """Checkpoints (DCP: any layout resumes any other) and HuggingFace import and export."""

    dir: str = recipe_key("", "checkpoint folder; empty means `<train.output_dir>/checkpoints`")
    every: int = recipe_key(
        0, "steps between checkpoints; 0 disables them. When on, the final step is always saved"
    )
    keep: int = recipe_key(
        0,
        "keep only the newest N complete checkpoints (older ones are deleted after each new one is complete, "
        "and never the new one: in a folder reused without resume it counts as the newest); 0 keeps all",
    )
    async_save: bool = recipe_key(
        False,
        "save with DCP's asynchronous save: the state is copied to host memory and written by a background "
        "thread while training continues; the checkpoint gets its marker (and becomes loadable) when the next "
        "save starts or the run ends, so a crash mid-write leaves the previous one as the latest",
    )
    resume: bool = recipe_key(False, "continue from the latest checkpoint in `dir`")
    init_from_hf: str = recipe_key("", "HuggingFace checkpoint folder to load the initial weights from")
    export_hf: str = recipe_key("", "folder to write the final weights to in HuggingFace format")


@dataclass
class Config:
    """A recipe is a TOML file with the five sections below; keys that a recipe leaves out take the
    default. `[model]` keys are the HuggingFace `config.json` names, so a published config maps onto a
    recipe one to one. Unknown sections or keys, wrong types and impossible values are rejected with an
    error naming the file, the key and the fix, before any process group starts."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
}


def _closest(name: Any, options: typing.Iterable[str]) -> str:
    by_lower = {option.lower(): option for option in options}
    match = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean '{by_lower[match[0]]}'?" if match else ""


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a dataclass annotation; ints are accepted where floats are expected."""
    hint = eval(annotation, vars(sys.modules[__name__])) if isinstance(annotation, str) else annotation
    origin = typing.get_origin(hint)
    if origin in (list, typing.List):
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list of {item.__name__}, got {value!r}.")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported annotation {hint}")  # keep config fields simple
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        # TOML integers are 64-bit; larger ones only come from Python callers and break messages.
        raise ConfigError(f"{where} must fit in a signed 64-bit integer, got a {value.bit_length()}-bit value.")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {value!r}.")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where} must be an integer, got {value!r}.")
    if not isinstance(value, hint):
        raise ConfigError(f"{where} must be of type {hint.__name__}, got {value!r}.")
    return value


def _section_from_dict(name: str, raw: Any, source: str) -> Any:
    cls = _SECTION_TYPES[name]
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: [{name}] must be a table of keys, got {raw!r}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key '{key}' in [{name}].{_closest(key, fields)} "
                f"Valid keys: {', '.join(fields)}."
            )
        values[key] = _coerce(value, fields[key].type, f"{source}: [{name}] {key}")
    return cls(**values)


def config_from_dict(raw: dict[str, Any], source: str = "<recipe>") -> Config:
    """Build a :class:`Config` from a parsed TOML mapping, rejecting unknown sections and keys."""
    for name in raw:
        if name not in _SECTION_TYPES:
            raise ConfigError(
                f"{source}: unknown section [{name}].{_closest(name, _SECTION_TYPES)} "
                f"Valid sections: {', '.join(_SECTION_TYPES)}."
            )
    cfg = Config(**{n: _section_from_dict(n, raw.get(n, {}), source) for n in _SECTION_TYPES})
    validate(cfg, source)
    return infer_microbatches(cfg)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _parse_override_value(text: str) -> Any:
    """Read a command-line value as TOML (so ``true``, ``2``, ``[1, 3]`` work), else as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """Turn ``["--parallel.tp", "2", "--train.steps=10"]`` into ``{"parallel": {"tp": 2}, ...}``."""
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"override '{arg}' must look like --section.key value (e.g. --parallel.tp 2).")
        if "=" in arg:
            dotted, text = arg[2:].split("=", 1)
            i += 1
        else:
            # A following flag means this one has no value; negative numbers have one dash only.
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"override '{arg}' has no value; write {arg} VALUE or {arg}=VALUE.")
            dotted, text = arg[2:], args[i + 1]
            i += 2
        section, dot, key = dotted.partition(".")
        if not (section and dot and key):
            raise ConfigError(
                f"override '{arg}' must name a section and a key, like --parallel.tp 2 or --train.steps=10."
            )
        out.setdefault(section, {})[key] = _parse_override_value(text)
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load a TOML recipe, apply ``--section.key value`` overrides and validate the result."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe '{path}' is not a file; pass --recipe with a path to a .toml file.")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err}); a recipe must be a UTF-8 TOML file.") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: malformed TOML: {err}. Fix the syntax at that line.") from None
    for section, keys in parse_overrides(overrides or []).items():
        raw.setdefault(section, {})
        if isinstance(raw[section], dict):
            raw[section].update(keys)
        else:
            raw[section] = keys
    return config_from_dict(raw, source=str(path))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# The values of the recipe's choice keys, defined once here (below every other module): the checks
# below use them and the modules that implement the choices import them.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev")  # built by parallel/pipeline/schedules.py
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank, placed down the ranks and back up
VIRTUAL = ("interleaved",) + V_SHAPED  # the schedules that run more than one virtual stage per rank
DTYPES = ("float32", "bfloat16")
FP8_RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's names; meshtron/parallel/float8.py
DATA_PARALLEL_MODES = ("fsdp", "hsdp", "replicate")
FSDP_GATHERS = ("per_microbatch", "per_step")  # how often FSDP gathers a unit under accumulation
ACTIVATION_CHECKPOINTING = ("none", "full", "selective", "op")
AC_POLICIES = ("save_matmuls", "alternate_matmuls", "parts")
AC_PARTS = ("core_attn", "mlp", "moe_experts")  # [parallel] ac_parts; meshtron/parallel/checkpointing.py
OFFLOADS = ("none", "optimizer")  # [parallel] offload; meshtron/parallel/data.py
NONFINITE_POLICIES = ("stop", "skip")
MEMORY_CHECKS = ("error", "warn", "off")


def not_one_of(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """The message for a choice ``key`` (e.g. "[parallel] data_parallel") set to another ``value``."""
    return f"{key} must be one of {', '.join(choices)}, got '{value}'."


def needs_virtual_schedule(virtual_stages: int) -> str:
    """Why ``virtual_stages`` > 1 needs one of the ``VIRTUAL`` schedules (recipe and build_schedule)."""
    names = ", ".join(f"'{name}'" for name in VIRTUAL[:-1]) + f" or '{VIRTUAL[-1]}'"
    return f"virtual_stages = {virtual_stages} needs schedule = {names}"


def needs_two_virtual_stages(virtual_stages: int) -> str:
    """Why a ``V_SHAPED`` schedule needs ``virtual_stages = 2`` (recipe and build_schedule)."""
    return f"needs virtual_stages = 2 (rank r runs stages r and 2 pp - 1 - r), got {virtual_stages}"


def _require_choice(source: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{source}: " + not_one_of(key, value, choices) + _closest(value, choices))


def _validate_fp8(cfg: Config, source: str) -> None:
    fp8 = cfg.train.fp8
    _require_choice(source, "[train] fp8", fp8, FP8_RECIPES)
    if fp8 == "none":
        return
    _require(importlib.util.find_spec("torchao") is not None,
             f"{source}: [train] fp8 = '{fp8}' needs torchao: pip install 'meshtron[fp8]'.")
    _require(not (cfg.parallel.tp_overlap and cfg.parallel.tp > 1),
             f"{source}: [train] fp8 = '{fp8}' with [parallel] tp_overlap = true: the overlapped rings compute their "
             "GEMMs in the training dtype, not in float8; set tp_overlap = false or fp8 = 'none'.")
    _require(not cfg.model.hf_model, f"{source}: [train] fp8 = '{fp8}' is built for meshtron's own models; "
             "[model] hf_model trains without it (fp8 = 'none').")
    _require(cfg.parallel.etp == 1,
             f"{source}: [train] fp8 = '{fp8}' with [parallel] etp = {cfg.parallel.etp}: the experts' float8 GEMMs "
             "scale an operand over a whole expert, which etp splits; set etp = 1 or fp8 = 'none'.")


def _validate_data_parallel(p: ParallelConfig, source: str) -> None:
    _require_choice(source, "[parallel] data_parallel", p.data_parallel, DATA_PARALLEL_MODES)
    _require_choice(source, "[parallel] fsdp_gather", p.fsdp_gather, FSDP_GATHERS)
    _require_choice(source, "[parallel] activation_checkpointing", p.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    _require(
        p.ac_every >= 1,
        f"{source}: [parallel] ac_every must be >= 1 (checkpoint every N-th block), got {p.ac_every}.",
    )
    _require_choice(source, "[parallel] ac_policy", p.ac_policy, AC_POLICIES)
    _require(not (p.compile and p.activation_checkpointing == "op"),
             f"{source}: [parallel] activation_checkpointing = 'op' does not compose with compile = true yet (a "
             "compiled block's recomputation runs its whole graph again, keeping the op outputs as well); use "
             "activation_checkpointing = 'full' or compile = false.")


def _validate_ac_parts(cfg: Config, source: str) -> None:
    p, where = cfg.parallel, f"{source}: [parallel] ac_parts"
    if p.ac_policy != "parts":
        _require(not p.ac_parts, f"{where} = {p.ac_parts} is read with ac_policy = 'parts' only (got "
                                 f"'{p.ac_policy}'); set ac_policy = 'parts' or ac_parts = [].")
        return
    _require(bool(p.ac_parts), f"{where} is empty: ac_policy = 'parts' recomputes the parts it names; name "
                               f"some of {', '.join(AC_PARTS)} or use ac_policy = 'save_matmuls'.")
    for part in p.ac_parts:
        _require_choice(source, "[parallel] ac_parts entry", part, AC_PARTS)
    _require(len(set(p.ac_parts)) == len(p.ac_parts), f"{where} = {p.ac_parts} names a part twice.")
    _require(not cfg.model.hf_model, f"{source}: [parallel] ac_policy = 'parts' is built for meshtron's own "
                                     "models; [model] hf_model trains without it (ac_policy = 'save_matmuls').")


def _validate_offload(cfg: Config, source: str) -> None:
    """Host-memory offload: FSDP2's CPU offload of the sharded state, per-block activation offload."""
    p, where = cfg.parallel, f"{source}: [parallel]"
    _require_choice(source, "[parallel] offload", p.offload, OFFLOADS)
    # (key, its value, the value that turns it off) of each offload the recipe sets
    offloads = [("offload", f"'{p.offload}'", "'none'")] if p.offload != "none" else []
    offloads += [("offload_activations", "true", "false")] if p.offload_activations else []
    for key, value, off in offloads:
        _require(p.pp == 1, f"{where} {key} = {value} runs without a pipeline (pp = 1), got pp = {p.pp}; "
                 f"set pp = 1 or {key} = {off}.")
        _require(not cfg.model.hf_model, f"{where} {key} = {value} is built for meshtron's own models; "
                 f"[model] hf_model trains without it; set {key} = {off}.")
    if p.offload != "none":
        _require(p.data_parallel in ("fsdp", "hsdp"),
                 f"{where} offload = '{p.offload}' keeps FSDP's parameter shards in host memory: it needs "
                 f"data_parallel = 'fsdp' or 'hsdp', got '{p.data_parallel}'.")
        _require(cfg.train.fp8 == "none",
                 f"{where} offload = '{p.offload}' does not compose with [train] fp8 = '{cfg.train.fp8}' (float8 "
                 "all-gathers of host shards); set fp8 = 'none' or offload = 'none'.")
    _require(not p.offload_activations or p.activation_checkpointing != "full",
             f"{where} offload_activations = true offloads the blocks activation checkpointing does not recompute, "
             "and activation_checkpointing = 'full' recomputes every block: nothing would move. Use "
             "activation_checkpointing = 'none' or 'selective', or offload_activations = false.")
    _require(not (p.offload_activations and p.compile),
             f"{where} offload_activations = true hooks each block's saved tensors, which compile = true would trace "
             "into the compiled graph; set one of them false.")


def _check_numbers(section: str, obj: Any, source: str) -> None:
    """No recipe number may be negative, NaN or infinite (seed is the one signed field)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: [{section}] {f.name} must be a finite number, got {value}.")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0 and f.name != "seed":
            raise ConfigError(f"{source}: [{section}] {f.name} must not be negative, got {value}.")


def _validate_model(m: ModelConfig, source: str) -> None:
    where = f"{source}: [model]"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings"):
        _require(getattr(m, key) > 0, f"{where} {key} must be positive, got {getattr(m, key)}.")
    for key in ("rope_theta", "rms_norm_eps", "initializer_range"):
        _require(getattr(m, key) > 0, f"{where} {key} must be > 0, got {getattr(m, key)}.")
    _require(
        m.num_attention_heads % m.kv_heads == 0,
        f"{where} num_attention_heads ({m.num_attention_heads}) must be a multiple of "
        f"num_key_value_heads ({m.kv_heads}).",
    )
    _require(
        m.head_dim > 0 or m.hidden_size % m.num_attention_heads == 0,
        f"{where} hidden_size ({m.hidden_size}) is not divisible by num_attention_heads "
        f"({m.num_attention_heads}); set head_dim explicitly.",
    )
    _require(m.head_size % 2 == 0, f"{where} head size {m.head_size} must be even for RoPE.")
    _require(m.hidden_act == "silu", f"{where} hidden_act must be 'silu', got '{m.hidden_act}'.")
    bad_layers = [i for i in m.mlp_only_layers if not 0 <= i < m.num_hidden_layers]
    _require(
        not bad_layers,
        f"{where} mlp_only_layers {bad_layers} are not layer indices 0..{m.num_hidden_layers - 1}.",
    )
    if not m.is_moe:
        return
    _require(
        0 < m.num_experts_per_tok <= m.num_experts,
        f"{where} num_experts_per_tok must be in 1..num_experts ({m.num_experts}), got {m.num_experts_per_tok}.",
    )
    _require(m.moe_intermediate_size > 0, f"{where} moe_intermediate_size must be > 0 for MoE.")
    _require(m.decoder_sparse_step >= 1, f"{where} decoder_sparse_step must be >= 1, got {m.decoder_sparse_step}.")
    for key in ("router_aux_loss_coef", "router_z_loss_coef", "moe_aux_free_bias_rate", "moe_capacity_factor"):
        _require(getattr(m, key) >= 0, f"{where} {key} must be >= 0 (0 turns it off), got {getattr(m, key)}.")


def _validate_layout(cfg: Config, source: str) -> None:
    """The [parallel] checks that need no world size: each key, the schedule against virtual_stages
    and the expert keys against the model. Fitting the layout to the world size, the model and the batch
    is :func:`meshtron.parallel.layout.validate_layout`."""
    p = cfg.parallel
    where = f"{source}: [parallel]"
    for key in ("pp", "cp", "ep", "tp", "virtual_stages"):
        _require(getattr(p, key) >= 1, f"{where} {key} must be >= 1, got {getattr(p, key)}.")
    _require_choice(source, "[parallel] schedule", p.schedule, SCHEDULES)
    _require(
        p.virtual_stages == 1 or p.schedule in VIRTUAL, f"{where} {needs_virtual_schedule(p.virtual_stages)}."
    )
    _require(
        p.virtual_stages == 2 or p.schedule not in V_SHAPED,
        f"{where} schedule = '{p.schedule}' {needs_two_virtual_stages(p.virtual_stages)}.",
    )
    _validate_data_parallel(p, source)
    _validate_ac_parts(cfg, source)
    _validate_offload(cfg, source)
    _require(
        not p.tp_overlap or (p.sp and p.tp > 1 and not cfg.model.hf_model),
        f"{where} tp_overlap = true overlaps sequence parallelism's collectives with meshtron's own blocks: it "
        f"needs sp = true and tp > 1 (got sp = {str(p.sp).lower()}, tp = {p.tp})"
        + (" and applies to meshtron's own models, not [model] hf_model" if cfg.model.hf_model else "")
        + "; set those or tp_overlap = false.",
    )
    expert_keys = expert_keys_without_experts(p)
    _require(  # an hf_model folder's experts are known later: parallel/layout.py runs this rule again
        not expert_keys or cfg.model.is_moe or cfg.model.hf_model, f"{where} {expert_keys}"
    )


def expert_keys_without_experts(p: ParallelConfig) -> str | None:
    """For a model without experts: what is wrong with the first expert key set (ep, etp, fold_ep).
    The rule's one owner: the recipe check above and ``validate_layout`` (for hf_model) both use it."""
    for key, used in (("ep", p.ep > 1), ("etp", p.etp > 1), ("fold_ep", p.fold_ep)):
        if used:
            value = str(getattr(p, key)).lower()
            return (f"{key} = {value} needs an MoE model (num_experts > 0); "
                    + ("use dp instead." if key == "ep" else f"remove {key}."))
    return None


def infer_dp(cfg: Config, world_size: int) -> Config:
    """``[parallel] dp = 0`` becomes the world size divided by pp x cp x ep x tp (as Megatron infers
    its data-parallel size); any other dp is returned unchanged. Raises :class:`ConfigError` when the
    division is not exact."""
    p = cfg.parallel
    if p.dp != 0:
        return infer_microbatches(cfg)
    others = p.pp * p.cp * p.mesh_ep * p.tp
    _require(
        world_size % others == 0,
        f"[parallel] dp = 0 infers dp as the world size / (pp x cp x ep x tp), but the world size {world_size} is "
        f"not a multiple of pp x cp x ep x tp = {p.pp} x {p.cp} x {p.mesh_ep} x {p.tp} = {others}"
        + (" (folded ep counts 1)" if p.fold_ep else "") + f". Launch a multiple "
        f"of {others} ranks, or set [parallel] dp explicitly.",
    )
    return infer_microbatches(dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=world_size // others)))


def fewest_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches ``schedule`` runs on ``pp`` stages: one per stage, one per chunk for the
    V-shaped schedules (their warm-up fills both chunks of every rank). Owned here for the pipeline's
    checks (``parallel/pipeline/schedules.py``) and ``microbatches = 0``."""
    if pp == 1:
        return 1
    return 2 * pp if schedule in V_SHAPED else pp


def microbatch_multiple(schedule: str, pp: int) -> int:
    """What the micro-batch count must be a multiple of: pp for ``interleaved``, which feeds each chunk
    micro-batches in groups of pp; 1 otherwise."""
    return pp if schedule == "interleaved" and pp > 1 else 1


def rank_batch(cfg: Config) -> int:
    """The sequences of a step each data-parallel (and expert-parallel) rank reads; dp must be known."""
    t, readers = cfg.train, cfg.parallel.dp * cfg.parallel.mesh_ep
    _require(
        t.global_batch_size % readers == 0,
        f"[train] global_batch_size = {t.global_batch_size} must be a multiple of dp x ep = {readers} "
        f"(the batch is split over dp and ep). Use global_batch_size = {round_up(t.global_batch_size, readers)}.",
    )
    return t.global_batch_size // readers


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` not below ``value`` (the fix an error message suggests)."""
    return -(-value // multiple) * multiple


def infer_microbatches(cfg: Config) -> Config:
    """``[parallel] microbatches = 0`` becomes the fewest micro-batches that divide the per-rank batch and
    that the schedule runs: 1 without a pipeline, pp for 1F1B, 2 pp for ``zbv``. The global batch stays as
    set (Megatron also derives its count from the batch sizes), so a recipe written without a pipeline runs
    with one by overriding pp alone. Waits for a concrete dp (:func:`infer_dp` calls it again)."""
    p = cfg.parallel
    if p.microbatches != 0 or p.dp == 0:
        return cfg
    local = rank_batch(cfg)
    fewest, multiple = fewest_microbatches(p.schedule, p.pp), microbatch_multiple(p.schedule, p.pp)
    for count in range(fewest, local + 1):
        if local % count == 0 and count % multiple == 0:
            return dataclasses.replace(cfg, parallel=dataclasses.replace(p, microbatches=count))
    raise ConfigError(
        f"[parallel] microbatches = 0 takes the fewest micro-batches that divide the per-rank batch "
        f"global_batch_size / (dp x ep) = {local} and that schedule = '{p.schedule}' runs on pp = {p.pp} stages "
        f"(at least {fewest}{f', a multiple of {multiple}' if multiple > 1 else ''}); none does. Raise [train] "
        f"global_batch_size, lower pp or dp, or set microbatches."
    )


MIXTURE_KEYS = ("path", "weight", "text_key")
DATA_FORMATS = ("text", "prompt_response", "chat")


def _validate_mixture(d: DataConfig, source: str) -> None:
    """``[data] sources``: tables of a non-empty path, a positive weight and an optional text_key."""
    _require(
        not d.sources or d.source == "builtin",
        f"{source}: [data] source = '{d.source}' and [data] sources are both set; put every source in sources.",
    )
    for i, entry in enumerate(d.sources):
        where = f"{source}: [data] sources[{i}]"
        for key in entry:
            _require(key in MIXTURE_KEYS, f"{where} has unknown key '{key}'; valid keys: "
                     f"{', '.join(MIXTURE_KEYS)}." + _closest(key, MIXTURE_KEYS))
        _require(isinstance(entry.get("path"), str) and entry["path"] != "",
                 f"{where} needs a path (a string), e.g. {{path = \"data/web\", weight = 0.7}}.")
        weight = entry.get("weight")
        _require(
            isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight) and weight > 0,
            f"{where} weight must be a positive number, got {weight!r}.",
        )
        _require(isinstance(entry.get("text_key", ""), str), f"{where} text_key must be a string.")


def validate(cfg: Config, source: str = "<recipe>") -> None:
    """Checks of single values and choices; :func:`meshtron.parallel.layout.validate_layout` fits the
    layout to the ranks."""
    for name in _SECTION_TYPES:
        _check_numbers(name, getattr(cfg, name), source)
    _validate_model(cfg.model, source)
    t = cfg.train
    _require_choice(source, "[train] dtype", t.dtype, DTYPES)
    _validate_fp8(cfg, source)
    for key in ("steps", "global_batch_size", "seq_len", "log_every", "loss_chunk_tokens", "eval_steps"):
        _require(getattr(t, key) >= 1, f"{source}: [train] {key} must be >= 1, got {getattr(t, key)}.")
    _require(t.lr > 0, f"{source}: [train] lr must be > 0, got {t.lr}.")
    _require(
        t.collective_timeout_s > 0,
        f"{source}: [train] collective_timeout_s must be > 0 seconds, got {t.collective_timeout_s}.",
    )
    _require(
        0 <= t.hang_timeout_s < t.collective_timeout_s,
        f"{source}: [train] hang_timeout_s must be >= 0 (0: automatic) and shorter than collective_timeout_s "
        f"({t.collective_timeout_s}), got {t.hang_timeout_s}: a collective that times out first ends the job "
        "before the hang report.",
    )
    _require_choice(source, "[train] on_nonfinite", t.on_nonfinite, NONFINITE_POLICIES)
    _require_choice(source, "[train] memory_check", t.memory_check, MEMORY_CHECKS)
    _require(
        not t.profile_steps or (len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1] <= t.steps),
        f"{source}: [train] profile_steps must be [first, last] with 1 <= first <= last <= steps ({t.steps}), "
        f"got {t.profile_steps}; use [] for no profile.",
    )
    _require(t.min_lr <= t.lr, f"{source}: [train] min_lr ({t.min_lr}) must not exceed lr ({t.lr}).")
    for key in ("beta1", "beta2"):
        _require(getattr(t, key) < 1, f"{source}: [train] {key} must be in [0, 1), got {getattr(t, key)}.")
    _validate_layout(cfg, source)
    d = cfg.data
    _require(bool(d.source), f"{source}: [data] source is empty; use 'builtin' or a path to text.")
    _validate_mixture(d, source)
    _require_choice(source, "[data] format", d.format, DATA_FORMATS)
    _require(
        not t.eval_every or bool(d.eval_source),
        f"{source}: [train] eval_every = {t.eval_every} needs [data] eval_source (held-out data, e.g. a .txt or "
        ".jsonl file); set it, or set eval_every = 0.",
    )
    _require(
        d.tokenizer != "bytes" or cfg.model.vocab_size >= 256,
        f"{source}: [data] tokenizer 'bytes' needs [model] vocab_size >= 256, got {cfg.model.vocab_size}.",
    )
