"""Multi-token prediction (``[model] num_nextn_predict_layers``): the shifted inputs and targets, DeepSeek-V3's
module and loss as written, the recipe's checks, HF export, and the same losses and weights on every layout as
in one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import Config, ConfigError, load_config
from meshtron.models.mtp import mtp_loss_weights, tokens_ahead
from meshtron.testing import (
    cached_recipe_mesh,
    documented_command,
    launch_tests,
    random_model,
    rel_err,
    run_torchrun,
)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def _mtp_config(recipe: str, *overrides: str, depth: int = 2) -> Config:
    return load_config(ROOT / "recipes" / f"{recipe}.toml", [f"--model.num_nextn_predict_layers={depth}", *overrides])


def test_tokens_ahead_shifts_inputs_and_targets_and_stops_at_documents():
    """Module k at position i reads token i + k and predicts the label at i + k; nothing past the sequence, and
    with documents nothing from another document (SFT's ignored labels stay ignored)."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    labels = torch.tensor([[11, -100, 13, 14, 15, 16]])
    inputs, targets = tokens_ahead(ids, labels, 2)
    assert inputs[0, :, 0].tolist() == [11, 12, 13, 14, 15, 0]
    assert inputs[0, :, 1].tolist() == [12, 13, 14, 15, 0, 0]
    assert targets[0, :, 0].tolist() == [-100, 13, 14, 15, 16, -100]
    assert targets[0, :, 1].tolist() == [13, 14, 15, 16, -100, -100]
    documents = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two documents of three tokens
    _, targets = tokens_ahead(ids, labels, 2, documents)
    assert targets[0, :, 0].tolist() == [-100, 13, -100, 15, 16, -100]
    assert targets[0, :, 1].tolist() == [13, -100, -100, 16, -100, -100]


def _written_losses(model, ids: torch.Tensor, labels: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """DeepSeek-V3's MTP from its paper, by hand on whole logits: h⁰ the last block's output; module k at
    position i joins RMSNorm(h^{k-1}_i) and RMSNorm(Emb(t_{i+k})) through M_k, its block gives h^k, the shared
    head on its norm predicts t_{i+k+1}; each loss summed over the positions that have a target."""
    cfg = model.config
    seq = ids.shape[1]
    rope = model.rotary(torch.arange(seq).expand(ids.shape[0], -1), torch.float32)
    h = model.embed_tokens(ids)
    for i in range(cfg.num_hidden_layers):
        h = model.layers[str(i)](h, rope)
    losses = [F.cross_entropy(model.lm_head(model.norm(h)).flatten(0, 1), labels.flatten(), reduction="sum")]
    for k in range(1, depth + 1):
        module = model.layers[str(cfg.num_hidden_layers + k - 1)]
        ahead = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], dim=1)
        joined = torch.cat([module.enorm(model.embed_tokens(ahead)), module.hnorm(h)], dim=-1)
        h = super(type(module), module).forward(module.eh_proj(joined), rope)
        logits = model.lm_head(module.norm(h))[:, : seq - k]
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten(), reduction="sum"))
    return losses


@pytest.mark.parametrize("recipe", ["debug_dense", "debug_moe"])
def test_the_modules_losses_are_deepseek_v3s_written_rule(recipe):
    """The model's stacked losses equal the paper's computation done by hand, and the step's objective is the
    next-token loss + λ × the modules' mean loss, each per its own counted targets."""
    cfg = _mtp_config(recipe, "--parallel.ep=1")
    model = random_model(cfg.model, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    inputs, targets = tokens_ahead(ids, labels, 2)
    got = model(ids, labels=labels, mtp_tokens=inputs, mtp_labels=targets)
    written = _written_losses(model, ids, labels, 2)
    assert got.shape == (3,)
    for k, (mine, theirs) in enumerate(zip(got, written)):
        assert rel_err(mine, theirs) < 1e-5, (k, mine, theirs)
    counts = torch.tensor([64.0, 62.0, 60.0])  # 2 x 32 targets, one and two fewer per sample ahead
    assert [(t != -100).sum().item() for t in (labels, targets[..., 0], targets[..., 1])] == counts.tolist()
    weights = mtp_loss_weights(cfg.model, torch.device("cpu"))
    assert weights.tolist() == pytest.approx([1.0, 0.05, 0.05])
    objective = written[0] / 64 + 0.1 * (written[1] / 62 + written[2] / 60) / 2
    assert rel_err((got / counts) @ weights, objective) < 1e-6
    for depth in (1, 2):
        assert abs(got[depth].item() / counts[depth].item() - math.log(cfg.model.vocab_size)) < 0.5  # random init


def test_the_modules_are_layers_after_the_decoder_and_get_gradients():
    """Stored as layers L .. L + depth - 1 (DeepSeek-V3's layout) with their norms, projection and block; the
    MTP losses' gradients reach the modules, the shared embedding and head, and the main blocks."""
    cfg = _mtp_config("debug_dense")
    model = random_model(cfg.model, seed=0)
    last = cfg.model.num_hidden_layers
    names = model.state_dict().keys()
    assert {f"layers.{last}.{part}.weight" for part in ("enorm", "hnorm", "eh_proj", "norm")} <= names
    assert f"layers.{last + 1}.self_attn.q_proj.weight" in names and f"layers.{last + 2}.enorm.weight" not in names
    assert model.layers[str(last)].eh_proj.weight.shape == (cfg.model.hidden_size, 2 * cfg.model.hidden_size)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17))
    inputs, targets = tokens_ahead(tokens[:, :-1], tokens[:, 1:], 2)
    losses = model(tokens[:, :-1], labels=torch.full_like(tokens[:, 1:], -100), mtp_tokens=inputs, mtp_labels=targets)
    assert losses[0].item() == 0  # only the modules' losses: every gradient below comes from them
    losses.sum().backward()
    for name in ("embed_tokens.weight", "lm_head.weight", f"layers.{last - 1}.mlp.down_proj.weight"):
        assert model.get_parameter(name).grad.abs().max() > 0, name
    for name, param in model.layers[str(last + 1)].named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, name


@pytest.mark.parametrize("recipe", ["debug_dense", "debug_moe"])
def test_mfu_flops_count_each_module_as_a_block_a_projection_and_a_head_pass(recipe):
    """MFU's FLOPs per token: each module adds 6 FLOPs per weight of its matrices (its block's, active experts
    only, and eh_proj's, counted on the model) and of the LM head, and one more layer of causal attention."""
    from meshtron.models import flops_per_token

    plain = _mtp_config(recipe, "--parallel.ep=1", depth=0).model
    cfg = _mtp_config(recipe, "--parallel.ep=1", depth=1).model
    model = random_model(cfg, seed=0)
    module = model.layers[str(cfg.num_hidden_layers)]
    matrices = sum(p.numel() for n, p in module.named_parameters() if p.ndim == 2 and "experts" not in n)
    # The router is counted below; the shared expert's one-output gate, as for every MoE block, not at all.
    left_out = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")
    matrices -= sum(p.numel() for n, p in module.named_parameters() if n.endswith(left_out))
    if cfg.is_moe:  # the router's and the top-k experts' GEMMs: FLOPs count active weights
        matrices += cfg.hidden_size * cfg.num_experts
        matrices += 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    added = flops_per_token(cfg, 0) - flops_per_token(plain, 0)
    assert added == 6 * (matrices + model.lm_head.weight.numel())
    attention = flops_per_token(plain, 64) - flops_per_token(plain, 0)
    assert (
        flops_per_token(cfg, 64) - flops_per_token(cfg, 0)
        == attention * (cfg.num_hidden_layers + 1) / cfg.num_hidden_layers
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--model.num_nextn_predict_layers=128"], r"num_nextn_predict_layers = 128 predicts past the sequence"),
        (["--parallel.pp=2", "--parallel.dp=1"], r"runs without a pipeline for now \(\[parallel\] pp = 2\)"),
        (["--train.fp8=tensorwise", "--train.dtype=bfloat16"], r"\[train\] fp8 = 'tensorwise' would take"),
        (["--model.hf_model=/some/folder"], r"a \[model\] hf_model is trained on its next-token loss only"),
    ],
)
def test_recipe_refuses_what_mtp_does_not_run_on(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _mtp_config("debug_dense", *overrides, depth=1)


def test_hf_export_drops_the_modules_with_a_line(tmp_path, capsys):
    """Qwen2 checkpoints have no place for MTP modules: the export writes the decoder, says what it left out,
    and transformers loads it with nothing missing or unexpected."""
    from transformers import AutoModelForCausalLM

    from meshtron.hf.io import save_hf

    cfg = _mtp_config("debug_dense")
    state = random_model(cfg.model, seed=0).state_dict()
    save_hf(state, cfg.model, str(tmp_path))
    assert "drops the 2 multi-token prediction modules (layers 4..5)" in capsys.readouterr().out
    _, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_init_from_a_qwen2_folder_keeps_the_modules_seeded_initialization(tmp_path):
    """A Qwen2 checkpoint (here exported from an MTP model, which drops the modules) fills the decoder; the
    modules, which it has no weights for, keep the seeded initialization; any other missing weight still
    raises."""
    from meshtron.hf.io import save_hf
    from meshtron.hf.slices import load_native_sharded

    cfg = _mtp_config("debug_dense", depth=1)
    trained = random_model(cfg.model, seed=7).state_dict()
    save_hf(trained, cfg.model, str(tmp_path))
    model = random_model(cfg.model, seed=0)
    seeded = {k: v.clone() for k, v in model.state_dict().items()}
    load_native_sharded(model, tmp_path, tied=False, fresh_layers=cfg.model.mtp_layers)
    last = cfg.model.num_hidden_layers
    for name, value in model.state_dict().items():
        expected = seeded[name] if name.startswith(f"layers.{last}.") else trained[name]
        assert torch.equal(value, expected), name
    with pytest.raises(ConfigError, match=rf"has no tensor for parameter 'layers\.{last}\."):
        load_native_sharded(model, tmp_path, tied=False)


def _batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ids, labels, packed positions): with ``[data] document_mask`` each sequence packs three documents, the
    label of each one's last token ignored."""
    gen = torch.Generator().manual_seed(100 + step)
    t = cfg.train
    tokens = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    if not cfg.data.document_mask:
        return ids, labels, None
    starts = [0, t.seq_len // 3, t.seq_len // 2, t.seq_len]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(starts, starts[1:])]).expand_as(ids)
    labels[:, [end - 1 for end in starts[1:]]] = -100
    return ids, labels, positions


def _one_process(cfg: Config, steps: int) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """One process from the seed's weights, one micro-batch per step: (state dict, per step [next-token loss,
    each module's])."""
    from meshtron.optim import build_optimizer, lr_at, set_lr

    model = random_model(cfg.model, seed=cfg.train.seed)
    model.document_mask = cfg.data.document_mask
    optimizer = build_optimizer(model, cfg.train)
    weights = mtp_loss_weights(cfg.model, torch.device("cpu"))
    losses = []
    for step in range(steps):
        ids, labels, positions = _batch(cfg, step)
        inputs, targets = tokens_ahead(ids, labels, cfg.model.num_nextn_predict_layers, positions)
        counts = torch.stack([(labels != -100).sum()] + [(targets[..., k] != -100).sum() for k in range(2)])
        per_loss = model(ids, positions, labels=labels, mtp_tokens=inputs, mtp_labels=targets) / counts
        set_lr(optimizer, lr_at(step, cfg.train))
        (per_loss @ weights).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(per_loss.tolist())
    return model.state_dict(), losses


def _layout_run(cfg: Config, steps: int) -> tuple[dict | None, list[list[float]]]:
    """The layout's runner stepped ``steps`` times (no clipping, as the one-process run): the full state dict on
    rank 0 and, per step, [next-token loss, each module's] as the runner reports them."""
    from meshtron.checkpoint import load_full_state_dict
    from meshtron.mesh import batch_mesh
    from meshtron.optim import build_optimizer, lr_at, set_lr
    from meshtron.runner import build_runner

    mesh = cached_recipe_mesh(cfg)
    runner = build_runner(cfg, mesh, torch.device("cpu"))
    optimizer = build_optimizer(runner.module, cfg.train)
    load_full_state_dict(runner.module, random_model(cfg.model, seed=cfg.train.seed).state_dict())
    readers = batch_mesh(mesh)
    losses = []
    for step in range(steps):
        ids, labels, positions = _batch(cfg, step)
        rows = ids.shape[0] // readers.size()
        mine = slice(readers.get_local_rank() * rows, (readers.get_local_rank() + 1) * rows)
        set_lr(optimizer, lr_at(step, cfg.train))
        loss = runner.forward_backward(ids[mine], labels[mine], None if positions is None else positions[mine])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append([loss.item(), *runner.mtp_losses().tolist()])
    return runner.full_state_dict(), losses


# 4-rank layouts, each splitting the modules as it splits the blocks; cp also with packed documents, whose
# boundaries the shifted targets must respect across the cp ranks' shards, and FSDP x tp + SP under Muon, which
# takes the modules' matrices with the blocks'.
DOCUMENTS, MUON = ["--data.document_mask=true"], ["--train.optimizer=muon"]
LAYOUTS = [
    ("debug_dense", dict(dp=4), []),
    ("debug_dense", dict(dp=2, tp=2, sp=True), []),
    ("debug_dense", dict(dp=2, tp=2, sp=False), []),
    ("debug_dense", dict(dp=2, cp=2), []),
    ("debug_dense", dict(dp=2, cp=2), DOCUMENTS),
    ("debug_dense", dict(dp=4, data_parallel="hsdp"), []),
    ("debug_dense", dict(dp=2, tp=2, sp=True), MUON),
    ("debug_moe", dict(dp=2, ep=2), []),
    ("debug_moe", dict(dp=2, tp=2, sp=True, ep=2, etp=2, fold_ep=True), []),
]
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-3  # AdamW's m / sqrt(v) turns float noise into steps of about lr (tests/test_muon.py)


def check_mtp_matches_one_process_on_every_layout(_):
    """Every layout's next-token and MTP losses at each step, and its weights after STEPS optimizer steps (AdamW,
    or Muon where the layout says), are the one-process run's."""
    import torch.distributed as dist

    for recipe, layout, overrides in LAYOUTS:
        keys = [f"--parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in layout.items()]
        cfg = _mtp_config(recipe, "--parallel.ep=1", "--parallel.microbatches=1", *keys, *overrides)
        got, losses = _layout_run(cfg, STEPS)
        if dist.get_rank() != 0:
            continue
        reference, reference_losses = _one_process(cfg, STEPS)
        for step, (mine, theirs) in enumerate(zip(losses, reference_losses)):
            assert len(mine) == 3 and rel_err(torch.tensor(mine), torch.tensor(theirs)) < LOSS_RTOL, (
                layout,
                step,
                mine,
                theirs,
            )
        assert got.keys() == reference.keys()
        for name, value in reference.items():
            assert rel_err(got[name], value) < PARAM_RTOL, (recipe, layout, overrides, name, rel_err(got[name], value))
        start = random_model(cfg.model, seed=cfg.train.seed).state_dict()
        modules = [n for n in reference if n.startswith(f"layers.{cfg.model.num_hidden_layers}.")]
        moved = min(rel_err(reference[n], start[n]) for n in modules if start[n].ndim == 2)
        assert moved > 10 * PARAM_RTOL, (layout, moved)  # the modules' matrices moved far beyond the bound


@pytest.mark.full
@launch_tests(4, [check_mtp_matches_one_process_on_every_layout])
def test_mtp_on_4_ranks(tmp_path):
    return (str(tmp_path),)


@pytest.mark.full
def test_the_documented_command_trains_with_mtp(tmp_path):
    """docs/training.md's command, as typed, with its output folder under a temporary one: every logged step
    has one module loss, in the console line and in metrics.jsonl, and both losses fall from about ln(256)."""
    import json

    command = documented_command(ROOT / "docs" / "training.md", "Multi-token prediction", "torchrun")
    done = run_torchrun([arg.replace("runs/mtp", str(tmp_path / "mtp")) for arg in command], ROOT)
    records = [json.loads(line) for line in (tmp_path / "mtp" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 10 and all(len(r["mtp_losses"]) == 1 for r in records), records
    lines = [line for line in done.stdout.splitlines() if "step 10/10" in line]
    assert lines and f"mtp {records[-1]['mtp_losses'][0]:.4f}" in lines[0], lines
    main = [r["loss"] for r in records]
    ahead = [r["mtp_losses"][0] for r in records]
    for losses in (main, ahead):
        assert abs(losses[0] - math.log(256)) < 0.5 and losses[-1] < losses[0] - 0.5, losses
