"""Single-process tests of the optional router features in meshtron/models/moe.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import ConfigError, config_from_dict
from meshtron.models.moe import MoE, capacity_mask, update_expert_bias
from meshtron.testing import random_moe, rel_err

BLOCK = dict(
    vocab_size=32,
    hidden_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=20,
    shared_expert_intermediate_size=16,
)


def _expert_loop(moe: MoE, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Reference: every (token, slot) pair through its expert one by one."""
    e = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(experts.shape[1]):
            i = experts[t, s]
            h = F.silu(x[t] @ e.gate_proj[i]) * (x[t] @ e.up_proj[i])
            out[t] = out[t] + weights[t, s] * (h @ e.down_proj[i])
    return out


def test_z_loss_gradient_and_value_match_the_formula():
    coef = 0.3
    moe = random_moe(BLOCK, 0, router_aux_loss_coef=0.0, router_z_loss_coef=coef)
    x = torch.randn(2, 7, 24)
    moe(x).sum().mul(0).backward()  # only the attached z-loss gradient reaches the router
    got = moe.gate.weight.grad.clone()
    moe.zero_grad()
    logits = x.reshape(-1, 24) @ moe.gate.weight.t()
    z = torch.logsumexp(logits, -1).square().mean()
    (coef * z).backward()
    assert got.abs().max() > 0
    assert rel_err(got, moe.gate.weight.grad) < 1e-5
    assert rel_err(moe.last_z_loss, z) < 1e-6


def test_aux_free_bias_steers_choice_not_weights_and_updates_by_sign():
    rate = 0.01
    moe = random_moe(BLOCK, 1, moe_aux_free_bias_rate=rate, norm_topk_prob=True)
    assert torch.equal(moe.gate.expert_bias, torch.zeros(6))
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.3)
    x = torch.randn(40, 24)
    moe.gate.expert_bias[3] = 10.0  # expert 3 wins every top-k choice
    route = moe.gate(x)
    assert (route.experts == 3).any(dim=1).all()
    chosen = route.probs.gather(1, route.experts)
    assert rel_err(route.weights, chosen / chosen.sum(-1, keepdim=True)) < 1e-6
    moe.gate.expert_bias.zero_()
    moe(x)
    load_a = moe.last_tokens_per_expert.clone()
    moe(x[:17])
    load = (load_a + moe.last_tokens_per_expert).float()
    assert load.max() > load.min()
    update_expert_bias(moe)
    assert torch.equal(moe.gate.expert_bias, rate * torch.sign(load.mean() - load))
    assert moe.load_since_update is None
    assert "gate.expert_bias" in moe.state_dict()


def test_capacity_drops_late_copies_and_their_gradients():
    factor = 0.5
    moe = random_moe(BLOCK, 2, moe_capacity_factor=factor, shared_expert_intermediate_size=0, router_aux_loss_coef=0.0)
    x = torch.randn(30, 24, requires_grad=True)
    route = moe.gate(x)
    keep = capacity_mask(route.experts, 6, factor)
    capacity = math.ceil(factor * 30 * 2 / 6)
    seen = [0] * 6
    for t in range(30):  # first come first served in (token, slot) order
        for s in range(2):
            e = route.experts[t, s].item()
            assert keep[t, s].item() == (seen[e] < capacity)
            seen[e] += 1
    assert 0 < keep.sum() < keep.numel()
    out = moe(x)
    ref = _expert_loop(moe, x, route.weights * keep, route.experts)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(moe.last_dropped_fraction, 1 - keep.float().mean()) < 1e-6
    # Dropped copies give the router no gradient: perturbing their weights changes nothing.
    g = torch.randn_like(out)
    out.backward(g)
    got = moe.gate.weight.grad.clone()
    moe.zero_grad()
    ref.backward(g)
    assert rel_err(got, moe.gate.weight.grad) < 1e-5


def test_router_options_are_validated():
    base = {"model": {**BLOCK, "vocab_size": 256}}  # the default byte tokenizer needs 256 ids
    for key in ("router_z_loss_coef", "moe_aux_free_bias_rate", "moe_capacity_factor"):
        with pytest.raises(ConfigError, match=key):
            config_from_dict({"model": {**base["model"], key: -0.5}})
    assert config_from_dict({"model": {**base["model"], "moe_capacity_factor": 1.25}}).model.moe_capacity_factor == 1.25


MODEL = dict(
    BLOCK,
    num_hidden_layers=2,
    num_key_value_heads=1,
    intermediate_size=32,
    rope_theta=10000.0,
    moe_aux_free_bias_rate=0.01,
    router_aux_loss_coef=0.1,
)


def _model(**overrides):
    from meshtron.config import ModelConfig
    from meshtron.models import build_model

    model = build_model(ModelConfig(**{**MODEL, **overrides})).train()
    model.init_weights(seed=4)
    return model


def test_activation_checkpointing_counts_router_statistics_once():
    """The recomputation in backward replays the MoE forward; the load behind the aux-free bias and
    the last_* statistics still count the training forward once, and gradients are unchanged."""
    from meshtron.models import moe_layers
    from meshtron.parallel.recompute import apply_activation_checkpointing

    ids = torch.randint(0, 32, (2, 9))
    plain, checkpointed = _model(), _model()
    apply_activation_checkpointing(checkpointed, "full")
    for model in (plain, checkpointed):
        model(ids).logsumexp(-1).sum().backward()
    for p, c in zip(moe_layers(plain), moe_layers(checkpointed)):
        assert p.load_since_update.sum() == ids.numel() * 2  # every token's top-2 copies, once
        assert torch.equal(c.load_since_update, p.load_since_update)
        assert torch.equal(c.last_tokens_per_expert, p.last_tokens_per_expert)
        assert rel_err(c.last_aux_loss, p.last_aux_loss) < 1e-6
    for (name, p), c in zip(plain.named_parameters(), checkpointed.parameters()):
        assert rel_err(c.grad, p.grad) < 1e-6, name


class _Runner:
    """What ``training_step`` uses of a runner, on one process, with a loss made NaN on request."""

    def __init__(self, model):
        from meshtron.models import moe_layers

        self.module, self.moes, self.poison = model, moe_layers(model), False

    def forward_backward(self, ids, labels, position_ids=None):
        loss = F.cross_entropy(self.module(ids, position_ids).flatten(0, 1), labels.flatten())
        loss.backward()
        return loss.detach() * (float("nan") if self.poison else 1.0)

    def clip_grad_norm(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)


def test_skipped_step_leaves_the_expert_bias():
    """A non-finite step skips the optimizer update on the device; the bias step is skipped with it
    (and its load discarded), while a finite step moves the bias."""
    from meshtron.config import TrainConfig
    from meshtron.optim import build_optimizer
    from meshtron.train import training_step

    model = _model()
    runner, optimizer = _Runner(model), build_optimizer(model, TrainConfig(lr=1e-3))
    ids = torch.randint(0, 32, (2, 9))
    bias = [m.gate.expert_bias for m in runner.moes]
    runner.poison = True
    training_step(runner, optimizer, ids, ids, 1.0)
    assert all(not b.any() for b in bias)
    assert all(m.load_since_update is None for m in runner.moes)
    runner.poison = False
    training_step(runner, optimizer, ids, ids, 1.0)
    assert all(b.abs().sum() > 0 for b in bias)


def test_router_loss_averaging_is_idempotent():
    """A second runner on the same model sets the same micro-batch count instead of halving again."""
    from meshtron.models import moe_layers
    from meshtron.parallel.runner import average_router_losses_over_microbatches

    model = _model(router_z_loss_coef=0.2)
    ids = torch.randint(0, 32, (2, 9))

    def router_grad():
        model.zero_grad()
        model(ids).sum().mul(0).backward()  # only the attached router losses reach the router
        return model.layers["0"].mlp.gate.weight.grad.clone()

    whole = router_grad()
    for _ in range(2):
        average_router_losses_over_microbatches(model, 2)
        assert rel_err(router_grad(), whole / 2) < 1e-6
    assert all(m.microbatches == 2 for m in moe_layers(model))


def test_hf_export_refuses_a_trained_expert_bias():
    from meshtron.hf import to_hf

    model = _model()
    exported = to_hf(model.state_dict(), model.config)  # an untrained (zero) bias routes like transformers
    assert exported and not any("expert_bias" in k for k in exported)
    with torch.no_grad():
        model.layers["1"].mlp.gate.expert_bias[0] = 0.5
    with pytest.raises(
        ConfigError,
        match=r"layers\.1\.mlp\.gate\.expert_bias.*moe_aux_free_bias_rate = 0\.01.*"
        r"moe_aux_free_bias_rate = 0 to export",
    ):
        to_hf(model.state_dict(), model.config)
