"""meshtron.optim: the learning-rate schedule's shape and LocalAdamW, torch's fused AdamW stepped on local tensors."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from meshtron.config import ParallelConfig, TrainConfig, load_config
from meshtron.optim import LocalAdamW, build_optimizer, lr_at
from meshtron.testing import cached_recipe_mesh, launch_tests, random_model

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [ParallelConfig(dp=2), ParallelConfig(tp=2, sp=True), ParallelConfig(dp=2, data_parallel="hsdp")]


def _dtensor_calls(optimizer) -> int:
    """Python calls into torch.distributed.tensor (DTensor's dispatch, sharding propagation) during one step."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call" and "torch/distributed/tensor/" in frame.f_code.co_filename.replace("\\", "/"):
            calls[0] += 1

    sys.setprofile(profile)
    try:
        optimizer.step()
    finally:
        sys.setprofile(None)
    return calls[0]


def check_local_adamw_is_torch_fused_adamw_bit_for_bit(_):
    """On each layout, three steps of the same model and batches (the second one non-finite, so skipped on the
    device): parameters and state equal torch's fused AdamW over the DTensors, bit for bit; the state stays
    DTensors (checkpoints reshard it); after the first step, which creates the state, a step runs no DTensor
    code (torch's: more than a call per parameter)."""
    from meshtron.checkpoint import load_full_state_dict
    from meshtron.runner import build_runner

    for layout in LAYOUTS:
        cfg = load_config(ROOT / "recipes" / "debug_dense.toml", layout.overrides())
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, weight_decay=0.1))
        mesh = cached_recipe_mesh(cfg)
        reference = random_model(cfg.model, seed=3).state_dict()
        ids = torch.randint(0, cfg.model.vocab_size, (4, 32), generator=torch.Generator().manual_seed(4))
        runs = []
        for make in (_torch_fused_adamw, build_optimizer):
            runner = build_runner(cfg, mesh, torch.device("cpu"))
            load_full_state_dict(runner.module, reference)
            optimizer = make(runner.module, cfg.train)
            dispatched = []
            for step in range(3):
                optimizer.zero_grad(set_to_none=True)
                runner.forward_backward(ids, ids)
                optimizer.found_inf = torch.tensor(float(step == 1))
                dispatched.append(_dtensor_calls(optimizer))
            runs.append((runner, optimizer, dispatched))
        (theirs, their_optimizer, their_dispatches), (ours, our_optimizer, our_dispatches) = runs
        # The first step creates the state (DTensors, with DTensor ops); the later ones run none.
        assert isinstance(our_optimizer, LocalAdamW) and our_dispatches[1:] == [0, 0], (layout.name, our_dispatches)
        params = list(ours.module.parameters())
        assert min(their_dispatches[1:]) >= len(params), (layout.name, their_dispatches)
        for (name, mine), other in zip(ours.module.named_parameters(), theirs.module.parameters()):
            assert torch.equal(mine.to_local(), other.to_local()), f"{layout.name}: {name}"
            mine_state, other_state = our_optimizer.state[mine], their_optimizer.state[other]
            assert mine_state["step"].item() == 2.0, (layout.name, name, mine_state["step"])  # step 2 was skipped
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(mine_state[key], DTensor) and mine_state[key].placements == mine.placements
                assert torch.equal(mine_state[key].to_local(), other_state[key].to_local()), (layout.name, name, key)


def _torch_fused_adamw(model, train: TrainConfig) -> torch.optim.AdamW:
    groups = build_optimizer(model, train).param_groups
    return torch.optim.AdamW(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
        lr=groups[0]["lr"],
        betas=groups[0]["betas"],
        fused=True,
    )


@launch_tests(2, [check_local_adamw_is_torch_fused_adamw_bit_for_bit])
def test_optimizer_on_2_ranks():
    return (None,)


def test_local_adamw_refuses_what_it_does_not_run():
    params = [torch.nn.Parameter(torch.ones(2))]
    for option in ("amsgrad", "maximize"):
        with pytest.raises(ValueError, match=f"{option} are not supported|amsgrad and maximize"):
            LocalAdamW(params, **{option: True})
    with pytest.raises(ValueError, match="takes no closure"):
        LocalAdamW(params).step(lambda: 0.0)


def test_lr_warms_up_then_decays_to_min_lr():
    train = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, steps=12)
    lrs = [lr_at(step, train) for step in range(12)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] > 1e-4
    assert lr_at(100, train) == pytest.approx(1e-4)
