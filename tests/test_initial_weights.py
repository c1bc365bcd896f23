"""Initial weights: any slice computed on its own equals that slice of the full tensor, and a sharded
model filled rank by rank (each rank computing only its slices) equals the single-process model."""

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshtron import env
from meshtron.checkpoint import fill_local_slices
from meshtron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from meshtron.models import InitialWeights, build_model, materialize
from meshtron.models.counter_rng import normal_slice_, tensor_key
from meshtron.parallel.pipeline import prune_to_stage
from meshtron.parallel.runner import materialize_sharded, parallelize
from meshtron.testing import cached_mesh, launch_tests

DENSE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=44,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
)
MOE = dict(
    DENSE,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=12,
    shared_expert_intermediate_size=20,
    mlp_only_layers=[0],
)
TIED = dict(DENSE, tie_word_embeddings=True)
SEED = 5


def _devices():
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", _devices())
def test_a_slice_equals_that_slice_of_the_full_tensor(device):
    key, shape = tensor_key(3, "layers.0.mlp.experts.gate_proj"), (7, 33, 19)
    full = normal_slice_(torch.empty(shape, device=device), key, shape, (0, 0, 0), 1.0)
    for offsets, size in [
        ((0, 0, 0), (7, 33, 19)),
        ((3, 5, 11), (2, 17, 8)),
        ((6, 32, 18), (1, 1, 1)),
        ((1, 9, 0), (0, 4, 19)),
    ]:
        block = normal_slice_(torch.empty(size, device=device), key, shape, offsets, 1.0)
        index = tuple(slice(o, o + n) for o, n in zip(offsets, size))
        assert torch.equal(block, full[index]), (offsets, size)
    with pytest.raises(ValueError, match="outside"):
        normal_slice_(torch.empty(2, 20, 1), key, shape, (6, 0, 0), 1.0)


def test_values_are_normal_with_the_initializer_range_and_differ_between_tensors():
    cfg = ModelConfig(**DENSE, initializer_range=0.05)
    init = InitialWeights(cfg, SEED)
    embed = init["embed_tokens.weight"]
    assert abs(embed.mean()) < 0.003 and abs(embed.std() - 0.05) < 0.002
    assert abs((embed.abs() < 0.05).float().mean() - 0.6827) < 0.02  # one-sigma mass of a normal
    assert not torch.equal(init["lm_head.weight"], embed)
    assert not torch.equal(InitialWeights(cfg, SEED + 1)["embed_tokens.weight"], embed)
    assert torch.equal(init["layers.1.input_layernorm.weight"], torch.ones(32))
    assert torch.equal(init["layers.1.self_attn.q_proj.bias"], torch.zeros(32))
    tied = InitialWeights(ModelConfig(**TIED), SEED)
    assert torch.equal(tied["lm_head.weight"], tied["embed_tokens.weight"])


def test_init_weights_gives_initial_weights_values():
    cfg = ModelConfig(**MOE)
    model = materialize(build_model(cfg), "cpu", seed=SEED)
    init = InitialWeights(cfg, SEED)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, init[name]), name


class LargestAllocation(TorchDispatchMode):
    """Largest tensor (elements of its local data) any op creates while active; meta tensors
    (shapes only) do not count."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.largest = max(self.largest, (t.to_local() if isinstance(t, DTensor) else t).numel())
        return out


class RecordingFills:
    """``InitialWeights`` that records the largest tensor each ``fill_`` creates."""

    def __init__(self, init: InitialWeights):
        self.init, self.largest = init, {}

    def fill_(self, name, out, offsets):
        with LargestAllocation() as alloc:
            self.init.fill_(name, out, offsets)
        self.largest[name] = alloc.largest
        return out


LAYOUTS = [
    # (model, layout)
    (DENSE, ParallelConfig(tp=8)),  # vocab 97 over 8: uneven shards
    (DENSE, ParallelConfig(dp=2, tp=4)),  # FSDP Shard(0) on top of tp's Shard(0) / Shard(1)
    (DENSE, ParallelConfig(dp=4, tp=2)),  # vocab 97 over tp 2 is uneven: FSDP shards the hidden dim instead
    (DENSE, ParallelConfig(dp=8)),
    (MOE, ParallelConfig(dp=2, ep=4)),  # experts split over ep, then FSDP over dp
    (MOE, ParallelConfig(dp=2, ep=2, tp=2, data_parallel="hsdp")),
    (TIED, ParallelConfig(pp=2, tp=4)),  # pipeline stages x tp; the LM head copy on the last stage
]


def check_sharded_fill_equals_the_full_init():
    device = env.local_device()
    for model_cfg, layout in LAYOUTS:
        cfg = Config(model=ModelConfig(**model_cfg), parallel=layout, train=TrainConfig(seed=SEED))
        mesh = cached_mesh(**layout.sizes)
        with torch.device("meta"):
            model = build_model(cfg.model)
        if layout.pp > 1:
            prune_to_stage(model, mesh["pp"].get_local_rank(), layout.pp)
        parallelize(model, mesh, cfg)
        with LargestAllocation() as alloc:
            materialize_sharded(model, device, cfg)
        full = materialize(build_model(cfg.model), "cpu", seed=SEED).state_dict()
        fills = RecordingFills(InitialWeights(cfg.model, SEED))
        fill_local_slices(model, fills)  # again, watching each parameter's fill
        kind = "moe" if model_cfg is MOE else "tied" if model_cfg is TIED else "dense"
        where, sharded = f"{layout.name} {kind}", []
        for name, tensor in model.state_dict().items():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            assert local.device.type == device.type, f"{where}: {name} on {local.device}"
            if local.numel() < tensor.numel():
                sharded.append(tensor.numel())
                assert fills.largest[name] <= local.numel(), (
                    f"{where}: {name}'s fill made {fills.largest[name]} elements for a shard of {local.numel()}"
                )
            value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            assert torch.equal(value.cpu(), full[name]), f"{where}: {name}"
        # Nothing in the whole start-up (allocation included) is as large as the largest parameter.
        assert sharded and alloc.largest < max(sharded), f"{where}: allocated {alloc.largest} vs {max(sharded)}"


@pytest.mark.full
@launch_tests(8, [check_sharded_fill_equals_the_full_init], timeout=300)
def test_sharded_fill_equals_the_full_init_on_8_ranks():
    return ()
