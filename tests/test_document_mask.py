"""Document masking of packed windows on one process: the data rule, and the model against
transformers with packed ``position_ids`` and against the documents run one by one (float32)."""

from __future__ import annotations

import random

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from meshtron.config import ModelConfig
from meshtron.data import TokenDataset
from meshtron.data.packing import pack_documents
from meshtron.hf import from_hf
from meshtron.models import build_model, token_loss_sum
from meshtron.testing import rel_err
from test_data import make_cfg, random_docs, write_jsonl

CFG = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
)
EOS = 0


def _packed_batch(lengths: list[list[int]], seed: int):
    """Windows made of documents of the given lengths (each ending in EOS), with their next-token
    labels, packed positions and the documents themselves."""
    gen = torch.Generator().manual_seed(seed)
    rows, docs = [], []
    for row in lengths:
        parts = [
            torch.cat([torch.randint(1, CFG["vocab_size"], (n - 1,), generator=gen), torch.tensor([EOS])]) for n in row
        ]
        docs.append(parts)
        rows.append(torch.cat(parts + [torch.randint(1, CFG["vocab_size"], (1,), generator=gen)]))
    windows = torch.stack(rows)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    labels, positions = pack_documents(inputs, targets, EOS)
    return inputs, labels, positions, docs


def test_pack_documents_restarts_positions_and_ignores_boundary_targets():
    inputs = torch.tensor([[5, 6, 0, 7, 0, 0, 8, 9], [1, 2, 3, 4, 5, 6, 7, 0]])
    labels = inputs.roll(-1, 1)
    labels_out, positions = pack_documents(inputs, labels, 0)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]
    expected = labels.clone()
    expected[inputs == 0] = -100
    assert torch.equal(labels_out, expected)


def test_dataset_serves_packed_positions_only_when_asked(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", random_docs(random.Random(3), 80, max_words=4))
    plain = TokenDataset.open(make_cfg(tmp_path, source, seq_len=64, batch=4))
    cfg = make_cfg(tmp_path, source, seq_len=64, batch=4)
    cfg.data.document_mask = True
    masked = TokenDataset.open(cfg)
    x, y = plain.batch_for_step(2, 0, 1)
    mx, my, pos = masked.batch_for_step(2, 0, 1)
    assert torch.equal(mx, x)
    eos = plain.tokens[0].eos_id
    assert (x == eos).any(), "the windows should hold document boundaries"
    assert torch.equal(my, y.masked_fill(x == eos, -100))
    assert torch.equal(pack_documents(x, y, eos)[1], pos)
    assert (pos[x.roll(1, 1) == eos][1:] == 0).all()


def _hf_pair(seed: int = 0):
    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(Qwen2Config(**CFG, attn_implementation="sdpa")).train()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    cfg = ModelConfig(**CFG)
    ours = build_model(cfg).train()
    ours.load_state_dict(from_hf(hf.state_dict(), cfg), strict=False)
    ours.tie_weights()
    ours.document_mask = True
    return hf, ours, cfg


def test_document_mask_matches_transformers_packed_position_ids():
    """The oracle: transformers builds its block-diagonal mask from packed position_ids."""
    hf, ours, cfg = _hf_pair()
    inputs, labels, positions, _ = _packed_batch([[5, 9, 2, 8], [24]], seed=1)
    count = (labels != -100).sum()
    ref = token_loss_sum(hf(input_ids=inputs, position_ids=positions, use_cache=False).logits, labels) / count
    ref.backward()
    loss = ours(inputs, positions, labels=labels) / count
    loss.backward()
    assert rel_err(loss, ref) < 1e-5
    hf_grads = from_hf({n: p.grad for n, p in hf.named_parameters()}, cfg)
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, hf_grads[name]) < 1e-4, name


def test_document_mask_equals_documents_one_by_one_and_is_not_a_no_op():
    _, ours, _ = _hf_pair(seed=2)
    inputs, labels, positions, docs = _packed_batch([[7, 3, 11, 3], [6, 18]], seed=4)
    with torch.no_grad():
        packed = ours(inputs, positions)
        alone = torch.cat([torch.cat([ours(d[None]) for d in row], dim=1) for row in docs])
        assert rel_err(packed, alone) < 1e-5
        masked = ours(inputs, positions, labels=labels)
        ours.document_mask = False  # today's packing: one causal sequence per window
        assert torch.equal(ours(inputs), ours(inputs, torch.arange(inputs.shape[1]).expand_as(inputs)))
        assert rel_err(ours(inputs), packed) > 1e-2
        unmasked = ours(inputs, labels=labels)
    assert abs(masked - unmasked) / masked > 1e-3, (masked, unmasked)
