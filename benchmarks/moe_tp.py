"""MoE blocks under tensor parallelism: collectives per MoE layer and expert rows computed per rank.

On 4 CPU ranks (gloo), one decoder layer whose MLP is a Qwen2-MoE block (8 experts, top-2, shared
expert), forward + backward under ``CommDebugMode``, for tp2 (ep1), tp2 + SP, ep2 x tp2 and
ep2 x tp2 + SP. Expert rows per rank: token copies entering the routed experts' grouped GEMMs.

Run: ``PYTHONPATH=. python benchmarks/moe_tp.py`` (prints a markdown table). ``--before`` applies
expert parallelism the way the runner did before MoE tokens were split over tp (never under SP);
run it with ``PYTHONPATH`` pointing at an older tree to measure that code.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from meshtron.config import ModelConfig
from meshtron.mesh import batch_mesh, build_mesh
from meshtron.models import build_model, materialize, token_loss_sum
from meshtron.parallel.expert import apply_expert_parallel
from meshtron.parallel.tensor import apply_tensor_parallel
from meshtron.parallel.vocab_loss import parallel_token_loss_sum
from meshtron.testing import module_collectives, run_checks

MODEL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=32,
    router_aux_loss_coef=0.01,
    rope_theta=10000.0,
)
LAYOUTS = [
    ("tp2, ep1", dict(dp=2, tp=2), False),
    ("tp2 + SP, ep1", dict(dp=2, tp=2), True),
    ("ep2 x tp2", dict(ep=2, tp=2), False),
    ("ep2 x tp2 + SP", dict(ep=2, tp=2), True),
]
BATCH, SEQ = 4, 16  # global; each dp x ep reader gets BATCH / readers sequences
MOE = "Transformer.layers.0.mlp"


def _rows_counter(store: list[int]):
    import meshtron.models.moe as moe_module
    import meshtron.parallel.expert as expert_module

    original = moe_module.grouped_swiglu

    def counting(x, counts, *weights):
        store.append(x.shape[0])
        return original(x, counts, *weights)

    moe_module.grouped_swiglu = expert_module.grouped_swiglu = counting


def _measure(name: str, layout: dict, sp: bool, before: bool) -> dict:
    mesh = build_mesh(**layout)
    cfg = ModelConfig(**MODEL)
    model = materialize(build_model(cfg), torch.device("cpu"), seed=3).train()
    apply_tensor_parallel(model, mesh["tp"], sp)
    apply_expert_parallel(model, mesh, sequence_parallel=sp and not before)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    readers = batch_mesh(mesh)
    local = ids.chunk(readers.size())[readers.get_local_rank()]
    rows: list[int] = []
    _rows_counter(rows)
    comm = CommDebugMode()
    with comm:
        logits = model(local)
        loss_fn = parallel_token_loss_sum if mesh["tp"].size() > 1 else token_loss_sum
        loss_fn(logits, local).backward()  # any labels: only the collectives and row counts matter
    phases = module_collectives(comm, MOE)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows[0])
    return dict(layout=name, tokens_per_rank=local.numel(), expert_rows=gathered, **phases)


def measure(path: str, before: bool) -> None:
    results = [_measure(name, layout, sp, before) for name, layout, sp in LAYOUTS]
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(results, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", action="store_true")
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        run_checks([measure], 4, out.name, args.before)
        results = json.load(open(out.name))
    print("| layout | forward | backward | expert rows per rank |")
    print("|---|---|---|---|")
    for r in results:
        fmt = lambda c: ", ".join(f"{op} {n}" for op, n in sorted(c.items())) or "none"  # noqa: E731
        print(f"| {r['layout']} | {fmt(r['forward'])} | {fmt(r['backward'])} | {r['expert_rows']} |")


if __name__ == "__main__":
    main()
