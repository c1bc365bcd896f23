"""The CUDA path on one device, in one process: bf16 parity with transformers, grouped-GEMM experts,
the ring-attention block kernels, fused attention with GQA, a step without host syncs, the fused loss
at the 7B vocabulary and the planner's memory against the allocator's peak (``conftest.py``: what
runs here without CUDA)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from meshtron import env
from meshtron.config import ModelConfig, load_config
from meshtron.hf import from_hf
from meshtron.models import build_model, token_loss_sum
from meshtron.models.chunked_loss import linear_cross_entropy_sum
from meshtron.models.moe import Router, grouped_swiglu
from meshtron.models.qwen2 import CausalAttention
from meshtron.parallel import context
from meshtron.testing import rel_err

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import mfu  # noqa: E402 - the benchmark measures the step the checks below need

BF16 = torch.bfloat16


def on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def pick(device: torch.device, cuda, cpu):
    """The GPU size on CUDA, a small stand-in on the CPU."""
    return cuda if on_cuda(device) else cpu


def require_cuda(device: torch.device, what: str) -> None:
    if not on_cuda(device):
        pytest.skip(f"{what} needs CUDA")


# --------------------------------------------------------------------------------------------
# bf16 model parity with transformers
# --------------------------------------------------------------------------------------------

SMALL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
SMALL_MOE = dict(
    SMALL,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    router_aux_loss_coef=0.0,
)  # transformers adds it only with labels


def _pair(kind: str, device: torch.device):
    """transformers' model and meshtron's with the same random fp32 weights, on ``device``."""
    torch.manual_seed(0)
    shape = SMALL if kind == "dense" else SMALL_MOE
    cls, config = (Qwen2ForCausalLM, Qwen2Config) if kind == "dense" else (Qwen2MoeForCausalLM, Qwen2MoeConfig)
    hf = cls(config.from_dict(dict(shape), attn_implementation="sdpa")).to(device).train()
    with torch.no_grad():  # decisive routing: near-ties would flip experts between fp32 and bf16 at random
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(5.0)
    cfg = ModelConfig(**shape)
    ours = build_model(cfg).to(device).train()
    ours.load_state_dict(from_hf(hf.state_dict(), cfg), strict=not cfg.tie_word_embeddings)
    ours.tie_weights()
    return hf, ours, cfg


def _loss_and_grads(model, ids: torch.Tensor, hf: bool, cfg: ModelConfig):
    logits = model(ids).logits if hf else model(ids)
    loss = token_loss_sum(logits[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    return loss.float(), logits.float().detach(), (from_hf(grads, cfg) if hf else grads)


def _routes(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's chosen experts per token (sorted), from meshtron's routers."""
    chosen = []
    hooks = [
        m.register_forward_hook(lambda m, args, out: chosen.append(out.experts.sort(-1).values))
        for m in model.modules()
        if isinstance(m, Router)
    ]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return chosen


def _routed_as_in_fp32(ours, ours16, cfg: ModelConfig, seq: int, device: torch.device, tries: int = 20) -> torch.Tensor:
    """Random token ids that the bf16 model routes exactly as the fp32 one (the first of ``tries`` draws):
    bf16 rounding flips a near-tie between experts at random (seen on an H100 at 128 tokens), and the
    gradients compare expert by expert only under the same routes."""
    for _ in range(tries):
        ids = torch.randint(0, cfg.vocab_size, (2, seq), device=device)
        fp32_routes = _routes(ours, ids)  # fp32 GQA attention has no fused CUDA kernel: the math one runs it
        with env.fused_attention_only(device):
            if all(torch.equal(a, b) for a, b in zip(_routes(ours16, ids), fp32_routes)):
                return ids
    pytest.fail(f"no draw of {tries} was routed alike in bf16 and fp32")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_model_matches_transformers(device, kind):
    """In bf16 meshtron departs from the fp32 result no further than transformers does in bf16 (MoE:
    with every token routed as in fp32, so that gradients compare expert by expert)."""
    hf, ours, cfg = _pair(kind, device)
    ours16 = copy.deepcopy(ours).to(BF16)
    ids = _routed_as_in_fp32(ours, ours16, cfg, pick(device, 1024, 128) if kind == "dense" else 128, device)
    ref_loss, ref_logits, ref_grads = _loss_and_grads(hf, ids, True, cfg)
    with env.fused_attention_only(device):
        hf_loss, hf_logits, hf_grads = _loss_and_grads(copy.deepcopy(hf).to(BF16), ids, True, cfg)
        our_loss, our_logits, our_grads = _loss_and_grads(ours16, ids, False, cfg)
    assert rel_err(our_loss, ref_loss) <= 2 * rel_err(hf_loss, ref_loss) + 1e-3
    assert rel_err(our_logits, ref_logits) <= 1.5 * rel_err(hf_logits, ref_logits) + 1e-3
    # Two correct bf16 backwards differ by roundings of their own: each gradient's error (relative to its
    # largest entry) is ~bf16's epsilon either way, and which of the two is larger is chance (the router
    # gate's ratio was 2.0 on an AVX2-only CPU, the other gradients' 0.6-1.6). Allowed: transformers' error
    # x 1.5 plus one bf16 epsilon.
    eps = torch.finfo(BF16).eps
    for name, ref in ref_grads.items():
        ours_err, theirs_err = rel_err(our_grads[name], ref), rel_err(hf_grads[name], ref)
        assert ours_err <= 1.5 * theirs_err + eps, f"{name}: meshtron {ours_err:.2e}, transformers {theirs_err:.2e}"


# --------------------------------------------------------------------------------------------
# Grouped-GEMM experts in bf16
# --------------------------------------------------------------------------------------------


def _experts_loop(x, counts, gate, up, down):
    """Each expert's SwiGLU on its rows, one at a time, in fp32."""
    out, start = [], 0
    for g, n in enumerate(counts.tolist()):
        rows = x[start : start + n]
        out.append((F.silu(rows @ gate[g]) * (rows @ up[g])) @ down[g])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(
    "counts",
    [[0, 37, 1, 0, 150, 5, 60, 3], [0, 0, 256, 0, 0, 0, 0, 0], [0] * 8],
    ids=["uneven", "one-expert", "no-tokens"],
)
def test_grouped_experts_bf16_forward_and_backward(device, counts):
    """Uneven rows per expert, empty experts and an empty batch (an EP rank that receives nothing);
    an inner size (100) that grouped_mm's alignment pads."""
    torch.manual_seed(0)
    experts, hidden, inner = len(counts), 256, 100
    counts = torch.tensor(counts, device=device)
    x = torch.randn(int(counts.sum()), hidden, device=device)
    weights = [
        torch.randn(experts, *shape, device=device) / shape[0] ** 0.5
        for shape in ((hidden, inner), (hidden, inner), (inner, hidden))
    ]
    dy = torch.randn(x.shape[0], hidden, device=device)
    leaves = [t.to(BF16).requires_grad_() for t in (x, *weights)]
    grouped_swiglu(leaves[0], counts, *leaves[1:]).backward(dy.to(BF16))
    ref = [t.clone().requires_grad_() for t in (x, *weights)]
    want = _experts_loop(ref[0], counts, *ref[1:])
    want.backward(dy)
    got = grouped_swiglu(leaves[0].detach(), counts, *(w.detach() for w in leaves[1:]))
    assert got.dtype == BF16 and got.shape == want.shape
    assert all(leaf.grad.dtype == BF16 for leaf in leaves)
    if x.shape[0]:
        assert rel_err(got, want) < 2e-2
        for name, leaf, r in zip(("x", "gate", "up", "down"), leaves, ref):
            assert rel_err(leaf.grad, r.grad) < 2e-2, name
    empty = counts == 0
    for leaf in leaves[1:]:
        assert not leaf.grad[empty].any(), "an expert without tokens got a gradient"


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_experts_float8_kernel_matches_the_cpu_emulation(device, recipe):
    """The experts' float8 grouped GEMMs through torch._scaled_grouped_mm on an H100 / H200 against the CPU's
    emulation of the same float8 values (tests/test_float8.py holds both to their contract without a GPU):
    uneven groups, an empty one, groups no multiple of 16 (the weight gradient's realigned)."""
    pytest.importorskip("torchao")
    from meshtron.parallel.float8 import Float8GroupedMatmul, runs_float8_kernel

    if not runs_float8_kernel(device):
        pytest.skip("torch._scaled_grouped_mm runs on compute capability 9.x only")
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 10, 64, 1, 33, 0])
    x = torch.randn(int(counts.sum()), 256, generator=gen).to(BF16)
    w = torch.randn(len(counts), 256, 128, generator=gen).to(BF16) / 16
    dy = torch.randn(x.shape[0], 128, generator=gen).to(BF16)
    runs = []
    for where in (device, torch.device("cpu")):
        xr, wr = x.to(where).requires_grad_(), w.to(where).requires_grad_()
        out = Float8GroupedMatmul(recipe)(xr, wr, counts.to(where))
        out.backward(dy.to(where))
        runs.append([t.float().cpu() for t in (out, xr.grad, wr.grad)])
    for name, kernel, emulated in zip(("output", "input gradient", "weight gradient"), *runs):
        assert rel_err(kernel, emulated) < 1e-2, (recipe, name, rel_err(kernel, emulated))


# --------------------------------------------------------------------------------------------
# Ring attention's block kernels against full SDPA
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["aten", "math"])
def test_ring_block_kernels_match_full_sdpa(device, kernel):
    """Causal attention as ring attention computes it, but locally: the sequence in chunks, each q
    chunk merged over the kv chunks it sees (the diagonal one causal), and the per-block gradients
    from the merged output and log-sum-exp summed; against SDPA over the whole sequence."""
    torch.manual_seed(0)
    b, heads, kv_heads, seq, dim, chunks = 2, 8, 2, pick(device, 2048, 256), 128, 4
    q = torch.randn(b, heads, seq, dim, device=device, dtype=BF16)
    k, v = (torch.randn(b, kv_heads, seq, dim, device=device, dtype=BF16) for _ in range(2))
    dout = torch.randn_like(q)
    scale = dim**-0.5
    if on_cuda(device):
        assert context._kernel_name(q, "auto") == "aten", "bf16 on CUDA must take the flash kernel"
    qs, ks, vs, douts = (t.chunk(chunks, dim=2) for t in (q, k, v, dout))
    outs, lses = [], []
    for i in range(chunks):
        out, lse = context._empty_result(qs[i])
        for j in range(i + 1):
            context._merge(out, lse, *context.attention_block(qs[i], ks[j], vs[j], i == j, scale, kernel))
        outs.append(out)
        lses.append(lse)
    dq = [torch.zeros_like(t, dtype=torch.float32) for t in qs]
    dk = [torch.zeros_like(t, dtype=torch.float32) for t in ks]
    dv = [torch.zeros_like(t, dtype=torch.float32) for t in vs]
    for i in range(chunks):
        for j in range(i + 1):
            gq, gk, gv = context.attention_block_backward(
                douts[i], qs[i], ks[j], vs[j], outs[i], lses[i], i == j, scale, kernel
            )
            dq[i] += gq
            dk[j] += gk
            dv[j] += gv
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=True, scale=scale, enable_gqa=True)
    want.backward(dout.float())
    assert rel_err(torch.cat(outs, dim=2), want) < 1e-2
    for got, r in zip((dq, dk, dv), ref):
        assert rel_err(torch.cat(got, dim=2), r.grad) < 2e-2


# --------------------------------------------------------------------------------------------
# Fused attention with GQA: no silent fallback to the math kernel
# --------------------------------------------------------------------------------------------


def test_flash_attention_takes_gqa_without_math_fallback(device):
    """The model's attention with fewer kv heads runs on the flash kernel alone (SDPA raises when
    the only kernel allowed cannot take the inputs), forward and backward; document-masked
    attention on the fused kernels that take a mask."""
    torch.manual_seed(0)
    b, seq, dim = 2, pick(device, 4096, 256), 128
    q = torch.randn(b, 16, seq, dim, device=device, dtype=BF16, requires_grad=True)
    k, v = (torch.randn(b, 2, seq, dim, device=device, dtype=BF16, requires_grad=True) for _ in range(2))
    attention = CausalAttention()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = attention(q, k, v)
        out.float().square().sum().backward()
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    want.square().sum().backward()
    assert rel_err(out, want) < 1e-2
    assert all(rel_err(t.grad, r.grad) < 2e-2 for t, r in zip((q, k, v), ref))
    documents = torch.cat([torch.arange(seq // 4), torch.arange(seq - seq // 4)]).expand(b, -1).to(device)
    with env.fused_attention_only(device):
        masked = attention(q, k, v, documents)
    first = seq // 4
    assert rel_err(masked[:, :, :first], out[:, :, :first]) < 1e-2  # the first document sees only itself


# --------------------------------------------------------------------------------------------
# The training step: FSDP2, fused AdamW, no host sync (and compiled)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_step_has_no_host_sync(device, one_rank, compiled):
    """The trainer's own step on one rank (FSDP2 units, bf16 compute, fp32 master weights, fused
    AdamW with the on-device non-finite guard, clipping) under set_sync_debug_mode("error"): any
    host sync raises. The loss goes down."""
    require_cuda(device, "torch.cuda.set_sync_debug_mode (tests/test_syncs.py counts syncs on the CPU)")
    cfg = mfu.step_config(ModelConfig(**SMALL), "bfloat16", batch=4, seq=1024, compile=compiled)
    batch = torch.randint(0, cfg.model.vocab_size, (4, 1025), device=device)
    losses = mfu.run_meshtron(cfg, batch, device, steps=5, warmup=2, sync_check=True)["losses"]
    assert losses[-1] < losses[0], losses


# --------------------------------------------------------------------------------------------
# The fused loss at the 7B vocabulary
# --------------------------------------------------------------------------------------------


def test_fused_loss_at_7b_vocabulary(device):
    """Qwen2.5-7B's head (vocabulary 152064, hidden 3584) over 4096 bf16 tokens: loss and gradients
    as cross-entropy of the bf16 logits in fp32, and on CUDA the allocator's peak over the inputs is
    the planner's loss term (``meshtron.plan.moments.loss_bytes``), not the logits."""
    from meshtron.config import Config, TrainConfig
    from meshtron.plan.moments import loss_bytes

    torch.manual_seed(0)
    seven = load_config(ROOT / "recipes" / "qwen2p5_7b.toml").model
    vocab, hidden, tokens = pick(device, (seven.vocab_size, seven.hidden_size, 4096), (4096, 256, 256))
    h = torch.randn(tokens, hidden, device=device, dtype=BF16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) * 0.02).to(BF16).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[::7] = -100
    if on_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    loss = linear_cross_entropy_sum(h, w, labels, 1024)
    loss.backward()
    if on_cuda(device):
        extra = torch.cuda.max_memory_allocated(device) - before
        cfg = Config(
            model=ModelConfig(vocab_size=vocab, hidden_size=hidden),
            train=TrainConfig(dtype="bfloat16", seq_len=tokens, global_batch_size=1),
        )
        predicted = loss_bytes(cfg, 0)
        assert abs(extra / predicted - 1) < 0.1, (extra / 2**30, predicted / 2**30)
    ref_h, ref_w = h.detach().requires_grad_(), w.detach().requires_grad_()
    want = F.cross_entropy((ref_h @ ref_w.t()).float(), labels, ignore_index=-100, reduction="sum")
    want.backward()
    assert rel_err(loss, want) < 1e-4
    assert rel_err(h.grad, ref_h.grad) < 2e-2 and rel_err(w.grad, ref_w.grad) < 2e-2


# --------------------------------------------------------------------------------------------
# The planner's memory against the allocator
# --------------------------------------------------------------------------------------------


PLANNER_SHAPES = {
    "Qwen2.5-0.5B, seq 4096": ("qwen2p5_0p5b", None, 4096, {}),
    "Qwen2.5-1.5B (8 layers), seq 4096, full checkpointing": (
        "qwen2p5_1p5b",
        8,
        4096,
        {"activation_checkpointing": "full"},
    ),
    "Qwen2.5-7B (4 layers), seq 2048, 2 micro-batches": ("qwen2p5_7b", 4, 2048, {"microbatches": 2}),
}


@pytest.mark.parametrize("shape", list(PLANNER_SHAPES))
def test_planner_memory_within_10_percent_of_cuda_peak(device, one_rank, shape):
    """``meshtron.plan.predict_memory`` (allocated bytes: no context, no allocator slack) against
    ``torch.cuda.max_memory_allocated`` over real training steps of the same configuration."""
    require_cuda(device, "torch.cuda.max_memory_allocated")
    recipe, layers, seq, parallel = PLANNER_SHAPES[shape]
    model = load_config(ROOT / "recipes" / f"{recipe}.toml").model
    model.num_hidden_layers = layers or model.num_hidden_layers
    batch_size = parallel.get("microbatches", 1)
    cfg = mfu.step_config(model, "bfloat16", batch=batch_size, seq=seq, **parallel)
    batch = torch.randint(0, model.vocab_size, (batch_size, seq + 1), device=device)
    result = mfu.run_meshtron(cfg, batch, device, steps=2, warmup=1)
    error = result["predicted_memory_gib"] / result["peak_memory_gib"] - 1
    print(
        f"{shape}: measured {result['peak_memory_gib']:.2f} GiB, predicted {result['predicted_memory_gib']:.2f} "
        f"GiB ({100 * error:+.1f}%)"
    )
    assert abs(error) < 0.10, result
