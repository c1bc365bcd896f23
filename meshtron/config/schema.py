"""The recipe's typed schema: one dataclass per section, each key a field declared with :func:`recipe_key`.

A recipe is a TOML file with the sections ``[model]``, ``[parallel]``, ``[train]``, ``[data]`` and
``[checkpoint]``. ``[model]`` keys are the HuggingFace ``config.json`` names so a published config
maps onto a recipe one to one. This module only declares the keys, their defaults and meanings (which
docs/reference.md is generated from); reading a recipe is :mod:`meshtron.config.loading`, checking one
:mod:`meshtron.config.checks`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def recipe_key(default: Any, meaning: str) -> Any:
    """A recipe key's dataclass field: its default and its one-line meaning (Markdown; links are relative to
    docs/), which ``python -m meshtron.config.reference --write`` renders into docs/reference.md."""
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
        "weight of the load-balancing auxiliary loss (Switch, per MoE layer, averaged over layers and micro-batches)",
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

    num_nextn_predict_layers: int = recipe_key(
        0,
        "multi-token prediction modules (DeepSeek-V3's MTP): module k takes module k - 1's hidden states (k = 1: "
        "the last block's) and the embedding of the token k ahead through its own decoder block and the shared "
        "LM head to predict the token k + 1 ahead; stored as layers `num_hidden_layers + k - 1`; 0 turns it off "
        "([Multi-token prediction](training.md#multi-token-prediction))",
    )
    mtp_loss_coef: float = recipe_key(
        0.1,
        "weight λ of the MTP losses: a step minimizes the next-token loss + λ × the mean of the modules' losses "
        "(DeepSeek-V3: 0.3, then 0.1); not an HF key",
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

    @property
    def mtp_layers(self) -> range:
        """Global indices of the multi-token prediction modules, after the decoder layers."""
        return range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen2-MoE's rule: sparse every ``decoder_sparse_step`` layers unless listed as MLP-only."""
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


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
    virtual_stages: int = recipe_key(1, "model chunks per pipeline rank (`interleaved`; `zbv` and `dualpipev` need 2)")
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
        "with `op`: `save_matmuls` keeps every weight GEMM's, fused attention's and collective's output and recomputes "
        "norms, RoPE, SwiGLU's activation and residual adds; `alternate_matmuls` (torchtitan's) also "
        "recomputes every second matmul of a block; `parts`: as `save_matmuls`, but the parts `ac_parts` "
        "names are recomputed whole (Megatron's `recompute_modules`)",
    )
    ac_parts: list[str] = recipe_key(
        [],
        'with `ac_policy = "parts"`: the parts of each block recomputed whole, of `core_attn` (the attention '
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
        "all-gather, gradients copied back after their reduce-scatter); needs `data_parallel` `fsdp` or `hsdp`; "
        "`none`: all on the device (see [Training](training.md#host-memory-offload))",
    )
    offload_activations: bool = recipe_key(
        False,
        "send the tensors each block saves for backward to host memory after its forward and back in its "
        "backward (on CUDA on a side stream, overlapping compute); blocks recomputed by "
        "`activation_checkpointing` keep their inputs on the device instead",
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

    @property
    def sizes(self) -> dict[str, int]:
        """The five mesh sizes in the mesh's order, ep as its factor in the world size (1 when folded)."""
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "ep": self.mesh_ep, "tp": self.tp}

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.mesh_ep * self.tp

    def options(self) -> dict[str, Any]:
        """The keys besides the five sizes that differ from their defaults."""
        defaults = ParallelConfig()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _SIZES and getattr(self, f.name) != getattr(defaults, f.name)
        }

    def overrides(self) -> list[str]:
        """The ``--parallel.key value`` arguments that give a recipe this layout: the five sizes, then every
        other key that differs from its default (values in TOML, as a recipe writes them)."""
        keys = {k: getattr(self, k) for k in _SIZES} | self.options()
        return [arg for k, v in keys.items() for arg in (f"--parallel.{k}", _toml_value(v))]

    @property
    def name(self) -> str:
        """A short name for test ids and folders: the sizes above 1, then the options, e.g.
        ``pp2_dp2_tp2_sp_zbv_v2_mb4`` (the schedule named whenever pp > 1)."""
        words = [f"{k}{getattr(self, k)}" for k in _SIZES if getattr(self, k) > 1]
        options = self.options()
        if self.pp > 1:
            options.setdefault("schedule", self.schedule)
        for key, value in options.items():
            if value is True or isinstance(value, str):
                words.append(key if value is True else value)
            else:
                joined = "+".join(map(str, value)) if isinstance(value, list) else value
                words.append(f"{_SHORT.get(key, key + '_')}{joined}")
        return "_".join(words) or "single"


_SIZES = ("pp", "dp", "cp", "ep", "tp")
_SHORT = {"virtual_stages": "v", "microbatches": "mb", "etp": "etp"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


@dataclass
class TrainConfig:
    """The run: its length and batch, the optimizer, logging, evaluation, profiling and failure handling."""

    steps: int = recipe_key(10, "optimizer steps")
    seed: int = recipe_key(0, "seed for initialization and data order")
    dtype: str = recipe_key("float32", "training dtype: `float32` or `bfloat16`")
    fp8: str = recipe_key(
        "none",
        "FP8 GEMMs in the blocks' attention and MLP linears and routed experts (torchao, the `meshtron[fp8]` "
        "extra): `none`, `tensorwise`, `rowwise`, `rowwise_with_gw_hp` or `mxfp8`; parameters, embedding, LM head, "
        "router "
        "and norms stay in `dtype` (see [FP8](fp8.md))",
    )
    global_batch_size: int = recipe_key(8, "sequences per step over all ranks; divisible by dp × ep × microbatches")
    seq_len: int = recipe_key(128, "tokens per sequence")
    lr: float = recipe_key(3e-4, "peak learning rate")
    min_lr: float = recipe_key(3e-5, "lowest learning rate the schedule decays to")
    warmup_steps: int = recipe_key(2, "linear warm-up steps")
    optimizer: str = recipe_key(
        "adamw",
        "`adamw`, or `muon`: Muon on the blocks' weight matrices (each routed expert's on its own), AdamW on "
        "embeddings, head, norms, biases, routers and gates ([Optimizers](optimizers.md))",
    )
    weight_decay: float = recipe_key(0.1, "decoupled weight decay of the matrices (AdamW's and Muon's)")
    beta1: float = recipe_key(0.9, "AdamW beta1")
    beta2: float = recipe_key(0.95, "AdamW beta2")
    muon_momentum: float = recipe_key(0.95, "Muon's momentum")
    muon_nesterov: bool = recipe_key(True, "Muon orthogonalizes the Nesterov blend `g + momentum × m`, else `m`")
    muon_ns_steps: int = recipe_key(5, "Newton–Schulz iterations orthogonalizing each matrix's update")
    muon_ns_coefficients: list[float] = recipe_key(
        [3.4445, -4.775, 2.0315], "the quintic Newton–Schulz iteration's (a, b, c): `X <- aX + (bA + cA²)X`, `A = XXᵀ`"
    )
    muon_scale: str = recipe_key(
        "adamw_rms",
        "the orthogonal update's scale: `adamw_rms` (0.2 √max(rows, cols), AdamW's update RMS, so `lr` and "
        "`weight_decay` carry over) or `spectral` (√max(1, fan_out / fan_in))",
    )
    muon_adamw_lr: float = recipe_key(
        0.0, "peak learning rate of the parameters Muon leaves to AdamW (scheduled like `lr`); 0: `lr`"
    )
    max_grad_norm: float = recipe_key(1.0, "gradient clipping threshold (global norm)")
    log_every: int = recipe_key(
        1,
        "steps between metric lines; the host reads the device's loss and gradient norm on those steps (and on "
        "checkpoint and eval steps) only and runs ahead of the device between them, a non-finite step being "
        "stopped at or reported at the next read ([Training](training.md#the-step-clock-and-host-reads))",
    )
    output_dir: str = recipe_key("runs/default", "where `metrics.jsonl`, checkpoints and `pids/rank-R.pid` go")
    collective_timeout_s: float = recipe_key(
        600.0, "a collective waiting longer than this fails (a dead or stuck rank) instead of hanging"
    )
    hang_timeout_s: float = recipe_key(
        0.0,
        "a step running longer is reported as a hang (`meshtron/watch/watchdog.py`: which rank is behind, in which "
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
    prompt_key: str = recipe_key("prompt", '`format = "prompt_response"`: the field / column holding the prompt')
    response_key: str = recipe_key("response", '`format = "prompt_response"`: the field / column holding the response')
    messages_key: str = recipe_key(
        "messages",
        '`format = "chat"`: the field / column holding `[{role, content}, ...]`, rendered with the '
        "tokenizer's chat template",
    )
    eval_source: str = recipe_key("", "held-out data for evaluation (any kind `source` accepts); empty: no evaluation")
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
    every: int = recipe_key(0, "steps between checkpoints; 0 disables them. When on, the final step is always saved")
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
class TrackConfig:
    """Experiment trackers beside `metrics.jsonl`: Weights & Biases and MLflow, on rank 0, each step's record
    logged as it is written there (`meshtron/watch/trackers.py`, [Training](training.md#trackers))."""

    wandb: bool = recipe_key(
        False,
        "log every metrics record, and the resolved recipe as the run's config, to a Weights & Biases run (needs "
        "the `meshtron[wandb]` extra); a resumed run continues the same W&B run",
    )
    wandb_mode: str = recipe_key(
        "offline",
        "`offline`: the run is written under `<output_dir>/wandb` for `wandb sync` to upload later; `online`: "
        "uploaded as it runs (needs `wandb login`)",
    )
    mlflow: bool = recipe_key(
        False,
        "log every metrics record, and the resolved recipe as the run's parameters, to an MLflow run (needs the "
        "`meshtron[mlflow]` extra); a resumed run continues the same MLflow run",
    )
    mlflow_uri: str = recipe_key(
        "", "MLflow tracking URI (a server, or `sqlite:///path.db`); empty: `sqlite:///<output_dir>/mlflow.db`"
    )
    project: str = recipe_key("meshtron", "the W&B project and the MLflow experiment")
    run_name: str = recipe_key("", "the run's name in both; empty: the output folder's name")
    tags: list[str] = recipe_key([], "tags of the run in both")


@dataclass
class Config:
    """A recipe is a TOML file with the six sections below; keys that a recipe leaves out take the
    default. `[model]` keys are the HuggingFace `config.json` names, so a published config maps onto a
    recipe one to one. Unknown sections or keys, wrong types and impossible values are rejected with an
    error naming the file, the key and the fix, before any process group starts."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    track: TrackConfig = field(default_factory=TrackConfig)


# The recipe's sections in order: what a TOML table may be called, and the reference page's order.
SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "track": TrackConfig,
}
