"""Host-memory offload: the recipe keys' refusals and the activation offload's hooks on one process.

The numerics on data-parallel layouts (bit-identical losses, gradients and parameters with the optimizer
state and the saved tensors on the host) are checked in ``test_data_parallel.py``'s 4-rank launch, and a
1-rank training run with a save and resume in ``test_train.py``'s single-rank launch.
"""

from __future__ import annotations

import pytest
import torch

from meshtron.config import Config, ConfigError, ModelConfig, ParallelConfig, validate
from meshtron.models import token_loss_sum
from meshtron.parallel.offload import BlockOffload, apply_activation_offload
from meshtron.parallel.recompute import apply_activation_checkpointing
from meshtron.testing import random_model

CFG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    rope_theta=10000.0,
)


def _loss_and_grads(model, tokens):
    loss = token_loss_sum(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_activation_offload_copies_every_saved_activation_and_changes_no_bit(monkeypatch):
    """Every block not recomputed hands its saved tensors (not its weights, nor their transposed views) to the
    hooks, which keep one copy of each storage span in other memory, however many views of it autograd saves;
    the loss and every gradient stay bit-identical."""
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    expected = _loss_and_grads(random_model(CFG, seed=1), tokens)
    model = random_model(CFG, seed=1)
    assert apply_activation_checkpointing(model, "selective", 2) == [0, 2]
    assert apply_activation_offload(model) == [1, 3]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = []

    def pack(self, tensor):
        out = original(self, tensor)
        packed.append((self, tensor, out))
        return out

    original = BlockOffload.pack
    monkeypatch.setattr(BlockOffload, "pack", pack)
    loss, grads = _loss_and_grads(model, tokens)
    copies = [(block, t, out[1], out[2]) for block, t, out in packed if not isinstance(out, torch.Tensor)]
    kept = [t for _, t, out in packed if isinstance(out, torch.Tensor)]
    assert len(copies) >= 2 * 10, "two blocks' norms, attention and MLP tensors must be offloaded"
    assert kept and all(t.untyped_storage().data_ptr() in weights for t in kept), "only weights stay where they are"
    for _, tensor, copy, (shape, stride, offset) in copies:
        assert copy.host.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
        assert torch.equal(copy.host.as_strided(shape, stride, offset), tensor)
    # Views of one storage (a norm's output and each projection's 2-D view of it) share one copy per block, as
    # autograd keeps the storage once on the device; no element is copied twice by a block. (Each block copies
    # the rotary cos / sin all blocks read.)
    storages = {(id(block), t.untyped_storage()): t for block, t, _, _ in copies}
    hosts = {id(copy): copy for _, _, copy, _ in copies}
    assert len(hosts) == len(storages) < len({id(t) for _, t, _, _ in copies})
    copied = sum(c.host.numel() * c.host.element_size() for c in hosts.values())
    assert copied == sum(t.untyped_storage().nbytes() for t in storages.values())
    assert torch.equal(loss, expected[0])
    for name, grad in expected[1].items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize(
    "layout, message",
    [
        pytest.param(layout, message, id=layout.name)
        for layout, message in [
            (ParallelConfig(offload="cpu"), "offload must be one of none, optimizer, got 'cpu'"),
            (
                ParallelConfig(offload="optimizer", data_parallel="replicate"),
                "offload = 'optimizer' keeps FSDP's parameter shards in host memory: it needs data_parallel = 'fsdp' "
                "or 'hsdp', got 'replicate'",
            ),
            (
                ParallelConfig(offload_activations=True, activation_checkpointing="full"),
                "activation_checkpointing = 'full' recomputes every block: nothing would move",
            ),
            (ParallelConfig(offload_activations=True, compile=True), "set one of them false"),
        ]
    ],
)
def test_offload_config_errors(layout, message):
    cfg = Config(parallel=layout)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        validate(cfg)
