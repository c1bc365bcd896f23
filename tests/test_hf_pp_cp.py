"""pp and cp for transformers models (meshtron.hf.pipeline / meshtron.hf.context): loss and gradients
equal the unparallelized transformers model's on the full batch (float32: 1e-5 loss, 1e-4 gradients).

One 4-rank launch for parity: cp 2 (meshtron's attention through transformers' attention interface:
ring, a2a and allgather) with dp 2 and with tp 2 (+SP); pp 2 with 1F1B, interleaved 1F1B (2 virtual
stages) and the zero-bubble zb1p, zbv and dualpipev with dp 2 and tp 2 (+SP), and pp 2 x cp 2; over
Llama, Qwen2 (tied embeddings), Qwen3 (q/k norms), Mistral, Phi3 (fused projections), Gemma 2 (scaled embedding,
soft-capped logits) and Gemma 3 (per-layer-type RoPE); and MoE families with
their aux loss (Qwen2-MoE, Qwen3-MoE, Mixtral) under pp with ep, dp or cp, against the unpipelined model run
per global micro-batch (the aux loss is counted once per forward). Parts found by structure: NanoChat's one norm
on the embeddings and after the blocks (cp 2 x tp 2 + SP, pp 2 x tp 2 + SP under 1F1B and zbv; with weights of its
own: parity at dp 2 x tp 2, refused under SP and pp) and BioGPT's blocks without _no_split_modules and MLP
projections directly in its blocks (cp 2 x tp 2 + SP).

``[model] hf_model`` (meshtron.hf.runner): a 1-rank launch trains a Llama folder (with safetensors), a
Qwen2 and Qwen2-MoE, Qwen3-MoE and Mixtral folders (config.json only: seeded init; the MoE ones with
their aux loss) for the reference loss and held-out loss curves; a 4-rank launch the same recipes on
pp2 x cp2, cp2 x tp2 + SP, dp2 x tp2 (checkpoint, export) and zbv pp2 x tp2 (tied Qwen2, both ends on
rank 0), and resumes the dp2 x tp2 checkpoint resharded onto pp2 x tp2; an 8-rank launch pp2 x cp2 x
tp2 (Llama), dp2 x ep2 x tp2 (Qwen2-MoE) and, for each MoE family, pp2 x dp2 x ep2 and pp2 x ep2 x tp2
(Qwen3-MoE + SP, Mixtral's pp2 x dp2 x ep2 interleaved), Gemma 2 and Gemma 3 (config.json only) on pp2 x dp2 x
tp2. Losses within 1e-4. In the same launches a Qwen2 folder trains in FP8 (``[train] fp8 =
"rowwise_with_gw_hp"``) on dp4, dp2 x tp2 + SP, pp2 x cp2 (zb1p) and pp2 x dp2 x tp2, and a Qwen2-MoE folder
(experts in float8) on dp2 x ep2, ep4 folded over dp2 x tp2 + SP and pp2 x dp2 x ep2, each against its
single-rank FP8 run and that run's own one-ulp noise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from meshtron import HFPipelineRunner, parallelize_hf_model
from meshtron.config import ConfigError, ParallelConfig
from meshtron.hf.context import RING, next_token_labels
from meshtron.hf.discover import hf_parts
from meshtron.hf.runner import parallelize_options
from meshtron.mesh import batch_mesh
from meshtron.models.qwen2 import LMHead
from meshtron.testing import (
    HF_TINY_FAMILIES,
    HF_TINY_SIZES,
    LOSS_CURVE_RTOL,
    LaunchedRuns,
    assert_parity,
    cached_recipe_mesh,
    checks_needed,
    count_calls,
    launch_checks,
    launch_tests,
    launched_beside,
    launched_check_results,
    layout_mesh,
    units_with_parameters,
    whole_weight_passes,
)

SMALL = dict(HF_TINY_SIZES, num_hidden_layers=4)
# MoE folders with their aux loss weighted enough to matter (transformers adds it once per forward).
_AUX = dict(num_key_value_heads=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)
MODELS = {
    **HF_TINY_FAMILIES,
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(_AUX, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_AUX, num_experts=4, moe_intermediate_size=32)),
    "mixtral": ("MixtralConfig", dict(_AUX, num_local_experts=4)),
    # Scaled embedding, tied; a sliding window shorter than the sequence; a cap low enough to bend the logits.
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=4, sliding_window=8, final_logit_softcapping=2.0)),
    # Sliding and full layers on both stages, each with its own RoPE base (Gemma 3's local rotary).
    "gemma3": (
        "Gemma3TextConfig",
        dict(num_key_value_heads=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
    ),
    # Parts found by structure: NanoChat's one weightless norm runs on the embeddings and after the blocks;
    # BioGPT declares no _no_split_modules (its blocks are the one list of num_hidden_layers modules).
    "nanochat": ("NanoChatConfig", dict(num_key_value_heads=4)),
    "biogpt": ("BioGptConfig", dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, activation_dropout=0.0)),
}
# Gradients zero in exact arithmetic (assert_parity's ``vanishing``): the key biases of a family without RoPE.
VANISHING = {"biogpt": ("k_proj.bias",)}
ROWS, SEQ = 8, 16  # the global batch
ROOT = Path(__file__).resolve().parents[1]


def _model(arch: str, **overrides):
    """The same random model on every rank (transformers' init plus noise on norms and biases)."""
    import transformers

    cls, extra = MODELS[arch]
    torch.manual_seed(len(arch))
    cfg = getattr(transformers, cls)(**{**SMALL, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.train()


def _gpt_oss():
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(
        **{**SMALL, "intermediate_size": 32}, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _batch(seed: int):
    """Ids and labels with a different number of ignored labels per row (prompt and right padding)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (ROWS, SEQ), generator=gen)
    labels = ids.clone()
    for row in range(ROWS):
        labels[row, : row % 5] = -100
        labels[row, SEQ - row % 3 :] = -100
    return ids, labels


def _rows(t: torch.Tensor, mesh) -> torch.Tensor:
    data = batch_mesh(mesh)
    per = ROWS // data.size()
    return t[data.get_local_rank() * per : (data.get_local_rank() + 1) * per]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _reference(arch: str, ids, labels, microbatches: list[torch.Tensor] | None = None):
    """Loss and gradients of the whole batch, or summed over ``microbatches`` (row indices, each a
    forward of its own, so that an MoE aux loss is counted once per micro-batch as in a pipeline)."""
    ref = _model(arch)
    tokens = (next_token_labels(labels) != -100).sum()
    total = torch.zeros(())
    for rows in microbatches or [torch.arange(ROWS)]:
        loss = ref(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=tokens).loss
        loss.backward()
        total += loss.detach()
    return total, {name: p.grad for name, p in ref.named_parameters(remove_duplicate=False)}


def _global_microbatches(mesh, microbatches: int) -> list[torch.Tensor]:
    """Rows of the pipeline's global micro-batches: micro-batch j of every data rank's rows."""
    data = batch_mesh(mesh).size()
    per, size = ROWS // data, ROWS // data // microbatches
    return [
        torch.cat([torch.arange(r * per + j * size, r * per + (j + 1) * size) for r in range(data)])
        for j in range(microbatches)
    ]


# (model, layout)
CP_CASES = [
    ("llama", ParallelConfig(dp=2, cp=2)),
    ("qwen2", ParallelConfig(cp=2, tp=2, sp=True)),
    # 1 kv head per tp rank, repeated for a2a
    ("qwen3", ParallelConfig(cp=2, tp=2, cp_comm_type="a2a", activation_checkpointing="full")),
    ("mistral", ParallelConfig(dp=2, cp=2, cp_comm_type="allgather", data_parallel="replicate")),
    ("phi3", ParallelConfig(cp=2, tp=2)),
    ("biogpt", ParallelConfig(cp=2, tp=2, sp=True)),  # learned positions: the global ones of this rank's tokens
    ("nanochat", ParallelConfig(cp=2, tp=2, sp=True)),  # the norm on the whole embeddings and on SP's slices
]


def check_context_parallel(_tmp: str) -> None:
    """model(input_ids, labels) with whole sequences: the model shards them over cp, the attention is the
    ring, the loss is the global batch's mean token loss and the gradients the full model's."""
    for index, (arch, layout) in enumerate(CP_CASES):
        where = f"cp {arch} {layout.name} (weights seed {len(arch)}, batch seed {index})"
        ids, labels = _batch(seed=index)
        ref_loss, grads = _reference(arch, ids, labels)
        mesh = layout_mesh(layout)
        model = parallelize_hf_model(_model(arch), mesh, **parallelize_options(layout))
        assert model.config._attn_implementation == RING, where
        out = model(input_ids=_rows(ids, mesh), labels=_rows(labels, mesh))
        assert out.logits.shape[1] == SEQ // mesh["cp"].size(), where  # this rank's tokens only
        out.loss.backward()
        held = [(name, p.grad) for name, p in model.named_parameters()]
        assert assert_parity(where, out.loss, ref_loss, held, grads, vanishing=VANISHING.get(arch, ())), (
            f"{where}: no parameters"
        )


# (model, layout): 4 micro-batches per step, microbatches = 4 / (dp x ep); interleaved, zbv and dualpipev run 2
# virtual stages per rank
PP_CASES = [
    ("llama", ParallelConfig(pp=2, dp=2, schedule="1f1b", microbatches=2, activation_checkpointing="full")),
    # tied embedding and head on different ranks
    ("qwen2", ParallelConfig(pp=2, tp=2, sp=True, schedule="interleaved", virtual_stages=2, microbatches=4)),
    ("qwen3", ParallelConfig(pp=2, tp=2, schedule="1f1b", microbatches=4)),
    ("mistral", ParallelConfig(pp=2, dp=2, schedule="interleaved", virtual_stages=2, microbatches=2)),
    ("phi3", ParallelConfig(pp=2, tp=2, schedule="interleaved", virtual_stages=2, microbatches=4)),
    ("llama", ParallelConfig(pp=2, cp=2, schedule="interleaved", virtual_stages=2, microbatches=4)),
    ("qwen3", ParallelConfig(pp=2, cp=2, cp_comm_type="a2a", schedule="1f1b", microbatches=4)),
    # Zero-bubble: W restarted inside HF blocks, under FSDP; a V holds a tied embedding and head on rank 0.
    ("llama", ParallelConfig(pp=2, dp=2, schedule="zb1p", microbatches=2)),
    ("qwen2", ParallelConfig(pp=2, tp=2, sp=True, schedule="zbv", virtual_stages=2, microbatches=4)),
    ("qwen3", ParallelConfig(pp=2, cp=2, cp_comm_type="a2a", schedule="dualpipev", virtual_stages=2, microbatches=4)),
    # MoE with aux loss (router statistics relayed between stages), experts over ep inside a stage. Zero-bubble
    # without dispatched experts: their fused gate_up_proj feeds two grouped GEMMs, so W re-runs the whole backward.
    ("qwen2_moe", ParallelConfig(pp=2, dp=2, schedule="zb1p", microbatches=2)),
    (
        "qwen3_moe",
        ParallelConfig(
            pp=2, ep=2, schedule="interleaved", virtual_stages=2, microbatches=2, activation_checkpointing="full"
        ),
    ),
    ("mixtral", ParallelConfig(pp=2, ep=2, schedule="1f1b", microbatches=2)),
    # the relay handed over at the V's turn; tokens over cp
    ("mixtral", ParallelConfig(pp=2, cp=2, schedule="zbv", virtual_stages=2, microbatches=4)),
    # What Gemma does around its blocks: scaled embedding on the first stage, soft-capped fused loss on the last.
    ("gemma2", ParallelConfig(pp=2, tp=2, sp=True, schedule="1f1b", microbatches=4)),
    ("gemma3", ParallelConfig(pp=2, dp=2, schedule="interleaved", virtual_stages=2, microbatches=2)),
    # NanoChat's norm on the first stage's embeddings and the last stage's output; under zbv both on rank 0.
    ("nanochat", ParallelConfig(pp=2, tp=2, sp=True, schedule="1f1b", microbatches=4)),
    ("nanochat", ParallelConfig(pp=2, tp=2, sp=True, schedule="zbv", virtual_stages=2, microbatches=4)),
]


def check_pipeline(_tmp: str) -> None:
    """Our schedules and executor over the HF blocks: the step's loss on every rank and each stage's
    gradients equal the full model's (parameter names are transformers')."""
    for index, (arch, layout) in enumerate(PP_CASES):
        where = f"pp {arch} {layout.name} (weights seed {len(arch)}, batch seed {10 + index})"
        ids, labels = _batch(seed=10 + index)
        mesh = layout_mesh(layout)
        ref_loss, grads = _reference(arch, ids, labels, _global_microbatches(mesh, layout.microbatches))
        stage = parallelize_hf_model(_model(arch), mesh, **parallelize_options(layout))
        runner = HFPipelineRunner(stage, mesh)
        assert runner.module is stage, where
        whole = whole_weight_passes(runner.executor)
        loss = runner.forward_backward(_rows(ids, mesh), _rows(next_token_labels(labels), mesh))
        assert not whole, f"{where}: W re-ran the whole backward for {whole}"
        held = [(name, p.grad) for name, p in runner.module.named_parameters()]  # this stage's
        assert assert_parity(where, loss, ref_loss, held, grads, vanishing=VANISHING.get(arch, ())), (
            f"{where}: no parameters"
        )
        head = hf_parts(runner.module).head
        assert head is None or isinstance(head, LMHead), f"{where}: the last stage's loss is the fused head's"
        blocks = {int(name.split(".")[2]) for name, _ in runner.module.named_parameters() if ".layers." in name}
        assert len(blocks) == SMALL["num_hidden_layers"] // 2, f"{where}: this rank holds blocks {blocks}"


def check_errors(_tmp: str) -> None:
    from transformers import AutoModelForCausalLM, CohereConfig, GraniteConfig

    mesh = layout_mesh(ParallelConfig(dp=2, cp=2))
    with pytest.raises(ConfigError, match=r"multiple of 2 \* cp = 4 chunks"):
        parallelize_hf_model(_model("llama"), mesh)(input_ids=torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ConfigError, match="sliding_window = 8 is shorter than the sequence \\(16 tokens\\)"):
        parallelize_hf_model(_model("mistral", sliding_window=8), mesh)(input_ids=torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ConfigError, match="pass no attention_mask"):
        ids = torch.zeros(2, 16, dtype=torch.long)
        parallelize_hf_model(_model("llama"), mesh)(input_ids=ids, attention_mask=torch.ones_like(ids))
    with pytest.raises(ConfigError, match="cp > 1 does not support config.attn_logit_softcapping = 50.0"):
        model = _model("llama")
        model.config.attn_logit_softcapping = 50.0
        parallelize_hf_model(model, mesh)
    with pytest.raises(ConfigError, match=r"cp > 1 does not support attention sinks \(GptOssAttention.sinks\)"):
        parallelize_hf_model(_gpt_oss(), mesh)
    pp = layout_mesh(ParallelConfig(pp=2, dp=2))
    # What a stage would skip: read from the decoder's forward, or named by the config.
    granite = AutoModelForCausalLM.from_config(GraniteConfig(**SMALL))
    with pytest.raises(
        ConfigError,
        match=r"GraniteModel's forward rescaling the embeddings outside its embedding "
        r"module \('inputs_embeds = inputs_embeds \* self.embedding_multiplier'\)",
    ):
        parallelize_hf_model(granite, pp, microbatches=2)
    cohere = AutoModelForCausalLM.from_config(CohereConfig(**SMALL, eos_token_id=2))
    with pytest.raises(ConfigError, match=r"scaled logits \(Cohere\) \(config.logit_scale = 0.0625\); use pp = 1"):
        parallelize_hf_model(cohere, pp, microbatches=2)
    with pytest.raises(ConfigError, match=r"output_router_logits needs LlamaForCausalLM's attributes \['num_experts'"):
        parallelize_hf_model(_model("llama", output_router_logits=True), pp, microbatches=2)
    with pytest.raises(ConfigError, match="num_hidden_layers = 4 is fewer than pp \\* virtual_stages = 8"):
        parallelize_hf_model(_model("llama"), pp, schedule="interleaved", microbatches=2, virtual_stages=4)
    with pytest.raises(ConfigError, match="pass the stage model that parallelize_hf_model returns"):
        HFPipelineRunner(_model("llama"), pp)  # a whole model, not cut to a stage
    with pytest.raises(ConfigError, match="pp > 1 needs one rotary embedding module; BioGptForCausalLM has none"):
        parallelize_hf_model(_model("biogpt"), pp, microbatches=2)
    _check_norm_on_embeddings_with_weights()
    _check_block_proof_under_pp()


def _check_norm_on_embeddings_with_weights() -> None:
    """NanoChat's norm given weights: tp without SP keeps parity (every use whole); SP (a gradient part from
    the slices, whole from the embeddings) and pp (a copy on the first and on the last stage) are refused."""

    def weighted():
        model = _model("nanochat")
        model.model.norm = torch.nn.RMSNorm(SMALL["hidden_size"], eps=1e-6)
        with torch.no_grad():
            model.model.norm.weight.add_(torch.randn(SMALL["hidden_size"]) * 0.05)
        return model

    layout = ParallelConfig(dp=2, tp=2)
    ids, labels = _batch(seed=99)
    ref = weighted()
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    mesh = layout_mesh(layout)
    model = parallelize_hf_model(weighted(), mesh)
    out = model(input_ids=_rows(ids, mesh), labels=_rows(labels, mesh))
    out.loss.backward()
    grads = {name: p.grad for name, p in ref.named_parameters()}
    held = [(name, p.grad) for name, p in model.named_parameters()]
    assert_parity(f"nanochat, weighted norm, {layout.name}", out.loss, ref_loss, held, grads)
    with pytest.raises(ConfigError, match="SP does not support the final norm 'model.norm' also normalising"):
        parallelize_hf_model(weighted(), mesh, sp=True)
    with pytest.raises(ConfigError, match="pp > 1 does not support NanoChatModel's final norm 'model.norm' also"):
        parallelize_hf_model(weighted(), layout_mesh(ParallelConfig(pp=2, dp=2)), microbatches=2)


def _check_block_proof_under_pp() -> None:
    """The block check (meshtron.hf.prove) under pp: each stage proves the blocks it holds, and a split wrong
    on one stage only (stage 1's o_proj shard scaled on tp rank 1, as a wrong translation would leave it) is
    refused on every rank, the right stage's included (it would otherwise hang in its first collective)."""
    from unittest import mock

    from meshtron.hf import parallelize, prove

    mesh = layout_mesh(ParallelConfig(pp=2, tp=2))
    real = parallelize.apply_hf_tensor_parallel

    def wrong_on_stage_1(model, parts, tp_mesh, sp):
        real(model, parts, tp_mesh, sp)
        if "2" in parts.blocks and tp_mesh.get_local_rank() == 1:
            with torch.no_grad():
                parts.blocks["2"].self_attn.o_proj.weight.to_local().mul_(1.5)

    proved, real_prove = [], prove.prove_blocks

    def recorded(*args, **kwargs):
        proved.append([ref.index for ref in args[3]])  # the references' blocks
        return real_prove(*args, **kwargs)

    with mock.patch.object(prove, "prove_blocks", recorded):
        parallelize_hf_model(_model("llama"), mesh, sp=True, microbatches=2)
    assert proved == [[0] if mesh["pp"].get_local_rank() == 0 else [2]], f"blocks proved on this stage: {proved}"
    with mock.patch.object(parallelize, "apply_hf_tensor_parallel", wrong_on_stage_1):
        with pytest.raises(
            ConfigError,
            match=r"LlamaForCausalLM block 2 \(LlamaDecoderLayer\) split at pp 2 x tp 2 "
            r"\+ SP does not compute what it computes whole: its output differs by",
        ):
            parallelize_hf_model(_model("llama"), mesh, sp=True, microbatches=2)


@launch_tests(4, [check_errors, check_context_parallel, check_pipeline], timeout=300)
def test_hf_pp_cp_4_ranks(tmp_path):
    return (str(tmp_path),)


# ---- [model] hf_model: a transformers folder trained by meshtron.train on every layout ----

RECIPE_STEPS = 4
RECIPE_HALF = RECIPE_STEPS // 2  # evaluated after it and the last step; the resume test restarts there
# model -> layouts, run by the launch of their world size; the 1-rank run is the reference
RECIPE_LAYOUTS = {
    "llama": {
        "pp2_cp2": ParallelConfig(pp=2, cp=2),
        "cp2_tp2_sp": ParallelConfig(cp=2, tp=2, sp=True),
        "dp2_tp2": ParallelConfig(dp=2, tp=2),
        "pp2_cp2_tp2": ParallelConfig(pp=2, cp=2, tp=2),
    },
    # zbv: the tied embedding and head both on rank 0, evaluated through the V (2 pp micro-batches).
    "qwen2": {"pp2_tp2_zbv": ParallelConfig(pp=2, tp=2, schedule="zbv", virtual_stages=2, microbatches=4)},
    # MoE folders with output_router_logits: the aux loss counted once per micro-batch on every layout;
    # under pp its router statistics travel with the pipeline's boundary tensors (meshtron.hf.router).
    # dp2_ep2_tp2 gathers its FSDP units once per step (the transformers step shares MicrobatchSync).
    "qwen2_moe": {
        "dp2_ep2_tp2": ParallelConfig(dp=2, ep=2, tp=2, fsdp_gather="per_step"),
        "pp2_dp2_ep2": ParallelConfig(pp=2, dp=2, ep=2),
        "pp2_ep2_tp2": ParallelConfig(pp=2, ep=2, tp=2),
    },
    "qwen3_moe": {
        "pp2_dp2_ep2": ParallelConfig(pp=2, dp=2, ep=2),
        "pp2_ep2_tp2_sp": ParallelConfig(pp=2, ep=2, tp=2, sp=True),
    },
    "mixtral": {
        "pp2_dp2_ep2_interleaved": ParallelConfig(pp=2, dp=2, ep=2, schedule="interleaved", virtual_stages=2),
        "pp2_ep2_tp2": ParallelConfig(pp=2, ep=2, tp=2),
    },
    # The first stage's scaled embedding, the last stage's soft-capped fused loss (Gemma 2), per-type RoPE (Gemma 3).
    "gemma2": {"pp2_dp2_tp2": ParallelConfig(pp=2, dp=2, tp=2)},
    "gemma3": {"pp2_dp2_tp2": ParallelConfig(pp=2, dp=2, tp=2)},
    # [train] fp8 = "rowwise_with_gw_hp" (FP8_MODELS): dp (FSDP), tp + SP, pp under a zero-bubble schedule with
    # cp, and pp 1F1B with dp x tp; the single-rank run from weights one float32 ulp up (qwen2_fp8_ulp)
    # measures FP8's own rounding noise.
    "qwen2_fp8": {
        "dp4": ParallelConfig(dp=4),
        "dp2_tp2_sp": ParallelConfig(dp=2, tp=2, sp=True),
        "pp2_cp2_zb1p": ParallelConfig(pp=2, cp=2, schedule="zb1p"),
        "pp2_dp2_tp2": ParallelConfig(pp=2, dp=2, tp=2),
    },
    # Its routed experts in float8 through meshtron's dispatch (on the single rank too): ep, ep folded over
    # dp x tp + SP, pp x dp x ep.
    "qwen2_moe_fp8": {
        "dp2_ep2": ParallelConfig(dp=2, ep=2),
        "dp2_tp2_ep4_folded_sp": ParallelConfig(dp=2, ep=4, tp=2, sp=True, fold_ep=True),
        "pp2_dp2_ep2": ParallelConfig(pp=2, dp=2, ep=2),
    },
    "qwen2_fp8_ulp": {},
    "qwen2_moe_fp8_ulp": {},
}
# FP8 model -> its twin from weights one float32 ulp up (single rank only)
FP8_TWINS = {"qwen2_fp8": "qwen2_fp8_ulp", "qwen2_moe_fp8": "qwen2_moe_fp8_ulp"}
FP8_MODELS = {*FP8_TWINS, *FP8_TWINS.values()}
FP8 = ["--train.fp8", "rowwise_with_gw_hp"]
EVAL = ["--data.eval_source", "builtin", "--train.eval_every", str(RECIPE_HALF), "--train.eval_steps", "1"]


def _recipe_folders(root: Path) -> dict[str, str]:
    """A tiny Llama with weights (safetensors); a Qwen2, three MoE families (their aux loss weighted enough
    to matter), Gemma 2 (a logit cap low enough to bend the logits) and Gemma 3 (sliding and full layers
    on each stage) with only a config.json (seeded random init); windows shorter than the sequence."""
    import transformers

    folders = {}
    aux = dict(output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)
    moe = dict(aux, num_key_value_heads=2, num_experts=4, moe_intermediate_size=32)
    for name, cls, extra in (
        ("llama", "LlamaConfig", dict(num_key_value_heads=2)),
        ("qwen2", "Qwen2Config", dict(num_key_value_heads=4, tie_word_embeddings=True)),
        ("qwen2_moe", "Qwen2MoeConfig", dict(moe, shared_expert_intermediate_size=64)),
        ("qwen3_moe", "Qwen3MoeConfig", moe),
        ("mixtral", "MixtralConfig", dict(aux, num_key_value_heads=2, num_local_experts=4)),
        ("gemma2", "Gemma2Config", dict(num_key_value_heads=2, sliding_window=16, final_logit_softcapping=3.0)),
        (
            "gemma3",
            "Gemma3TextConfig",
            dict(num_key_value_heads=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2),
        ),
    ):
        cfg = getattr(transformers, cls)(**{**SMALL, "vocab_size": 256, "max_position_embeddings": 256}, **extra)
        folders[name] = str(root / name)
        if name == "llama":
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folders[name])
        else:
            cfg.save_pretrained(folders[name])
    # FP8: 4 KV heads of 8 keep k_proj / v_proj at 16 features per rank under tp 2 (a float8 GEMM's multiple).
    fp8 = {**SMALL, "vocab_size": 256, "max_position_embeddings": 256, "num_key_value_heads": 4}
    _save_with_ulp_twin(transformers.Qwen2Config(**fp8, tie_word_embeddings=True), root, "qwen2_fp8", folders)
    _save_with_ulp_twin(
        transformers.Qwen2MoeConfig(
            **fp8, **aux, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64
        ),
        root,
        "qwen2_moe_fp8",
        folders,
    )
    return folders


def _save_with_ulp_twin(cfg, root: Path, name: str, folders: dict) -> None:
    """A folder with seeded weights, and its FP8_TWINS twin with every weight one float32 ulp up."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    folders[name] = str(root / name)
    model.save_pretrained(folders[name])
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.nextafter(param, torch.full_like(param, torch.inf)))
    folders[FP8_TWINS[name]] = str(root / FP8_TWINS[name])
    model.save_pretrained(folders[FP8_TWINS[name]])


def _train_hf(folder: str, out: Path, layout: ParallelConfig, extra: list[str] = ()):
    from meshtron.config import load_config
    from meshtron.hf.runner import with_hf_model
    from meshtron.parallel.layout import validate_layout
    from meshtron.train import Trainer

    args = [
        "--model.hf_model",
        folder,
        "--train.steps",
        str(RECIPE_STEPS),
        "--parallel.microbatches",
        "2",
        "--train.output_dir",
        str(out),
        "--data.cache_dir",
        str(out.parent.parent / "token_cache"),
        *EVAL,
    ]
    args += layout.overrides()
    cfg = with_hf_model(load_config(ROOT / "recipes" / "debug_dense.toml", args + list(extra)))
    validate_layout(cfg, torch.distributed.get_world_size())
    trainer = Trainer(cfg, cached_recipe_mesh(cfg))
    trainer.fit()
    return trainer


def recipe_single_rank(root: str, folders: dict) -> None:
    for name, folder in folders.items():
        _train_hf(folder, Path(root) / name / "single", ParallelConfig(), FP8 if name in FP8_MODELS else [])


def recipe_layouts(root: str, folders: dict) -> None:
    """Every layout of this launch's world size; the dp2 x tp2 Llama run checkpoints at RECIPE_HALF and exports."""
    root = Path(root)
    for name, folder in folders.items():
        for layout, parallel in RECIPE_LAYOUTS[name].items():
            if parallel.world_size != torch.distributed.get_world_size():
                continue
            exports = layout == "dp2_tp2"
            extra = (
                [
                    "--checkpoint.every",
                    str(RECIPE_HALF),
                    "--checkpoint.dir",
                    str(root / "ckpt"),
                    "--checkpoint.export_hf",
                    str(root / "export"),
                ]
                if exports
                else []
            )
            extra += FP8 if name in FP8_MODELS else []
            trainer = _train_hf(folder, root / name / layout, parallel, extra)
            if exports:
                _assert_exported(_gathered(trainer.runner.module), root / "export")


def _gathered(module) -> dict[str, torch.Tensor]:
    """Every parameter's full value, gathered by DTensor.full_tensor (collective), not by the state-dict
    gather the export itself uses."""
    return {name: _full(p).detach().cpu() for name, p in module.named_parameters()}


def _assert_exported(trained: dict[str, torch.Tensor], folder: Path) -> None:
    """The exported folder holds exactly the trained model's values (checked on rank 0, the writer). That
    every weight differs from the source folder's, all the test in the parent can see, would still pass a
    weight exported from another step or with its tp shards in the wrong order."""
    from safetensors.torch import load_file

    if torch.distributed.get_rank() != 0:
        return
    saved = {name: t for path in sorted(folder.glob("*.safetensors")) for name, t in load_file(path).items()}
    assert set(saved) == set(trained), f"exported {sorted(set(saved) ^ set(trained))} (only one side)"
    differ = [name for name, t in trained.items() if not torch.equal(saved[name], t)]
    assert not differ, f"exported values differ from the trained model's: {differ}"


def recipe_resume(root: str, folders: dict) -> None:
    """A fresh trainer resumes dp2 x tp2's step-RECIPE_HALF checkpoint resharded onto pp2 x tp2 and runs the
    remaining steps."""
    root = Path(root)
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(root / "ckpt" / f"step-{RECIPE_STEPS:08d}")  # as if the run had stopped after RECIPE_HALF
    torch.distributed.barrier()
    _train_hf(
        folders["llama"],
        root / "llama" / "resumed",
        ParallelConfig(pp=2, tp=2),
        ["--checkpoint.resume", "true", "--checkpoint.dir", str(root / "ckpt")],
    )


def recipe_gathers_once_per_step(root: str, folders: dict) -> None:
    """The transformers step with ``fsdp_gather = "per_step"`` (dp2_ep2_tp2 above, whose losses follow the
    single-rank run's): each FSDP unit all-gathered and reduce-scattered once per step of 2 micro-batches,
    the second step too (the native step's per-micro-batch counts: ``tests/test_pipeline_parallel.py``)."""
    from meshtron.config import load_config
    from meshtron.hf.runner import with_hf_model
    from meshtron.runner import build_runner

    args = ["--model.hf_model", folders["qwen2_moe"], "--parallel.microbatches", "2"]
    args += RECIPE_LAYOUTS["qwen2_moe"]["dp2_ep2_tp2"].overrides()
    cfg = with_hf_model(load_config(ROOT / "recipes" / "debug_dense.toml", args))
    mesh = cached_recipe_mesh(cfg)
    runner = build_runner(cfg, mesh, torch.device("cpu"))
    units = units_with_parameters(runner.module)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    for step in range(2):
        runner.module.zero_grad(set_to_none=True)
        tp = mesh["tp"].get_group()  # MoE under tp gathers tokens over tp with the same call
        with (
            count_calls(torch.distributed, "all_gather_single", skip_group=tp) as gathers,
            count_calls(torch.distributed, "reduce_scatter_single", skip_group=tp) as reduces,
        ):
            runner.forward_backward(ids, ids)
        assert len(gathers) == len(reduces) == units, (step, len(gathers), len(reduces), units)


def _losses(out: Path, key: str = "loss") -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if key in r]


RECIPE_LAUNCHES = {
    1: [recipe_single_rank],
    4: [recipe_layouts, recipe_resume],
    8: [recipe_layouts, recipe_gathers_once_per_step],
}


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("hf_recipe")
    folders = _recipe_folders(root)
    one, four, eight = (checks_needed(request, c, "test_recipe_check") for c in RECIPE_LAUNCHES.values())
    with launched_beside(one, 1, str(root), folders, timeout=600) as reference:
        reports = [launch_checks(four, 4, str(root), folders, timeout=900)]
    reports += [reference.result(), launch_checks(eight, 8, str(root), folders, timeout=900)]
    return LaunchedRuns(root, reports)


test_recipe_check = pytest.mark.full(
    launched_check_results(
        "recipe_runs", [recipe_single_rank, recipe_layouts, recipe_resume, recipe_gathers_once_per_step]
    )
)


@pytest.mark.full
@pytest.mark.parametrize("model", [name for name in RECIPE_LAYOUTS if name not in FP8_MODELS])
def test_hf_model_recipe_loss_curve_is_layout_invariant(recipe_runs, model):
    """Training and held-out losses of every layout follow the single-rank run's (1e-4)."""
    root = recipe_runs.after("recipe_single_rank", "recipe_layouts")
    reference = _losses(root / model / "single")
    assert len(reference) == RECIPE_STEPS and reference[-1] < reference[0] - 0.05, reference
    eval_reference = _losses(root / model / "single", "eval_loss")
    assert len(eval_reference) == 2, eval_reference  # after RECIPE_HALF and RECIPE_STEPS
    for layout in RECIPE_LAYOUTS[model]:
        for key, ref in (("loss", reference), ("eval_loss", eval_reference)):
            got = _losses(root / model / layout, key)
            assert len(got) == len(ref), f"{model} {layout}: {key} {got}"
            for step, (a, b) in enumerate(zip(got, ref), start=1):
                assert_parity(f"{model} {layout} {key} #{step}", a, b, loss_rtol=LOSS_CURVE_RTOL)


# rowwise_with_gw_hp scales every operand over the whole logical tensor, so the first step's loss is the single
# rank's to float32 reassociation on dp, ep and pp layouts (measured <= 1.7e-7). From the second step the
# weights differ by reduction order and a float8 cast can turn that last bit into a whole float8 step: the
# single-rank run from weights one ulp up departs as far (measured: dp4 6.8e-7, MoE dp2 x ep2 8.5e-6, pp2 x dp2 x
# ep2 9.6e-6, against one-ulp gaps up to 3.2e-5 and 4.0e-5; bound FP8_VS_ULP_NOISE times them). cp merges the ring's
# attention blocks in another order than transformers' attention, more than one float32 sum's reassociation, so its
# first step too is held to the ulp-noise bound (measured 1.4e-5, max 4.8e-5). tp's row-parallel partial sums come out
# of torch's rowwise float8 GEMM in bf16 (tests/test_float8.py, TP_LOSS: 3e-3 on meshtron's model; measured here 1.5e-4,
# with or without pp; MoE with its experts folded over dp x tp + SP 4.4e-5).
FP8_FIRST_STEP = 1e-6
FP8_VS_ULP_NOISE = 4.0
FP8_TP_LOSS = 3e-3


@pytest.mark.full
@pytest.mark.parametrize("model", list(FP8_TWINS))
def test_hf_model_recipe_fp8_follows_its_single_rank_run(recipe_runs, model):
    """A transformers model in FP8 (rowwise_with_gw_hp) on dp, tp + SP, pp (zb1p with cp, 1F1B with dp x tp), and
    a MoE one's experts in float8 on ep layouts: the training losses against the single-rank FP8 run."""
    root = recipe_runs.after("recipe_single_rank", "recipe_layouts")
    reference = _losses(root / model / "single")
    noise = [abs(a - b) / b for a, b in zip(_losses(root / FP8_TWINS[model] / "single"), reference)]
    assert len(reference) == RECIPE_STEPS and reference[-1] < reference[0] - 0.05, reference
    for layout, parallel in RECIPE_LAYOUTS[model].items():
        gaps = [abs(a - b) / b for a, b in zip(_losses(root / model / layout), reference)]
        where = f"{model} {layout}: loss gaps {gaps}, one-ulp gaps {noise}"
        print(where)
        assert len(gaps) == RECIPE_STEPS, where
        if parallel.tp > 1:
            assert max(gaps) < FP8_TP_LOSS, where
            continue
        assert parallel.cp > 1 or gaps[0] < FP8_FIRST_STEP, where
        assert max(gaps) < FP8_VS_ULP_NOISE * max(noise), where


@pytest.mark.full
def test_hf_model_recipe_resumes_and_exports(recipe_runs):
    root = recipe_runs.after("recipe_layouts", "recipe_resume")
    from transformers import AutoModelForCausalLM

    full = _losses(root / "llama" / "dp2_tp2")
    resumed = _losses(root / "llama" / "resumed")
    assert len(resumed) == RECIPE_STEPS - RECIPE_HALF
    for step, (a, b) in enumerate(zip(resumed, full[RECIPE_HALF:]), start=RECIPE_HALF + 1):
        assert_parity(f"step {step}: resumed on pp2 x tp2 vs uninterrupted", a, b, loss_rtol=LOSS_CURVE_RTOL)
    exported = AutoModelForCausalLM.from_pretrained(root / "export")
    source = AutoModelForCausalLM.from_pretrained(root / "llama")
    assert type(exported) is type(source)
    # The values equal the trained model's (recipe_layouts compares them in the launch); here: it trained.
    moved = [n for n, p in exported.named_parameters() if not torch.equal(p, source.get_parameter(n))]
    assert len(moved) == len(list(source.parameters())), "every trained weight is exported"


def test_hf_model_recipe_reads_any_family_and_checks_its_layout(tmp_path):
    """The folder's sizes come through transformers' config class (GPT-2's n_embd / n_head, Mixtral's
    num_local_experts); the layout is checked against them before any rank starts."""
    from transformers import Gemma4TextConfig, GPT2Config, MixtralConfig

    from meshtron.config import load_config
    from meshtron.hf.runner import with_hf_model
    from meshtron.parallel.layout import validate_layout

    GPT2Config(n_embd=64, n_head=8, n_layer=2, vocab_size=256, n_positions=128).save_pretrained(tmp_path / "gpt2")
    MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=4,
        vocab_size=256,
    ).save_pretrained(tmp_path / "mixtral")

    def recipe(folder, *overrides):
        return with_hf_model(
            load_config(ROOT / "recipes" / "debug_dense.toml", ["--model.hf_model", str(tmp_path / folder), *overrides])
        )

    gpt2 = recipe("gpt2", "--parallel.ep", "2", "--parallel.dp", "1").model
    assert (
        gpt2.hidden_size,
        gpt2.num_attention_heads,
        gpt2.kv_heads,
        gpt2.num_hidden_layers,
        gpt2.intermediate_size,
        gpt2.max_position_embeddings,
        gpt2.tie_word_embeddings,
        gpt2.num_experts,
    ) == (64, 8, 8, 2, 256, 128, True, 0)
    with pytest.raises(
        ConfigError, match=r"^\[parallel\] ep = 2 needs an MoE model \(num_experts > 0\); use dp instead"
    ):
        validate_layout(recipe("gpt2", "--parallel.ep", "2", "--parallel.dp", "1"), 2)
    mixtral = recipe("mixtral", "--parallel.ep", "3", "--parallel.dp", "1")
    assert (mixtral.model.num_experts, mixtral.model.num_experts_per_tok, mixtral.model.moe_intermediate_size) == (
        4,
        2,
        96,
    )
    with pytest.raises(ConfigError, match=r"ep = 3 does not divide \[model\] num_experts = 4"):
        validate_layout(mixtral, 3)
    with pytest.raises(ConfigError, match=r"hf_model = '.*nowhere' has no config.json"):
        recipe("nowhere")
    with pytest.raises(ConfigError, match=r"\[data\] document_mask is not supported with \[model\] hf_model"):
        recipe("gpt2", "--data.document_mask", "true")
    # Layers of their own shape (Gemma 4's full-attention head_dim): refused by name, not a raw AttributeError.
    Gemma4TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        global_head_dim=16,
        vocab_size=256,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
    ).save_pretrained(tmp_path / "gemma4")
    with pytest.raises(ConfigError, match=r"gemma4': its config gives layers their own head_dim \(per_layer_config\)"):
        recipe("gemma4")
