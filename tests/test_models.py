"""Parity of meshtron's Qwen2 / Qwen2-MoE with transformers, and the HF round trip."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from meshtron.config import ModelConfig
from meshtron.hf import CheckpointError, from_hf, load_hf_model, read_hf_config, save_hf, to_hf
from meshtron.models import aux_loss, build_model, count_parameters, materialize, token_loss_sum
from meshtron.testing import rel_err

DENSE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)
MOE = dict(
    DENSE,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=20,
    shared_expert_intermediate_size=40,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere (biases and norms too), so no parameter is tested at a trivial value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] == 64 else 0.0))


def _hf_pair(kind: str, seed: int = 0, **overrides):
    """A random transformers model and the meshtron model with the same weights."""
    torch.manual_seed(seed)
    if kind == "dense":
        hf = Qwen2ForCausalLM(Qwen2Config(**{**DENSE, **overrides}))
    else:
        hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**MOE, **overrides}))
    _randomize(hf, seed)
    ours_overrides = {k: v for k, v in overrides.items() if k in ModelConfig.__dataclass_fields__}
    cfg = ModelConfig(**{**(DENSE if kind == "dense" else MOE), **ours_overrides})
    ours = build_model(cfg)
    ours.load_state_dict(from_hf(hf.state_dict(), cfg), strict=not cfg.tie_word_embeddings)
    ours.tie_weights()
    return hf.train(), ours.train(), cfg


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return token_loss_sum(logits[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()


def _assert_grad_parity(hf, ours, cfg, tol=1e-4) -> float:
    hf_grads = from_hf({n: p.grad for n, p in hf.named_parameters()}, cfg)
    worst = 0.0
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, f"{name} got no gradient"
        err = rel_err(p.grad, hf_grads[name])
        assert err < tol, f"{name}: gradient rel err {err:.2e}"
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("tie", [False, True])
def test_dense_parity_with_transformers(tie):
    hf, ours, cfg = _hf_pair("dense", seed=1, tie_word_embeddings=tie)
    ids = torch.randint(0, cfg.vocab_size, (3, 17))
    out = hf(input_ids=ids, labels=ids)
    logits = ours(ids)
    assert rel_err(logits, out.logits) < 1e-5
    loss = token_loss_sum(logits[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()
    assert rel_err(loss, out.loss) < 1e-5
    out.loss.backward()
    loss.backward()
    _assert_grad_parity(hf, ours, cfg)
    if tie:
        assert ours.lm_head.weight is ours.embed_tokens.weight


@pytest.mark.parametrize("norm_topk", [False, True])
def test_moe_parity_with_transformers_including_aux_loss(norm_topk):
    # One MoE layer between two dense ones: transformers pools the aux loss over layers, which
    # equals the per-layer Switch loss only with a single MoE layer (see meshtron/models/moe.py).
    coef = 0.1
    hf, ours, cfg = _hf_pair(
        "moe",
        seed=2,
        num_hidden_layers=3,
        mlp_only_layers=[0, 2],
        norm_topk_prob=norm_topk,
        router_aux_loss_coef=coef,
        output_router_logits=True,
    )
    ids = torch.randint(0, cfg.vocab_size, (2, 19))
    out = hf(input_ids=ids, labels=ids)
    ce = _loss(ours, ids)
    aux = aux_loss(ours)
    assert rel_err(aux, out.aux_loss) < 1e-5
    assert rel_err(ce + coef * aux, out.loss) < 1e-5
    out.loss.backward()
    ce.backward()  # the aux loss reaches the router through its attached gradient
    _assert_grad_parity(hf, ours, cfg)


def _switch_aux(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Independent per-layer formula: E * sum_e (top-k assignments_e / T) * mean prob_e."""
    probs = router_logits.softmax(-1)
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=-1).indices, 1.0)
    return probs.shape[1] * (chosen.mean(0) * probs.mean(0)).sum()


def test_moe_multilayer_parity_and_independent_aux_formula():
    hf, ours, cfg = _hf_pair("moe", seed=3, num_hidden_layers=3, router_aux_loss_coef=0.0, output_router_logits=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    out = hf(input_ids=ids, labels=ids)
    loss = _loss(ours, ids)
    assert rel_err(loss, out.loss) < 1e-5
    expected = torch.stack([_switch_aux(logits, cfg.num_experts_per_tok) for logits in out.router_logits]).mean()
    assert rel_err(aux_loss(ours), expected) < 1e-5
    out.loss.backward()
    loss.backward()
    _assert_grad_parity(hf, ours, cfg)


def test_aux_loss_gradient_matches_autograd_of_formula():
    """The attached aux gradient equals differentiating coef * mean-layer Switch loss directly."""
    cfg = ModelConfig(**{**MOE, "num_hidden_layers": 2, "router_aux_loss_coef": 0.5})
    torch.manual_seed(4)
    model = materialize(build_model(cfg), "cpu", seed=4)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    captured = []
    hooks = [
        m.gate.register_forward_hook(lambda mod, inp, o: captured.append(o[0]))
        for m in model.modules()
        if hasattr(m, "gate") and hasattr(m, "experts")
    ]
    model(ids).sum().mul(0).backward()  # only the aux gradient reaches the routers
    got = [m.gate.weight.grad.clone() for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    model.zero_grad()
    captured.clear()
    model.eval()
    model(ids)
    expected_loss = (
        0.5
        * torch.stack(
            [
                cfg.num_experts
                * ((torch.zeros_like(p).scatter(1, p.topk(2, -1).indices, 1.0).mean(0)) * p.mean(0)).sum()
                for p in captured
            ]
        ).mean()
    )
    expected_loss.backward()
    for h in hooks:
        h.remove()
    for g, m in zip(got, [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]):
        assert g.abs().max() > 0
        assert rel_err(g, m.gate.weight.grad) < 1e-5


@pytest.mark.parametrize("kind,layout", [("dense", "published"), ("moe", "published"), ("moe", "fused")])
def test_round_trip_is_bit_exact(kind, layout):
    _, ours, cfg = _hf_pair(kind, seed=5)
    state = ours.state_dict()
    back = from_hf(to_hf(state, cfg, layout=layout), cfg)
    assert set(back) == set(state)
    for name, t in state.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("kind,tie,shard_bytes", [("dense", True, 1 << 30), ("moe", False, 20_000)])
def test_save_hf_loads_in_transformers_with_same_logits(tmp_path, kind, tie, shard_bytes):
    cfg = ModelConfig(**{**(DENSE if kind == "dense" else MOE), "tie_word_embeddings": tie})
    ours = materialize(build_model(cfg), "cpu", seed=6)
    _randomize(ours, 6)
    save_hf(ours.state_dict(), cfg, tmp_path / "export", max_shard_bytes=shard_bytes)
    if shard_bytes < 1 << 20:
        assert (tmp_path / "export" / "model.safetensors.index.json").is_file()
    cls = Qwen2ForCausalLM if kind == "dense" else Qwen2MoeForCausalLM
    hf = cls.from_pretrained(tmp_path / "export").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    assert rel_err(ours.eval()(ids), hf(ids).logits) < 1e-5
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    reloaded = load_hf_model(tmp_path / "export")
    for name, t in ours.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], t), name
    assert (reloaded.lm_head.weight is reloaded.embed_tokens.weight) == tie


def test_load_transformers_save_pretrained_folder(tmp_path):
    hf, _, cfg = _hf_pair("moe", seed=7, norm_topk_prob=True)
    hf.save_pretrained(tmp_path / "hf")
    assert read_hf_config(tmp_path / "hf") == cfg
    ours = load_hf_model(tmp_path / "hf")
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    assert rel_err(ours.eval()(ids), hf.eval()(ids).logits) < 1e-5


def test_tied_embeddings_survive_meta_materialisation():
    cfg = ModelConfig(**{**DENSE, "tie_word_embeddings": True})
    with torch.device("meta"):
        model = build_model(cfg)
    assert count_parameters(model) == sum(p.numel() for n, p in model.named_parameters())
    materialize(model, "cpu", seed=0)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.embed_tokens.weight.std() > 0


def test_bad_hf_folders_give_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_hf_model(tmp_path / "nowhere")
    cfg = ModelConfig(**DENSE)
    ours = materialize(build_model(cfg), "cpu", seed=0)
    save_hf(ours.state_dict(), cfg, tmp_path / "ok")
    weights = tmp_path / "ok" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        load_hf_model(tmp_path / "ok")
    save_hf(ours.state_dict(), cfg, tmp_path / "sharded", max_shard_bytes=10_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    (tmp_path / "sharded" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_model(tmp_path / "sharded")
    save_hf(ours.state_dict(), cfg, tmp_path / "other")
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="does not match its config.json"):
        load_hf_model(tmp_path / "other")
