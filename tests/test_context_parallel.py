"""Ring attention with load-balanced sharding against full causal attention (8 CPU ranks, float32)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh

from meshtron import env
from meshtron.checkpoint import load_full_state_dict
from meshtron.config import ModelConfig
from meshtron.mesh import build_mesh
from meshtron.models.layers import document_causal_mask
from meshtron.models.qwen2 import build_model, token_loss_sum
from meshtron.parallel.context import (
    CP_COMM_TYPES,
    RingAttention,
    RingStats,
    a2a_group_size,
    apply_context_parallel,
    causal_score_elements,
    check_context_parallel,
    chunk_ids,
    cp_groups,
    document_blocks,
    ring_schedule,
    sequence_index,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)
from meshtron.testing import GRAD_RTOL, LOSS_RTOL, assert_parity, cached_mesh, launch_tests, random_model, rel_err

# (cp, batch, heads, kv heads, head dim, chunk length): GQA with 2 and 4 query heads per kv head,
# head dims that are not multiples of 8.
CASES = [(2, 2, 4, 2, 24, 8), (4, 1, 4, 1, 40, 6), (8, 2, 4, 2, 20, 5)]


def _cp_mesh(cp: int):
    """A (dp, cp) mesh over the 8 ranks, so cp groups of size 2 and 4 run side by side."""
    return init_device_mesh(env.device_type(), (dist.get_world_size() // cp, cp), mesh_dim_names=("dp", "cp"))


def _reference(q, k, v, dout):
    """Full-sequence causal SDPA in float64 with its gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def random_positions(batch: int, seq: int, gen: torch.Generator, longest: int) -> torch.Tensor:
    """Packed positions of documents of mixed random lengths (1 .. longest), restarting at every one."""
    rows = []
    for _ in range(batch):
        row = []
        while len(row) < seq:
            row += range(int(torch.randint(1, longest + 1, (1,), generator=gen)))
        rows.append(torch.tensor(row[:seq]))
    return torch.stack(rows)


def _reference_documents(q, k, v, dout, positions):
    """Full-sequence SDPA with the block-diagonal causal mask, float64, with its gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    index = torch.arange(q.shape[2])
    mask = document_causal_mask(positions, index, index).unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _comm_run(mesh, comm_type, q, k, v, dout, positions):
    """One cp_comm_type's attention forward/backward on the sharded inputs, unsharded again."""
    cp = mesh["cp"]
    rank, size = cp.get_local_rank(), cp.size()
    ring, a2a = cp_groups(mesh, comm_type, heads=q.shape[1], kv_heads=k.shape[1])
    attn = RingAttention(ring, a2a=a2a, allgather=CP_COMM_TYPES[comm_type].allgather, kernel="math")
    local = [shard_sequence(t, rank, size, dim=2).requires_grad_() for t in (q, k, v)]
    docs = shard_sequence(positions, rank, size) if positions is not None else None
    out = attn(*local, docs)
    out.backward(shard_sequence(dout, rank, size, dim=2))
    return [unshard_sequence(t, cp, dim=2) for t in (out.detach(), *(x.grad for x in local))]


@pytest.mark.full
def check_comm_types_match_full_attention():
    """Every cp_comm_type at cp 2, 4, 8, with and without document masks, against one process;
    (8 heads, 2 KV heads): at cp 4 and 8 the all-to-all types repeat KV heads (fewer than cp)."""
    for cp in (2, 4, 8):
        mesh = _cp_mesh(cp)
        seq = 2 * cp * 5
        gen = torch.Generator().manual_seed(2000 + cp)
        q, dout = (torch.randn(2, 8, seq, 12, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, 2, seq, 12, generator=gen) for _ in range(2))
        positions = random_positions(2, seq, gen, longest=seq // 3)
        refs = {False: _reference(q, k, v, dout), True: _reference_documents(q, k, v, dout, positions)}
        for comm_type in CP_COMM_TYPES:
            for documents, ref in refs.items():
                got = _comm_run(mesh, comm_type, q, k, v, dout, positions if documents else None)
                errs = [rel_err(g, r) for g, r in zip(got, ref)]
                where = f"cp={cp} {comm_type} documents={documents}: errs={errs}"
                assert errs[0] < LOSS_RTOL, where
                assert max(errs[1:]) < GRAD_RTOL, where


def _ring_run(mesh, q, k, v, dout, balanced: bool, kernel: str):
    """Shard, run ring attention forward/backward, and unshard out, dq, dk, dv."""
    cp = mesh["cp"]
    rank, size = cp.get_local_rank(), cp.size()
    local = [shard_sequence(t, rank, size, dim=2, balanced=balanced).requires_grad_() for t in (q, k, v)]
    out = RingAttention(cp, balanced=balanced, kernel=kernel)(*local)
    out.backward(shard_sequence(dout, rank, size, dim=2, balanced=balanced))
    return [unshard_sequence(t, cp, dim=2, balanced=balanced) for t in (out.detach(), *(x.grad for x in local))]


def check_ring_matches_full_attention():
    for cp, b, h, hkv, d, c in CASES:
        mesh = _cp_mesh(cp)
        seq = 2 * cp * c
        gen = torch.Generator().manual_seed(1000 + cp)  # same inputs on every rank
        q, dout = (torch.randn(b, h, seq, d, generator=gen) for _ in range(2))
        k, v = (torch.randn(b, hkv, seq, d, generator=gen) for _ in range(2))
        ref = _reference(q, k, v, dout)
        for balanced, kernel in [(True, "math"), (True, "aten"), (False, "math")]:
            got = _ring_run(mesh, q, k, v, dout, balanced, kernel)
            errs = [rel_err(g, r) for g, r in zip(got, ref)]
            where = f"cp={cp} H={h} Hkv={hkv} D={d} balanced={balanced} kernel={kernel}: errs={errs}"
            if dist.get_rank() == 0:
                print(where)
            assert errs[0] < LOSS_RTOL, where
            assert max(errs[1:]) < GRAD_RTOL, where


@pytest.mark.full
def check_ring_bfloat16():
    """bf16 activations (K/V travel in bf16, accumulators stay fp32) within the bf16 tolerance."""
    mesh = _cp_mesh(8)
    seq, gen = 128, torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 4, seq, 32, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, seq, 32, generator=gen) for _ in range(2))
    ref = _reference(q, k, v, dout)
    got = _ring_run(mesh, *(t.bfloat16() for t in (q, k, v, dout)), balanced=True, kernel="math")
    assert all(g.dtype == torch.bfloat16 for g in got)
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    assert max(errs) < 2e-2, errs


@pytest.mark.full
def check_per_rank_work_is_balanced():
    """Unmasked score elements each rank computes in a real run: balanced vs contiguous layout."""
    cp, h, d, c = 8, 2, 16, 8
    seq = 2 * cp * c
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, seq, d, generator=gen) for _ in range(3))
    ratios = {}
    for balanced in (True, False):
        attn = RingAttention(dist.group.WORLD, balanced=balanced)
        attn.stats = RingStats()
        attn(*(shard_sequence(t, rank, cp, dim=2, balanced=balanced) for t in (q, k, v)))
        counts = torch.zeros(cp, dtype=torch.int64)
        counts[rank] = attn.stats.score_elements
        dist.all_reduce(counts)
        assert attn.stats.steps == cp
        # Every unmasked (query, key) pair of the causal matrix is computed exactly once.
        assert counts.sum().item() == seq * (seq + 1) // 2, counts
        ratios[balanced] = counts.max().item() / counts.min().item()
        # The analytic count from the schedule agrees with what ran.
        chunk = seq // (2 * cp if balanced else cp)
        expected = sum(causal_score_elements(chunk, visible) for visible in ring_schedule(rank, cp, balanced))
        assert attn.stats.score_elements == expected
    if rank == 0:
        print(f"per-rank causal work max/min: balanced {ratios[True]:.3f}, contiguous {ratios[False]:.3f}")
    assert ratios[True] <= 1.05, ratios
    assert ratios[False] > 10, ratios


@pytest.mark.full
def check_document_work_is_counted():
    """With documents of mixed lengths the ring computes each visible (query, key) pair once (blocks
    no query sees are skipped): the per-rank counts add up to the block-diagonal mask's."""
    cp, c = 8, 8
    seq, rank = 2 * cp * c, dist.get_rank()
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, seq, 16, generator=gen) for _ in range(3))
    positions = random_positions(1, seq, gen, longest=seq // 2)
    index = torch.arange(seq)
    visible = int(document_causal_mask(positions, index, index).sum())
    assert visible < seq * (seq + 1) // 2
    for balanced in (True, False):
        attn = RingAttention(dist.group.WORLD, balanced=balanced)
        attn.stats = RingStats()
        local = [shard_sequence(t, rank, cp, dim=2, balanced=balanced) for t in (q, k, v)]
        attn(*local, shard_sequence(positions, rank, cp, balanced=balanced))
        counts = torch.zeros(cp, dtype=torch.int64)
        counts[rank] = attn.stats.score_elements
        dist.all_reduce(counts)
        assert counts.sum().item() == visible, (balanced, counts)


def check_sharding_round_trips():
    world = dist.get_world_size()
    mesh = init_device_mesh(env.device_type(), (1, 1, world, 1, 1), mesh_dim_names=("pp", "dp", "cp", "ep", "tp"))
    rank = mesh["cp"].get_local_rank()
    gen = torch.Generator().manual_seed(3)
    seq = 4 * world
    for balanced in (True, False):
        for dim, shape in [(1, (2, seq, 3)), (0, (seq, 5)), (2, (2, 3, seq, 4))]:
            t = torch.randn(*shape, generator=gen)
            local = shard_sequence(t, rank, world, dim=dim, balanced=balanced)
            assert torch.equal(unshard_sequence(local, mesh["cp"], dim=dim, balanced=balanced), t)
    ids = torch.randint(0, 1000, (2, seq), generator=gen)
    batch = shard_batch({"input_ids": ids, "labels": ids.roll(-1, 1)}, mesh)
    assert torch.equal(batch["position_ids"][0], sequence_index(seq, rank, world))
    assert torch.equal(batch["input_ids"], ids[:, sequence_index(seq, rank, world)])
    assert torch.equal(unshard_sequence(batch["labels"], mesh["cp"]), ids.roll(-1, 1))


def check_qwen2_loss_and_grads_match():
    """Whole model on build_mesh(cp=8) against the single-process model on the same batch.

    The training-loop contract: local token-loss sum / global token count, gradients summed over cp.
    """
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10_000.0,
    )
    model = random_model(cfg, seed=3, device="cpu")
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (2, 4 * world), generator=gen)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[0, :5] = -100  # ignored tokens fall unevenly on the cp ranks
    ref_loss = token_loss_sum(model(ids), labels) / (labels != -100).sum()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    mesh = build_mesh(cp=world)
    cp_group = mesh["cp"].get_group()
    apply_context_parallel(model, mesh)
    assert all(isinstance(layer.self_attn.core_attention, RingAttention) for layer in model.layers.values())
    batch = shard_batch({"input_ids": ids, "labels": labels}, mesh)
    local_sum = token_loss_sum(model(batch["input_ids"], batch["position_ids"]), batch["labels"])
    tokens = (batch["labels"] != -100).sum()
    dist.all_reduce(tokens, group=cp_group)
    (local_sum / tokens).backward()
    loss = local_sum.detach().clone()
    dist.all_reduce(loss, group=cp_group)
    for p in model.parameters():
        dist.all_reduce(p.grad, group=cp_group)
    grads = [(name, p.grad) for name, p in model.named_parameters()]
    assert_parity(f"cp{world} (weights seed 3, batch seed 11)", loss / tokens, ref_loss, grads, ref_grads)


@pytest.mark.full
def check_composed_layouts_match_single_process():
    """The runner's composition (TP/SP + CP + FSDP), dense and MoE: loss and every gathered gradient
    equal the single-process model on the same global batch (with the same document masks). p2p on
    cp 2, 4 and cp x tp 2x2, 4x2; every cp_comm_type at cp x tp 2x2 + SP, 4x2 (dense also cp 8),
    with and without documents; 8 heads and 2 KV heads, so the all-to-all types repeat KV heads."""
    from dataclasses import replace

    from meshtron.config import Config, DataConfig, ParallelConfig, TrainConfig
    from meshtron.mesh import batch_mesh
    from meshtron.parallel.runner import NoPipelineRunner

    dense = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=10_000.0,
    )
    moe = ModelConfig(
        **{
            **dense.__dict__,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 32,
            "router_aux_loss_coef": 0.1,
        }
    )
    # (layout, document masks); cp_comm_type p2p unless named
    p2p = [
        (ParallelConfig(dp=4, cp=2), False),
        (ParallelConfig(dp=2, cp=4), False),
        (ParallelConfig(dp=2, cp=2, tp=2, sp=True), False),
        (ParallelConfig(cp=4, tp=2), False),
    ]
    every = [
        (replace(layout, cp_comm_type=comm), documents)
        for comm in CP_COMM_TYPES
        for layout, documents in [
            (ParallelConfig(dp=2, cp=2, tp=2, sp=True), True),
            (ParallelConfig(cp=4, tp=2), False),
        ]
    ]
    cases = {
        "dense": p2p + every + [(ParallelConfig(cp=8, cp_comm_type=comm), True) for comm in CP_COMM_TYPES],
        "moe": p2p + [(ParallelConfig(cp=4, tp=2, sp=True, cp_comm_type=comm), True) for comm in CP_COMM_TYPES],
    }
    gen = torch.Generator().manual_seed(5)
    for kind, model_cfg in (("dense", dense), ("moe", moe)):
        ids = torch.randint(0, model_cfg.vocab_size, (4, 16), generator=gen)
        labels = ids.roll(-1, 1)
        labels[:, -1] = -100
        positions = random_positions(4, 16, gen, longest=7)
        refs = {}
        for documents in (False, True):
            reference = random_model(model_cfg, seed=1, device="cpu")
            reference.document_mask = documents
            ref_loss = token_loss_sum(reference(ids, positions if documents else None), labels) / (labels != -100).sum()
            ref_loss.backward()
            refs[documents] = ref_loss.item(), {name: p.grad for name, p in reference.named_parameters()}
        start = reference.state_dict()  # the weights (a backward leaves them as they were)
        assert abs(refs[True][0] - refs[False][0]) > 1e-3 * refs[False][0]  # the masks matter
        for layout, documents in cases[kind]:
            cfg = Config(
                model=model_cfg,
                parallel=layout,
                train=TrainConfig(seed=1, seq_len=16),
                data=DataConfig(document_mask=documents),
            )
            mesh = cached_mesh(**layout.sizes)
            with torch.device("meta"):
                model = build_model(model_cfg)
            runner = NoPipelineRunner(model, mesh, cfg, torch.device("cpu"))
            load_full_state_dict(runner.module, start)
            share = batch_mesh(mesh)
            rows = slice(
                share.get_local_rank() * ids.shape[0] // share.size(),
                (share.get_local_rank() + 1) * ids.shape[0] // share.size(),
            )
            loss = runner.forward_backward(ids[rows], labels[rows], positions[rows] if documents else None)
            ref_loss, ref_grads = refs[documents]
            where = f"{kind} {layout.name} documents={documents} (weights seed 1, batch seed 5)"
            grads = [(name, p.grad.full_tensor()) for name, p in runner.module.named_parameters()]
            assert_parity(where, loss, ref_loss, grads, ref_grads)


@launch_tests(
    8,
    [
        check_sharding_round_trips,
        check_ring_matches_full_attention,
        check_comm_types_match_full_attention,
        check_ring_bfloat16,
        check_per_rank_work_is_balanced,
        check_document_work_is_counted,
        check_qwen2_loss_and_grads_match,
        check_composed_layouts_match_single_process,
    ],
    timeout=600,
)
def test_context_parallel_8_ranks():
    return ()


def test_bad_sequence_length_names_the_numbers():
    with pytest.raises(ValueError, match=r"seq_len=100 with cp=8.*multiple of 16"):
        shard_sequence(torch.zeros(1, 100), 0, 8)
    with pytest.raises(ValueError, match=r"seq_len=30 with cp=4.*multiple of 4"):
        sequence_index(30, 1, 4, balanced=False)


def test_cp_comm_type_errors_name_the_key_and_fix():
    """Each unsupported layout gets one ConfigError from the recipe check, before any process group."""
    from meshtron.config import Config, ConfigError, ParallelConfig, TrainConfig
    from meshtron.parallel.layout import validate_layout

    def layout(comm: str, cp: int, tp: int = 1, heads: int = 8, kv: int = 2, a2a_size: int = 0, seq: int = 64):
        model = ModelConfig(
            vocab_size=64,
            hidden_size=8 * heads,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv,
        )
        parallel = ParallelConfig(cp=cp, tp=tp, cp_comm_type=comm, cp_a2a_size=a2a_size)
        validate_layout(Config(model=model, parallel=parallel, train=TrainConfig(seq_len=seq)), cp * tp)

    cases = [
        (dict(comm="ring", cp=2), r"cp_comm_type = 'ring' is not one of p2p, a2a, allgather, a2a\+p2p"),
        (dict(comm="a2a", cp=4, tp=2, heads=4), r"splits the 2 attention heads of each tp rank over 4 cp ranks"),
        (dict(comm="a2a", cp=4, heads=12, kv=3), r"the 3 key/value heads of each tp rank and the 4 cp ranks"),
        (dict(comm="a2a+p2p", cp=8, a2a_size=3), r"cp_a2a_size = 3 does not divide cp = 8"),
        (dict(comm="p2p", cp=4, a2a_size=2), r"cp_a2a_size = 2 is only used with cp_comm_type = 'a2a\+p2p'"),
        (dict(comm="allgather", cp=4, seq=36), r"seq_len = 36 must be a multiple of 2 x cp = 8"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            layout(**kwargs)
    layout("a2a", cp=4, tp=2, heads=8, kv=2)  # 4 heads and 1 (replicated) KV head per tp rank: fits
    with pytest.raises(ConfigError, match=r"sliding window of 4096 tokens; set cp = 1"):
        check_context_parallel("p2p", 2, 8, 2, seq_len=64, sliding_window=4096)
    assert [a2a_group_size("a2a+p2p", 8, heads=8, ranks_per_node=n) for n in (8, 2, 1)] == [4, 2, 1]
    assert a2a_group_size("a2a", 8) == 8 and a2a_group_size("allgather", 8) == 1


def test_document_blocks_skip_invisible_and_mask_only_boundaries():
    """Query chunk 2 (tokens 8..11, chunk length 4) whose documents start at 5 and 9."""
    visible = [(0, 0, False), (0, 1, False), (0, 2, True)]
    blocks = document_blocks(visible, (2,), (0, 1, 2), 4, first_start=[5], last_start=[9])
    # Chunk 0 (0..3) ends before 5: skipped; chunk 1 (4..7) straddles 5: masked; the diagonal
    # holds the start 9: masked, no longer plain causal.
    assert blocks == [(0, 1, False, True), (0, 2, False, True)]
    inside = document_blocks(visible, (2,), (0, 1, 2), 4, first_start=[0], last_start=[0])
    assert inside == [(0, j, causal, False) for _, j, causal in visible]


def test_schedule_skips_masked_blocks_and_balances():
    """Per step every rank runs the same amount of work: the whole diagonal, or half of a full block pair."""
    cp = 4
    for rank in range(cp):
        schedule = ring_schedule(rank, cp)
        assert schedule[0] == [(0, 0, True), (1, 0, False), (1, 1, True)]
        for step, visible in enumerate(schedule[1:], start=1):
            src = (rank - step) % cp
            # Earlier rank: all queries see its first chunk; later rank: the late query chunk sees all.
            assert visible == ([(0, 0, False), (1, 0, False)] if src < rank else [(1, 0, False), (1, 1, False)])


@given(cp=st.integers(1, 8), chunk=st.integers(1, 4), balanced=st.booleans())
@settings(max_examples=40, deadline=None)
def test_layout_and_schedule_cover_the_causal_matrix_once(cp, chunk, balanced):
    seq = chunk * (2 * cp if balanced else cp)
    held = [sequence_index(seq, r, cp, balanced) for r in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))
    # Every visible (query chunk, key chunk) pair is computed exactly once, on the query's owner.
    seen = []
    for rank in range(cp):
        for step, visible in enumerate(ring_schedule(rank, cp, balanced)):
            mine, visiting = chunk_ids(rank, cp, balanced), chunk_ids((rank - step) % cp, cp, balanced)
            seen += [(mine[i], visiting[j], causal) for i, j, causal in visible]
    n = 2 * cp if balanced else cp
    assert sorted(seen) == [(a, b, a == b) for a in range(n) for b in range(a + 1)]
