"""Muon (``[train] optimizer = "muon"``): the orthogonalization, the update rule, which parameters it takes,
the recipe's checks, and the same update on every layout as in one process, resumed across layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshtron.config import Config, ConfigError, load_config
from meshtron.models import token_loss_sum
from meshtron.optim import MuonWithAdamW, build_optimizer, lr_at, muon_matrices, newton_schulz, set_lr
from meshtron.testing import (
    cached_recipe_mesh,
    documented_command,
    launch_tests,
    random_model,
    rel_err,
    run_torchrun,
)

ROOT = Path(__file__).resolve().parents[1]
COEFFICIENTS = (3.4445, -4.775, 2.0315)
STEPS = 3
# Muon's matrices after STEPS float32 steps: within 1e-5 of the one-process Muon's (the bound). The
# parameters left to AdamW depart further, as under AdamW alone: its elementwise m / sqrt(v) turns gradients of
# float noise into steps of about lr (k_proj's bias has an exact gradient of zero, softmax being shift-invariant),
# and AdamW alone on dp 4 and dp 2 x tp 2 + SP departs by up to 5.5e-4 (down_proj) after the same steps.
MUON_RTOL = 1e-5
ADAMW_RTOL = 1e-3


def _muon_config(recipe: str, *overrides: str) -> Config:
    return load_config(ROOT / "recipes" / f"{recipe}.toml", ["--train.optimizer", "muon", *overrides])


def test_newton_schulz_keeps_singular_vectors_and_moves_singular_values_near_one():
    """Against the SVD (computed independently): the result is U diag(s') V^T of the input's own U and V, with
    every s' in the band the quintic's coefficients give (about 0.68 to 1.13 after 5 steps), for tall, wide and
    batched inputs."""
    gen = torch.Generator().manual_seed(0)
    for shape in ((48, 16), (16, 48), (3, 32, 24)):
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        out = newton_schulz(x, 5, COEFFICIENTS)
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        core = u.mT @ out @ vh.mT  # diagonal when out shares x's singular vectors
        diagonal = torch.diagonal(core, dim1=-2, dim2=-1)
        off_diagonal = core - torch.diag_embed(diagonal)
        assert off_diagonal.abs().max() < 1e-6, shape
        assert diagonal.min() > 0.6 and diagonal.max() < 1.2, (shape, diagonal.min(), diagonal.max())


def test_muon_takes_block_matrices_and_leaves_the_rest_to_adamw():
    """Dense and MoE: every block linear but the one-output shared-expert gate, and each expert stack; not the
    embedding, head, norms, biases or routers."""
    for recipe in ("debug_dense", "debug_moe"):
        cfg = _muon_config(recipe)
        model = random_model(cfg.model, seed=0)
        linears, experts = muon_matrices(model)
        names = {id(p): n for n, p in model.named_parameters()}
        taken = {names[id(p)] for p in linears + experts}
        expected = {
            n
            for n, p in model.named_parameters()
            if ".layers." in f".{n}"
            and n.endswith(("_proj.weight", "_proj"))
            and "shared_expert_gate" not in n
            and p.ndim >= 2
        }
        assert taken == expected, (recipe, sorted(taken ^ expected))
        assert {names[id(p)] for p in experts} == {n for n in expected if n.endswith("_proj") and ".experts." in n}
        optimizer = build_optimizer(model, cfg.train)
        muon_groups = [g for g in optimizer.param_groups if g.get("muon")]
        assert sum(len(g["params"]) for g in muon_groups) == len(taken)
        rest = [n for n in names.values() if n not in taken]
        assert any("embed_tokens" in n for n in rest) and any("lm_head" in n for n in rest)


def test_one_process_muon_step_is_the_written_rule():
    """Two steps on a one-layer model against the rule computed here by hand: momentum, Nesterov blend, the
    quintic iteration, the AdamW-RMS scale 0.2 sqrt(max(rows, cols)) and decoupled weight decay; AdamW's lr is
    ``muon_adamw_lr`` times the schedule's factor."""
    cfg = _muon_config("debug_dense", "--model.num_hidden_layers=1", "--train.muon_adamw_lr=0.0015")
    model = random_model(cfg.model, seed=1)
    optimizer = build_optimizer(model, cfg.train)
    assert isinstance(optimizer, MuonWithAdamW)
    weight = model.layers["0"].mlp.up_proj.weight
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    t, momentum = cfg.train, torch.zeros_like(weight)
    for step in range(2):
        lr = lr_at(step, t)
        set_lr(optimizer, lr)
        lrs = [(bool(g.get("muon")), g["lr"]) for g in optimizer.param_groups]
        assert lrs == [(True, lr)] + [(False, pytest.approx(lr * 0.0015 / t.lr))] * 2, lrs
        optimizer.zero_grad()
        token_loss_sum(model(ids), ids).backward()
        before, grad = weight.detach().clone(), weight.grad.clone()
        momentum = t.muon_momentum * momentum + grad
        blend = grad + t.muon_momentum * momentum
        x = blend.mT / blend.norm()  # up_proj is [128, 64]: iterate on its wide transpose
        for _ in range(5):
            a = x @ x.mT
            x = 3.4445 * x - 4.775 * a @ x + 2.0315 * a @ a @ x
        expected = before * (1 - lr * t.weight_decay) - lr * 0.2 * 128**0.5 * x.mT
        optimizer.step()
        assert rel_err(weight.detach(), expected) < 1e-6, step
        assert rel_err(optimizer.state[weight]["momentum_buffer"], momentum) < 1e-6, step


def test_a_nonfinite_step_leaves_weights_and_momentum():
    cfg = _muon_config("debug_moe", "--model.num_hidden_layers=1")
    model = random_model(cfg.model, seed=1)
    optimizer = build_optimizer(model, cfg.train)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    token_loss_sum(model(ids), ids).backward()
    optimizer.found_inf = torch.tensor(0.0)
    optimizer.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = {n: optimizer.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters() if p.ndim == 3}
    for p in model.parameters():
        p.grad.fill_(float("nan"))
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
        if n in states:
            assert torch.equal(optimizer.state[p]["momentum_buffer"], states[n]), n
            assert optimizer.state[p]["step"].item() == 1.0, n  # the skipped step is not counted


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--train.optimizer", "lion"], r"\[train\] optimizer must be one of adamw, muon, got 'lion'"),
        (["--train.optimizer", "muon", "--train.muon_scale", "rms"], r"\[train\] muon_scale must be one of"),
        (["--train.optimizer", "muon", "--train.muon_ns_steps", "0"], r"\[train\] muon_ns_steps must be >= 1"),
        (["--train.optimizer", "muon", "--train.muon_momentum", "1.0"], r"\[train\] muon_momentum must be in \[0, 1\)"),
        (["--train.optimizer", "muon", "--parallel.offload", "optimizer"], r"offload = 'optimizer' keeps them"),
    ],
)
def test_recipe_refuses_bad_muon_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "recipes" / "debug_dense.toml", overrides)


# (recipe, [parallel] keys) on 4 ranks: FSDP, FSDP x tp + SP (strided shards), HSDP, pp 1F1B, cp; MoE ep beside
# FSDP, folded ep with etp under tp + SP, and pp with folded ep.
LAYOUTS = [
    ("debug_dense", dict(dp=4)),
    ("debug_dense", dict(dp=2, tp=2, sp=True)),
    ("debug_dense", dict(dp=4, data_parallel="hsdp")),
    ("debug_dense", dict(pp=2, dp=2, microbatches=2)),
    ("debug_dense", dict(dp=2, cp=2)),
    ("debug_moe", dict(dp=2, ep=2)),
    ("debug_moe", dict(dp=2, tp=2, sp=True, ep=2, etp=2, fold_ep=True)),
    ("debug_moe", dict(pp=2, dp=2, ep=2, fold_ep=True, microbatches=2)),
]
# Checkpointed after STEPS - 1 steps on the first layout, resumed for the last step on the second.
RESUMES = [
    ("debug_dense", dict(dp=2, tp=2, sp=True), dict(pp=2, dp=2, microbatches=2)),
    ("debug_moe", dict(dp=2, ep=2), dict(dp=2, tp=2, sp=True, ep=2, etp=2, fold_ep=True)),
]


def _layout_config(recipe: str, layout: dict) -> Config:
    keys = [f"--parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in layout.items()]
    return _muon_config(recipe, "--parallel.ep=1", *keys)


def _batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    t = cfg.train
    tokens = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _one_process(cfg: Config, steps: int, readers: int) -> dict[str, torch.Tensor]:
    """The single-process Muon from the seed's weights, stepped as the layout's runner steps: micro-batch i
    holds micro-batch i of each of the ``readers`` (router losses are per global micro-batch)."""
    from meshtron.models import token_loss_sum
    from meshtron.parallel.step import average_router_losses_over_microbatches

    model = random_model(cfg.model, seed=cfg.train.seed)
    micro = cfg.parallel.microbatches
    average_router_losses_over_microbatches(model, micro)
    optimizer = build_optimizer(model, cfg.train)
    for step in range(steps):
        ids, labels = (t.unflatten(0, (readers, micro, -1)) for t in _batch(cfg, step))
        set_lr(optimizer, lr_at(step, cfg.train))
        loss = sum(token_loss_sum(model(ids[:, i].flatten(0, 1)), labels[:, i].flatten(0, 1)) for i in range(micro))
        (loss / labels.numel()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _layout_run(cfg: Config, steps: range, resume_from: Path | None = None, save_to: Path | None = None):
    """The layout's runner and Muon stepped over ``steps`` (the trainer's clipping off: the one-process run
    has none), from the seed's weights or a checkpoint; returns the full state dict on rank 0."""
    from meshtron.checkpoint import CheckpointWriter, load_checkpoint, load_full_state_dict, step_dir
    from meshtron.mesh import batch_mesh
    from meshtron.runner import build_runner

    mesh = cached_recipe_mesh(cfg)
    runner = build_runner(cfg, mesh, torch.device("cpu"))
    optimizer = build_optimizer(runner.module, cfg.train)
    if resume_from is None:
        load_full_state_dict(runner.module, random_model(cfg.model, seed=cfg.train.seed).state_dict())
    else:
        load_checkpoint(step_dir(resume_from, steps.start), runner.module, optimizer, cfg)
    readers = batch_mesh(mesh)
    for step in steps:
        ids, labels = _batch(cfg, step)
        rows = ids.shape[0] // readers.size()
        mine = slice(readers.get_local_rank() * rows, (readers.get_local_rank() + 1) * rows)
        set_lr(optimizer, lr_at(step, cfg.train))
        runner.forward_backward(ids[mine], labels[mine])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if save_to is not None:
        CheckpointWriter(save_to).save(steps.stop, runner.module, optimizer, cfg, {})
    return runner.full_state_dict()


def _assert_matches_one_process(where: str, got, cfg: Config, readers: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return
    reference = _one_process(cfg, STEPS, readers)
    start = random_model(cfg.model, seed=cfg.train.seed)
    names = {id(p): n for n, p in start.named_parameters()}
    taken = {names[id(p)] for p in sum(muon_matrices(start), [])}
    assert got.keys() == reference.keys(), where
    for name, value in reference.items():
        bound = MUON_RTOL if name in taken else ADAMW_RTOL
        assert rel_err(got[name], value) < bound, (where, name, rel_err(got[name], value), bound)
    moved = min(rel_err(reference[n], start.state_dict()[n]) for n in taken)
    assert moved > 100 * MUON_RTOL, (where, moved)  # every matrix moved far beyond the bound


def _readers(cfg: Config) -> int:
    from meshtron.mesh import batch_mesh

    return batch_mesh(cached_recipe_mesh(cfg)).size() if cfg.parallel.microbatches > 1 else 1


def check_muon_matches_one_process_on_every_layout(_):
    """Each layout's parameters after STEPS Muon steps equal the one-process Muon's to PARAM_RTOL."""
    for recipe, layout in LAYOUTS:
        cfg = _layout_config(recipe, layout)
        _assert_matches_one_process(f"{recipe} {layout}", _layout_run(cfg, range(STEPS)), cfg, _readers(cfg))


def check_muon_resumes_on_another_layout(root):
    """Saved after STEPS - 1 steps on one layout, resumed on another for the last: the one-process result."""
    import torch.distributed as dist

    for i, (recipe, saved_on, resumed_on) in enumerate(RESUMES):
        where = Path(root) / f"resume-{i}"
        first, second = _layout_config(recipe, saved_on), _layout_config(recipe, resumed_on)
        _layout_run(first, range(STEPS - 1), save_to=where)
        dist.barrier()
        got = _layout_run(second, range(STEPS - 1, STEPS), resume_from=where)
        readers = _readers(second)
        assert _readers(first) in (1, readers)  # the one-process run splits micro-batches as the resumed layout
        _assert_matches_one_process(f"{recipe} {saved_on} -> {resumed_on}", got, second, readers)


# Layouts whose ranks all hold the same stage: across the world every matrix is orthogonalized exactly once.
SPREAD_LAYOUTS = [LAYOUTS[0], LAYOUTS[1], LAYOUTS[2], LAYOUTS[4], LAYOUTS[5], LAYOUTS[6]]


def check_muon_spreads_the_iteration(_):
    """Each matrix (each expert's on its own) is iterated on by one rank of the world, and no rank takes more
    than its share: the ceiling of 1/4 of each stack of same-shaped matrices; the busiest rank's matrices and
    Newton–Schulz FLOPs (counted from the shapes iterated on) are the planner's ``muon_work``."""
    import math

    import torch.distributed as dist

    from meshtron import optim
    from meshtron.config import infer_dp
    from meshtron.plan.muon import muon_work

    for recipe, layout in SPREAD_LAYOUTS:
        cfg = _layout_config(recipe, layout)
        counted, iterate = [0, 0.0], optim.newton_schulz

        def counting(matrices, *args, counted=counted, iterate=iterate):
            m, n = sorted(matrices.shape[-2:])
            counted[0] += math.prod(matrices.shape[:-2])
            counted[1] += math.prod(matrices.shape[:-2]) * args[0] * (4 * m * m * n + 2 * m**3)  # args[0]: steps
            return iterate(matrices, *args)

        optim.newton_schulz = counting
        try:
            _layout_run(cfg, range(1))
        finally:
            optim.newton_schulz = iterate
        model = random_model(cfg.model, seed=0)
        linears, experts = muon_matrices(model)
        stacks: dict = {}
        for p in linears + experts:
            stacks[tuple(p.shape)] = stacks.get(tuple(p.shape), 0) + (p.shape[0] if p.ndim == 3 else 1)
        total = torch.tensor([counted[0]])
        dist.all_reduce(total)
        assert total.item() == sum(stacks.values()), (recipe, layout, total.item(), stacks)
        share = sum(math.ceil(n / dist.get_world_size()) for n in stacks.values())
        assert 0 < counted[0] <= share, (recipe, layout, counted[0], share)
        busiest = torch.tensor(counted, dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        planned = muon_work(infer_dp(cfg, dist.get_world_size()))
        assert (planned.matrices, planned.flops) == tuple(busiest.tolist()), (recipe, layout, planned, busiest)


@pytest.mark.full
@launch_tests(
    4,
    [
        check_muon_matches_one_process_on_every_layout,
        check_muon_resumes_on_another_layout,
        check_muon_spreads_the_iteration,
    ],
)
def test_muon_on_4_ranks(tmp_path):
    return (str(tmp_path),)


def _documented_command(start: str) -> list[str]:
    return documented_command(ROOT / "docs" / "optimizers.md", "Muon", start)


@pytest.mark.full
def test_the_documented_command_trains_with_muon(tmp_path):
    """docs/optimizers.md's command, as typed, with its output folder under a temporary one: 10 steps logged,
    the loss falls from about ln(256) (random init on bytes)."""
    import json
    import math

    command = [arg.replace("runs/muon", str(tmp_path / "muon")) for arg in _documented_command("torchrun")]
    run_torchrun(command, ROOT)
    records = [json.loads(line) for line in (tmp_path / "muon" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 10, records
    assert abs(losses[0] - math.log(256)) < 0.1 and losses[-1] < losses[0] - 0.5, losses


def test_the_documented_plan_command_prints_the_busiest_ranks_newton_schulz_work():
    """docs/optimizers.md's planner command, as typed: its Muon line is the one the page quotes, and its
    figures are the count for Qwen2.5-7B at the recipe's dp 2 x tp 4, one stage of 8 ranks: same-shaped,
    same-placed matrices of the 28 blocks stack (q and o apart, placed column- and row-wise; k with v; gate
    with up), each stack split by matrix over the 8 ranks, ``ns_steps (4 m²n + 2 m³)`` FLOPs a matrix."""
    import math
    import os
    import subprocess
    import sys

    import tomllib

    page = (ROOT / "docs" / "optimizers.md").read_text()
    command = _documented_command("python -m meshtron.plan")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line.strip() for line in done.stdout.splitlines() if line.strip().startswith("Muon:"))
    assert f"`{line}`" in page.replace("\n", " ")

    m = tomllib.loads((ROOT / "recipes" / "qwen2p5_7b.toml").read_text())["model"]
    h, f, layers = m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"]
    kv = m["num_key_value_heads"] * h // m["num_attention_heads"]
    ranks, steps = 8, 5

    def flops(rows, cols):
        small, large = sorted((rows, cols))
        return steps * (4 * small * small * large + 2 * small**3)

    stacks = [((h, h), layers), ((h, h), layers), ((kv, h), 2 * layers), ((f, h), 2 * layers), ((h, f), layers)]
    taken = [(shape, math.ceil(count / ranks)) for shape, count in stacks]
    matrices = sum(n for _, n in taken)
    tflop = sum(n * flops(*shape) for shape, n in taken) / 1e12
    assert line == (
        f"Muon: the busiest rank orthogonalizes {matrices} matrices per step, {tflop:.2f} TFLOP of "
        "Newton–Schulz (not in the step time above)"
    )


def test_loss_curves_table_is_its_runs():
    """benchmarks/results/loss_curves.md's losses and gaps are those of the runs stored next to it, every run of
    equal length and from the same first loss (same data and initial weights), the MTP runs with a module loss
    per step, and Muon, and AdamW with one MTP module, end below AdamW on both debug recipes, the module's loss within
    2 % of the next-token loss, as docs/optimizers.md and docs/training.md say."""
    import json
    import re

    results = ROOT / "benchmarks" / "results"
    curves = json.loads((results / "loss_curves.json").read_text())
    training = " ".join((ROOT / "docs" / "training.md").read_text().split())
    rows = re.findall(
        r"^\| (\w+) \| `([\w+]+)` \| ([\d.]+) \| ([\d.]+) \| (\S+) \| (\S+) \|$",
        (results / "loss_curves.md").read_text(),
        re.M,
    )
    assert [(r[0], r[1]) for r in rows] == [(recipe, v) for recipe in curves for v in curves[recipe]]
    assert {v for runs in curves.values() for v in runs} == {"adamw", "muon", "adamw+mtp", "muon+mtp"}

    def final(losses):
        return sum(losses[-10:]) / 10

    for recipe, variant, first, last, gap, mtp in rows:
        losses, adamw = curves[recipe][variant], curves[recipe]["adamw"]["loss"]
        assert len(losses["loss"]) == len(adamw) and losses["loss"][0] == pytest.approx(adamw[0], rel=1e-6)
        assert float(first) == pytest.approx(losses["loss"][0], abs=1e-4)
        assert float(last) == pytest.approx(final(losses["loss"]), abs=1e-4)
        assert ("mtp" in losses) == variant.endswith("+mtp") == (mtp != "–")
        if "mtp" in losses:
            assert len(losses["mtp"]) == len(adamw) and float(mtp) == pytest.approx(final(losses["mtp"]), abs=1e-4)
        if variant != "adamw":
            measured = (final(losses["loss"]) - final(adamw)) / final(adamw)
            assert float(gap.rstrip("%")) / 100 == pytest.approx(measured, abs=1e-4)
        if variant in ("muon", "adamw+mtp"):
            assert measured < 0, (recipe, variant, measured)
        if variant == "adamw+mtp":
            assert abs(final(losses["mtp"]) - final(losses["loss"])) < 0.02 * final(losses["loss"]), (recipe, variant)
            quoted = f"{final(losses['mtp']):.3f} against {final(losses['loss']):.3f}"
            assert quoted in training and f"{-measured:.2%}".replace("%", " %") in training, (recipe, quoted)
