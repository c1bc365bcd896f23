"""parallelize_hf_model / load_hf_checkpoint: transformers causal LMs sharded over (dp, ep, tp) match the
unparallelized model (loss, MoE aux loss, gradients, three AdamW steps), sharded loading reads only
each rank's slices and is bit-identical to a full load, and a sharded model saves back to a folder HF
reads with the same weights and logits.

One 8-rank launch: dense models (Llama, Qwen2, Mistral, Qwen3 with its per-head q/k norms) at
(dp, tp) = (4, 2) and (2, 4), Phi3's fused projections (gathered-output styles) at (2, 4) + SP; Qwen2-MoE at those and
with its experts split by meshtron's all-to-all at (dp, ep) = (2, 4) and (dp, ep, tp) = (2, 2, 2), with and without SP;
FSDP (or replicate / HSDP) over the data meshes. In the same launch, twelve more families (FAMILIES: with plans, without
plans as GPT-2's Conv1D, fused qkv, ALiBi, Mixtral's, gpt-oss's and Aria's experts) at dp2 x tp4 and dp4 x tp2 + SP (the
MoE families over ep instead: dp2 x ep4 and dp2 x ep2 x tp2 + SP, Aria the latter; Llama 4's router-scaled experts,
without an ep plan, at dp2 x ep4, dp2 x ep2 x tp2 ± SP and dp4 x tp2 + SP), DeepSeek-V2/V3's MLA at tp 2 and 4 with and
without SP, and OPT's MLP projections split directly in its blocks (tokens at dim -2 under SP). Issue 41's classes
join the same launch: plans leaving parts whole under SP (MiniMax, GraniteMoe/-Shared, Jamba at dp2 x ep2 x tp2 +
SP), norms over all split features (BitNet), in-place edits of split outputs (Olmo's clip_qkv), plans naming only
the input embedding (CodeGen, HunYuan, FalconH1, Bamba), and a Parameter shared by two layers kept one (refused over
pp stages).
The block check (meshtron.hf.prove, on by default) runs on the parity models and issue 41's families; its
negative controls switch each of those fixes off and see the family refused, on load_hf_checkpoint's path too
(a twin holding the checkpoint's weights is proved; each loaded parity case records what it proved and read);
its refusals name what the layout cannot serve (MiniMax's lightning attention under cp, Zamba2's second
whole-sequence input under SP).
DeepSeek-V4's [batch, sequence, hc_mult, hidden] streams train at dp and tp, and SP, cp and pp are refused; its
save_pretrained folder (converted by transformers on load) loads. HY-V4's per-head attention sinks split with
its heads (left whole: refused by the block check), Qwen4-Exp's decoder-level hyper-connection mixer runs whole.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshtron import load_hf_checkpoint, parallelize_hf_model, save_hf_checkpoint
from meshtron.config import Config, ConfigError, ParallelConfig
from meshtron.hf.discover import hf_parts
from meshtron.hf.experts import FusedExpertParallel
from meshtron.hf.runner import parallelize_options
from meshtron.mesh import batch_mesh, expert_split
from meshtron.parallel.offload import BlockOffload
from meshtron.testing import (
    GRAD_RTOL,
    HF_TINY_FAMILIES,
    HF_TINY_SIZES,
    LOSS_RTOL,
    assert_parity,
    count_calls,
    launch_tests,
    layout_mesh,
    rel_err,
)

SMALL = HF_TINY_SIZES
# name -> (config class, extra config); llama/mistral with 2 KV heads replicate them at tp = 4.
MODELS = {
    **HF_TINY_FAMILIES,
    # Layer 0 sparse (fused experts + shared expert), layer 1 dense.
    # The aux loss is returned and weighted enough to matter in the loss comparisons.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_key_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
    ),
}
OFFLOADS = dict(offload="optimizer", offload_activations=True)
# (family, layout): FSDP (or replicate / HSDP) over the data meshes
CASES = [
    ("llama", ParallelConfig(dp=4, tp=2)),
    # KV heads replicated (2 heads, tp 4)
    ("llama", ParallelConfig(dp=2, tp=4, sp=True, activation_checkpointing="full")),
    ("qwen2", ParallelConfig(dp=2, tp=4, data_parallel="replicate")),
    ("mistral", ParallelConfig(dp=2, tp=4)),
    ("mistral", ParallelConfig(dp=4, tp=2, sp=True, **OFFLOADS)),  # both host offloads change no number
    ("qwen3", ParallelConfig(dp=2, tp=4)),
    ("qwen3", ParallelConfig(dp=4, tp=2, sp=True)),
    ("qwen2_moe", ParallelConfig(dp=2, tp=4)),  # experts whole, tokens split over tp
    ("qwen2_moe", ParallelConfig(dp=4, tp=2, sp=True)),
    ("qwen2_moe", ParallelConfig(dp=2, ep=4)),  # one expert per ep rank
    ("qwen2_moe", ParallelConfig(dp=2, ep=2, tp=2, **OFFLOADS)),
    ("qwen2_moe", ParallelConfig(dp=2, ep=2, tp=2, sp=True, data_parallel="hsdp", activation_checkpointing="full")),
    ("qwen2_moe", ParallelConfig(dp=2, ep=4, tp=4, sp=True, fold_ep=True)),  # experts folded over the tp ranks
]
PER_RANK, SEQ = 2, 16


def _save_models(root: Path) -> dict[str, str]:
    import transformers

    folders = {}
    for name, (cls, extra) in MODELS.items():
        torch.manual_seed(len(name))
        cfg = getattr(transformers, cls)(**SMALL, **extra)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # default init has constant norms and zero biases
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        folders[name] = str(root / name)
        # Small shards: every model is split over several safetensors files with an index.
        model.save_pretrained(folders[name], max_shard_size="40KB")
    return folders


def _reference(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()


def _batch(readers: int, seed: int):
    """The global batch (identical on all ranks): ids, labels with a different number of ignored labels
    per row, and an attention mask with 0 to 2 padded positions at the end of each row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (readers * PER_RANK, SEQ), generator=gen)
    labels = ids.clone()
    mask = torch.ones_like(ids)
    for row in range(labels.shape[0]):
        labels[row, : row % 5] = -100
        labels[row, SEQ - row % 3 :] = -100
        mask[row, SEQ - row % 3 :] = 0
    return ids, labels, mask


def _local(t: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's rows: the batch is split over dp x ep."""
    r = batch_mesh(mesh).get_local_rank()
    return t[r * PER_RANK : (r + 1) * PER_RANK]


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


# Qwen3-Next's gated delta-net decay parameters get gradients of ~1e-5 out of large cancellations: the
# single-process model with meshtron's chunked cross-entropy instead of transformers' is already 1.4e-4
# (A_log) / 1.0e-4 (dt_bias) from transformers' own, with no parallelism at all. A wrong reduction is O(1).
# HY-V4's output hyper-connection head: its scalar scale's gradient (-4.6e-5 in the tp 2 case) is a sum of
# terms up to 1.8 x larger per token; the vocab-parallel head's rounding moves it by 5e-9 (1.1e-4 relative),
# while every block parameter and the loss agree within 1e-5.
CANCELLING_GRADS = {"linear_attn.A_log": 3e-4, "linear_attn.dt_bias": 3e-4, "hc_head.hc_scale": 5e-4}


def _grads(model, ref, where: str) -> tuple[list, dict]:
    """What assert_parity compares: ``model``'s (name, gradient) pairs and ``ref``'s gradients by name. A
    parameter ``ref``'s forward left unused (DeepSeek-V4's indexer: too few tokens to index) must get no
    gradient in ``model`` either."""
    ref_params = dict(ref.named_parameters())
    pairs = []
    for name, p in model.named_parameters():
        if ref_params[name].grad is None:
            assert p.grad is None or not _full(p.grad).any(), f"{where}: grad {name} of an unused parameter"
        else:
            pairs.append((name, p.grad))
    return pairs, {name: p.grad for name, p in ref_params.items()}


def _check_experts(model, mesh, ac: str, all_to_alls: int, where: str) -> dict:
    """The sparse layer's experts run through meshtron's dispatch: split Shard(0) over ep, each token copy
    sent once (this rank's 1/tp of the tokens, k copies each), and per step one count exchange plus
    two all-to-alls in forward (again when checkpointing recomputes it) and two in backward."""
    (experts,) = [m for m in model.modules() if isinstance(m, FusedExpertParallel)]  # layer 0 is sparse
    ep, tp = expert_split(mesh).ep, mesh["tp"].size()
    if ep == 1:
        assert all_to_alls == 0 and experts.last_dispatch_bytes == 0, where
        return {}
    for p in experts.parameters():
        assert dict(zip(p.device_mesh.mesh_dim_names, p.placements))["ep"] == Shard(0), where
    expected = PER_RANK * SEQ // tp * MODELS["qwen2_moe"][1]["num_experts_per_tok"] * SMALL["hidden_size"] * 4
    assert experts.last_dispatch_bytes == expected, f"{where}: {experts.last_dispatch_bytes} bytes dispatched"
    assert all_to_alls == (8 if ac == "full" else 5), f"{where}: {all_to_alls} all-to-alls"
    return {"dispatch_bytes_per_rank": expected, "all_to_alls_per_step": all_to_alls}


def _check_saved(model, folder: Path, ids: torch.Tensor, mask: torch.Tensor, mesh, where: str) -> None:
    """transformers reads the saved folder back with the same weights and the same logits."""
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    saved = dict(back.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(_full(p).detach(), saved[name].detach()), f"{where}: saved {name} differs"
    logits = _full(model(input_ids=_local(ids, mesh), attention_mask=_local(mask, mesh)).logits)
    expected = _local(back(input_ids=ids, attention_mask=mask).logits, mesh)
    assert rel_err(logits, expected) < LOSS_RTOL, f"{where}: logits of the saved model differ"


# CASES the quick tier trains: tp 4 + SP with full checkpointing and replicated KV heads, and Qwen2-MoE's
# experts folded over the tp ranks (ep 4) with SP; check_parity_and_training trains the others.
QUICK_CASES = (1, 12)


def check_parity_and_training_quick(folders: dict[str, str], out: str) -> None:
    """:func:`check_parity_and_training` on :data:`QUICK_CASES`."""
    _parity_and_training(folders, out, QUICK_CASES)


@pytest.mark.full
def check_parity_and_training(folders: dict[str, str], out: str) -> None:
    """Per case: sliced loading == full load bit for bit, then three AdamW steps on fresh batches with
    loss (and MoE aux loss) within 1e-5 at every step, step-0 gradients within 1e-4, and the final
    weights and their updates within 1e-4.

    Adam's eps is 1e-3 here, not the usual 1e-8: Adam divides each gradient element by its own
    magnitude, so an element's update moves by up to lr x (its gradient's error) / eps, and the
    float32 rounding differences of a gradient are about 1e-6 of the tensor's largest element (0.1-0.2
    for the embedding). We measured, over these cases, the largest weight / update errors at eps 1e-5:
    1.6e-4 / 1.1e-3 (mistral embedding), at 1e-4: 1.1e-4 / 8.1e-4 (one embedding element with gradient
    3.7e-5 off by 4.4e-7), at 1e-3: 2.2e-6 / 1.7e-5. With eps 1e-3 a quarter to half of the gradient
    elements fall below eps; the others still take Adam's normalised, sign-like steps.
    """
    _parity_and_training(folders, out, [i for i in range(len(CASES)) if i not in QUICK_CASES])


def _parity_and_training(folders: dict[str, str], out: str, indices) -> None:
    figures = {}
    for index in indices:
        arch, layout = CASES[index]
        where = f"{arch} {layout.name} (weights seed {len(arch)}, batch seed {100 * index} + step)"
        mesh = layout_mesh(layout)
        readers = batch_mesh(mesh).size()
        ref = _reference(folders[arch])
        with _recorded_twin_proof() as proof:
            model, _ = load_hf_checkpoint(folders[arch], mesh, **parallelize_options(layout))
        figures.setdefault("twin_bytes", {})[where] = _check_twin_proof(proof, ref, where)
        offloading = [
            m
            for m in model.modules()
            if any(isinstance(getattr(h, "__self__", None), BlockOffload) for h in m._forward_pre_hooks.values())
        ]
        assert len(offloading) == (ref.config.num_hidden_layers if layout.offload_activations else 0), where
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():  # sharded streaming load == full load, bit for bit
            assert torch.equal(_full(p), ref_params[name].detach()), f"{where}: loaded {name} differs"
        initial = {name: p.detach().clone() for name, p in ref_params.items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, foreach=False)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3, foreach=False)
        for step in range(3):
            ids, labels, mask = _batch(readers, seed=100 * index + step)
            ref_out = ref(input_ids=ids, labels=labels, attention_mask=mask)
            moe = getattr(ref_out, "aux_loss", None) is not None
            # The dispatch's all-to-alls counted as calls: CommDebugMode's module tracker fails on a module called
            # more than once in a forward, which transformers 5.25 with `kernels` (its dependency now) makes of
            # apply_rotary_pos_emb (one shared nn.Module every attention layer calls).
            counting = moe and step == 0
            with count_calls(dist, "all_to_all_single") if counting else contextlib.nullcontext([]) as exchanges:
                out_ = model(
                    input_ids=_local(ids, mesh), labels=_local(labels, mesh), attention_mask=_local(mask, mesh)
                )
                out_.loss.backward()
            if mesh["tp"].size() > 1:
                assert isinstance(out_.logits, DTensor) and out_.logits.placements[-1].is_shard(), where
            if moe:
                assert_parity(f"{where} step {step} aux loss", out_.aux_loss, ref_out.aux_loss)
            if moe and step == 0:
                figures[where] = _check_experts(model, mesh, layout.activation_checkpointing, len(exchanges), where)
            ref_out.loss.backward()
            # Gradients at step 0: later steps are covered by the losses and the final weights.
            grads = _grads(model, ref, where) if step == 0 else ((), None)
            assert_parity(f"{where} step {step}", out_.loss, ref_out.loss, *grads, looser=CANCELLING_GRADS)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        for name, p in model.named_parameters():
            weights, update = _full(p).detach(), ref_params[name].detach()
            err = max(rel_err(weights, update), rel_err(weights - initial[name], update - initial[name]))
            assert err < GRAD_RTOL, f"{where}: after 3 AdamW steps {name} (weights or update) rel err {err:.2e}"
        if index in (1, 10):  # save the trained sharded model; HF reads it back
            save_hf_checkpoint(model, Path(out) / f"saved_{arch}", max_shard_bytes=30_000)
            _check_saved(model, Path(out) / f"saved_{arch}", ids, mask, mesh, where)
    if dist.get_rank() == 0:
        (Path(out) / "expert_comms.json").write_text(json.dumps({k: v for k, v in figures.items() if v}))


@contextlib.contextmanager
def _recorded_twin_proof():
    """What load_hf_checkpoint's block check proved (the references' block indices) and the bytes its twin
    read whole."""
    from unittest import mock

    from meshtron.hf import parallelize, prove

    record = {"blocks": [], "bytes": []}
    real_prove, real_twin = prove.prove_blocks, parallelize._check_twin

    def proving(*args, **kwargs):
        record["blocks"].append([ref.index for ref in args[3]])
        return real_prove(*args, **kwargs)

    def twin(*args, **kwargs):
        record["bytes"].append(real_twin(*args, **kwargs))
        return record["bytes"][-1]

    with mock.patch.object(prove, "prove_blocks", proving), mock.patch.object(parallelize, "_check_twin", twin):
        yield record


def _check_twin_proof(proof: dict, ref, where: str) -> dict:
    """The loaded model's block check ran: each kind's first block proved (Qwen2-MoE's layer 0 sparse and
    layer 1 dense), its twin having read whole exactly the tensors up to the last kind's block: all but later
    blocks and an untied head, 4 bytes each."""
    kinds = [0, 1] if "qwen2_moe" in where else [0]
    assert proof["blocks"] == [kinds], f"{where}: block check proved {proof['blocks']}"
    later = tuple(f"model.layers.{i}." for i in range(kinds[-1] + 1, ref.config.num_hidden_layers))
    read = [
        p
        for name, p in ref.named_parameters()  # a tied head is listed once, as the embedding
        if not name.startswith(later) and (name != "lm_head.weight" or ref.config.tie_word_embeddings)
    ]
    expected = 4 * sum(p.numel() for p in read)
    assert proof["bytes"] == [expected], f"{where}: the twin read {proof['bytes']} bytes, expected {expected}"
    return {"twin": expected, "checkpoint": 4 * sum(p.numel() for p in ref.parameters())}


def check_from_pretrained_then_parallelize(folders: dict[str, str], out: str) -> None:
    """The other entry path: a materialised HF model parallelized in place gives the same loss and
    gradients. The MoE case has 2 x 15 tokens per rank, which tp = 4 does not divide (the expert
    dispatch pads its tp split). Phi3's fused projections take the gathered-output styles."""
    cases = [
        ("qwen2", ParallelConfig(dp=2, tp=4, sp=True), SEQ),
        ("qwen2_moe", ParallelConfig(ep=2, tp=4), 15),
        ("phi3", ParallelConfig(dp=2, tp=4, sp=True), SEQ),
    ]
    for arch, layout, seq in cases:
        mesh = layout_mesh(layout)
        ref = _reference(folders[arch])
        model = parallelize_hf_model(_reference(folders[arch]), mesh, **parallelize_options(layout))
        ids, labels, _ = (t[:, :seq] for t in _batch(batch_mesh(mesh).size(), seed=7))
        loss = model(input_ids=_local(ids, mesh), labels=_local(labels, mesh)).loss
        ref_loss = ref(input_ids=ids, labels=labels).loss
        where = f"{arch} {layout.name} from_pretrained + parallelize (weights seed {len(arch)}, batch seed 7)"
        loss.backward()
        ref_loss.backward()
        assert_parity(where, loss, ref_loss, *_grads(model, ref, where), looser=CANCELLING_GRADS)


TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8)
# DeepSeek's multi-head latent attention, tiny: kv latent 16 + rope key 4, heads of 8 + 4 (q/k), 8 (v).
MLA = dict(
    TINY,
    num_key_value_heads=8,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=8,
)
# More families, built in each rank from a config (no folder): name -> (config class, config, what it covers).
FAMILIES = {
    "gemma2": (
        "Gemma2Config",
        dict(TINY, num_key_value_heads=4, head_dim=8, intermediate_size=96, sliding_window=8),
        "attention and final-logit softcapping, sliding window 8 < sequence 16, four norms per block",
    ),
    "olmo2": (
        "Olmo2Config",
        dict(TINY, num_key_value_heads=4, intermediate_size=96),
        "plan with colwise_gather_output q/k/v (q/k norms over all heads), post-norms only",
    ),
    "cohere": ("CohereConfig", dict(TINY, num_key_value_heads=4, intermediate_size=96), "parallel attention + MLP"),
    "gpt2": (
        "GPT2Config",
        dict(
            n_embd=64,
            n_layer=2,
            n_head=8,
            vocab_size=128,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        "no plan; Conv1D ([in, out] weights), fused c_attn gathered, learned positions replicated",
    ),
    "gpt_neox": ("GPTNeoXConfig", dict(TINY, intermediate_size=96), "plan: fused per-head query_key_value colwise"),
    "falcon": ("FalconConfig", dict(TINY), "no plan; multi-query fused query_key_value gathered, parallel attention"),
    "bloom": ("BloomConfig", dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=8), "no plan; ALiBi, fused qkv"),
    "gptj": (
        "GPTJConfig",
        dict(vocab_size=128, n_embd=64, n_layer=2, n_head=8, rotary_dim=4, n_positions=64),
        "no plan; separate q/k/v reshaped by the full head count (gathered)",
    ),
    "stablelm": (
        "StableLmConfig",
        dict(TINY, num_key_value_heads=4, intermediate_size=96),
        "no plan; LayerNorm with bias, separate q/k/v (gathered: reshapes by num_heads)",
    ),
    "mixtral": (
        "MixtralConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
        "MoE, fused experts dispatched by meshtron (ep plan), global aux loss",
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            head_dim=8,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
        ),
        "no tp plan; attention sinks (gathered), interleaved biased clamped experts dispatched by meshtron",
    ),
    "aria": (
        "AriaTextConfig",
        dict(
            TINY, num_key_value_heads=4, intermediate_size=32, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1
        ),
        "MoE, SiLU experts stored [E, in, out] (transposed) dispatched by meshtron, shared experts",
    ),
    # Parameters on tp-split activations that no plan entry names: each tp rank's gradient is a part.
    "apertus": (
        "ApertusConfig",
        dict(TINY, num_key_value_heads=4, intermediate_size=96),
        "xIELU activation with its own alpha_p / alpha_n after the column-split up projection",
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            use_qk_norm=True,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
        ),
        "per-head q_norm / k_norm on column-split heads, absent from its plan; fused experts, shared experts",
    ),
    "gain_llama": (
        "LlamaConfig",
        dict(TINY, num_key_value_heads=2, intermediate_size=96),
        "hand-made: a scalar gain on the column-split MLP activation; 2 KV heads replicated at tp 4",
    ),
    # Discovery by the model's structure: Lfm2's final norm is called embedding_norm and its short
    # convolutions hand their kernel to a fused op; Llama 4 keeps its base model in self.model but
    # declares base_model_prefix 'language_model'; Qwen3-Next's linear attention has a 3-D conv1d.
    "lfm2": (
        "Lfm2Config",
        dict(TINY, num_key_value_heads=4, layer_types=["conv", "full_attention"]),
        "no plan; short-convolution layers (whole over tp) next to attention layers",
    ),
    # Llama 4's router scores scale its experts' inputs; layer 0 dense with RoPE, L2 q/k norm and chunked
    # attention (chunk 8 < sequence 16), layer 1 MoE without RoPE, with attention temperature tuning.
    "llama4": (
        "Llama4TextConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            intermediate_size=32,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 0],
            attention_chunk_size=8,
            floor_scale=4,
        ),
        "decoder found by structure; experts without an ep plan, their inputs scaled by the router",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
        "hybrid: gated delta-net linear attention (gathered projections, its own input masking) and "
        "fused experts over ep",
    ),
    # Appended last: the batches of the families above keep their seeds (their index).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            head_dim=8,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
        "MoE with per-head q/k norms, fused experts folded over the tp ranks (fold_ep)",
    ),
    # MLA: replicated low-rank down projections, up projections split by heads, the rope key shared by them.
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(MLA, q_lora_rank=None),
        "MLA as V2-Lite (q_proj colwise, no q down projection), plan with mla_kv_a_proj; fused experts",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(MLA, q_lora_rank=24, n_group=1, topk_group=1),
        "MLA with q_a_proj / q_a_layernorm; its plan names no attention (MLA entries added); experts",
    ),
    # Parts a model's own plan leaves whole run on the gathered sequence under SP: MiniMax's plan names
    # q/k/v/o of its full-attention layers only (layer 0's lightning attention unplanned), GraniteMoe's,
    # GraniteMoeShared's and Jamba's name only the experts (Jamba's mamba mixer and attention whole).
    "minimax": (
        "MiniMaxConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            head_dim=8,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"],
            block_size=8,
        ),
        "own plan skipping the linear-attention layers; experts over ep",
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        dict(TINY, num_key_value_heads=4, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
        "own plan naming only the experts",
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
        ),
        "own plan naming only the experts; a shared MLP beside them",
    ),
    "jamba": (
        "JambaConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            use_mamba_kernels=False,
        ),
        "mamba mixer and attention layers, experts in every other layer; plan naming only the experts",
    ),
    # Norms over all split features: the projections around them gather their outputs.
    "bitnet": (
        "BitNetConfig",
        dict(TINY, num_key_value_heads=4, intermediate_size=96),
        "no plan; attn_sub_norm over all heads before o_proj, ffn_sub_norm over the MLP's features",
    ),
    # In-place edits of a column-split output: Olmo's clip_qkv clamps q, k, v in place.
    "olmo": (
        "OlmoConfig",
        dict(TINY, num_key_value_heads=4, intermediate_size=96, clip_qkv=0.05),
        "own plan, q/k/v colwise clamped in place (clip_qkv)",
    ),
    # Plans with transformers 5.24's embedding_rowwise entry for the input embedding (meshtron splits it).
    "codegen": (
        "CodeGenConfig",
        dict(vocab_size=128, n_embd=64, n_layer=2, n_head=8, rotary_dim=4, n_positions=64),
        "plan naming only the input embedding; fused qkv_proj (inferred, gathered)",
    ),
    "hunyuan": (
        "HunYuanDenseV1Config",
        dict(TINY, num_key_value_heads=4, intermediate_size=96, head_dim=8),
        "plan naming only the input embedding (inferred instead); per-head query/key layernorms after RoPE",
    ),
    "falcon_h1": (
        "FalconH1Config",
        dict(
            TINY,
            num_key_value_heads=4,
            intermediate_size=96,
            head_dim=8,
            mamba_d_state=8,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_d_ssm=128,
        ),
        "hybrid: mamba mixer beside attention in every layer (whole over tp)",
    ),
    "bamba": (
        "BambaConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            intermediate_size=96,
            attn_layer_indices=[1],
            mamba_d_state=8,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=2,
        ),
        "attention only in layer 1 (found there, not in block 0); mamba layers whole over tp",
    ),
    # Residual streams of another shape: [batch, sequence, hc_mult, hidden] hyper-connection streams, layer 0
    # hash-routed, layer 1 top-k routed with a compressed sparse attention; its own plan names only the experts,
    # which meshtron cannot dispatch (swiglu_limit) and leaves whole. SP, cp and pp are refused (check_errors).
    "deepseek_v4": (
        "DeepseekV4Config",
        dict(
            TINY,
            moe_intermediate_size=32,
            num_key_value_heads=1,
            head_dim=16,
            q_lora_rank=32,
            num_experts_per_tok=2,
            n_routed_experts=4,
            hc_mult=2,
            hc_sinkhorn_iters=3,
            sliding_window=8,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            partial_rotary_factor=0.5,
            max_position_embeddings=64,
            layer_types=["sliding_attention", "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        ),
        "mHC streams [B, S, 2, H], hash and top-k routed MoE, compressed sparse attention; dp, tp",
    ),
    # Learned per-head attention sinks split with the heads ("sinks": "colwise" under "local_params"), MLA with a
    # gated output, [B, S, hc_mult, H] streams; layer 0 dense, layer 1 MoE.
    "hy_v4": (
        "HYV4Config",
        dict(
            TINY,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=2,
            hc_mult=2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "learned attention sinks split with the heads, gated MLA, hyper-connection streams; dp, tp",
    ),
    # One transformer block shared by the hybrid layers (its weights reused, not copied), mamba layers whole.
    "zamba2": (
        "Zamba2Config",
        dict(
            TINY,
            num_key_value_heads=8,
            intermediate_size=96,
            mamba_d_state=8,
            mamba_headdim=16,
            n_mamba_heads=8,
            mamba_ngroups=1,
            layers_block_type=["mamba", "hybrid"],
            hybrid_layer_ids=[1],
            num_mem_blocks=1,
            max_position_embeddings=64,
        ),
        "a transformer block shared by the hybrid layers; mamba layers whole",
    ),
    # MLA only in its full-attention layers (one in four in the released model), Kimi delta attention in the
    # others, under one decoder-layer class; the plan names only the MLPs.
    "kimi_linear": (
        "KimiLinearConfig",
        dict(
            TINY,
            num_key_value_heads=8,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_token=2,
            num_shared_experts=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            v_head_dim=8,
            qk_nope_head_dim=8,
            linear_head_dim=8,
            linear_num_heads=8,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "dense"],
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "MLA in the full-attention layers only, delta attention in the others; plan names the MLPs",
    ),
    # Hyper-connection streams mixed back into one by a decoder-level mixer in place of a final norm; gated
    # delta-net and indexed attention layers, fused experts.
    "qwen4_exp": (
        "Qwen4ExpTextConfig",
        dict(
            TINY,
            num_key_value_heads=4,
            head_dim=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            hc_count=2,
            hc_lowrank=16,
            max_position_embeddings=64,
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=8,
            indexer_budget=8,
            indexer_compress_ratio=4,
        ),
        "hyper-connection streams mixed by a decoder-level mixer; linear and indexed attention; experts",
    ),
}
DENSE_LAYOUTS = [ParallelConfig(dp=2, tp=4), ParallelConfig(dp=4, tp=2, sp=True)]
EP_LAYOUTS = [ParallelConfig(dp=2, ep=4), ParallelConfig(dp=2, ep=2, tp=2, sp=True)]
# tp 2 and 4, each with and without SP.
SPLIT_ACTIVATION_LAYOUTS = [
    ParallelConfig(dp=2, tp=4),
    ParallelConfig(dp=2, tp=4, sp=True),
    ParallelConfig(dp=4, tp=2),
    ParallelConfig(dp=4, tp=2, sp=True),
]
# Experts folded over the dense ranks: ep 4 drawn from dense tp 4 x dp 2.
FOLDED_LAYOUT = ParallelConfig(dp=2, ep=4, tp=4, sp=True, fold_ep=True)
FAMILY_LAYOUTS = {
    "mixtral": [*EP_LAYOUTS, FOLDED_LAYOUT],
    "qwen3_moe": [FOLDED_LAYOUT],
    "gpt_oss": EP_LAYOUTS,
    "aria": EP_LAYOUTS[1:],
    "apertus": SPLIT_ACTIVATION_LAYOUTS,
    "gain_llama": SPLIT_ACTIVATION_LAYOUTS,
    "glm4_moe": [
        ParallelConfig(dp=2, ep=2, tp=2),
        ParallelConfig(dp=2, ep=2, tp=2, sp=True),
        ParallelConfig(ep=2, tp=4),
        ParallelConfig(ep=2, tp=4, sp=True),
    ],
    "lfm2": [ParallelConfig(dp=2, tp=4), ParallelConfig(dp=4, tp=2, sp=True)],
    "llama4": [*EP_LAYOUTS, ParallelConfig(dp=2, ep=2, tp=2), ParallelConfig(dp=4, tp=2, sp=True)],
    "qwen3_next": [*EP_LAYOUTS, ParallelConfig(dp=4, tp=2)],
    "deepseek_v2": SPLIT_ACTIVATION_LAYOUTS,
    "deepseek_v3": SPLIT_ACTIVATION_LAYOUTS,
    **{
        name: [ParallelConfig(dp=2, ep=2, tp=2, sp=True)]
        for name in ("minimax", "granitemoe", "granitemoeshared", "jamba")
    },
    "bitnet": [ParallelConfig(dp=4, tp=2), ParallelConfig(dp=2, tp=4, sp=True)],
    "olmo": [ParallelConfig(dp=4, tp=2), ParallelConfig(dp=2, tp=4, sp=True)],
    "deepseek_v4": [ParallelConfig(dp=8), ParallelConfig(dp=2, tp=4)],
    "hy_v4": [ParallelConfig(dp=2, tp=4)],
    "qwen4_exp": [ParallelConfig(dp=4, tp=2)],
    "kimi_linear": [ParallelConfig(dp=2, tp=4, sp=True)],
    # Battery only (benchmarks/hf_families.py): its inferred plan splits nothing over tp.
    "zamba2": [],
}
# MLA families: projection -> its tp placement (the down projection replicated, the others split by heads).
MLA_PLACEMENTS = {
    "q_proj": Shard(0),
    "q_b_proj": Shard(0),
    "q_a_proj": Replicate(),
    "kv_a_proj_with_mqa": Replicate(),
    "kv_b_proj": Shard(0),
    "o_proj": Shard(1),
}
# Issue 41's families (and the two whose SP used to be refused): check_families runs the block check on these.
PROVED_FAMILIES = (
    "minimax",
    "granitemoe",
    "granitemoeshared",
    "jamba",
    "bitnet",
    "olmo",
    "codegen",
    "hunyuan",
    "falcon_h1",
    "bamba",
    "lfm2",
    "qwen3_next",
    "deepseek_v4",
    "hy_v4",
    "qwen4_exp",
    "kimi_linear",
)
# Own plans naming only the experts: over ep x tp nothing else in their blocks is split (it runs whole; so
# do DeepSeek-V4's experts).
EXPERTS_ONLY_PLANS = ("granitemoe", "granitemoeshared", "jamba", "deepseek_v4")
# MoE family -> the class that runs its experts.
EXPERT_CLASSES = {
    "mixtral": "FusedExpertParallel",
    "qwen3_moe": "FusedExpertParallel",
    "gpt_oss": "ClampedExpertParallel",
    "aria": "TransposedExpertParallel",
    "llama4": "ScaledInputExpertParallel",
}


class GainSiLU(torch.nn.Module):
    """SiLU times a learned scalar: a parameter acting on the column-split MLP activation under tp."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.gain * torch.nn.functional.silu(x)


def _family_model(name: str):
    import transformers

    cls, cfg, _ = FAMILIES[name]
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**cfg), dtype=torch.float32)
    if name == "gain_llama":
        for layer in model.model.layers:
            layer.mlp.act_fn = GainSiLU()
    with torch.no_grad():  # default init has constant norms and zero biases
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        if name == "deepseek_v4":  # the hash table starts all zeros: every token's two picks are expert 0
            router = model.model.layers[0].mlp.gate
            router.tid2eid.copy_(torch.rand(router.tid2eid.shape[0], router.num_experts).argsort(-1)[:, :2])
    return model.train()


@pytest.mark.full
def check_families(folders: dict[str, str], out: str) -> None:
    """Each family of FAMILIES parallelized in place (FSDP over dp, tp by its plan or the inferred one,
    SP in the second layout; Mixtral and gpt-oss over ep, their experts and gpt-oss's expert biases split
    Shard(0)): loss (and aux loss) within 1e-5 and gradients within 1e-4 of the unparallelized
    transformers model on the global batch (padded rows, ignored labels); gpt-oss over ep x tp saved
    and loaded back sliced."""
    for index, name in enumerate(FAMILIES):
        for layout in FAMILY_LAYOUTS.get(name, DENSE_LAYOUTS):
            where = f"{name} {layout.name} (weights seed {len(name)}, batch seed {index})"
            mesh = layout_mesh(layout)
            ref = _family_model(name)
            # The block check runs in every parallelization of check_parity_and_training; here, to keep the
            # launch short, on the families whose classes it was built for (all families pass it).
            proved = replace(layout, prove_blocks=name in PROVED_FAMILIES)
            model = parallelize_hf_model(_family_model(name), mesh, **parallelize_options(proved))
            if name in EXPERT_CLASSES:
                _check_expert_split(model, name, mesh, where)
            if name in ("deepseek_v2", "deepseek_v3", "kimi_linear"):
                _check_mla_split(model, where)
            if name not in EXPERTS_ONLY_PLANS:
                _check_blocks_split(model, mesh, where)
            ids, labels, mask = _batch(batch_mesh(mesh).size(), seed=index)
            out_ = model(input_ids=_local(ids, mesh), labels=_local(labels, mesh), attention_mask=_local(mask, mesh))
            ref_out = ref(input_ids=ids, labels=labels, attention_mask=mask)
            if getattr(ref_out, "aux_loss", None) is not None:
                assert_parity(f"{where} aux loss", out_.aux_loss, ref_out.aux_loss)
            out_.loss.backward()
            ref_out.loss.backward()
            assert_parity(where, out_.loss, ref_out.loss, *_grads(model, ref, where), looser=CANCELLING_GRADS)
            if name == "gpt_oss" and layout.sp:
                _check_gpt_oss_round_trip(model, Path(out) / "saved_gpt_oss", ids, mask, layout, where)


def _check_gpt_oss_round_trip(model, folder: Path, ids, mask, layout: ParallelConfig, where: str) -> None:
    """Biased experts split over ep save to a folder HF reads back, and sliced loading of that folder
    gives the same weights."""
    mesh = layout_mesh(layout)
    save_hf_checkpoint(model, folder, max_shard_bytes=30_000)
    _check_saved(model, folder, ids, mask, mesh, where)
    loaded, _ = load_hf_checkpoint(folder, mesh, **parallelize_options(layout))
    params = dict(loaded.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(_full(p).detach(), _full(params[name]).detach()), f"{where}: loaded {name} differs"


def _check_blocks_split(model, mesh, where: str) -> None:
    """Parity alone would pass a plan that splits nothing (HunYuan's names only the input embedding)."""
    if mesh["tp"].size() == 1:
        return
    split = [
        name
        for name, p in hf_parts(model).blocks.named_parameters()
        if isinstance(p, DTensor) and isinstance(dict(zip(p.device_mesh.mesh_dim_names, p.placements)).get("tp"), Shard)
    ]
    assert split, f"{where}: no block parameter is split over tp"


def _check_mla_split(model, where: str) -> None:
    """MLA runs split, not whole on every tp rank, in every layer that has it (Kimi Linear's layer 1; its layer
    0's delta attention stays whole): the parity alone would not tell."""
    mla = [layer for layer in model.model.layers if hasattr(layer.self_attn, "kv_b_proj")]
    assert mla, where
    for layer in model.model.layers:
        if layer not in mla:
            weight = layer.self_attn.o_proj.weight
            assert not isinstance(weight, DTensor) or not isinstance(
                dict(zip(weight.device_mesh.mesh_dim_names, weight.placements)).get("tp"), Shard
            ), where
    for layer in mla:
        for proj, placement in MLA_PLACEMENTS.items():
            if (module := getattr(layer.self_attn, proj, None)) is not None:
                weight = module.weight
                assert dict(zip(weight.device_mesh.mesh_dim_names, weight.placements))["tp"] == placement, (
                    f"{where}: {proj} {weight.placements}"
                )


def _sparse_layers(config) -> list[int]:
    """Indices of the MoE layers (Llama 4 interleaves dense ones; the others here are all sparse)."""
    return list(getattr(config, "moe_layers", None) or range(config.num_hidden_layers))


def _check_expert_split(model, name: str, mesh, where: str) -> None:
    """Every experts module runs through meshtron's dispatch, its parameters (biases too) Shard(0) over ep
    (at ep = 1 whole, each tp rank dispatching its share of the tokens)."""
    experts = [m for m in model.modules() if isinstance(m, FusedExpertParallel)]
    assert len(experts) == len(_sparse_layers(model.config)), where
    for module in experts:
        assert type(module).__name__.removeprefix("FSDP") == EXPERT_CLASSES[name], f"{where}: {type(module).__name__}"
        for p in module.parameters() if expert_split(mesh).ep > 1 else ():
            assert dict(zip(p.device_mesh.mesh_dim_names, p.placements))["ep"] == Shard(0), where


@pytest.mark.full
def check_bytes_read_per_rank(folders: dict[str, str], out: str) -> None:
    """Each rank reads about 1/8 of the bytes: qwen2 with every KV head split (4 KV heads, tp 4) and FSDP
    over dp 2; Qwen2-MoE with its experts split over ep 4 and everything FSDP-sharded over dp x ep."""
    report = {}
    for arch, layout in [("qwen2", ParallelConfig(dp=2, tp=4)), ("qwen2_moe", ParallelConfig(dp=2, ep=4))]:
        _, read = load_hf_checkpoint(folders[arch], layout_mesh(layout), **parallelize_options(layout))
        index = json.loads((Path(folders[arch]) / "model.safetensors.index.json").read_text())
        total = index["metadata"]["total_size"]
        reads = [None] * dist.get_world_size()
        dist.all_gather_object(reads, read)
        assert sum(reads) >= total  # everything was read by someone
        assert max(reads) < 1.1 * total / 8, f"{arch}: per-rank bytes read {reads} of {total}"
        report[arch] = {"total": total, "per_rank": reads}
    if dist.get_rank() == 0:
        (Path(out) / "bytes.json").write_text(json.dumps(report))


NATIVE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=20,
    shared_expert_intermediate_size=48,
    mlp_only_layers=[0],
    tie_word_embeddings=True,
    rope_theta=10000.0,
)


def _save_native(root: Path) -> dict[str, str]:
    """A meshtron Qwen2-MoE in both HF expert layouts: per-expert (save_pretrained's) and fused."""
    from meshtron.config import ModelConfig
    from meshtron.hf import hf_config_dict, save_hf, to_hf
    from meshtron.hf.io import write_safetensors_folder
    from meshtron.models import build_model, materialize

    cfg = ModelConfig(**NATIVE)
    state = materialize(build_model(cfg), "cpu", seed=3).state_dict()
    save_hf(state, cfg, root / "native_published", max_shard_bytes=60_000)
    write_safetensors_folder(to_hf(state, cfg, "fused"), hf_config_dict(cfg), root / "native_fused", 60_000)
    return {"published": str(root / "native_published"), "fused": str(root / "native_fused")}


@pytest.mark.full
def check_native_sliced_loading(folders: dict[str, str], out: str) -> None:
    """meshtron's own model (tp x ep x FSDP, tied embeddings, stacked experts): the sliced loader
    equals the full-state-dict path bit for bit, from either expert layout, reading a fraction."""
    from meshtron.checkpoint import load_full_state_dict
    from meshtron.config import ModelConfig
    from meshtron.hf import load_hf_state_dict, load_native_sharded
    from meshtron.models import build_model
    from meshtron.parallel.compose import parallelize

    cfg = Config(model=ModelConfig(**NATIVE))
    mesh = layout_mesh(ParallelConfig(dp=2, ep=2, tp=2))

    def sharded_model():
        """The training runner's layout, allocated but not filled (every value must come from the loader)."""
        with torch.device("meta"):
            model = build_model(cfg.model)
        parallelize(model, mesh, cfg)
        model.to_empty(device="cpu")
        model.tie_weights()
        return model

    for layout in ("published", "fused"):
        sliced, full = sharded_model(), sharded_model()
        read = load_native_sharded(sliced, folders[f"native_{layout}"], tied=True)
        load_full_state_dict(full, load_hf_state_dict(folders[f"native_{layout}"], cfg.model), strict=False)
        expected = dict(full.named_parameters())
        for name, p in sliced.named_parameters():
            assert torch.equal(p.to_local(), expected[name].to_local()), f"{layout}: {name} differs"
        total = sum(p.numel() * p.element_size() for p in expected.values())
        assert read < 0.5 * total, f"{layout}: read {read} of {total} bytes"


def _check_direct_mlp(mesh) -> None:
    """OPT (no plan) keeps its MLP projections directly in the block: the inferred plan splits them with its
    attention, without a warning; under SP fc1 gathers and fc2 scatters the tokens at dim -2 (OPT flattens
    them to [B x S, H] before its MLP's norm). Loss and gradients are the unsplit model's."""
    import warnings

    import transformers

    def opt():
        torch.manual_seed(0)
        cfg = transformers.OPTConfig(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            ffn_dim=96,
            word_embed_proj_dim=64,
            dropout=0.0,
        )
        return transformers.AutoModelForCausalLM.from_config(cfg).train()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = parallelize_hf_model(opt(), mesh, sp=True)
    assert not [w for w in caught if "parallelize_hf_model" in str(w.message)], [str(w.message) for w in caught]
    layer = model.model.decoder.layers[0]
    assert layer.self_attn.q_proj.weight.placements == (Shard(0),)
    assert (layer.fc1.weight.placements, layer.fc2.weight.placements) == ((Shard(0),), (Shard(1),))
    ids, labels, mask = _batch(1, seed=5)
    split = model(input_ids=ids, labels=labels, attention_mask=mask).loss
    ref = opt()
    whole = ref(input_ids=ids, labels=labels, attention_mask=mask).loss
    split.backward()
    whole.backward()
    grads = {name: p.grad for name, p in ref.named_parameters()}
    held = [(name, p.grad) for name, p in model.named_parameters()]
    assert_parity("OPT tp8_sp", split, whole, held, grads, vanishing=("k_proj.bias",))


def _check_shared_parameter_kept() -> None:
    """A Parameter shared by two decoder layers (not the tied embedding / head) stays one Parameter: tp splits
    each owner's reference alike and they are tied again, FSDP takes both layers as one unit (replicate: the
    root). The loss and gradients are the unparallelized model's, and after two AdamW steps the layers still
    hold one Parameter. Layers on different pipeline stages would train two copies: refused, naming both."""

    def shared_model():
        model = _family_model("gain_llama")
        model.model.layers[1].mlp.down_proj.weight = model.model.layers[0].mlp.down_proj.weight
        return model

    for layout in [ParallelConfig(dp=4, tp=2, sp=True), ParallelConfig(dp=8, data_parallel="replicate")]:
        mesh, where = layout_mesh(layout), f"shared down_proj {layout.name}"
        ref, model = shared_model(), shared_model()
        distinct = len(list(model.parameters()))
        model = parallelize_hf_model(model, mesh, **parallelize_options(layout))
        layers = model.model.layers
        assert len(list(model.parameters())) == distinct, where
        ids, labels, mask = _batch(batch_mesh(mesh).size(), seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            out = model(input_ids=_local(ids, mesh), labels=_local(labels, mesh), attention_mask=_local(mask, mesh))
            out.loss.backward()
            if step == 0:
                ref_out = ref(input_ids=ids, labels=labels, attention_mask=mask)
                ref_out.loss.backward()
                assert_parity(where, out.loss, ref_out.loss, *_grads(model, ref, where), looser=CANCELLING_GRADS)
            opt.step()
            opt.zero_grad()
        assert layers[1].mlp.down_proj.weight is layers[0].mlp.down_proj.weight, where
    from unittest import mock

    from meshtron.hf import parallelize as hf_parallelize
    from meshtron.parallel import data_parallel

    # Controls: not tied again after tp, or each layer its own FSDP unit: the copies are caught.
    for switched_off in (
        mock.patch.object(hf_parallelize, "_share_again", lambda *_: None),
        mock.patch.object(data_parallel, "_sharing_groups", lambda modules: [[m] for m in modules]),
    ):
        with (
            switched_off,
            pytest.raises(
                ConfigError,
                match=r"'model.layers.0.mlp.down_proj.weight', 'model.layers.1."
                r"mlp.down_proj.weight' share one Parameter, but parallelizing gave them separate",
            ),
        ):
            parallelize_hf_model(shared_model(), layout_mesh(ParallelConfig(dp=4, tp=2)))
    with pytest.raises(
        ConfigError,
        match=r"'model.layers.0.mlp.down_proj.weight', 'model.layers.1.mlp.down_proj.weight' "
        r"share one Parameter, but pp = 2 puts their layers \[0, 1\] on different "
        r"pipeline stages \(each stage would train its own copy\)",
    ):
        parallelize_hf_model(shared_model(), layout_mesh(ParallelConfig(pp=2, dp=4)), microbatches=2)


@pytest.mark.full
def check_block_proof_refuses(folders: dict[str, str], out: str) -> None:
    """Negative controls of the block check (meshtron.hf.prove): each fix of issue 41 switched off, the
    family it fixes is refused by name before training (the check on by default), and prove_blocks=False
    lets the wrong split through."""
    from unittest import mock

    from meshtron.hf import tp_plan

    refusal = r"block 0 \({cls}\) split at {layout} does not compute what it computes whole: its {what}"
    controls = [  # (fix switched off, family, layout, what the check reports)
        (
            mock.patch.object(tp_plan, "_left_whole", lambda *_: []),
            "minimax",
            ParallelConfig(dp=2, ep=2, tp=2, sp=True),
            refusal.format(cls="MiniMaxDecoderLayer", layout=r"dp 2 x ep 2 x tp 2 \+ SP", what=r"output differs by"),
        ),
        (
            mock.patch.object(tp_plan, "_gather_spanning_norms", lambda plan, _parts: plan),
            "bitnet",
            ParallelConfig(dp=4, tp=2),
            refusal.format(
                cls="BitNetDecoderLayer",
                layout="dp 4 x tp 2",
                what=r"forward and backward \(the split block raised RuntimeError",
            ),
        ),
        (
            mock.patch.object(tp_plan, "_own_split_outputs", lambda *_: None),
            "olmo",
            ParallelConfig(dp=4, tp=2),
            refusal.format(cls="OlmoDecoderLayer", layout="dp 4 x tp 2", what=r"forward and backward .* is a view"),
        ),
        # HY-V4's per-head attention sinks left whole while its heads are split.
        (
            mock.patch.object(tp_plan, "_head_split_params", lambda *_: {}),
            "hy_v4",
            ParallelConfig(dp=4, tp=2),
            refusal.format(
                cls="HYV4DecoderLayer",
                layout="dp 4 x tp 2",
                what=r"forward and backward \(the split block raised RuntimeError",
            ),
        ),
    ]
    for switched_off, name, layout, message in controls:
        with switched_off:
            with pytest.raises(ConfigError, match=message):
                parallelize_hf_model(_family_model(name), layout_mesh(layout), **parallelize_options(layout))
    switched_off, _, layout, _ = controls[0]
    with switched_off:  # the check off: the wrong split is accepted
        parallelize_hf_model(
            _family_model("minimax"), layout_mesh(layout), **parallelize_options(replace(layout, prove_blocks=False))
        )
    # load_hf_checkpoint's model is split on the meta device: its check runs on a twin with the folder's weights.
    folder = Path(out) / "olmo"
    if dist.get_rank() == 0:
        _family_model("olmo").save_pretrained(folder)
    dist.barrier()
    switched_off, _, layout, message = controls[2]
    with switched_off:
        with pytest.raises(ConfigError, match=message):
            load_hf_checkpoint(folder, layout_mesh(layout), **parallelize_options(layout))
        load_hf_checkpoint(folder, layout_mesh(layout), **parallelize_options(replace(layout, prove_blocks=False)))
    # Not a control: cp's ring serves softmax attention only; MiniMax's lightning attention would see only
    # this rank's chunks, and the refusal names it (found by what it does: token 0 moves its later outputs).
    with pytest.raises(
        ConfigError,
        match=refusal.format(cls="MiniMaxDecoderLayer", layout="dp 4 x cp 2", what="output differs by")
        + r".* on a probe batch. 'self_attn' \(MiniMaxLightningAttention\) mixes tokens along the "
        r"sequence and is not softmax attention, the only mixer cp's ring attention serves: .* Set "
        r"\[parallel\] cp = 1 for this family",
    ):
        parallelize_hf_model(_family_model("minimax"), layout_mesh(ParallelConfig(dp=4, cp=2)))
    # Nor this: Zamba2's hybrid layers take the whole-sequence embedding output beside the SP-split stream.
    with pytest.raises(
        ConfigError,
        match=r"block 1 \(Zamba2HybridLayer\) split at dp 4 x tp 2 \+ SP .* Zamba2HybridLayer "
        r"takes 'original_hidden_states' \[1, 16, 64\] beside its hidden states \[1, 16, 64\], along the same "
        r"tokens: under SP the stream is split along the sequence, that input is not. Set \[parallel\] sp = "
        r"false for this family",
    ):
        parallelize_hf_model(_family_model("zamba2"), layout_mesh(ParallelConfig(dp=4, tp=2)), sp=True)


def _check_stream_refused(out: str) -> None:
    """DeepSeek-V4's blocks take [batch, sequence, hc_mult, hidden] streams: SP, cp and pp, which assume
    [batch, sequence, hidden], are refused naming the block class and the shape, before any collective; by
    load_hf_checkpoint too (its model has no weights to probe: checked on its twin)."""
    refusal = (
        r"DeepseekV4DecoderLayer takes hidden states of shape \[1, {n}, 2, 64\] for one row of {n} tokens "
        r"\(the sequence at dim 1\), not \[batch, sequence, hidden\]; {what} that layout of the residual "
        r"stream. Set \[parallel\] {fix} "
    )
    for layout, n, what, fix in [
        (ParallelConfig(dp=4, tp=2, sp=True), 4, "SP assumes", "sp = false"),
        (ParallelConfig(dp=2, cp=2, tp=2, sp=True), 8, "SP and cp assume", "sp = false and cp = 1"),
        (ParallelConfig(pp=2, dp=4), 2, "pp assumes", "pp = 1"),
    ]:
        with pytest.raises(ConfigError, match=refusal.format(n=n, what=what, fix=fix)):
            parallelize_hf_model(_family_model("deepseek_v4"), layout_mesh(layout), **parallelize_options(layout))
    folder = Path(out) / "deepseek_v4"  # meshtron's writer keeps the model's names (save_pretrained converts V4's)
    save_hf_checkpoint(_family_model("deepseek_v4"), folder)
    with pytest.raises(ConfigError, match=refusal.format(n=4, what="SP assumes", fix="sp = false")):
        load_hf_checkpoint(folder, layout_mesh(ParallelConfig(dp=4, tp=2)), sp=True)
    _check_converted_folder(Path(out) / "deepseek_v4_pretrained")


def _check_converted_folder(folder: Path) -> None:
    """DeepSeek-V4's save_pretrained folder (its original per-expert names, converted by transformers on load)
    loads through from_pretrained on every rank: the same weights and loss as the model that wrote it, the
    whole folder's bytes read."""
    source = _family_model("deepseek_v4")
    if dist.get_rank() == 0:
        source.save_pretrained(folder)
    dist.barrier()
    mesh = layout_mesh(ParallelConfig(dp=2, tp=4))
    model, read = load_hf_checkpoint(folder, mesh)
    assert read == sum(f.stat().st_size for f in folder.glob("*.safetensors")), read
    ids, labels, mask = _batch(batch_mesh(mesh).size(), seed=0)
    loss = model(input_ids=_local(ids, mesh), labels=_local(labels, mesh), attention_mask=_local(mask, mesh)).loss
    assert_parity(
        "deepseek_v4 from its save_pretrained folder",
        loss,
        source(input_ids=ids, labels=labels, attention_mask=mask).loss,
    )


def check_errors(folders: dict[str, str], out: str) -> None:
    _check_stream_refused(out)
    mesh = layout_mesh(ParallelConfig(dp=2, tp=4))
    model = _reference(folders["llama"])
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "local_packed_rowwise"}
    with pytest.raises(
        ConfigError, match=r"unknown tp plan style 'local_packed_rowwise' \(for module 'layers.<i>.mlp.gate_proj'"
    ):
        parallelize_hf_model(model, mesh)
    model.config.base_model_tp_plan = {
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.q_proj.weight": "colwise",
    }
    with pytest.raises(ConfigError, match="names a parameter"):
        parallelize_hf_model(model, mesh)
    with pytest.raises(ConfigError, match="ep = 2 needs a MoE model"):
        parallelize_hf_model(_reference(folders["llama"]), layout_mesh(ParallelConfig(dp=2, ep=2, tp=2)))
    _check_direct_mlp(layout_mesh(ParallelConfig(tp=8)))
    _check_shared_parameter_kept()
    moe = _reference(folders["qwen2_moe"])
    moe.config.base_model_ep_plan = None
    with pytest.raises(ConfigError, match="no base_model_ep_plan entry .* is not a MoE whose router scores scale"):
        parallelize_hf_model(moe, layout_mesh(ParallelConfig(dp=4, ep=2)))
    with pytest.raises(ConfigError, match=r"etp = 2 is not supported for transformers experts yet .*use etp = 1"):
        parallelize_hf_model(
            _reference(folders["qwen2_moe"]), layout_mesh(ParallelConfig(dp=2, ep=2, tp=4, etp=2, fold_ep=True))
        )


def test_expert_layouts():
    """Fused expert layouts are told apart by transformers' layout attributes and the activation, not the
    class: Mixtral's SiLU experts, Aria's transposed ones and gpt-oss's clamped ones are dispatched; gpt-oss's experts
    with another activation are refused at ep > 1 naming what was found, and left whole at ep = 1."""
    from meshtron.hf.experts import hf_expert_modules
    from meshtron.hf.runner import hf_fp8_note

    def classes(model, ep: int) -> dict[str, str]:
        return {name: cls.__name__ for name, (_, cls) in hf_expert_modules(model, ep).items()}

    names = [f"model.layers.{i}.mlp.experts" for i in range(TINY["num_hidden_layers"])]
    for family, cls in EXPERT_CLASSES.items():
        model = _family_model(family)
        experts = {n for n, _ in model.named_modules() if n.endswith(".experts")}
        assert len(experts) == len(_sparse_layers(model.config)) and classes(model, 2) == dict.fromkeys(experts, cls), (
            family
        )
    other_activation = _family_model("gpt_oss")
    other_activation.model.layers[1].mlp.experts._apply_gate = lambda gate_up: (
        gate_up[..., ::2].sigmoid() * gate_up[..., 1::2]
    )
    with pytest.raises(
        ConfigError,
        match=r"ep = 2: experts 'model.layers.1.mlp.experts' \(GptOssExperts\) are not in a "
        r"layout .*'is_concatenated': False.*'alpha': 1.702.*supported: SiLU-gated .*; clamped GLU",
    ):
        hf_expert_modules(other_activation, 2)
    with pytest.warns(
        UserWarning, match=r"1 experts modules stay whole on every tp rank .*'model.layers.1.mlp.experts'"
    ):
        assert classes(other_activation, 1) == {names[0]: "ClampedExpertParallel"}
    # Under [train] fp8 those run as transformers' own module, in the training dtype: the start-up line says so.
    assert hf_fp8_note(other_activation, "rowwise") == (
        "meshtron: fp8 = 'rowwise': experts meshtron's dispatch does not run stay in the training dtype: "
        "model.layers.*.mlp.experts"
    )
    _check_router_scaled_refusals()
    recurrent = _family_model("gain_llama")  # [heads, d, d] gating weights in a model without experts: not experts
    recurrent.model.layers[0].self_attn.gates = torch.nn.Parameter(torch.randn(8, 8, 8))
    assert hf_expert_modules(recurrent, 1) == {}


def _check_router_scaled_refusals() -> None:
    """Llama 4's experts, outside any ep plan, are taken for what their block and forward compute on probe
    values: another activation is refused naming the layout, a block weighting the outputs instead of the
    inputs is refused as a MoE whose dispatch is unknown."""
    from meshtron.hf.experts import hf_expert_modules

    other_activation = _family_model("llama4")
    other_activation.model.layers[1].feed_forward.experts.act_fn = torch.nn.GELU()
    with pytest.raises(
        ConfigError,
        match=r"ep = 2: experts 'model.layers.1.feed_forward.experts' \(Llama4TextExperts\) of "
        r"a router-scaled MoE are not in a layout .*supported: SiLU-gated .*\(Llama 4\)",
    ):
        hf_expert_modules(other_activation, 2)
    weighted_outputs = _family_model("llama4")
    block = weighted_outputs.model.layers[1].feed_forward

    def forward(hidden_states):  # the router's scores applied after the experts, not before
        x = hidden_states.reshape(-1, block.hidden_dim)
        scores, logits = block.router(x)
        out = block.experts(x.repeat(scores.shape[1], 1)).view(scores.shape[1], *x.shape)
        return block.shared_expert(x) + (out * scores.t()[..., None]).sum(0), logits

    block.forward = forward
    with pytest.raises(
        ConfigError,
        match=r"'model.layers.1.feed_forward.experts' holds stacked expert weights but "
        r"Llama4ForCausalLM's config has no base_model_ep_plan entry .*block 'model.layers.1.feed_forward' "
        r"\(Llama4TextMoe\) is not a MoE whose router scores scale the experts' inputs",
    ):
        hf_expert_modules(weighted_outputs, 2)


def test_tp_plan_styles():
    """Every tp-plan style transformers registers is translated or refused by name; an unknown one is a
    ConfigError naming the style and the module; an entry for the input embedding (transformers 5.24's
    ``embedding_rowwise``) is left to meshtron's vocab-parallel embedding, one for another embedding refused."""
    from types import SimpleNamespace

    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from meshtron.hf.experts import _EP_STYLES
    from meshtron.hf.tp_plan import _REFUSED, _STYLES, _base_plan

    layer = torch.nn.Module()
    layer.mlp = torch.nn.ModuleDict({"x": torch.nn.Linear(1, 1), "up_embed": torch.nn.Embedding(2, 1)})
    parts = SimpleNamespace(plan_embed="embed_tokens", plan_blocks="layers", block_items=lambda: [(0, layer)])

    def plan_of(plan):
        return _base_plan(SimpleNamespace(config=SimpleNamespace(base_model_tp_plan=plan)), parts)

    # transformers registers the base_model_ep_plan styles in the same table once its MoE code is
    # imported (so it depends on test order); those belong to the expert-parallel path.
    tp_styles = set(ALL_PARALLEL_STYLES) - set(_EP_STYLES)
    assert tp_styles <= set(_STYLES) | set(_REFUSED), tp_styles - set(_STYLES) - set(_REFUSED)
    plan = {f"layers.*.m{i}": style for i, style in enumerate(_STYLES)}
    assert plan_of(plan) == plan
    for style in _REFUSED:
        with pytest.raises(
            ConfigError, match=f"tp plan style '{style}' \\(for module 'layers.<i>.mlp.x'\\) is not supported"
        ):
            plan_of({"layers.*.mlp.x": style})
    with pytest.raises(
        ConfigError, match=r"unknown tp plan style 'colwise_future' \(for module 'layers.<i>.self_attn.qkv'"
    ):
        plan_of({"layers.*.self_attn.qkv": "colwise_future"})
    # Fused experts follow base_model_ep_plan, whatever their tp style.
    assert plan_of({"layers.*.mlp.experts.gate_up_proj": "moe_tp_experts"})
    assert plan_of({"embed_tokens": "embedding_rowwise", "layers.*.mlp.up_proj": "colwise"}) == {
        "layers.*.mlp.up_proj": "colwise"
    }
    with pytest.raises(
        ConfigError, match=r"'embedding_rowwise' \(for module 'layers.<i>.mlp.up_embed'\) is not supported"
    ):
        plan_of({"layers.*.mlp.up_embed": "embedding_rowwise"})
    # An entry for a part this model lacks refuses nothing (Qwen4-Exp's n-gram embeddings without ple_layer_ids).
    assert plan_of({"layers.*.ple.ngram_embedding": "embedding_colwise", "layers.*.mlp.x": "colwise"}) == {
        "layers.*.mlp.x": "colwise"
    }


@launch_tests(
    8,
    [
        check_native_sliced_loading,
        check_families,
        check_parity_and_training_quick,
        check_parity_and_training,
        check_from_pretrained_then_parallelize,
        check_bytes_read_per_rank,
        check_errors,
        check_block_proof_refuses,
    ],
    timeout=900,
)
def test_hf_parallelize_8_ranks(tmp_path):
    folders = _save_models(tmp_path)
    folders.update({f"native_{k}": v for k, v in _save_native(tmp_path).items()})
    yield folders, str(tmp_path)
    if (tmp_path / "bytes.json").exists():  # written by check_bytes_read_per_rank, when selected
        for arch, report in json.loads((tmp_path / "bytes.json").read_text()).items():
            print(f"{arch}: bytes read per rank: {report['per_rank']} of {report['total']}")
    if (tmp_path / "expert_comms.json").exists():  # by check_parity_and_training
        comms = json.loads((tmp_path / "expert_comms.json").read_text())
        for where, read in comms.pop("twin_bytes").items():
            print(f"{where}: load_hf_checkpoint's block check read {read['twin']} of {read['checkpoint']} bytes whole")
        print(f"expert all-to-alls: {comms}")


# family config class, extra config -> (decoder, blocks, embed, head, final norm, rotary) paths
DISCOVERY = {
    "GPT2Config": (
        dict(n_embd=64, n_layer=2, n_head=8, vocab_size=128),
        ("transformer", "transformer.h", "transformer.wte", "lm_head", "transformer.ln_f", None),
    ),
    "GPTNeoXConfig": (
        dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8),
        (
            "gpt_neox",
            "gpt_neox.layers",
            "gpt_neox.embed_in",
            "lm_head",
            "gpt_neox.final_layer_norm",
            "gpt_neox.rotary_emb",
        ),
    ),
    "OPTConfig": (
        dict(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            ffn_dim=96,
            word_embed_proj_dim=64,
        ),
        (
            "model.decoder",
            "model.decoder.layers",
            "model.decoder.embed_tokens",
            "lm_head",
            "model.decoder.final_layer_norm",
            None,
        ),
    ),
    "BloomConfig": (
        dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=8),  # plus an embedding norm
        ("transformer", "transformer.h", "transformer.word_embeddings", "lm_head", "transformer.ln_f", None),
    ),
    # The one norm, before and after the blocks (also its embedding norm).
    "NanoChatConfig": (
        dict(SMALL, num_key_value_heads=4),
        ("model", "model.layers", "model.embed_tokens", "lm_head", "model.norm", "model.rotary_emb"),
    ),
    # No _no_split_modules: the one list of num_hidden_layers modules of one class.
    "BioGptConfig": (
        dict(SMALL, intermediate_size=96),
        ("biogpt", "biogpt.layers", "biogpt.embed_tokens", "output_projection", "biogpt.layer_norm", None),
    ),
    "Qwen2Config": (
        dict(SMALL, num_key_value_heads=4),
        ("model", "model.layers", "model.embed_tokens", "lm_head", "model.norm", "model.rotary_emb"),
    ),
    "Lfm2Config": (
        dict(SMALL, num_key_value_heads=4, layer_types=["conv", "full_attention"]),  # norm run after the blocks
        ("model", "model.layers", "model.embed_tokens", "lm_head", "model.embedding_norm", "model.rotary_emb"),
    ),
    "Llama4TextConfig": (
        dict(SMALL, num_key_value_heads=4, intermediate_size_mlp=96, num_local_experts=4),
        ("model", "model.layers", "model.embed_tokens", "lm_head", "model.norm", "model.rotary_emb"),
    ),
    # One rotary module holding a set of frequencies per layer type (sliding_attention_inv_freq, ...).
    "Gemma3TextConfig": (
        dict(SMALL, num_key_value_heads=4),
        ("model", "model.layers", "model.embed_tokens", "lm_head", "model.norm", "model.rotary_emb"),
    ),
}


EMBEDDING_NORMS = {"BloomConfig": "transformer.word_embeddings_layernorm", "NanoChatConfig": "model.norm"}
BIOGPT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8)


def test_hf_parts_discovery():
    """hf_parts finds each family's decoder, blocks, embeddings, head, final norm and rotary embedding
    by the model's API (meta device, no weights); a model without them is a ConfigError naming the part."""
    import transformers

    from meshtron.hf.discover import hf_parts

    for cls, (extra, expected) in DISCOVERY.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**extra))
        parts = hf_parts(model)
        found = (
            parts.decoder_path,
            parts.blocks_path,
            parts.embed_path,
            parts.head_path,
            parts.norm_path,
            parts.rotary_path,
        )
        assert found == expected, cls
        assert parts.embed_norm_path == EMBEDDING_NORMS.get(cls), cls
        assert parts.blocks is model.get_submodule(parts.blocks_path) and len(parts.blocks) == 2, cls
        assert parts.plan_blocks == expected[1].rsplit(".", 1)[1], cls
        model._no_split_modules = ["SomethingElse"]
        with pytest.raises(
            ConfigError, match=f"cannot find the decoder blocks of {type(model).__name__}: 0 nn.ModuleLists"
        ):
            hf_parts(model)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.BioGptConfig(**BIOGPT))
    model.config.num_hidden_layers = 3
    with pytest.raises(
        ConfigError,
        match=r"BioGptForCausalLM: it declares no _no_split_modules, and 0 nn.ModuleLists in its decoder hold "
        r"config.num_hidden_layers = 3 modules of one class \(need exactly one\)",
    ):
        hf_parts(model)


def test_parts_found_by_what_they_do():
    """cp's ring serves every module that calls transformers' attention interface, whatever its name (CodeGen's
    `attn`, GPT-NeoX's `attention`; Jamba and Lfm2 only in their attention layers): looked up as `self_attn`, cp
    crashed on these families (AttributeError). Qwen4-Exp's decoder ends in a hyper-connection mixer, no norm:
    that is the part run on the blocks' output."""
    import transformers

    from meshtron.hf.context import _attention_modules
    from meshtron.hf.discover import hf_parts

    def meta_family(name):
        cls, cfg, _ = FAMILIES[name]
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**cfg))

    expected = {
        "codegen": ["CodeGenAttention"] * 2,
        "gpt_neox": ["GPTNeoXAttention"] * 2,
        "jamba": ["JambaAttention"],
        "lfm2": ["Lfm2Attention"],
        "olmo": ["OlmoAttention"] * 2,
    }
    for name, classes in expected.items():
        assert [type(m).__name__ for m in _attention_modules(meta_family(name))] == classes, name
    assert hf_parts(meta_family("qwen4_exp")).norm_path == "model.hyper_connection_mixer"


def test_token_mixers_found_by_what_they_do():
    """The parts cp's ring cannot serve, named in the block check's cp refusal, are found by running each part
    again with its first token changed (no names, no classes): mamba, convolution and linear-attention mixers
    are found, a softmax attention (served by the ring) and per-token parts (MLPs, norms, projections) are not."""
    from meshtron.hf import prove

    expected = {
        "olmo": {0: [], 1: []},
        "lfm2": {0: ["'conv' (Lfm2ShortConv)"], 1: []},
        "falcon_h1": {0: ["'mamba' (FalconH1Mixer)"]},
        "minimax": {0: ["'self_attn' (MiniMaxLightningAttention)"]},
        "jamba": {0: ["'mamba' (JambaMambaMixer)"], 1: []},
    }
    for name, per_block in expected.items():
        model = _family_model(name).eval()
        blocks = list(enumerate(hf_parts(model).blocks))
        ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        # B023: _capture_inputs runs the lambda at once, in this iteration.
        inputs = prove._capture_inputs(blocks, lambda: model(input_ids=ids, use_cache=False))  # noqa: B023
        for index, mixers in per_block.items():
            args, kwargs = inputs[index]
            found = prove._unserved_mixers(blocks[index][1], args, kwargs, prove._hidden_of(args, kwargs))
            assert found == mixers, (name, index, found)


def test_inferred_tp_plans():
    """Plans inferred from module types (meta device, no ranks), in transformers' style names; a part tp
    cannot divide stays whole with one warning naming it and why."""
    import transformers

    from meshtron.hf.discover import hf_parts
    from meshtron.hf.infer import infer_tp_plan, with_mla_attention

    def meta_model(name, **change):
        cls, cfg, _ = FAMILIES[name]
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**cfg, **change}))

    def plan(name, tp=4, **change):
        model = meta_model(name, **change)
        return infer_tp_plan(model, hf_parts(model), tp)

    def config_plan(name, layer=0):
        model = meta_model(name)
        parts = hf_parts(model)
        given = model.config.base_model_tp_plan
        return given, with_mla_attention(given, parts.plan_blocks, parts.blocks[layer])

    assert plan("gpt2") == {
        "h.*.attn.c_attn": "colwise_gather_output",
        "h.*.attn.c_proj": "rowwise_split_input",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    }
    assert plan("falcon") == {
        "h.*.self_attention.query_key_value": "colwise_gather_output",
        "h.*.self_attention.dense": "rowwise_split_input",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    }
    assert plan("stablelm")["layers.*.self_attn.q_proj"] == "colwise_gather_output"  # reshapes by num_heads
    mla = {
        f"layers.*.self_attn.{p}": style
        for p, style in [
            ("q_b_proj", "colwise"),
            ("kv_a_proj_with_mqa", "mla_kv_a_proj"),
            ("kv_b_proj", "colwise"),
            ("o_proj", "rowwise"),
        ]
    }
    assert plan("deepseek_v3") == mla | {f"layers.*.mlp.{p}_proj": "colwise" for p in ("gate", "up")} | {
        "layers.*.mlp.down_proj": "rowwise"
    }  # block 0 is dense
    assert plan("deepseek_v2")["layers.*.self_attn.q_proj"] == "colwise"  # no q down projection
    given, completed = config_plan("deepseek_v3")  # a config plan naming nothing of the MLA attention gets it
    assert completed == given | mla
    given, completed = config_plan("deepseek_v2")  # one naming it stays as it is
    assert completed == given
    # Found in each layer that has it: Kimi Linear's layer 1 (MLA) gets the entries, its layer 0's delta
    # attention (q_proj and o_proj of its own) gets none.
    given, completed = config_plan("kimi_linear", layer=1)
    assert completed == given | {
        f"layers.*.self_attn.{p}": style
        for p, style in [
            ("q_proj", "colwise"),
            ("kv_a_proj_with_mqa", "mla_kv_a_proj"),
            ("kv_b_proj", "colwise"),
            ("o_proj", "rowwise"),
        ]
    }
    given, completed = config_plan("kimi_linear", layer=0)
    assert completed == given
    assert plan("gpt_oss") == {
        f"layers.*.self_attn.{p}": "colwise_gather_output" for p in ("q_proj", "k_proj", "v_proj")
    } | {"layers.*.self_attn.o_proj": "rowwise_split_input"}  # sinks: per-head parameters; experts elsewhere
    with pytest.warns(
        UserWarning,
        match=r"^parallelize_hf_model: GPT2LMHeadModel has no base_model_tp_plan; the inferred "
        r"plan leaves these parts unsplit over tp \(FSDP still shards them; under SP they run on the gathered "
        r"sequence\): MLP 'h.\*.mlp' \(GPT2MLP\): "
        r"tp = 2 does not divide the features of 'c_fc' \(64, 95\).$",
    ):
        found = plan("gpt2", tp=2, n_inner=95)
    assert "h.*.mlp.c_fc" not in found
    # OPT's and BioGPT's MLP projections are children of the block itself (no MLP module).
    with torch.device("meta"):
        biogpt = transformers.AutoModelForCausalLM.from_config(transformers.BioGptConfig(**BIOGPT))
    found = infer_tp_plan(biogpt, hf_parts(biogpt), 4)
    assert {k: v for k, v in found.items() if "self_attn" not in k} == {
        "layers.*.fc1": "colwise",
        "layers.*.fc2": "rowwise",
    }
    with torch.device("meta"):
        biogpt = transformers.AutoModelForCausalLM.from_config(
            transformers.BioGptConfig(**BIOGPT, intermediate_size=95)
        )
    with pytest.warns(
        UserWarning,
        match=r"MLP in 'layers.\*' \['fc1', 'fc2'\]: tp = 2 does not divide the features of 'fc1' \(64, 95\)",
    ):
        assert "layers.*.fc1" not in infer_tp_plan(biogpt, hf_parts(biogpt), 2)
