"""Expert parallelism on 8 CPU ranks: parity with one process and with transformers' Qwen2-MoE.

Layouts cover ep = 2, 4, 8, ep x dp and ep x tp (tp here is replicated-token tensor parallelism:
weights are not sharded, the mesh's tp ranks hold the same tokens, which is what EP sees under TP
without sequence parallelism).

On transformers 5.23: the aux loss of Qwen2-MoE applies softmax once. Its router returns the raw
logits (``F.linear``) and ``load_balancing_loss_func`` softmaxes those, so the double softmax
reported in transformers issue 45120 (router probabilities softmaxed again) is not in this version;
we checked that ``router_logits`` equal the raw gate logits, and the aux-loss parity below would
fail otherwise.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtron.checkpoint import load_full_state_dict
from meshtron.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from meshtron.hf import from_hf
from meshtron.mesh import batch_mesh, dense_data_mesh, expert_data_mesh
from meshtron.models import aux_loss, build_model, moe_layers, token_loss_sum, update_expert_bias
from meshtron.models.qwen2 import InitialWeights
from meshtron.parallel.expert import ExpertParallelExperts, apply_expert_parallel, token_mesh
from meshtron.testing import (
    GRAD_RTOL,
    LOSS_RTOL,
    assert_parity,
    launch_tests,
    layout_mesh,
    random_model,
    random_moe,
    rel_err,
)
from test_float8 import (
    HAS_TORCHAO,
    check_debug_recipes_match_one_rank_fp8,
    check_experts_split_over_etp_keep_every_float8_value,
)
from test_mxfp8 import check_debug_recipes_match_one_rank_mxfp8

BLOCK = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=18,
    shared_expert_intermediate_size=40,
    router_aux_loss_coef=0.1,
)
MODEL = dict(
    BLOCK,
    num_hidden_layers=2,
    num_key_value_heads=1,
    intermediate_size=48,
    mlp_only_layers=[0],
    moe_intermediate_size=20,  # transformers pads nothing: grouped_mm needs 16-byte rows
    rope_theta=10000.0,
)
# cp ranks hold different tokens like dp ranks; pp ranks are independent stages (here replicas).
LAYOUTS = [
    ParallelConfig(ep=2, dp=4),
    ParallelConfig(ep=4, dp=2),
    ParallelConfig(ep=8),
    ParallelConfig(ep=2, dp=2, tp=2),
    ParallelConfig(ep=4, tp=2),
    ParallelConfig(ep=2, cp=2, dp=2),
    ParallelConfig(pp=2, ep=4),
]
EP4_DP2 = ParallelConfig(ep=4, dp=2)  # the layout of the checks on one block's mechanics
TOKENS = 48  # global tokens of the block checks: 6 per reader with 8 readers


def _my_rows(mesh, total: int, holders=batch_mesh) -> slice:
    """The rows of a global batch this rank reads: sequences split over dp x ep (``batch_mesh``), or
    tokens over dp x cp x ep (``dense_data_mesh``); tp ranks share theirs."""
    readers = holders(mesh)
    n = total // readers.size()
    return slice(readers.get_local_rank() * n, (readers.get_local_rank() + 1) * n)


def _global_grads(model: torch.nn.Module, mesh, holders=dense_data_mesh) -> dict[str, torch.Tensor]:
    """Full gradients: expert ones summed over their edp ranks, tp-sharded dense ones over the dense
    data ranks, plain dense ones over the token holders; then gathered."""
    out = {}
    for name, p in model.named_parameters():
        sharded = isinstance(p.grad, DTensor)
        local = (p.grad.to_local() if sharded else p.grad).clone()
        if ".experts." in f".{name}":
            group = expert_data_mesh(mesh)
        else:
            group = dense_data_mesh(mesh) if sharded else holders(mesh)
        dist.all_reduce(local, group=group.get_group())
        out[name] = DTensor.from_local(local, p.grad.device_mesh, p.grad.placements).full_tensor() if sharded else local
    return out


def _every(got: dict, expected: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) pairs of ``got`` for every gradient of the reference ``expected``."""
    return [(name, got[name]) for name in expected]


def _block_parity(layout: ParallelConfig, seed: int, skew: bool) -> None:
    """One MoE block split as ``layout`` says (tokens split over tp with its ``sp``) against the whole block."""
    mesh, sequence_parallel = layout_mesh(layout), layout.sp
    where = f"{layout.name} seed {seed}" + (" skewed" if skew else "")
    ref = random_moe(BLOCK, seed)
    x = torch.randn(TOKENS, 32)
    if skew:  # every token picks experts 0 and 1: all on ep rank 0 (or 0 and 1 with ep = 8)
        x[:, 0] = 4.0
        with torch.no_grad():
            ref.gate.weight[:2, 0] = 8.0
    g = torch.randn(TOKENS, 32)
    ep_block = copy.deepcopy(ref)
    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * g).sum().backward()
    if skew:
        assert ref.last_tokens_per_expert[2:].sum() == 0 and ref.last_tokens_per_expert[:2].min() > 0
    apply_expert_parallel(ep_block, mesh, sequence_parallel=sequence_parallel)
    assert isinstance(ep_block.experts, ExpertParallelExperts)
    holders = functools.partial(token_mesh, sequence_parallel=sequence_parallel)
    rows = _my_rows(mesh, TOKENS, holders)
    x_local = x[rows].clone().requires_grad_()
    out = ep_block(x_local)
    (out * g[rows]).sum().backward()
    assert rel_err(out, out_ref[rows]) < LOSS_RTOL, f"{where}: output"
    assert rel_err(x_local.grad, x_ref.grad[rows]) < GRAD_RTOL, f"{where}: input gradient"
    assert torch.equal(ep_block.last_tokens_per_expert, ref.last_tokens_per_expert), f"{where}: tokens per expert"
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    grads = _global_grads(ep_block, mesh, holders)
    aux, ref_aux = ep_block.last_aux_loss, ref.last_aux_loss
    assert_parity(f"{where} (loss: the aux loss)", aux, ref_aux, _every(grads, ref_grads), ref_grads)


@pytest.mark.full
def check_block_parity(refs: dict):
    for i, layout in enumerate(LAYOUTS):
        _block_parity(layout, seed=10 + i, skew=False)
        _block_parity(layout, seed=20 + i, skew=True)
    # Sequence parallelism: tp ranks hold different tokens, nothing is split over tp.
    _block_parity(ParallelConfig(ep=4, tp=2, sp=True), seed=30, skew=False)


@pytest.mark.full
def check_fsdp_composes(refs: dict):
    """FSDP2 over edp (dp x cp here) on top of the ep-sharded experts (3-D DTensors (edp, ep, etp)) keeps gradients.

    FSDP averages gradients over its mesh; meshtron's loss is already normalised globally, so the
    data-parallel module must turn that into a sum (gloo lacks the PREMUL_SUM that
    set_gradient_divide_factor(1.0) needs; this test multiplies the mesh size back instead).
    """
    from torch.distributed.fsdp import fully_shard

    mesh = layout_mesh(EP4_DP2)
    ref = random_moe(BLOCK, 4)
    x, g = torch.randn(TOKENS, 32), torch.randn(TOKENS, 32)
    block = apply_expert_parallel(copy.deepcopy(ref), mesh)
    (ref(x) * g).sum().backward()
    fully_shard(block.experts, mesh=expert_data_mesh(mesh))
    fully_shard(block, mesh=dense_data_mesh(mesh))
    rows = _my_rows(mesh, TOKENS, dense_data_mesh)
    (block(x[rows]) * g[rows]).sum().backward()
    assert block.experts.gate_proj.device_mesh.mesh_dim_names == ("edp", "ep", "etp")
    for name, p in block.named_parameters():
        averaged_over = (expert_data_mesh if name.startswith("experts.") else dense_data_mesh)(mesh).size()
        expected = dict(ref.named_parameters())[name].grad
        err = rel_err(p.grad.full_tensor() * averaged_over, expected)
        assert err < GRAD_RTOL, f"{EP4_DP2.name} under FSDP: grad {name} rel err {err:.2e}"


@pytest.mark.full
def check_dispatch_bytes(refs: dict):
    """Each all-to-all moves tokens x top-k x hidden x element size bytes over the ep group.

    Rank by rank: the dispatch sends this rank's T x k copies and the combine sends back the rows
    it received; both sum to the group's tokens x k rows.
    """
    mesh = layout_mesh(EP4_DP2)
    block = random_moe(BLOCK, 3)
    apply_expert_parallel(block, mesh)
    sent: list[tuple[int, bool]] = []
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent.append((input.numel() * input.element_size(), input.is_floating_point()))
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        local_tokens = 10
        x = torch.randn(local_tokens, 32, requires_grad=True)
        block(x).sum().backward()
    finally:
        dist.all_to_all_single = original
    copies_bytes = local_tokens * 2 * 32 * 4
    received_bytes = sent[2][0]
    # counts exchange, dispatch, combine; backward: the combine's reverse, then the dispatch's
    assert sent == [
        (8 * 8, False),
        (copies_bytes, True),
        (received_bytes, True),
        (copies_bytes, True),
        (received_bytes, True),
    ], sent
    assert block.experts.last_dispatch_bytes == copies_bytes
    totals = torch.tensor([float(copies_bytes), float(received_bytes)])
    dist.all_reduce(totals, group=mesh["ep"].get_group())
    assert totals.tolist() == [4 * local_tokens * 2 * 32 * 4] * 2


@pytest.mark.full
def check_router_options_under_ep(refs: dict):
    """Capacity (on the global batch, in its token order), z-loss and aux-free bias with global statistics."""
    mesh, where = layout_mesh(EP4_DP2), EP4_DP2.name
    opts = dict(router_z_loss_coef=0.05, moe_aux_free_bias_rate=0.01, moe_capacity_factor=0.5)
    ref = random_moe(BLOCK, 5, **opts)
    x = torch.randn(TOKENS, 32)
    ep_block = apply_expert_parallel(copy.deepcopy(ref), mesh)
    rows = _my_rows(mesh, TOKENS, dense_data_mesh)
    out = ep_block(x[rows])
    out_ref = ref(x)
    global_z, global_counts = ref.last_z_loss, ref.last_tokens_per_expert
    assert rel_err(out, out_ref[rows]) < LOSS_RTOL, f"{where}: output"
    dropped = ep_block.last_dropped_fraction.clone()
    dist.all_reduce(dropped)  # equal token counts per rank: the mean of the fractions is the global one
    assert ref.last_dropped_fraction > 0, f"{where}: the reference drops nothing"
    assert rel_err(dropped / dist.get_world_size(), ref.last_dropped_fraction) < 1e-6, f"{where}: dropped fraction"
    assert_parity(f"{where} z-loss", ep_block.last_z_loss, global_z)
    assert torch.equal(ep_block.last_tokens_per_expert, global_counts), f"{where}: tokens per expert"
    update_expert_bias(ep_block)
    load = global_counts.float()
    assert torch.equal(ep_block.gate.expert_bias, 0.01 * torch.sign(load.mean() - load))


def check_meta_init_and_errors(refs: dict):
    mesh = layout_mesh(EP4_DP2)
    cfg = ModelConfig(**MODEL)
    with torch.device("meta"):
        model = build_model(cfg)
    apply_expert_parallel(model, mesh)
    model.to_empty(device="cpu")
    init = InitialWeights(cfg, seed=7)
    load_full_state_dict(model, init)
    w = model.layers["1"].mlp.experts.gate_proj
    assert isinstance(w, DTensor) and w.shape == (8, 32, 20) and w.to_local().shape == (2, 32, 20)
    ep_rank = mesh["ep"].get_local_rank()
    assert torch.equal(w.to_local(), init["layers.1.mlp.experts.gate_proj"][2 * ep_rank : 2 * ep_rank + 2])
    assert torch.equal(w.full_tensor(), init["layers.1.mlp.experts.gate_proj"])
    bad = build_model(ModelConfig(**{**MODEL, "num_experts": 6}))
    with pytest.raises(ConfigError, match="ep = 4 does not divide .* num_experts = 6; valid ep values: 1, 2, 3, 6"):
        apply_expert_parallel(bad, mesh)
    dense = build_model(ModelConfig(**{**MODEL, "num_experts": 0, "mlp_only_layers": []}))
    with pytest.raises(ConfigError, match="needs an MoE model"):
        apply_expert_parallel(dense, mesh)


def _references(seed: int) -> dict:
    """transformers and single-process meshtron results for one batch, computed once in the parent
    (importing transformers on eight ranks would cost more than the checks themselves)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(**MODEL, output_router_logits=True)).train()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] == 32 else 0.0))
    cfg = ModelConfig(**MODEL)
    state = from_hf(hf.state_dict(), cfg)
    ids = torch.randint(0, cfg.vocab_size, (8, 9))
    out = hf(input_ids=ids, labels=ids)
    out.loss.backward()
    ref = build_model(cfg).train()
    ref.load_state_dict(state)
    ce = token_loss_sum(ref(ids)[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()
    ce.backward()
    ref_loss = (ce + cfg.router_aux_loss_coef * aux_loss(ref)).detach()
    assert_parity("one process vs transformers", ref_loss, out.loss)
    return dict(
        state=state,
        ids=ids,
        loss=out.loss.detach(),
        ref_loss=ref_loss,
        aux=out.aux_loss.detach(),
        hf_grads=from_hf({n: p.grad for n, p in hf.named_parameters()}, cfg),
        ref_grads={n: p.grad for n, p in ref.named_parameters()},
    )


@pytest.mark.full
def check_model_parity_with_transformers(refs: dict):
    """Whole Qwen2-MoE model (one MoE layer, so transformers' pooled aux loss is the per-layer one)."""
    cfg = ModelConfig(**MODEL)
    ids = refs["ids"]
    for layout in (EP4_DP2, ParallelConfig(ep=2, dp=2, tp=2), ParallelConfig(ep=8)):
        mesh = layout_mesh(layout)
        with torch.device("meta"):
            model = build_model(cfg)
        apply_expert_parallel(model, mesh)
        model.to_empty(device="cpu")
        load_full_state_dict(model, refs["state"])
        model.train()
        local = ids[_my_rows(mesh, ids.shape[0])]
        ce = token_loss_sum(model(local)[:, :-1], local[:, 1:]) / ids[:, 1:].numel()
        ce.backward()
        total = ce.detach().clone()
        dist.all_reduce(total, group=dense_data_mesh(mesh).get_group())
        loss = total + cfg.router_aux_loss_coef * aux_loss(model)
        grads = _global_grads(model, mesh)
        hf_grads, ref_grads = refs["hf_grads"], refs["ref_grads"]
        assert_parity(f"{layout.name} vs transformers", loss, refs["loss"], _every(grads, hf_grads), hf_grads)
        assert_parity(f"{layout.name} aux loss vs transformers", aux_loss(model), refs["aux"])
        assert_parity(f"{layout.name} vs one process", loss, refs["ref_loss"], _every(grads, ref_grads), ref_grads)


TP_MODEL = dict(
    MODEL, num_attention_heads=4, num_key_value_heads=2, router_z_loss_coef=0.01, moe_aux_free_bias_rate=0.01
)
# Collectives of the MoE block per layer at tp2, ep1, dp4 (all_reduce includes the router statistics
# over the token holders). No SP: forward gathers the routed outputs and all-reduces the shared
# expert; backward gathers the token and routing-weight gradients and reduces the shared expert's
# input gradient over tp. SP: the shared expert gathers its input and reduce-scatters its output
# (and the reverse in backward); router and shared-expert gate sum their gradients over tp. The
# experts' gradients are summed over their edp ranks (tp included) by data parallelism, once per
# step, not here: before folding they took three all-reduces over tp in every MoE layer's backward.
TP_MOE_COLLECTIVES = {
    # Without SP the backward adds, on this first step only, one all-gather each verifying that the router's
    # and the shared-expert gate's replicated gradients are equal on both tp ranks (TpGradient "replicate").
    False: {"forward": {"all_gather": 1, "all_reduce": 2}, "backward": {"all_gather": 2 + 2, "all_reduce": 1}},
    # Under SP the shared expert saves its input sequence-sharded and re-gathers it in backward.
    True: {
        "forward": {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1},
        "backward": {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 2},
    },
}


# Folded ep 4 x etp 2 under dense tp 4 + SP x dp 2 (the first step, as above). Forward: the counts
# all-to-all over ep and their all-gather over etp, the dispatch all-to-all, the etp gather and
# reduce-scatter of rows (as all-to-alls), the combine; the shared expert's SP gather/reduce-scatter and
# the router statistics' all-reduce. Backward: the four row exchanges reversed, the shared expert's.
FOLDED_MOE_COLLECTIVES = {
    "forward": {"all_gather": 2, "all_reduce": 1, "all_to_all": 5, "reduce_scatter": 1},
    "backward": {"all_gather": 2, "all_reduce": 2, "all_to_all": 4, "reduce_scatter": 1},
}


def _tp_reference(seed: int):
    """Single-process model (random router bias too) and its loss and gradients on a fresh batch."""
    cfg = ModelConfig(**TP_MODEL)
    torch.manual_seed(seed)
    ref = build_model(cfg).train()
    with torch.no_grad():
        for p in [*ref.parameters(), *ref.buffers()]:
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 and p.shape[0] == 32 else 0.0))
    ids = torch.randint(0, cfg.vocab_size, (8, 8))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    loss = token_loss_sum(ref(ids), labels) / (labels != -100).sum()
    loss.backward()
    return ref, ids, labels, loss.detach()


@pytest.mark.full
def check_moe_under_tp(refs: dict):
    """MoE at ep = 1 under tp 2 and 4, with and without SP: each tp rank routes and computes only its
    share of the tokens (half the rows with tp2), and loss, aux loss, expert counts and gathered
    gradients match the single-process model. Then the experts folded over the same ranks (ep 4 x
    etp 2 under tp 4 + SP): the same parity, each rank's own tokens dispatched once."""
    from torch.distributed.tensor.debug import CommDebugMode

    from meshtron.parallel.tensor import apply_tensor_parallel
    from meshtron.parallel.vocab_loss import parallel_token_loss_sum
    from meshtron.testing import module_collectives

    cases = [
        ParallelConfig(dp=4, tp=2),
        ParallelConfig(dp=4, tp=2, sp=True),
        ParallelConfig(dp=2, tp=4),
        ParallelConfig(dp=2, tp=4, sp=True),
        ParallelConfig(dp=2, tp=4, sp=True, ep=4, etp=2, fold_ep=True),
    ]
    collectives = {0: TP_MOE_COLLECTIVES[False], 1: TP_MOE_COLLECTIVES[True], 4: FOLDED_MOE_COLLECTIVES}
    for i, layout in enumerate(cases):
        ref, ids, labels, loss_ref = _tp_reference(40 + i)
        mesh, tp, sp, where = layout_mesh(layout), layout.tp, layout.sp, layout.name
        with torch.device("meta"):
            model = build_model(ref.config)
        apply_tensor_parallel(model, mesh["tp"], sp)
        apply_expert_parallel(model, mesh, sequence_parallel=sp)
        model.to_empty(device="cpu")
        load_full_state_dict(model, ref.state_dict())
        model.train()
        rows = _my_rows(mesh, ids.shape[0])
        comm = CommDebugMode()
        with comm:
            loss = parallel_token_loss_sum(model(ids[rows]), labels[rows]) / (labels != -100).sum()
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dense_data_mesh(mesh).get_group())
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        assert_parity(where, total, loss_ref, _every(_global_grads(model, mesh), ref_grads), ref_grads)
        assert_parity(f"{where} aux loss", aux_loss(model), aux_loss(ref))
        moe, moe_ref = model.layers["1"].mlp, ref.layers["1"].mlp
        assert torch.equal(moe.last_tokens_per_expert, moe_ref.last_tokens_per_expert), where
        copies = ids[rows].numel() * ref.config.num_experts_per_tok // tp  # this rank's share of the tokens
        if layout.ep > 1:  # each copy leaves this rank once
            assert moe.experts.last_dispatch_bytes == copies * ref.config.hidden_size * 4, where
        else:
            assert moe.experts.last_rows == copies, where
        if i in collectives:
            assert module_collectives(comm, "Transformer.layers.1.mlp") == collectives[i], where


def _step_matches(cfg, mesh, ids, labels, start: dict, loss_ref, ref_params: dict, seeds: str):
    """One step of the layout's runner from the reference's ``start`` weights on this rank's rows; its loss
    and every (gathered) gradient equal the single-process ones. Returns the runner."""
    from meshtron.parallel.runner import build_model_runner

    with torch.device("meta"):
        model = build_model(cfg.model)
    runner = build_model_runner(model, mesh, cfg, torch.device("cpu"))
    load_full_state_dict(runner.module, start)
    rows = _my_rows(mesh, ids.shape[0])
    loss = runner.forward_backward(ids[rows], labels[rows])
    grads = [(name, param.grad) for name, param in runner.module.named_parameters()]
    ref_grads = {name: param.grad for name, param in ref_params.items()}
    assert_parity(f"{cfg.parallel.name} ({seeds})", loss, loss_ref, grads, ref_grads)
    return runner


@pytest.mark.full
def check_capacity_is_global(refs: dict):
    """moe_capacity_factor counts the global micro-batch in its global token order: dp, ep, cp and
    cp x ep x tp (SP) layouts drop the same copies as the single-process model, so loss, gradients
    and the number of dropped copies match it."""
    model_cfg = ModelConfig(**{**TP_MODEL, "moe_aux_free_bias_rate": 0.0, "moe_capacity_factor": 0.75})
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model_cfg.vocab_size, (8, 16), generator=gen)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    ref = random_model(model_cfg, seed=2, device="cpu")
    start = {n: t.clone() for n, t in ref.state_dict().items()}
    loss_ref = token_loss_sum(ref(ids), labels) / (labels != -100).sum()
    loss_ref.backward()
    copies = ids.numel() * model_cfg.num_experts_per_tok
    dropped_ref = ref.layers["1"].mlp.last_dropped_fraction * copies
    assert dropped_ref > 0
    ref_grads = dict(ref.named_parameters())
    layouts = [
        ParallelConfig(dp=8),
        ParallelConfig(ep=2, dp=4),
        ParallelConfig(cp=2, dp=4),
        ParallelConfig(cp=2, ep=2, tp=2, sp=True),
    ]
    for layout in layouts:
        cfg = Config(model=model_cfg, parallel=layout, train=TrainConfig(seed=2, seq_len=16))
        mesh = layout_mesh(layout)
        runner = _step_matches(cfg, mesh, ids, labels, start, loss_ref, ref_grads, "weights seed 2, batch seed 7")
        holders = token_mesh(mesh, layout.sp)
        dropped = runner.moes[0].last_dropped_fraction * copies / holders.size()  # equal copies per holder
        dist.all_reduce(dropped, group=holders.get_group())
        assert abs(dropped - dropped_ref) < 1e-3, f"{layout.name}: {dropped} copies dropped vs {dropped_ref}"


# Experts folded over the dense ranks (fold_ep) and split over etp, as issue 30 names them; the last
# two keep ep as a mesh dimension. (ep and etp are the experts' sizes, the rest the dense layout.) The
# last overlaps SP's collectives with the dense MLP's and the shared expert's GEMMs (tp_overlap).
FOLDED_LAYOUTS = [
    ParallelConfig(dp=2, tp=4, ep=8, fold_ep=True),
    ParallelConfig(dp=2, tp=4, sp=True, ep=4, etp=2, fold_ep=True),
    ParallelConfig(dp=2, cp=2, tp=2, ep=4, etp=2, fold_ep=True),
    ParallelConfig(pp=2, tp=4, ep=4, fold_ep=True, microbatches=2),
    ParallelConfig(pp=2, tp=4, ep=4, fold_ep=True, microbatches=4, schedule="zbv", virtual_stages=2),
    ParallelConfig(dp=2, ep=2, tp=2, etp=2),
    ParallelConfig(dp=2, ep=2, tp=2, etp=2, sp=True, data_parallel="hsdp", tp_overlap=True),
]


def _folded_reference(model_cfg: ModelConfig, ids, labels, microbatches: int):
    """The single-process step of one reader holding every row, in ``microbatches`` micro-batches of
    consecutive rows (capacity and the aux loss are per micro-batch): the weights it started from, loss,
    parameters (with gradients) and the expert biases after their update."""
    from meshtron.parallel.step import average_router_losses_over_microbatches

    ref = random_model(model_cfg, seed=3, device="cpu")
    start = {n: t.clone() for n, t in ref.state_dict().items()}  # before the expert biases move
    average_router_losses_over_microbatches(ref, microbatches)
    tokens = (labels != -100).sum()
    loss = sum(
        token_loss_sum(ref(i), lab) / tokens for i, lab in zip(ids.chunk(microbatches), labels.chunk(microbatches))
    )
    loss.backward()
    assert ref.layers["1"].mlp.last_dropped_fraction > 0
    update_expert_bias(ref)
    biases = {n: b for n, b in ref.named_buffers() if n.endswith("expert_bias")}
    return start, loss.detach(), dict(ref.named_parameters()), biases


def check_folded_experts(refs: dict):
    """Folded ep and etp: loss, every gradient, the router's global counts and the aux-free bias
    after its update equal the single-process model's, with capacity dropping copies, the aux loss
    and the z-loss on (one step of the whole runner: TP, EP, CP, pipeline and FSDP/HSDP composed)."""
    from meshtron.parallel.tensor_overlap import _overlapped_rowwise_forward

    opts = dict(moe_capacity_factor=1.0, router_aux_loss_coef=0.1, num_hidden_layers=4, mlp_only_layers=[0])
    model_cfg = ModelConfig(**{**TP_MODEL, **opts})
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, model_cfg.vocab_size, (8, 16), generator=gen)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    references = {}
    for layout in FOLDED_LAYOUTS:
        cfg = Config(model=model_cfg, parallel=layout, train=TrainConfig(seed=3, seq_len=16))
        p, where = cfg.parallel, layout.name
        assert p.microbatches == 1 or p.dp == 1, f"{where}: the reference's micro-batches are those of one reader"
        if p.microbatches not in references:
            references[p.microbatches] = _folded_reference(model_cfg, ids, labels, p.microbatches)
        start, loss_ref, ref_params, ref_bias = references[p.microbatches]
        mesh = layout_mesh(layout)
        runner = _step_matches(cfg, mesh, ids, labels, start, loss_ref, ref_params, "weights seed 3, batch seed 9")
        if p.tp_overlap:
            shared = runner.module.layers["1"].mlp.shared_expert
            assert shared.down_proj.forward.__func__ is _overlapped_rowwise_forward, where
        update_expert_bias(runner.module)
        for name, bias in runner.module.named_buffers():
            if name in ref_bias:
                assert torch.equal(bias, ref_bias[name]), f"{where}: {name}"
        for moe in moe_layers(runner.module):  # experts split (ep, etp), then FSDP over their edp ranks
            assert tuple(moe.experts.mesh.shape) == (p.ep, p.etp), where
            assert tuple(moe.experts.gate_proj.device_mesh.shape)[-2:] == (p.ep, p.etp), where


def check_fp8_debug_recipes(_):
    """[train] fp8 on the debug recipes' ep, folded-ep (with etp), cp and pp layouts, and the experts' float8
    GEMM split over etp (tests/test_float8.py); mxfp8 on tp + SP with tp_overlap under zb1p, cp and folded ep
    with etp (tests/test_mxfp8.py)."""
    check_experts_split_over_etp_keep_every_float8_value()
    check_debug_recipes_match_one_rank_fp8()
    check_debug_recipes_match_one_rank_mxfp8()


@launch_tests(
    8,
    [
        check_block_parity,
        check_fsdp_composes,
        check_dispatch_bytes,
        check_router_options_under_ep,
        check_meta_init_and_errors,
        check_model_parity_with_transformers,
        check_moe_under_tp,
        check_capacity_is_global,
        check_folded_experts,
    ],
    timeout=900,
)  # a hang guard, not a speed bound
def test_expert_parallel_8_ranks():
    return (_references(seed=11),)


@pytest.mark.full
@pytest.mark.skipif(not HAS_TORCHAO, reason="[train] fp8 needs torchao (pip install -e '.[fp8]')")
@launch_tests(8, [check_fp8_debug_recipes], timeout=900)
def test_fp8_debug_recipes_8_ranks():
    """Its own launch: in the processes of the launch above each of its ops runs slower (6x, measured)."""
    return (None,)
