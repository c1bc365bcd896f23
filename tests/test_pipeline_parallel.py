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
from meshtron.testing import cached_mesh, count_calls, launch_tests, rel_err, units_with_parameters, whole_weight_passes
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


def _config(
    model: dict,
    pp: int,
    dp: int,
    schedule: str,
    m: int,
    v: int = 1,
    tp: int = 1,
    cp: int = 1,
    sp: bool = False,
    fp8: str = "none",
) -> Config:
    return Config(
        model=ModelConfig(**model),
        parallel=ParallelConfig(pp=pp, dp=dp, tp=tp, cp=cp, sp=sp, schedule=schedule, virtual_stages=v, microbatches=m),
        train=TrainConfig(global_batch_size=dp * m * MB_SIZE, seq_len=SEQ, seed=3, fp8=fp8),
    )


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
    # (model, pp, dp, schedule, microbatches, virtual[, tp[, cp[, sp]]])
    (DENSE, 8, 1, "1f1b", 9, 1),
    (MOE, 4, 2, "1f1b", 5, 1),
    (DENSE, 2, 4, "1f1b", 3, 1),
    (MOE, 2, 4, "interleaved", 4, 2),
    (DENSE, 4, 2, "interleaved", 4, 2),
    (MOE, 2, 4, "gpipe", 2, 1),
    (DENSE, 2, 2, "1f1b", 2, 1, 2),  # tp shards inside stages; its ranks must not count the loss twice
    (DENSE, 2, 1, "interleaved", 2, 2, 2, 2),  # cp x tp inside interleaved stages
    (TIED, 4, 2, "1f1b", 4, 1, 1),  # embedding on rank 0, its tied LM head copy on rank 3
]


# The zero-bubble schedules, each with pp x dp (FSDP inside stages) and pp x tp, dense and MoE.
ZERO_BUBBLE_LAYOUTS = [
    (DENSE, 4, 2, "zb1p", 4, 1),
    (MOE, 4, 1, "zb1p", 5, 1, 2),
    (DENSE, 4, 1, "zbv", 8, 2, 2),
    (MOE, 4, 2, "zbv", 8, 2),
    (MOE, 4, 1, "dualpipev", 8, 2, 2),
    (DENSE, 2, 4, "dualpipev", 4, 2),
    (DENSE, 2, 2, "zbv", 4, 2, 2, 1, True),  # SP's fused linears split between B and W
]


def check_zero_bubble_schedules_match_single_process(_folder):
    check_pipeline_matches_single_process(_folder, ZERO_BUBBLE_LAYOUTS)


# [train] fp8 split into 8 stages (every converted linear's dims are multiples of 16 here): each stage runs
# its linears on the micro-batches the single process runs, so every float8 scale is the same. Both scale
# granularities (rowwise_with_gw_hp differs from rowwise only in its weight-gradient GEMM, in bf16).
FP8_LAYOUTS = [(DENSE, 8, 1, "1f1b", 8, 1, 1, 1, False, recipe) for recipe in ("tensorwise", "rowwise")]


@pytest.mark.full
def check_fp8_pipeline_matches_single_process(_folder):
    if HAS_TORCHAO:
        check_pipeline_matches_single_process(_folder, FP8_LAYOUTS)


@pytest.mark.full
def check_pipeline_matches_single_process(_folder, layouts=LAYOUTS):
    for layout in layouts:
        cfg = _config(*layout)
        p = cfg.parallel
        mesh = cached_mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp)
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
        assert not whole, f"{layout}: W re-ran the whole backward for {whole}"
        assert tracker.checked == p.microbatches * p.virtual_stages and len(tracker.live) == 0
        assert runner.executor.peak_live == peak_in_flight(runner.executor.entries)
        _check_matches_reference(runner, mesh, loss, reference, layout)


def _check_matches_reference(runner, mesh, loss, reference, layout) -> None:
    """The step's loss, aux loss, gradients and gradient norm against :func:`_reference`'s, to 1e-5."""
    ref, ref_loss, ref_aux, ref_norm = reference
    assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5, (layout, loss, ref_loss)
    if ref_aux is not None:
        assert abs(runner.aux_loss() - ref_aux) / ref_aux < 1e-5, (layout, runner.aux_loss(), ref_aux)
    _check_grads(runner.module, ref, dense_data_mesh(mesh).get_group(), layout)
    norm = runner.clip_grad_norm(1e9)
    assert abs(norm - ref_norm) / ref_norm < 1e-5, (layout, norm, ref_norm)


def _reduced_by_data_parallelism(grad) -> bool:
    from torch.distributed.tensor import DTensor

    data_meshes = {"dp", "dp_ep", "dp_ep_cp", "edp", "edp_replicate"}  # dense and expert data meshes
    return isinstance(grad, DTensor) and bool(data_meshes & set(grad.device_mesh.mesh_dim_names))


def _check_grads(stage, ref, data_group, layout):
    from torch.distributed.tensor import DTensor

    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}  # tied: both names
    names = [n for n, _ in stage.named_parameters()]
    assert names and all(n in ref_grads for n in names)
    for name, param in stage.named_parameters():
        assert param.grad is not None, f"{layout}: {name} has no gradient"
        if not _reduced_by_data_parallelism(param.grad):  # plain replicas: sum them as data parallelism will
            dist.all_reduce(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad, group=data_group)
        assert ref_grads[name].abs().max() > 0
        err = rel_err(param.grad, ref_grads[name])
        assert err < 1e-4, f"{layout}: {name} gradient rel err {err:.2e}"


FSDP_LAYOUTS = [
    # (layout as in LAYOUTS, data_parallel): every schedule, tp and cp inside stages, tied embeddings
    ((DENSE, 2, 2, "1f1b", 4, 1, 2), "fsdp"),
    ((DENSE, 2, 2, "gpipe", 4, 1, 2), "fsdp"),
    ((MOE, 2, 2, "interleaved", 4, 2, 2), "fsdp"),
    ((TIED, 2, 2, "1f1b", 4, 1, 2), "fsdp"),
    ((TIED, 2, 2, "interleaved", 4, 2, 1, 2), "hsdp"),  # sharded over cp, replicated over dp
    ((MOE, 2, 2, "zbv", 4, 2, 2), "fsdp"),  # W restarted inside the graph: FSDP's hooks run by hand
    ((DENSE, 2, 2, "zb1p", 4, 1, 1, 2), "hsdp"),
]


@pytest.mark.full
def check_fsdp_gathers_and_reduces_once_per_step(_folder):
    """Each FSDP unit is all-gathered once and reduce-scattered once per step, not per micro-batch,
    and the step still equals the single-process one."""
    for layout, mode in FSDP_LAYOUTS:
        cfg = _config(*layout)
        cfg.parallel.data_parallel = mode
        p = cfg.parallel
        mesh = cached_mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp)
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
            assert len(gathers) == len(reduces) == units, (layout, mode, step, len(gathers), len(reduces), units)
        assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5, (layout, loss, ref_loss)
        _check_grads(runner.module, ref, dense_data_mesh(mesh).get_group(), layout)
        norm = runner.clip_grad_norm(1e9)
        assert abs(norm - ref_norm) / ref_norm < 1e-5, (layout, norm, ref_norm)


# Without a pipeline (pp = 1), 8 ranks: (layout as in LAYOUTS, data_parallel, ep), each run per micro-batch
# and per step ([parallel] fsdp_gather): dense with cp x tp + SP, MoE under hsdp with ep x tp (dense units
# sharded over ep, experts split over ep and sharded over tp inside a dp slice).
STEP_FSDP_LAYOUTS = [
    ((dict(DENSE, vocab_size=96), 1, 2, "1f1b", 4, 1, 2, 2, True), "fsdp", 1),  # vocab rows even over tp x data
    ((MOE, 1, 2, "1f1b", 4, 1, 2), "hsdp", 2),
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
    for layout, mode, ep in STEP_FSDP_LAYOUTS:
        model, pp, dp, *rest = layout
        readers = _config(model, pp, dp * ep, *rest)  # ep ranks read samples of their own, as dp ranks do
        ids, labels = _batch(readers)
        reference = _reference(readers, ids, labels)
        cfg = _config(*layout)
        cfg.parallel.ep, cfg.train.global_batch_size = ep, readers.train.global_batch_size
        for gather in ("per_microbatch", "per_step"):
            cfg.parallel.data_parallel, cfg.parallel.fsdp_gather = mode, gather
            p = cfg.parallel
            mesh = cached_mesh(dp=p.dp, cp=p.cp, ep=p.ep, tp=p.tp)
            runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
            row = batch_mesh(mesh).get_local_rank()
            local = ids.chunk(dp * ep)[row], labels.chunk(dp * ep)[row]
            load_full_state_dict(runner.module, _random_model(cfg).state_dict())
            expected = _step_collectives(p, units_with_parameters(runner.module))
            for step in range(2 if gather == "per_step" else 1):
                *counts, loss = _counted_step(runner, mesh, *local)
                assert tuple(counts) == expected, (layout, mode, gather, step, counts, expected)
            _check_matches_reference(runner, mesh, loss, reference, (layout, gather))


@pytest.mark.full
def check_zero_bubble_accumulates_in_fp32_under_bf16(_folder):
    """Under bf16 mixed precision a zb1p step gives 1F1B's gradients bit for bit: each W's weight
    gradients join FSDP's fp32 accumulator, as each whole backward's do."""
    grads = {}
    for schedule in ("1f1b", "zb1p"):
        cfg = _config(DENSE, 2, 4, schedule, 6)
        cfg.train.dtype = "bfloat16"
        mesh = cached_mesh(pp=2, dp=4)
        runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
        load_full_state_dict(runner.module, _random_model(cfg).state_dict())
        ids, labels = _batch(cfg)
        dp_rank = mesh["dp"].get_local_rank()
        runner.forward_backward(ids.chunk(4)[dp_rank], labels.chunk(4)[dp_rank])
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
        cfg = _config(DENSE, 2, 4, schedule, 4, v)
        cfg.parallel.activation_checkpointing, cfg.parallel.ac_policy = ac, "alternate_matmuls"
        mesh = cached_mesh(pp=2, dp=4)
        runner = build_model_runner(_meta_model(cfg), mesh, cfg, torch.device("cpu"))
        load_full_state_dict(runner.module, _random_model(cfg).state_dict())
        ids, labels = _batch(cfg)
        ref, ref_loss, _, _ = _reference(cfg, ids, labels)
        calls = []
        # B023: the hooks fire in this iteration's step and are removed before the next.
        hooks = [block.register_forward_pre_hook(lambda *_: calls.append(1)) for block in runner.module.layers.values()]  # noqa: B023
        dp_rank = mesh["dp"].get_local_rank()
        loss = runner.forward_backward(ids.chunk(4)[dp_rank], labels.chunk(4)[dp_rank])
        for hook in hooks:
            hook.remove()
        assert len(calls) == 2 * 4 * len(runner.module.layers), (schedule, len(calls))
        assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5, (schedule, loss, ref_loss)
        _check_grads(runner.module, ref, dense_data_mesh(mesh).get_group(), schedule)


@pytest.mark.full
def check_clipping_and_export_cover_all_stages(folder):
    cfg = _config(DENSE, 4, 2, "1f1b", 4)
    mesh = build_mesh(pp=4, dp=2)
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


# (layout, [parallel] overrides): dp x tp with SP inside the stages; a zero-bubble split backward over MoE
# stages, then its stages run whole under selective checkpointing; a tied LM head summed across the pipeline.
OFFLOAD_LAYOUTS = [
    ((DENSE, 2, 2, "1f1b", 2, 1, 2, 1, True), {}),
    ((MOE, 2, 4, "zbv", 4, 2), {}),
    ((MOE, 2, 4, "zbv", 4, 2), dict(activation_checkpointing="selective")),
    ((TIED, 4, 2, "1f1b", 4, 1), {}),
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
    for layout, overrides in OFFLOAD_LAYOUTS:
        plain = _config(*layout)
        plain = dataclasses.replace(plain, parallel=dataclasses.replace(plain.parallel, **overrides))
        offloaded = dataclasses.replace(
            plain, parallel=dataclasses.replace(plain.parallel, offload="optimizer", offload_activations=True)
        )
        p = plain.parallel
        mesh = cached_mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp)
        want, want_params = _trained(plain, mesh)
        got, params = _trained(offloaded, mesh)
        where = f"{layout[1:]} {overrides}"
        assert [torch.equal(a, b) for step in zip(got, want) for a, b in zip(*step)] == [True] * 2 * OFFLOAD_STEPS, (
            where,
            got,
            want,
        )
        assert all(torch.equal(a, b) for a, b in zip(params, want_params)), f"{where}: parameters changed"
        ref_loss = _reference(plain, *_batch(plain))[1]
        assert abs(got[0][0].item() - ref_loss) / abs(ref_loss) < 1e-5, (where, got[0][0], ref_loss)


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
        4,
        1,
        "interleaved",
        8,
        2,
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
    cfg = _config(TIED, 2, 1, "1f1b", 2)
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
    "cfg, message",
    [
        (_config(DENSE, 4, 2, "1f1b", 3), "microbatches = 3 is fewer than pp = 4"),
        (_config(DENSE, 4, 2, "interleaved", 6, 2), "not a multiple of pp = 4"),
        (_config(DENSE, 8, 1, "interleaved", 8, 2), "num_hidden_layers = 8 is fewer than"),
        (_config(DENSE, 4, 2, "zbv", 6, 2), r"zbv: microbatches = 6 is fewer than 2 \* pp = 8"),
        (_config(DENSE, 4, 2, "dualpipev", 6, 2), r"dualpipev: microbatches = 6 is fewer than the 8 stages"),
    ],
)
def test_invalid_pipeline_layouts_fail_before_any_collective(cfg, message):
    # No process group exists here: reaching a collective would raise something else.
    with pytest.raises(ConfigError, match=message):
        validate_layout(cfg, cfg.parallel.pp * cfg.parallel.dp)
    with pytest.raises(ConfigError, match=message):
        PipelineRunner(_meta_model(cfg), None, cfg, torch.device("cpu"))


def test_split_backward_gives_the_whole_backwards_gradients_and_frees_at_w():
    """B (input gradient, node gradients recorded) then W (weights only) on a MoE chunk equals one
    whole backward, and W leaves nothing saved behind."""
    from meshtron.parallel.pipeline.executor import _backward_input

    cfg = _config(MOE, 2, 1, "zbv", 4, 2)
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
