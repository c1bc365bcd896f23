"""MoE parallel folding and expert tensor parallelism: collectives and bytes per MoE layer, expert bytes per rank.

Part 1 (8 CPU ranks, gloo): one decoder layer whose MLP is a Qwen2-MoE block (hidden 64, 16 experts,
top-4, shared expert), dense layout tp 4 + SP x dp 2, forward + backward, with the experts split
three ways: unfolded ep 1 (the experts whole on every rank, as every tp layout had to run before
folding), folded ep 8, and folded ep 4 x etp 2. Counted inside the MoE block: each collective call
(CommDebugMode) and the bytes each rank sends through the token exchange (all-to-all payloads,
counted per call from the split sizes, a rank's own rows excluded), per token this rank holds.
Megatron-Core's alltoall dispatcher, for the same layouts under balanced routing, sends per token
and layer k x h x c x (ep - 1) / ep in each of its two all-to-alls and, with etp > 1, k x h x c x
(etp - 1) in its all-gather and in its reduce-scatter over etp (forward; backward mirrors it).

Part 2 (no processes): the routed-expert bytes one rank holds (bf16 parameters after ep / etp,
before FSDP) for the MoE recipes at tp 8 (Qwen1.5-MoE-A2.7B) and tp 4 (Qwen2-57B-A14B, 28 heads),
from ``meshtron.plan.memory``, whose per-rank shapes ``tests/test_plan.py`` checks against the DTensors.

Run: ``PYTHONPATH=. python benchmarks/moe_folding.py`` (writes benchmarks/results/moe_folding.md).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

from meshtron.config import ModelConfig, load_config  # noqa: E402
from meshtron.mesh import batch_mesh, build_mesh  # noqa: E402
from meshtron.models import build_model, materialize  # noqa: E402
from meshtron.parallel.expert import apply_expert_parallel  # noqa: E402
from meshtron.parallel.tensor import apply_tensor_parallel  # noqa: E402
from meshtron.parallel.vocab_loss import parallel_token_loss_sum  # noqa: E402
from meshtron.plan.memory import GIB  # noqa: E402
from meshtron.plan.parameters import Coords, _stage_params, model_parallel_shape  # noqa: E402
from meshtron.testing import module_collectives, run_checks  # noqa: E402

MODEL = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    router_aux_loss_coef=0.01,
    rope_theta=10000.0,
)
DENSE = dict(dp=2, tp=4)
SPLITS = [
    ("unfolded ep 1 (experts whole on every rank)", dict(ep=1, etp=1, fold_ep=False)),
    ("folded ep 8", dict(ep=8, etp=1, fold_ep=True)),
    ("folded ep 4 x etp 2", dict(ep=4, etp=2, fold_ep=True)),
]
BATCH, SEQ = 8, 32
MOE = "Transformer.layers.0.mlp"
OUT = ROOT / "benchmarks" / "results" / "moe_folding.md"


def _exchange_bytes(store: list[int]):
    """Counts the bytes this rank sends to other ranks through all_to_all_single."""
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        if input.is_floating_point():
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            me = dist.get_rank(group)
            peers = dist.get_world_size(group)
            sizes = input_split_sizes or [input.shape[0] // peers] * peers
            store.append(row * (sum(sizes) - sizes[me]))
        return original(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    dist.all_to_all_single = counting
    return original


def measure(out_path: str) -> None:
    results = []
    for name, split in SPLITS:
        mesh = build_mesh(**DENSE, **split)
        cfg = ModelConfig(**MODEL)
        model = materialize(build_model(cfg), torch.device("cpu"), seed=3).train()
        apply_tensor_parallel(model, mesh["tp"], True)
        apply_expert_parallel(model, mesh, sequence_parallel=True)
        readers = batch_mesh(mesh)
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
        local = ids.chunk(readers.size())[readers.get_local_rank()]
        sent: list[int] = []
        original = _exchange_bytes(sent)
        comm = CommDebugMode()
        try:
            with comm:
                parallel_token_loss_sum(model(local), local.roll(-1, 1)).backward()
        finally:
            dist.all_to_all_single = original
        tokens = local.numel() // mesh["tp"].size()  # SP: this rank's sequence shard at the MoE input
        total = torch.tensor([float(sum(sent)) / tokens])
        dist.all_reduce(total)
        results.append(
            dict(
                split=name,
                **split,
                collectives=module_collectives(comm, MOE),
                bytes_per_token=total.item() / dist.get_world_size(),
            )
        )
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))


def megatron_bytes_per_token(ep: int, etp: int, k: int, h: int, c: int) -> float:
    """Forward + backward bytes sent per token and MoE layer by Megatron's alltoall dispatcher."""
    per_pass = 2 * k * h * c * (ep - 1) / ep + 2 * k * h * c * (etp - 1)
    return 2 * per_pass


def expert_bytes_per_rank(recipe: str, tp: int, split: dict) -> float:
    cfg = load_config(ROOT / "recipes" / f"{recipe}.toml")
    p = dataclasses.replace(cfg.parallel, tp=tp, dp=8 // tp, pp=1, cp=1, sp=True, **split)
    cfg = dataclasses.replace(cfg, parallel=p)
    params = [q for q in _stage_params((None, tp, 1, 1, False, 0), cfg.model) if q.expert]
    elements = sum(torch.Size(model_parallel_shape(q, cfg, Coords())).numel() for q in params)
    return 2 * elements / GIB  # bf16


def main() -> None:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        run_checks([measure], 8, f.name, timeout=600)
        results = json.loads(Path(f.name).read_text())
    k, h = MODEL["num_experts_per_tok"], MODEL["hidden_size"]
    lines = [
        "# MoE parallel folding and expert tensor parallelism",
        "",
        "Generated by `PYTHONPATH=. python benchmarks/moe_folding.py` (see its docstring for the set-up).",
        "",
        f"## Per MoE layer: dense tp 4 + SP x dp 2 on 8 CPU ranks (hidden {h}, top-{k}, fp32)",
        "",
        "Bytes: what one rank sends to other ranks through the token exchange (forward + backward),",
        "per token it holds at the MoE input, mean over the 8 ranks; routing is the model's own (random",
        "weights), Megatron's figure assumes balanced routing. Collectives: counted inside the MoE block.",
        "",
        "| experts | forward | backward | token-exchange bytes / token | Megatron alltoall dispatcher, bytes / token |",
        "|---|---|---|---:|---:|",
    ]
    for r in results:
        fwd = ", ".join(f"{op} {n}" for op, n in sorted(r["collectives"]["forward"].items()))
        bwd = ", ".join(f"{op} {n}" for op, n in sorted(r["collectives"]["backward"].items()))
        ours = r["bytes_per_token"]
        theirs = megatron_bytes_per_token(r["ep"], r["etp"], k, h, 4)
        lines.append(f"| {r['split']} | {fwd} | {bwd} | {ours:,.0f} | {theirs:,.0f} |")
    lines += [
        "",
        "Unfolded ep 1 moves no tokens, but every rank holds all experts and, before folding, summed",
        "their gradients over tp with three all-reduces in every MoE layer's backward (one per",
        "projection: gate, up, down). Now the experts' gradients are summed once per step with the",
        "data-parallel reduction over their edp ranks, so that count is 0 in every layout above.",
        "Counted before (parent commit) by `tests/test_expert_parallel.py`'s `TP_MOE_COLLECTIVES` at",
        "tp 2: backward all_reduce 4 (no SP) and 5 (SP); now 1 and 2.",
        "",
        "## Routed-expert bytes per rank (bf16 parameters, before FSDP)",
        "",
        "On 8 GPUs (dp = 8 / tp). FSDP then shards each over its data ranks: before folding the experts'",
        "data ranks were dp x cp only (the tp ranks held copies), now they are edp (module docs).",
        "",
        "| recipe | dense tp | experts unfolded, ep 1 (before folding) | folded ep 4 | folded ep 4 x etp 2 |",
        "|---|---:|---:|---:|---:|",
    ]
    for recipe, tp in (("qwen1p5_moe_a2p7b", 8), ("qwen2_57b_a14b", 4)):  # 60 and 64 experts: ep 4 divides both
        before = expert_bytes_per_rank(recipe, tp, dict(ep=1, etp=1, fold_ep=False))
        folded = expert_bytes_per_rank(recipe, tp, dict(ep=4, etp=1, fold_ep=True))
        with_etp = expert_bytes_per_rank(recipe, tp, dict(ep=4, etp=2, fold_ep=True))
        lines.append(f"| `{recipe}` | {tp} | {before:.2f} GiB | {folded:.2f} GiB | {with_etp:.2f} GiB |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
