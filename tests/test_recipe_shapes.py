"""Every real recipe builds a model with the published parameter count.

Three independent numbers must agree for each recipe: the count published for the checkpoint (or
derived by hand from its config.json), a closed-form count from the recipe's [model] section, and
the parameters of a meta-device model from both transformers and meshtron.models. Meta tensors
allocate nothing, so even the 72B model costs only a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshtron.config import ModelConfig, load_config

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

# The checkpoints' safetensors totals as the Hugging Face Hub reports them (the model cards round
# them: 0.49B, 1.54B, 3.09B, 7.61B, 14.7B, 32.5B, 72.7B; 57B; 14.3B). Each one is also re-derived
# below from the recipe's shapes, so a wrong shape in a recipe cannot pass.
PUBLISHED = {
    "qwen2p5_0p5b": 494_032_768,
    "qwen2p5_1p5b": 1_543_714_304,
    "qwen2p5_3b": 3_085_938_688,
    "qwen2p5_7b": 7_615_616_512,
    "qwen2p5_14b": 14_770_033_664,
    "qwen2p5_32b": 32_763_876_352,
    "qwen2p5_72b": 72_706_203_648,
    "qwen2p5_72b_8gpu": 72_706_203_648,
    "qwen2_57b_a14b": 57_408_658_944,
    "qwen2_57b_a14b_8gpu": 57_408_658_944,
    "qwen1p5_moe_a2p7b": 14_315_784_192,
}


def _mlp(hidden: int, width: int) -> int:
    return 3 * hidden * width  # gate, up and down projections, no biases


def expected_count(m: ModelConfig) -> int:
    """Parameter count of a Qwen2 / Qwen2-MoE model written out from its config."""
    h, d = m.hidden_size, m.head_size
    q, kv = m.num_attention_heads * d, m.kv_heads * d
    bias = (q + 2 * kv) if m.attention_bias else 0
    attention = h * (q + 2 * kv) + bias + q * h
    total = 0
    for layer in range(m.num_hidden_layers):
        if m.is_moe_layer(layer):
            # router, routed experts, shared expert and its scalar sigmoid gate
            mlp = h * m.num_experts + m.num_experts * _mlp(h, m.moe_intermediate_size)
            mlp += _mlp(h, m.shared_expert_intermediate_size) + h
        else:
            mlp = _mlp(h, m.intermediate_size)
        total += attention + mlp + 2 * h  # two RMSNorm weights
    embeddings = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return total + embeddings + h  # final norm


def hf_config(m: ModelConfig):
    """The transformers config meshtron writes for the recipe's [model] section (HF key names map one to one)."""
    from transformers import Qwen2Config, Qwen2MoeConfig

    from meshtron.hf import hf_config_dict

    return (Qwen2MoeConfig if m.is_moe else Qwen2Config).from_dict(hf_config_dict(m))


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def hf_meta_count(m: ModelConfig) -> int:
    from transformers import Qwen2ForCausalLM, Qwen2MoeForCausalLM

    cls = Qwen2MoeForCausalLM if m.is_moe else Qwen2ForCausalLM
    with torch.device("meta"):
        return count(cls(hf_config(m)))


def meshtron_meta_count(m: ModelConfig) -> int:
    from meshtron.models import build_model

    with torch.device("meta"):
        return count(build_model(m))


@pytest.fixture(scope="module", params=sorted(PUBLISHED))
def recipe(request):
    return request.param, load_config(RECIPES / f"{request.param}.toml").model


def test_every_real_recipe_has_a_published_count():
    real = {p.stem for p in RECIPES.glob("*.toml") if not p.stem.startswith("debug_")}
    assert real == set(PUBLISHED)


def test_closed_form_matches_published(recipe):
    name, m = recipe
    assert expected_count(m) == PUBLISHED[name]


def test_transformers_meta_model_matches_published(recipe):
    name, m = recipe
    assert hf_meta_count(m) == PUBLISHED[name]


def test_meshtron_meta_model_matches_published(recipe):
    name, m = recipe
    assert meshtron_meta_count(m) == PUBLISHED[name]


@pytest.mark.parametrize("name", ["debug_dense", "debug_moe"])
def test_debug_models_match_transformers(name):
    m = load_config(RECIPES / f"{name}.toml").model
    assert expected_count(m) == hf_meta_count(m) == meshtron_meta_count(m)


def test_closed_form_follows_sparse_step_and_mlp_only_layers():
    """A mixed dense/MoE stack must be counted layer by layer, as transformers builds it."""
    m = load_config(
        RECIPES / "debug_moe.toml", ["--model.decoder_sparse_step", "2", "--model.mlp_only_layers", "[3]"]
    ).model
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert expected_count(m) == hf_meta_count(m)


def test_recipe_headers_state_the_plan():
    """Every GPU recipe's header states meshtron.plan's prediction for its layout on its stated hardware, to
    0.1 GiB (`python -m meshtron.plan.recipes recipes/*.toml` rewrites them)."""
    from meshtron.plan.recipes import planned_gib, recipe_hardware, stated_gib

    for path in sorted(RECIPES.glob("*.toml")):
        if recipe_hardware(path).device != "cuda":
            continue
        stated = stated_gib(path)
        assert stated is not None, f"{path.name}: no 'meshtron.plan predicts X GiB per GPU' in its header"
        assert stated == round(planned_gib(path), 1), (
            f"{path.name}: header says {stated} GiB, the plan {planned_gib(path):.2f}"
        )
