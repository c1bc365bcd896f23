"""MXFP8 training (``[train] fp8 = "mxfp8"``, meshtron/parallel/mxfp8.py): a block linear's GEMMs as torchao's
MXFP8 linear computes them, split over tp and over tokens without a collective and without changing a value,
the experts' grouped GEMM as an MX linear per expert, what converts, and the loss on one rank against float32.

The layouts against their 1-rank MXFP8 run (dp, cp, pp under zero-bubble, tp + SP with and without tp_overlap,
folded ep with etp) run in test_expert_parallel.py's FP8 launch (:func:`check_debug_recipes_match_one_rank_mxfp8`),
tp's own check in test_tensor_parallel.py's (:func:`check_tp_matches_one_rank_mxfp8`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshtron.config import ConfigError, ModelConfig
from meshtron.models.moe import grouped_matmul
from meshtron.testing import cached_mesh, random_model, rel_err
from test_float8 import (
    CFG,
    FIRST_STEP_EXACT,
    FP8_VS_FP32,
    HAS_TORCHAO,
    LAYOUT_VS_ULP_NOISE,
    MOE,
    SP_GATHERS,
    TP_CFG,
    _float32_losses,
    _one_rank,
    _overlap_matches_the_split,
    _sp_gathers,
    _tp_model,
    _tp_steps,
    layout_gaps,
    one_rank_group,  # noqa: F401 (a fixture)
    ulp_noise_per_step,
)

pytestmark = pytest.mark.skipif(not HAS_TORCHAO, reason="FP8 needs the meshtron[fp8] extra")

if HAS_TORCHAO:
    from meshtron.parallel.float8 import apply_float8, gemms_in_training_dtype, high_precision_linears, split_gemms
    from meshtron.parallel.mxfp8 import MXGemms, MXGroupedMatmul, MXLinear

# A split that cuts no MX block leaves every cast as it is, so a split GEMM differs from the whole only by the
# order of its float32 sums (measured <= 6e-8 relative).
SPLIT_EXACT = 1e-6


def _operands(tokens: int = 64, k: int = 128, n: int = 96):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(tokens, k, generator=gen),
        torch.randn(n, k, generator=gen) * 0.1,
        torch.randn(tokens, n, generator=gen),
    )


def test_mx_linear_is_torchaos_mxfp8_linear():
    """MXLinear's output and both gradients are those of torchao's MXFP8 linear (emulated, RCEIL scales)."""
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    x, weight, dy = _operands()
    x = x.unflatten(0, (2, 32)).requires_grad_()
    reference = weight.clone().requires_grad_()
    want = _to_mxfp8_then_scaled_mm(x, reference, KernelPreference.EMULATED, ScaleCalculationMode.RCEIL)
    want_x, want_w = torch.autograd.grad(want, (x, reference), dy.unflatten(0, (2, 32)))
    linear = nn.Linear(128, 96, bias=False)
    linear.weight.data.copy_(weight)
    mx = MXLinear.from_linear(linear)
    assert mx is linear and type(mx) is MXLinear  # the same module and parameters, its class swapped
    got = mx(x)
    got_x, got_w = torch.autograd.grad(got, (x, mx.weight), dy.unflatten(0, (2, 32)))
    assert torch.equal(got, want) and torch.equal(got_x, want_x) and torch.equal(got_w, want_w)
    assert 1e-3 < rel_err(got, F.linear(x, weight)) < 0.1  # MX, not the training dtype


def test_mx_gemms_split_like_tp_and_over_tokens_without_changing_a_value():
    """Column-parallel (N in pieces of 32), row-parallel (K in pieces of 64) and a token split (T in pieces of
    32) give the whole GEMMs to float32 reassociation; a token split that cuts a block (24 + 24 of 48) can differ."""
    x, weight, dy = _operands()
    g = MXGemms()
    whole = (g.output(x, weight), g.grad_input(dy, weight), g.grad_weight(dy, x))
    cols = [slice(i, i + 32) for i in range(0, 96, 32)]
    col = [(g.output(x, weight[c]), g.grad_input(dy[:, c], weight[c]), g.grad_weight(dy[:, c], x)) for c in cols]
    assert rel_err(torch.cat([c[0] for c in col], 1), whole[0]) < SPLIT_EXACT
    assert rel_err(sum(c[1] for c in col), whole[1]) < SPLIT_EXACT  # partial input gradients summed over tp
    assert rel_err(torch.cat([c[2] for c in col], 0), whole[2]) < SPLIT_EXACT
    rows = [slice(0, 64), slice(64, 128)]
    row = [(g.output(x[:, r], weight[:, r]), g.grad_input(dy, weight[:, r]), g.grad_weight(dy, x[:, r])) for r in rows]
    assert rel_err(sum(r[0] for r in row), whole[0]) < SPLIT_EXACT  # partial outputs summed over tp
    assert rel_err(torch.cat([r[1] for r in row], 1), whole[1]) < SPLIT_EXACT
    assert rel_err(torch.cat([r[2] for r in row], 1), whole[2]) < SPLIT_EXACT
    halves = [slice(0, 32), slice(32, 64)]  # dp, cp, micro-batches, a ring's chunks: tokens apart
    assert rel_err(sum(g.grad_weight(dy[t], x[t]) for t in halves), whole[2]) < SPLIT_EXACT
    # 48 tokens, zero-padded to 64 whole, to 32 + 32 when split 24 + 24: token 30, 2^16 times larger, sets the
    # scale of tokens 0-31 whole, of 24-47 split. e4m3 keeps its 3 mantissa bits over 2^14 below a block's
    # largest value, so only what falls under that range differs: tokens 0-23 flush to (sub)normal zeros whole.
    x48, dy48 = x[:48].clone(), dy[:48]
    x48[30] *= 2.0**16
    split = g.grad_weight(dy48[:24], x48[:24]) + g.grad_weight(dy48[24:], x48[24:])
    small = (dy48[:24].t() @ x48[:24]).abs().max()  # what tokens 0-23 contribute
    assert (split - g.grad_weight(dy48, x48)).abs().max() / small > 1e-2


# Rows per expert: an empty group, groups not multiples of 32 (each padded to 32 on its own for the weight gradient).
GROUP_ROWS = (5, 0, 40, 19)


def test_mx_grouped_gemm_is_an_mx_linear_per_expert():
    """The experts' MX grouped GEMM: output, input and weight gradients equal an MXLinear's GEMMs run per
    expert on its rows; and in the training dtype while the block check's mode lasts."""
    counts = torch.tensor(GROUP_ROWS)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(int(counts.sum()), 64, generator=gen, requires_grad=True)
    w = (torch.randn(len(GROUP_ROWS), 64, 96, generator=gen) * 0.1).requires_grad_()
    out = MXGroupedMatmul()(x, w, counts)
    dy = torch.randn(out.shape, generator=gen)
    grad_x, grad_w = torch.autograd.grad(out, (x, w), dy)
    g, starts = MXGemms(), (torch.cumsum(counts, 0) - counts).tolist()
    for e, (start, n) in enumerate(zip(starts, GROUP_ROWS)):
        rows, weight = slice(start, start + n), w[e].detach().t()
        if n:
            assert torch.equal(out[rows], g.output(x[rows].detach(), weight)), e
            assert torch.equal(grad_x[rows], g.grad_input(dy[rows], weight)), e
            assert torch.equal(grad_w[e], g.grad_weight(dy[rows], x[rows].detach()).t()), e
        else:
            assert not grad_w[e].any()
    assert 1e-3 < rel_err(out, grouped_matmul(x, w, counts)) < 0.1
    with gemms_in_training_dtype():
        assert torch.equal(MXGroupedMatmul()(x, w, counts), grouped_matmul(x, w, counts))


def test_the_plan_counts_the_emulated_mx_casts_working_set():
    """MX_CAST_BYTES (meshtron.plan.activations, from torchao's to_mx) is what an emulated cast holds beside its
    operand, measured: the output GEMM's cast of a bf16 operand [T, C] (its GEMM's dequantized copy is smaller),
    and the weight gradient's, which first copies both operands transposed (along_tokens)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshtron.plan.activations import MX_CAST_BYTES

    def working_set(fn, *operands) -> int:
        tracker = MemTracker()
        tracker.track_external(*operands)
        with tracker:
            fn(*operands)
        peak = sum(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values())
        return peak - sum(t.numel() * t.element_size() for t in operands)

    g, (tokens, width, hidden) = MXGemms(), (1024, 512, 256)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=gen).bfloat16()
    dy = torch.randn(tokens, hidden, generator=gen).bfloat16()
    weight = g.weight_for_output(torch.randn(hidden, width, generator=gen).bfloat16())
    assert working_set(lambda a: g.output(a, weight), x) / x.numel() == pytest.approx(MX_CAST_BYTES, rel=0.01)
    # dy's MX copy (1 + 1/32 bytes an element) lives while x is copied (2) and cast.
    planned = (1 + 1 / 32) * dy.numel() + (2 + MX_CAST_BYTES) * x.numel()
    assert working_set(lambda a, b: g.grad_weight(b, a), x, dy) == pytest.approx(planned, rel=0.02)


def test_mxfp8_converts_the_block_linears_whose_dims_are_multiples_of_32():
    """mxfp8 takes block linears and routed experts whose dims are multiples of 32 (the MX block), lists the
    rest, and keeps the router, gates, embedding and head; the block check's mode runs them as F.linear."""
    cfg = ModelConfig(**dict(MOE, moe_intermediate_size=48))  # experts [64 -> 48]; k / v [64 -> 16]
    model = apply_float8(random_model(cfg, seed=1), "mxfp8")
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, MXLinear))
    assert converted == sorted(
        [f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "o_proj")]
        + [f"layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    )
    # The shared expert's 48 is no multiple of 32 either; the rowwise recipes take it (16).
    assert high_precision_linears(model, "mxfp8") == [
        "layers.*.self_attn.k_proj [64 -> 16]",
        "layers.*.self_attn.v_proj [64 -> 16]",
        "layers.*.mlp.shared_expert.gate_proj [64 -> 48]",
        "layers.*.mlp.shared_expert.up_proj [64 -> 48]",
        "layers.*.mlp.shared_expert.down_proj [48 -> 64]",
        "layers.*.mlp.experts [64 -> 48]",
    ]
    assert model.layers["0"].mlp.experts.matmul is grouped_matmul
    assert isinstance(
        apply_float8(random_model(ModelConfig(**MOE), seed=1), "mxfp8").layers["0"].mlp.experts.matmul, MXGroupedMatmul
    )
    linear = model.layers["1"].self_attn.q_proj
    x = torch.randn(4, 16, 64)
    with gemms_in_training_dtype():
        assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))


@pytest.mark.usefixtures("one_rank_group")
def test_a_tp_split_that_cuts_an_mx_block_is_refused():
    """A per-rank weight dim that is no multiple of 32 is refused by name before any collective."""
    linear = MXLinear.from_linear(nn.Linear(64, 32))
    with pytest.raises(
        ConfigError,
        match=r"\[train\] fp8: a 32 x 64 block linear split over tp = 1 holds a 16 x 64 "
        r"weight per rank; an MX float8 GEMM needs both dims in multiples of 32",
    ):
        split_gemms(linear, cached_mesh(), "out", (16, 64))
    assert isinstance(split_gemms(linear, cached_mesh(), "out", (32, 64)), MXGemms)


def test_one_rank_mxfp8_trains_near_float32():
    """4 AdamW steps of the 2-layer model (k / v stay in float32: 16 features) against float32."""
    reference = _float32_losses(7)
    mx = _one_rank(ModelConfig(**CFG), "mxfp8", seed=7)
    gaps = [abs(a - b) / b for a, b in zip(mx, reference)]
    assert max(gaps) < FP8_VS_FP32, f"mxfp8 vs float32 loss gaps {gaps}"
    assert tuple(mx) != reference and mx[-1] < mx[0], mx


# The debug recipes' layouts against their own 1-rank MXFP8 run, LAYOUT_STEPS steps (as test_float8's
# rowwise_with_gw_hp check). No MX scale needs a collective and tp's partial sums stay in float32, so every
# layout's first step is the 1-rank one to float32 noise, tp included (measured <= 8.5e-8), except under cp:
# the ring merges attention in another order, and an MX cast rounds that difference (3.8e-6). Later steps
# stay within FP8's own noise (the 1-rank runs from weights one ulp up and down). Measured over 8 steps, gap |
# one-ulp-up gap (max), at #45: dense pp 2 x dp 2 x tp 2 + SP, zb1p, with and without tp_overlap (identical)
# 7.9e-4 | 1.2e-3; dense dp 4 x cp 2 1.1e-2 | 3.5e-3; MoE ep 4 folded over dp 4 x tp 2 + SP, etp 2 3.5e-4 |
# 3.4e-4. The tp
# layouts take 8 KV heads (k / v 32 features a rank) and MoE experts of 64 (32 a rank under etp 2).
MX_LAYOUTS = [
    (
        "debug_dense",
        dict(
            pp=2,
            dp=2,
            tp=2,
            sp=True,
            tp_overlap=True,
            microbatches=4,
            schedule="zb1p",
            model=(("num_key_value_heads", 8),),
        ),
    ),
    ("debug_dense", dict(dp=4, cp=2)),
    (
        "debug_moe",
        dict(
            dp=4,
            tp=2,
            sp=True,
            ep=4,
            etp=2,
            fold_ep=True,
            model=(("num_key_value_heads", 8), ("moe_intermediate_size", 64)),
        ),
    ),
]
CP_FIRST_STEP = 1e-5


def check_debug_recipes_match_one_rank_mxfp8():
    for name, layout in MX_LAYOUTS:
        gaps, noise = layout_gaps("mxfp8", name, layout)
        where = f"mxfp8 {name} {layout}: loss gaps {gaps}, one-ulp gaps {noise}"
        assert gaps[0] < (CP_FIRST_STEP if layout.get("cp", 1) > 1 else FIRST_STEP_EXACT), where
        assert max(gaps) < LAYOUT_VS_ULP_NOISE * max(noise), where
    if dist.get_rank() == 0:
        print(f"mxfp8 layouts match their 1-rank run: {[name for name, _ in MX_LAYOUTS]}")


# tp 2 (with SP, without, and with tp_overlap's rings) against the 1-rank MXFP8 model, TP_STEPS steps: no MX scale
# spans a rank's piece and the partial sums stay in float32, so the first step's loss is the 1-rank one and its
# gradients differ by float32 reassociation. From the second step the weights differ by that reassociation, and
# an MX cast can turn a last bit into a whole float8 step, as weights one ulp away do: later steps are held to
# LAYOUT_VS_ULP_NOISE times the 1-rank run's own noise from weights one ulp up or down, up to that step
# (ulp_noise_per_step). TP_CFG's 4 KV heads of 16 leave k / v 16 features a rank at tp 4, which MX refuses.
MX_TP_LOSS = 1e-6
MX_TP_GRAD = 1e-4


def check_tp_matches_one_rank_mxfp8(tp_mesh_of):
    """mxfp8 split over tp 2 (SP's all-gathers carrying MX bytes: SP_GATHERS; tp_overlap's rings the bytes the
    planner counts) against its 1-rank model. ``tp_mesh_of(tp)``: this rank's tp mesh of that size."""
    cfg = ModelConfig(**TP_CFG)
    plain, mx = _sp_gathers("none", tp_mesh_of(2)), _sp_gathers("mxfp8", tp_mesh_of(2))
    assert {dtype: mx.get(dtype, 0) - plain.get(dtype, 0) for dtype in {*mx, *plain}} == SP_GATHERS["mxfp8"], mx
    ref_losses, ref_grads = _tp_steps(apply_float8(random_model(cfg, seed=1), "mxfp8"), seed=5)
    loss_noise, grad_noise = ulp_noise_per_step("mxfp8", cfg, ref_losses, ref_grads)
    for sp in (True, False):
        losses, grads = _tp_steps(_tp_model("mxfp8", tp_mesh_of(2), sp, random_model(cfg, seed=1)), seed=5)
        loss_gaps = [abs(a - b) / b for a, b in zip(losses, ref_losses)]
        grad_gaps = [max(rel_err(g[n], r[n]) for n in r) for g, r in zip(grads, ref_grads)]
        where = (
            f"mxfp8 tp 2 sp {sp}: loss gaps {loss_gaps}, gradient gaps {grad_gaps}, one-ulp noise: losses "
            f"{loss_noise}, gradients {grad_noise}"
        )
        assert loss_gaps[0] < MX_TP_LOSS and grad_gaps[0] < MX_TP_GRAD, where
        for step in range(1, len(losses)):
            assert loss_gaps[step] <= LAYOUT_VS_ULP_NOISE * max(loss_noise[1 : step + 1]), where
            assert grad_gaps[step] <= LAYOUT_VS_ULP_NOISE * max(grad_noise[1 : step + 1]), where
        if sp:
            _overlap_matches_the_split("mxfp8", tp_mesh_of(2), losses, grads)
