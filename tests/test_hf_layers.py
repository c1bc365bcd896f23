"""parallelize_hf_model on models whose layers differ from each other (issue 62): per-layer figures read from each
layer's own config (transformers' ``per_layer_config``), never from one global value.

One 2-rank launch, Gemma 4 (its full-attention layers have a head_dim of their own, and its ep plan names its dense
MLP too): at tp 2 every layer's attention is split and the loss and gradients equal the unsplit model's, with the
default per-layer config, with one giving the full-attention layers a single key/value head, and with layers 2 and 3
reusing the keys and values of layers 0 and 1 (the block check proves them on the states handed to them); SP is
refused naming the per-layer input it would not split; a per-layer head count tp cannot split is refused naming the
layer, and pp (its blocks take a per-layer input and shared key/values no stage has) is refused naming them.

Another 2-rank launch, Inkling: its plan's 'all_reduce' shared experts (bare 3-D weights split, output summed once)
and its embedding class with a norm of its own (kept whole) keep the unsplit model's loss and gradients at tp 2,
with and without SP.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from meshtron.config import ConfigError
from meshtron.testing import assert_parity, cached_mesh, launch_tests

GEMMA4 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    global_head_dim=16,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2,
    vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=8,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
# The full-attention layers with one key/value head of 16 features (the sliding ones keep 4 of 8).
ONE_KV_HEAD = {i: {"head_dim": 16, "num_key_value_heads": 1} for i in (1, 3)}
# Layers 2 and 3 reuse the keys and values layers 0 and 1 computed (Gemma 3n's and 4's KV sharing).
KV_SHARED = {"num_kv_shared_layers": 2}
SPLIT = {"q_proj": Shard(0), "k_proj": Shard(0), "v_proj": Shard(0), "o_proj": Shard(1)}


def _gemma4(**overrides):
    """The same random Gemma 4 on every rank (transformers' init plus noise on every parameter)."""
    import transformers

    torch.manual_seed(4)
    config = transformers.Gemma4TextConfig(**{**GEMMA4, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.train()


def _tp_placement(weight) -> object:
    return (
        dict(zip(weight.device_mesh.mesh_dim_names, weight.placements))["tp"] if isinstance(weight, DTensor) else None
    )


def check_per_layer_configs() -> None:
    from meshtron import parallelize_hf_model

    gen = torch.Generator().manual_seed(62)
    ids = torch.randint(3, GEMMA4["vocab_size"], (2, 16), generator=gen)
    mesh = cached_mesh(tp=2)
    cases = (("default", {}), ("one kv head", {"per_layer_config": ONE_KV_HEAD}), ("kv shared", KV_SHARED))
    for name, overrides in cases:
        where = f"gemma4 {name} tp2"
        ref = _gemma4(**overrides)
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        model = parallelize_hf_model(_gemma4(**overrides), mesh)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        held = [(n, p.grad) for n, p in model.named_parameters()]
        assert assert_parity(where, loss, ref_loss, held, grads) == len(grads), where
        for layer in model.model.layers:  # q/k/v gathered (v_norm does not say its size), o_proj rowwise
            held = [(p, s) for p, s in SPLIT.items() if hasattr(layer.self_attn, p)]  # KV-sharing layers: no k, v
            assert [_tp_placement(getattr(layer.self_attn, p).weight) for p, _ in held] == [s for _, s in held], where
    # Gemma 4 reads its query heads globally, so a layer can differ in key/value heads only; 3 of them are a count
    # the layer itself could not run (8 query heads), which the check meets first without the block check.
    with pytest.raises(
        ConfigError,
        match=r"tp = 2 and num_key_value_heads = 3 do not divide one another.*\(decoder layer 1, its "
        r"per_layer_config\)",
    ):
        three = _gemma4(per_layer_config={i: {"num_key_value_heads": 3, "head_dim": 16} for i in (1, 3)})
        parallelize_hf_model(three, mesh, prove_blocks=False)
    # Under SP each block's per-layer input (the whole sequence) is refused by the block check, naming it.
    with pytest.raises(
        ConfigError,
        match=r"Gemma4TextDecoderLayer takes 'per_layer_input' \[1, 16, 8\] beside its hidden states "
        r"\[1, 16, 64\], along the same tokens: under SP the stream is split along the sequence",
    ):
        parallelize_hf_model(_gemma4(), mesh, sp=True)
    # Its decoder hands each block a per-layer input and the shared key/values: no pipeline stage has them.
    with pytest.raises(
        ConfigError,
        match=r"pp > 1 does not support Gemma4TextModel's forward handing its blocks 1 more positional "
        r"argument\(s\), shared_kv_states beyond the hidden states, masks and positions",
    ):
        parallelize_hf_model(_gemma4(), cached_mesh(pp=2), microbatches=2)


@launch_tests(2, [check_per_layer_configs])
def test_per_layer_configs_on_2_ranks():
    return ()


def test_the_block_check_proves_every_distinct_layer():
    """A block's kind includes its parameters' shapes, its attention type and its per-layer config: of a 64-layer
    Gemma 4 the full-attention layer 1 (its own head_dim) is proved beside the sliding layer 0, two blocks in all;
    Gemma 3's layers share their shapes but not their attention type; Llama's are one kind."""
    import transformers

    from meshtron.hf import prove
    from meshtron.hf.discover import hf_parts
    from meshtron.testing import HF_TINY_SIZES

    def proved(config) -> list[int]:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        return [index for index, _ in prove.block_kinds(hf_parts(model).block_items(), model.config)]

    types = ["sliding_attention", "full_attention"] * 32
    assert proved(transformers.Gemma4TextConfig(**{**GEMMA4, "num_hidden_layers": 64, "layer_types": types})) == [0, 1]
    gemma3 = transformers.Gemma3TextConfig(**HF_TINY_SIZES, sliding_window=8, layer_types=types[:2])
    assert proved(gemma3) == [0, 1]
    assert proved(transformers.LlamaConfig(**{**HF_TINY_SIZES, "num_hidden_layers": 4})) == [0]


def test_how_the_decoder_calls_its_blocks():
    """block_call reads the decoder's loop over its blocks: Llama hands them the hidden states, masks and positions
    a pipeline stage gives; Gemma 4 also a per-layer input (positional) and the shared key/values."""
    import transformers

    from meshtron.hf.discover import block_call, hf_parts
    from meshtron.testing import HF_TINY_SIZES

    with torch.device("meta"):
        llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**HF_TINY_SIZES))
        gemma4 = transformers.AutoModelForCausalLM.from_config(transformers.Gemma4TextConfig(**GEMMA4))
    assert block_call(hf_parts(llama)) == (
        1,
        ["attention_mask", "position_embeddings", "position_ids", "cache", "use_cache"],
    )
    positional, keywords = block_call(hf_parts(gemma4))
    assert positional == 2 and "shared_kv_states" in keywords, (positional, keywords)


INKLING = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    swa_num_attention_heads=8,
    swa_num_key_value_heads=4,
    swa_head_dim=8,
    sliding_window_size=8,
    d_rel=4,
    rel_extent=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    mlp_layer_types=["dense", "sparse"],
    pad_token_id=0,
)


# Inkling's shared experts under an 'all_reduce' module, as transformers 5.24's plan splits them (5.25's
# plan leaves them whole): set on the config so that the style is tested whatever the installed version.
INKLING_SHARED_EXPERTS_PLAN = {
    "layers.*.mlp.shared_experts.gate_proj": "colwise",
    "layers.*.mlp.shared_experts.up_proj": "colwise",
    "layers.*.mlp.shared_experts.down_proj": "rowwise",
    "layers.*.mlp.shared_experts": "all_reduce",
}


def _inkling():
    import transformers

    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.InklingTextConfig(**INKLING), dtype=torch.float32
    )
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, **INKLING_SHARED_EXPERTS_PLAN}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.train()


def check_all_reduce_shared_experts() -> None:
    """Inkling's plan splits its shared experts' bare [n, intermediate, hidden] weights ('colwise' / 'rowwise')
    under an 'all_reduce' module: each tp rank computes a part, summed once; its embedding class normalises
    after the lookup and stays whole. Loss and gradients equal the unsplit model's at tp 2, with and without SP."""
    from meshtron import parallelize_hf_model

    gen = torch.Generator().manual_seed(65)
    ids = torch.randint(1, INKLING["vocab_size"], (2, 16), generator=gen)
    ref = _inkling()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for sp in (False, True):
        where = f"inkling tp2{' + SP' if sp else ''}"
        model = parallelize_hf_model(_inkling(), cached_mesh(tp=2), sp=sp)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        held = [(n, p.grad) for n, p in model.named_parameters()]
        assert assert_parity(where, loss, ref_loss, held, grads) == len(grads), where
        shared = model.model.layers[1].mlp.shared_experts
        placements = [_tp_placement(getattr(shared, p)) for p in ("gate_proj", "up_proj", "down_proj")]
        assert placements == [Shard(1), Shard(1), Shard(2)], (where, placements)
        assert _tp_placement(model.model.embed_tokens.weight) != Shard(0), where


@launch_tests(2, [check_all_reduce_shared_experts])
def test_all_reduce_modules_on_2_ranks():
    return ()


def test_all_reduce_modules_split_bare_parameters_only():
    """An 'all_reduce' module's 'colwise' parameters split on their next-to-last dim, 'rowwise' ones on their last;
    entries naming its submodules, and SP outside a MoE block (ranks holding different tokens), are refused."""
    from torch import nn

    from meshtron.hf.tp_plan import _partial_sum_splits

    layer = nn.Module()
    layer.shared = nn.Module()
    layer.shared.up = nn.Parameter(torch.zeros(2, 32, 64))
    layer.shared.down = nn.Parameter(torch.zeros(2, 64, 32))
    plan = {"layers.*.shared": "all_reduce", "layers.*.shared.up": "colwise", "layers.*.shared.down": "rowwise"}
    assert _partial_sum_splits(plan, "layers.*.shared", layer, split_seq=False) == {"up": 1, "down": 2}
    with pytest.raises(ConfigError, match=r"SP does not support the 'all_reduce' module 'layers.<i>.shared' outside"):
        _partial_sum_splits(plan, "layers.*.shared", layer, split_seq=True)
    layer.shared.proj = nn.Linear(64, 64)
    with pytest.raises(ConfigError, match=r"it has 'proj' \('colwise'\)"):
        _partial_sum_splits({**plan, "layers.*.shared.proj": "colwise"}, "layers.*.shared", layer, split_seq=False)
