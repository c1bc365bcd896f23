"""Pipelined training step on 8 CPU ranks equals the single-process step (loss, gradients, aux, norm).

Every layout fills the 8 ranks with pp x dp (x cp x tp); main's parallelize shards the stages with
FSDP over the data ranks. The single-process reference runs the same micro-batches (micro-batch i
= every dp shard's i-th) because the MoE aux loss is defined per micro-batch.
"""

import dataclasses
import weakref

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from meshtron.checkpoint import load_full_state_dict
from meshtron.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from meshtron.hf import from_hf
from meshtron.hf.runner import export_hf
from meshtron.mesh import batch_mesh, build_mesh, dense_data_mesh
from meshtron.models import aux_loss, build_model, token_loss_sum
from meshtron.optim import build_optimizer
from meshtron.parallel.float8 import apply_float8
from meshtron.parallel.grad_norm import global_grad_norm
from meshtron.parallel.layout import validate_layout
from meshtron.parallel.offload import BlockOffload
from meshtron.parallel.pipeline import peak_in_flight, prune_to_stage
from meshtron.parallel.pipeline.pipelined_runner import PipelineRunner
from meshtron.parallel.runner import build_model_runner
from meshtron.parallel.step import average_router_losses_over_microbatches, training_step
from meshtron.testing import (
    assert_parity,
    cached_mesh,
    count_calls,
    launch_tests,
    rel_err,
    units_with_parameters,
    whole_weight_passes,
)
from test_float8 import HAS_TORCHAO

DENSE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
)
MOE = dict(
    DENSE,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    mlp_only_layers=[2],
    router_aux_loss_coef=0.1,
)
TIED = dict(DENSE, tie_word_embeddings=True)
SEQ, MB_SIZE = 8, 2


def _config(model: dict, layout: ParallelConfig, fp8: str = "none") -> Config:
    """The recipe of ``model`` on ``layout`` (a copy): each reader (dp x ep rank) takes one micro-batch of
    MB_SIZE rows per schedule slot."""
    batch = layout.dp * layout.mesh_ep * layout.microbatches * MB_SIZE
    return Config(
        model=ModelConfig(**model),
        parallel=dataclasses.replace(layout),
        train=TrainConfig(global_batch_size=batch, seq_len=SEQ, seed=3, fp8=fp8),
    )


def _where(model: dict, layout: ParallelConfig, fp8: str = "none") -> str:
    """The layout's name and the model's kind, to begin a failure message."""
    kind = "moe" if model.get("num_experts") else "tied" if model.get("tie_word_embeddings") else "dense"
    return f"{layout.name} {kind}" + (f" fp8 {fp8}" if fp8 != "none" else "")


def _random_model(cfg: Config) -> torch.nn.Module:
    """The full model with random values everywhere (norm weights and biases too)."""
    model = build_model(cfg.model)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    return model.train()


def _batch(cfg: Config):
    gen = torch.Generator().manual_seed(cfg.parallel.pp * 100 + cfg.parallel.microbatches)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, SEQ), generator=gen)
    labels = torch.randint(0, cfg.model.vocab_size, ids.shape, generator=gen)
    labels[torch.rand(ids.shape, generator=gen) < 0.2] = -100
    return ids, labels


def _reference(cfg: Config, ids, labels):
    """Single process on the same micro-batches: micro-batch i is every dp shard's i-th one (router
    statistics are global over the data ranks, so that is the batch each aux loss sees); FP8 as the recipe says."""
    model = apply_float8(_random_model(cfg), cfg.train.fp8)
    m = cfg.parallel.microbatches
    average_router_losses_over_microbatches(model, m)
    tokens = (labels != -100).sum()
    total, aux = 0.0, []
    shards = [(i.chunk(m), lab.chunk(m)) for i, lab in zip(ids.chunk(cfg.parallel.dp), labels.chunk(cfg.parallel.dp))]
    for mb in range(m):
        i = torch.cat([shard[0][mb] for shard in shards])
        lab = torch.cat([shard[1][mb] for shard in shards])
        # FP8 takes the fused head and loss the last stage runs: float8 casts would turn the other path's
        # last-bit differences into whole float8 steps.
        loss = (token_loss_sum(model(i), lab) if cfg.train.fp8 == "none" else model(i, labels=lab)) / tokens
        loss.backward()
        total += loss.item()
        if cfg.model.num_experts:
            aux.append(aux_loss(model))
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return model, total, (torch.stack(aux).mean().item() if aux else None), norm.item()


class SavedTensorTracker:
    """Counts tensors autograd saved for backward, tagged with the (stage, micro-batch) that saved them."""

    class _Saved:
        def __init__(self, tensor, tag):
            self.tensor, self.tag = tensor, tag

    def __init__(self):
        self.live, self.tag, self.checked = weakref.WeakSet(), None, 0

    def pack(self, tensor):
        # The data, not the graph: a saved output would otherwise hold its own grad_fn, a cycle that
        # only running that node's backward breaks (a split backward's W does not run every node).
        saved = self._Saved(tensor.detach(), self.tag)
        self.live.add(saved)
        return saved

    @staticmethod
    def unpack(saved):
        return saved.tensor

    def count(self, tag) -> int:
        return sum(1 for s in self.live if s.tag == tag)

    def install(self, executor):
        forward, backward, weight = executor._forward, executor._backward, executor._weight

        def tagged_forward(a, *args):
            self.tag = (a.stage, a.mb)
            out = forward(a, *args)
            assert self.count(self.tag) > 0, f"{a}: nothing saved for backward"
            return out

        def checked_backward(index, a):
            backward(index, a)
            if (a.stage, a.mb) in executor._split:  # a split backward keeps them for its W
                assert self.count((a.stage, a.mb)) > 0, f"{a}: activations freed before its W"
            else:
                assert self.count((a.stage, a.mb)) == 0, f"{a}: activations still alive after its backward"
                self.checked += 1

        def checked_weight(index, a):
            weight(index, a)
            assert self.count((a.stage, a.mb)) == 0, f"{a}: activations still alive after its W"
            self.checked += 1

        executor._forward, executor._backward, executor._weight = tagged_forward, checked_backward, checked_weight


LAYOUTS = [
    # (model, layout)
    (DENSE, ParallelConfig(pp=8, microbatches=9)),
    (MOE, ParallelConfig(pp=4, dp=2, microbatches=5)),
    (DENSE, ParallelConfig(pp=2, dp=4, microbatches=3)),
    (MOE, ParallelConfig(pp=2, dp=4, schedule="interleaved", virtual_stages=2, microbatches=4)),
    (DENSE, ParallelConfig(pp=4, dp=2, schedule="interleaved", virtual_stages=2, microbatches=4)),
    (MOE, ParallelConfig(pp=2, dp=4, schedule="gpipe", microbatches=2)),
    # tp shards inside stages; its ranks must not count the loss twice
    (DENSE, ParallelConfig(pp=2, dp=2, tp=2, microbatches=2)),
    # cp x tp inside interleaved stages
    (DENSE, ParallelConfig(pp=2, cp=2, tp=2, schedule="interleaved", virtual_stages=2, microbatches=2)),
    # embedding on rank 0, its tied LM head copy on rank 3
    (TIED, ParallelConfig(pp=4, dp=2, microbatches=4)),
]


# The zero-bubble schedules, each with pp x dp (FSDP inside stages) and pp x tp, dense and MoE.
ZERO_BUBBLE_LAYOUTS = [
    (DENSE, ParallelConfig(pp=4, dp=2, schedule="zb1p", microbatches=4)),
    (MOE, ParallelConfig(pp=4, tp=2, schedule="zb1p", microbatches=5)),
    (DENSE, ParallelConfig(pp=4, tp=2, schedule="zbv", virtual_stages=2, microbatches=8)),
    (MOE, ParallelConfig(pp=4, dp=2, schedule="zbv", virtual_stages=2, microbatches=8)),
    (MOE, ParallelConfig(pp=4, tp=2, schedule="dualpipev", virtual_stages=2, microbatches=8)),
    (DENSE, ParallelConfig(pp=2, dp=4, schedule="dualpipev", virtual_stages=2, microbatches=4)),
    # SP's fused linears split between B and W
    (DENSE, ParallelConfig(pp=2, dp=2, tp=2, sp=True, schedule="zbv", virtual_stages=2, microbatches=4)),
]


def check_zero_bubble_schedules_match_single_process(_folder):
    check_pipeline_matches_single_process(_folder, ZERO_BUBBLE_LAYOUTS)


# [train] fp8 split into 8 stages (every converted linear's dims are multiples of 16 here): each stage runs
# its linears on the micro-batches the single process runs, so every float8 scale is the same. Both scale
# granularities (rowwise_with_gw_hp differs from rowwise only in its weight-gradient GEMM, in bf16).
FP8_LAYOUTS = [(DENSE, ParallelConfig(pp=8, microbatches=8), recipe) for recipe in ("tensorwise", "rowwise")]


@pytest.mark.full
def check_fp8_pipeline_matches_single_process(_folder):
    if HAS_TORCHAO:
        check_pipeline_matches_single_process(_folder, FP8_LAYOUTS)


@pytest.mark.full
def check_pipeline_matches_single_process(_folder, layouts=LAYOUTS):
    for entry in layouts:  # (model, layout[, fp8])
        cfg, where = _config(*entry), _where(*entry)
        p = cfg.parallel
        mesh = cached_mesh(**p.sizes)
        runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
        assert isinstance(runner, PipelineRunner)
        assert len(runner.module.layers) < cfg.model.num_hidden_layers, "a stage holds the whole model"
        ids, labels = _batch(cfg)
        dp_rank = mesh["dp"].get_local_rank()
        reference = _reference(cfg, ids, labels)
        load_full_state_dict(runner.module, _random_model(cfg).state_dict())
        tracker = SavedTensorTracker()
        tracker.install(runner.executor)
        whole = whole_weight_passes(runner.executor)
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            loss = runner.forward_backward(ids.chunk(p.dp)[dp_rank], labels.chunk(p.dp)[dp_rank])
        assert not whole, f"{where}: W re-ran the whole backward for {whole}"
        assert tracker.checked == p.microbatches * p.virtual_stages and len(tracker.live) == 0, where
        assert runner.executor.peak_live == peak_in_flight(runner.executor.entries), where
        _check_matches_reference(where, runner, mesh, loss, reference)


def _check_matches_reference(where: str, runner, mesh, loss, reference) -> None:
    """The step's loss, gradients, aux loss and gradient norm against :func:`_reference`'s (an aux loss of
    None is not compared), within the numerics contract."""
    ref, ref_loss, ref_aux, ref_norm = reference
    _assert_stage_parity(where, runner.module, mesh, loss, ref, ref_loss)
    if ref_aux is not None:
        assert_parity(f"{where} aux loss", runner.aux_loss(), ref_aux)
    assert_parity(f"{where} gradient norm", runner.clip_grad_norm(1e9), ref_norm)


def _reduced_by_data_parallelism(grad) -> bool:
    from torch.distributed.tensor import DTensor

    data_meshes = {"dp", "dp_ep", "dp_ep_cp", "edp", "edp_replicate"}  # dense and expert data meshes
    return isinstance(grad, DTensor) and bool(data_meshes & set(grad.device_mesh.mesh_dim_names))


def _assert_stage_parity(where: str, stage, mesh, loss, ref, ref_loss) -> None:
    """The step's loss and every gradient of this rank's stage against the reference model's; plain replicas'
    gradients are first summed over the data ranks, as data parallelism will sum them."""
    from torch.distributed.tensor import DTensor

    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}  # tied: both names
    grads = [(n, p.grad) for n, p in stage.named_parameters()]
    assert grads and all(n in ref_grads for n, _ in grads), f"{where}: stage parameters the reference lacks"
    for name, grad in grads:
        assert grad is not None, f"{where}: {name} has no gradient"
        if not _reduced_by_data_parallelism(grad):
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, group=dense_data_mesh(mesh).get_group())
    assert_parity(where, loss, ref_loss, grads, ref_grads)


FSDP_LAYOUTS = [
    # (model, layout): every schedule, tp and cp inside stages, tied embeddings
    (DENSE, ParallelConfig(pp=2, dp=2, tp=2, microbatches=4)),
    (DENSE, ParallelConfig(pp=2, dp=2, tp=2, schedule="gpipe", microbatches=4)),
    (MOE, ParallelConfig(pp=2, dp=2, tp=2, schedule="interleaved", virtual_stages=2, microbatches=4)),
    (TIED, ParallelConfig(pp=2, dp=2, tp=2, microbatches=4)),
    # sharded over cp, replicated over dp
    (
        TIED,
        ParallelConfig(
            pp=2, dp=2, cp=2, schedule="interleaved", virtual_stages=2, microbatches=4, data_parallel="hsdp"
        ),
    ),
    # W restarted inside the graph: FSDP's hooks run by hand
    (MOE, ParallelConfig(pp=2, dp=2, tp=2, schedule="zbv", virtual_stages=2, microbatches=4)),
    (DENSE, ParallelConfig(pp=2, dp=2, cp=2, schedule="zb1p", microbatches=4, data_parallel="hsdp")),
]


@pytest.mark.full
def check_fsdp_gathers_and_reduces_once_per_step(_folder):
    """Each FSDP unit is all-gathered once and reduce-scattered once per step, not per micro-batch,
    and the step still equals the single-process one."""
    for model, layout in FSDP_LAYOUTS:
        cfg, where = _config(model, layout), _where(model, layout)
        p = cfg.parallel
        mesh = cached_mesh(**p.sizes)
        runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
        ids, labels = _batch(cfg)
        ref, ref_loss, _, ref_norm = _reference(cfg, ids, labels)
        dp_rank = mesh["dp"].get_local_rank()
        ids, labels = ids.chunk(p.dp)[dp_rank], labels.chunk(p.dp)[dp_rank]
        load_full_state_dict(runner.module, _random_model(cfg).state_dict())
        units = units_with_parameters(runner.module)
        tp_group = mesh["tp"].get_group()
        for step in range(2):  # the first step also initialises FSDP lazily
            runner.module.zero_grad(set_to_none=True)
            # FSDP's collectives only (MoE under tp gathers tokens over tp with the same call).
            with (
                count_calls(dist, "all_gather_single", skip_group=tp_group) as gathers,
                count_calls(dist, "reduce_scatter_single", skip_group=tp_group) as reduces,
            ):
                loss = runner.forward_backward(ids, labels)
            assert len(gathers) == len(reduces) == units, (
                f"{where} step {step}: {len(gathers)} all-gathers, {len(reduces)} reduce-scatters, {units} units"
            )
        _check_matches_reference(where, runner, mesh, loss, (ref, ref_loss, None, ref_norm))


# Without a pipeline (pp = 1), 8 ranks: (model, layout), each run per micro-batch and per step ([parallel]
# fsdp_gather): dense with cp x tp + SP, MoE under hsdp with ep x tp (dense units sharded over ep, experts
# split over ep and sharded over tp inside a dp slice).
STEP_FSDP_LAYOUTS = [
    # vocab rows even over tp x data
    (dict(DENSE, vocab_size=96), ParallelConfig(dp=2, cp=2, tp=2, sp=True, microbatches=4)),
    (MOE, ParallelConfig(dp=2, ep=2, tp=2, microbatches=4, data_parallel="hsdp")),
]


def _step_collectives(p: ParallelConfig, units: int) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of FSDP per step without a pipeline, counted from the rules: per
    micro-batch every unit is gathered in forward and again in backward but the root (kept from forward
    to backward), and full sharding reduce-scatters every backward (hsdp once); per step each unit is
    gathered once and reduce-scatters once."""
    m = p.microbatches
    if p.fsdp_gather == "per_step":
        return units, units
    return 2 * m * (units - 1) + m, units * (m if p.data_parallel == "fsdp" else 1)


def _counted_step(runner, mesh, ids, labels) -> tuple[int, int, torch.Tensor]:
    """(all-gathers, reduce-scatters, loss) of one step: FSDP's collectives only (MoE under tp gathers
    tokens over tp with the same call)."""
    runner.module.zero_grad(set_to_none=True)
    tp_group = mesh["tp"].get_group()
    with (
        count_calls(dist, "all_gather_single", skip_group=tp_group) as gathers,
        count_calls(dist, "reduce_scatter_single", skip_group=tp_group) as reduces,
    ):
        loss = runner.forward_backward(ids, labels)
    return len(gathers), len(reduces), loss


@pytest.mark.full
def check_fsdp_gathers_once_per_step_without_pipeline(_folder):
    """``fsdp_gather = "per_step"`` gathers and reduce-scatters each FSDP unit once per step (per
    micro-batch: 2 m gathers, m reduce-scatters; counted for one step), and equals the single-process
    step (the first step also initialises FSDP lazily, the second starts from released units)."""
    for model, layout in STEP_FSDP_LAYOUTS:
        # ep ranks read samples of their own, as dp ranks do: the reference splits the batch over dp x ep readers
        readers = _config(model, dataclasses.replace(layout, dp=layout.dp * layout.ep, ep=1))
        ids, labels = _batch(readers)
        reference = _reference(readers, ids, labels)
        for gather in ("per_microbatch", "per_step"):
            gathered = dataclasses.replace(layout, fsdp_gather=gather)
            cfg, where = _config(model, gathered), _where(model, gathered)
            p = cfg.parallel
            assert cfg.train.global_batch_size == readers.train.global_batch_size, where
            mesh = cached_mesh(**p.sizes)
            runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
            row = batch_mesh(mesh).get_local_rank()
            local = ids.chunk(p.dp * p.ep)[row], labels.chunk(p.dp * p.ep)[row]
            load_full_state_dict(runner.module, _random_model(cfg).state_dict())
            expected = _step_collectives(p, units_with_parameters(runner.module))
            for step in range(2 if gather == "per_step" else 1):
                *counts, loss = _counted_step(runner, mesh, *local)
                assert tuple(counts) == expected, f"{where} step {step}: (all-gathers, reduce-scatters) {counts}"
            _check_matches_reference(where, runner, mesh, loss, reference)


@pytest.mark.full
def check_zero_bubble_accumulates_in_fp32_under_bf16(_folder):
    """Under bf16 mixed precision a zb1p step gives 1F1B's gradients bit for bit: each W's weight
    gradients join FSDP's fp32 accumulator, as each whole backward's do."""
    grads = {}
    for schedule in ("1f1b", "zb1p"):
        layout = ParallelConfig(pp=2, dp=4, schedule=schedule, microbatches=6)
        cfg = _config(DENSE, layout)
        cfg.train.dtype = "bfloat16"
        mesh = cached_mesh(**layout.sizes)
        runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
        load_full_state_dict(runner.module, _random_model(cfg).state_dict())
        ids, labels = _batch(cfg)
        dp_rank = mesh["dp"].get_local_rank()
        runner.forward_backward(ids.chunk(layout.dp)[dp_rank], labels.chunk(layout.dp)[dp_rank])
        grads[schedule] = {n: p.grad.to_local().clone() for n, p in runner.module.named_parameters()}
    assert grads["1f1b"].keys() == grads["zb1p"].keys()
    for name, grad in grads["1f1b"].items():
        assert grad.dtype == torch.float32 and torch.equal(grads["zb1p"][name], grad), name


@pytest.mark.full
def check_zero_bubble_with_checkpointing_replays_each_block_once(_folder):
    """With activation checkpointing a zero-bubble step replays each block's forward once per
    micro-batch, as 1F1B does (a W restarted per weight pass would replay it once per pass), and
    still equals the single-process step; so does op-level checkpointing (it too runs unsplit)."""
    for schedule, v, ac in (("zb1p", 1, "full"), ("zbv", 2, "full"), ("zbv", 2, "op")):
        layout = ParallelConfig(
            pp=2,
            dp=4,
            schedule=schedule,
            virtual_stages=v,
            microbatches=4,
            activation_checkpointing=ac,
            ac_policy="alternate_matmuls",
        )
        cfg, where = _config(DENSE, layout), _where(DENSE, layout)
        mesh = cached_mesh(**layout.sizes)
        runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
        load_full_state_dict(runner.module, _random_model(cfg).state_dict())
        ids, labels = _batch(cfg)
        ref, ref_loss, _, _ = _reference(cfg, ids, labels)
        calls = []
        # B023: the hooks fire in this iteration's step and are removed before the next.
        hooks = [block.register_forward_pre_hook(lambda *_: calls.append(1)) for block in runner.module.layers.values()]  # noqa: B023
        dp_rank = mesh["dp"].get_local_rank()
        loss = runner.forward_backward(ids.chunk(layout.dp)[dp_rank], labels.chunk(layout.dp)[dp_rank])
        for hook in hooks:
            hook.remove()
        assert len(calls) == 2 * layout.microbatches * len(runner.module.layers), f"{where}: {len(calls)} replays"
        _assert_stage_parity(where, runner.module, mesh, loss, ref, ref_loss)


@pytest.mark.full
def check_clipping_and_export_cover_all_stages(folder):
    layout = ParallelConfig(pp=4, dp=2, microbatches=4)
    cfg = _config(DENSE, layout)
    mesh = build_mesh(**layout.sizes)
    runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
    load_full_state_dict(runner.module, _random_model(cfg).state_dict())
    ids, labels = _batch(cfg)
    runner.forward_backward(ids[: len(ids) // 2], labels[: len(labels) // 2])
    norm = runner.clip_grad_norm(0.5)
    clipped = global_grad_norm(runner.module.parameters(), pp_mesh=mesh["pp"]).item()
    assert norm > 0.5 and abs(clipped - 0.5) < 1e-5, (norm, clipped)
    export_hf(runner, cfg, folder)
    if dist.get_rank() == 0:
        exported = from_hf(load_file(f"{folder}/model.safetensors"), cfg.model)
        expected = _random_model(cfg).state_dict()
        assert exported.keys() == expected.keys(), sorted(exported.keys() ^ expected.keys())[:6]
        for name, value in expected.items():
            assert torch.equal(exported[name], value), name


# (model, layout): dp x tp with SP inside the stages; a zero-bubble split backward over MoE stages, then its
# stages run whole under selective checkpointing; a tied LM head summed across the pipeline.
OFFLOAD_LAYOUTS = [
    (DENSE, ParallelConfig(pp=2, dp=2, tp=2, sp=True, microbatches=2)),
    (MOE, ParallelConfig(pp=2, dp=4, schedule="zbv", virtual_stages=2, microbatches=4)),
    (
        MOE,
        ParallelConfig(
            pp=2, dp=4, schedule="zbv", virtual_stages=2, microbatches=4, activation_checkpointing="selective"
        ),
    ),
    (TIED, ParallelConfig(pp=4, dp=2, microbatches=4)),
]
OFFLOAD_STEPS = 2


def _trained(cfg: Config, mesh) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """(loss, gradient norm) of each of OFFLOAD_STEPS optimizer steps from the reference weights, and this
    rank's parameter shards after them."""
    runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
    offloading = [
        b
        for b in runner.module.layers.values()
        if any(isinstance(getattr(h, "__self__", None), BlockOffload) for h in b._forward_pre_hooks.values())
    ]
    assert bool(offloading) == cfg.parallel.offload_activations, "the stage's blocks offload as the recipe says"
    load_full_state_dict(runner.module, _random_model(cfg).state_dict())
    optimizer = build_optimizer(runner.module, cfg.train)
    ids, labels = _batch(cfg)
    rows = mesh["dp"].get_local_rank()
    steps = [
        tuple(
            t.clone()
            for t in training_step(
                runner, optimizer, ids.chunk(cfg.parallel.dp)[rows], labels.chunk(cfg.parallel.dp)[rows], 1.0
            )
        )
        for _ in range(OFFLOAD_STEPS)
    ]
    return steps, [q.to_local().detach().clone() for q in runner.module.parameters()]


@pytest.mark.full
def check_offload_keeps_the_pipelines_numbers(_folder):
    """Both host offloads under a pipeline (the optimizer state and step on the host, every block's saved
    tensors there between its forward and backward) change no bit of 2 optimizer steps' losses, gradient
    norms and parameters, and the first loss is the single process's."""
    for model, layout in OFFLOAD_LAYOUTS:
        plain, where = _config(model, layout), _where(model, layout)
        offloaded = _config(model, dataclasses.replace(layout, offload="optimizer", offload_activations=True))
        mesh = cached_mesh(**layout.sizes)
        want, want_params = _trained(plain, mesh)
        got, params = _trained(offloaded, mesh)
        assert [torch.equal(a, b) for step in zip(got, want) for a, b in zip(*step)] == [True] * 2 * OFFLOAD_STEPS, (
            f"{where}: offloaded (loss, gradient norm) {got} vs {want}"
        )
        assert all(torch.equal(a, b) for a, b in zip(params, want_params)), f"{where}: parameters changed"
        assert_parity(f"{where} offloaded", got[0][0], _reference(plain, *_batch(plain))[1])


@launch_tests(
    8,
    [
        check_pipeline_matches_single_process,
        check_zero_bubble_schedules_match_single_process,
        check_fp8_pipeline_matches_single_process,
        check_fsdp_gathers_and_reduces_once_per_step,
        check_fsdp_gathers_once_per_step_without_pipeline,
        check_zero_bubble_accumulates_in_fp32_under_bf16,
        check_zero_bubble_with_checkpointing_replays_each_block_once,
        check_clipping_and_export_cover_all_stages,
        check_offload_keeps_the_pipelines_numbers,
    ],
    timeout=900,
)  # a hang guard, not a speed bound
def test_pipeline_matches_single_process_on_8_ranks(tmp_path):
    return (str(tmp_path / "hf"),)


def test_a_7b_stage_is_pruned_on_the_meta_device():
    cfg = _config(
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
        ),
        ParallelConfig(pp=4, schedule="interleaved", virtual_stages=2, microbatches=8),
    )
    full = sum(p.numel() for p in _meta_model(cfg).parameters())
    owned = []
    for rank in range(4):
        stage = _meta_model(cfg)
        chunks = prune_to_stage(stage, rank, 4, 2)
        assert sorted(chunks) == [rank, rank + 4]
        assert all(p.is_meta for p in stage.parameters())
        assert [int(k) for k in stage.layers] == [i for r in chunks.values() for i in r]
        assert (stage.embed_tokens is not None) == (rank == 0) and (stage.lm_head is not None) == (rank == 3)
        owned.append(sum(p.numel() for p in stage.parameters()))
    assert sum(owned) == full and max(owned) < full / 3, [n / full for n in owned]


def test_tied_lm_head_stage_loads_the_embedding_from_an_hf_state():
    cfg = _config(TIED, ParallelConfig(pp=2, microbatches=2))
    last = _meta_model(cfg)
    prune_to_stage(last, 1, 2)
    last.to_empty(device="cpu")
    full = _random_model(cfg).state_dict()
    hf_like = {k: v for k, v in full.items() if k != "lm_head.weight"}  # HF folders store it once
    load_full_state_dict(last, hf_like, strict=True)
    assert torch.equal(last.lm_head.weight, full["embed_tokens.weight"])


def _meta_model(cfg):
    with torch.device("meta"):
        return build_model(cfg.model)


@pytest.mark.parametrize(
    "layout, message",
    [
        pytest.param(layout, message, id=layout.name)
        for layout, message in [
            (ParallelConfig(pp=4, dp=2, microbatches=3), "microbatches = 3 is fewer than pp = 4"),
            (
                ParallelConfig(pp=4, dp=2, schedule="interleaved", virtual_stages=2, microbatches=6),
                "not a multiple of pp = 4",
            ),
            (
                ParallelConfig(pp=8, schedule="interleaved", virtual_stages=2, microbatches=8),
                "num_hidden_layers = 8 is fewer than",
            ),
            (
                ParallelConfig(pp=4, dp=2, schedule="zbv", virtual_stages=2, microbatches=6),
                r"zbv: microbatches = 6 is fewer than 2 \* pp = 8",
            ),
            (
                ParallelConfig(pp=4, dp=2, schedule="dualpipev", virtual_stages=2, microbatches=6),
                r"dualpipev: microbatches = 6 is fewer than the 8 stages",
            ),
        ]
    ],
)
def test_invalid_pipeline_layouts_fail_before_any_collective(layout, message):
    cfg = _config(DENSE, layout)
    # No process group exists here: reaching a collective would raise something else.
    with pytest.raises(ConfigError, match=message):
        validate_layout(cfg, layout.world_size)
    with pytest.raises(ConfigError, match=message):
        PipelineRunner(_meta_model(cfg), None, cfg, torch.device("cpu"))


def test_split_backward_gives_the_whole_backwards_gradients_and_frees_at_w():
    """B (input gradient, node gradients recorded) then W (weights only) on a MoE chunk equals one
    whole backward, and W leaves nothing saved behind."""
    from meshtron.parallel.pipeline.executor import _backward_input

    cfg = _config(MOE, ParallelConfig(pp=2, schedule="zbv", virtual_stages=2, microbatches=4))
    model = _random_model(cfg)
    ids, _ = _batch(cfg)
    positions = torch.arange(SEQ).expand(ids.shape[0], -1)
    hidden = model(ids, positions, layers=range(0, 2)).detach()
    grad = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))

    def run(split):
        model.zero_grad(set_to_none=True)
        tracker = SavedTensorTracker()
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            x = hidden.clone().requires_grad_()
            out = model(x, positions, layers=range(2, 4))
        if not split:
            out.backward(grad)
            return x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, tracker
        deferred = _backward_input(out, grad, x)
        assert deferred.restarts and all(p.grad is None for p in model.parameters()), "B touched a weight"
        x_grad = x.grad
        deferred.run(out)
        del out, deferred
        return x_grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, tracker

    x_ref, ref, _ = run(False)
    x_grad, grads, tracker = run(True)
    assert rel_err(x_grad, x_ref) < 1e-6 and grads.keys() == ref.keys() and ref
    for name, g in ref.items():
        assert rel_err(grads[name], g) < 1e-5, name
    assert len(tracker.live) == 0
