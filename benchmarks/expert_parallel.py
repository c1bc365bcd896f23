"""MoE expert compute and expert-parallel traffic on this machine's CPU.

1. One MoE block, forward + backward, tokens per second: meshtron's grouped_mm experts, the same
   block with a per-expert Python loop, and transformers' ``Qwen2MoeSparseMoeBlock`` (its ``eager``
   per-expert loop and its ``grouped_mm`` implementation), all with the same weights. Shapes: the
   debug MoE recipe and one layer of Qwen1.5-MoE-A2.7B (hidden 2048, 60 experts top-4, expert
   intermediate 1408, shared expert 5632) with a token count small enough to run in seconds.
2. All-to-all bytes per MoE layer versus ep, counted on 8 CPU ranks (gloo) by wrapping
   ``all_to_all_single``, next to the formula tokens x top-k x hidden x bytes per element.

Run: ``PYTHONPATH=. python benchmarks/expert_parallel.py`` (writes benchmarks/results/expert_parallel.{md,json}).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig
from meshtron.hf import to_hf
from meshtron.models.moe import MoE

SHAPES = {
    "debug_moe": dict(
        hidden_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        tokens=1024,
    ),
    "qwen1.5-moe-a2.7b (1 layer)": dict(
        hidden_size=2048,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        tokens=64,
    ),
}
RESULTS = Path(__file__).parent / "results"


class LoopExperts(nn.Module):
    """The baseline: the same stacked weights, one expert at a time in Python.

    The stacks are unbound once per call: indexing ``w[e]`` per expert instead (as transformers'
    eager experts do) makes autograd build a full-size zero gradient per expert and projection.
    """

    def __init__(self, grouped: nn.Module):
        super().__init__()
        self.grouped = grouped

    def forward(self, x, weights, experts, shared=None):
        g = self.grouped
        out = torch.zeros_like(x)
        gates, ups, downs = g.gate_proj.unbind(0), g.up_proj.unbind(0), g.down_proj.unbind(0)
        for e in range(g.num_experts):
            token, slot = torch.where(experts == e)
            if token.numel() == 0:
                continue
            h = x[token]
            y = (F.silu(h @ gates[e]) * (h @ ups[e])) @ downs[e]
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out + shared() if shared is not None else out


def _config(shape: dict) -> ModelConfig:
    return ModelConfig(
        vocab_size=256,
        num_hidden_layers=1,
        num_attention_heads=8,
        **{k: v for k, v in shape.items() if k != "tokens"},
    )


def _hf_block(cfg: ModelConfig, ours: MoE, implementation: str) -> nn.Module:
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf_cfg = Qwen2MoeConfig(
        hidden_size=cfg.hidden_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
    )
    hf_cfg._experts_implementation = implementation
    block = Qwen2MoeSparseMoeBlock(hf_cfg)
    prefix = "layers.0.mlp."
    state = to_hf({prefix + k: v for k, v in ours.state_dict().items()}, cfg, layout="fused")
    block.load_state_dict({k.removeprefix("model." + prefix): v for k, v in state.items()})
    return block


def _step(block: nn.Module, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """CPU seconds of one forward + backward (one thread, so this does not count time lost to other
    processes on a shared machine), and the output; gradients are freed afterwards."""
    xi = x.clone().requires_grad_()
    start = time.process_time()
    out = block(xi)
    out.square().mean().backward()
    seconds = time.process_time() - start
    block.zero_grad(set_to_none=True)
    return seconds, out.detach()


def _variants(cfg: ModelConfig) -> dict[str, nn.Module]:
    """The four blocks with the same weights (each pair shares storage to halve memory)."""
    torch.manual_seed(0)
    ours = MoE(cfg).train()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.02)
    loop = MoE(cfg).train()
    loop.load_state_dict(ours.state_dict(), assign=True)
    loop.experts = LoopExperts(loop.experts)
    eager = _hf_block(cfg, ours, "eager").train()
    grouped = _hf_block(cfg, ours, "grouped_mm").train()
    grouped.load_state_dict(eager.state_dict(), assign=True)
    return {
        "meshtron grouped_mm": ours,
        "meshtron per-expert loop": loop,
        "transformers eager": eager,
        "transformers grouped_mm": grouped,
    }


def bench_blocks(repeats: int) -> list[dict]:
    """Variants take turns step by step, each keeping its fastest step. The small shape gets a
    warm-up round; the large one is measured once, without warm-up, to keep the run short."""
    rows = []
    for name, shape in SHAPES.items():
        cfg = _config(shape)
        variants = _variants(cfg)
        x = torch.randn(1, shape["tokens"], cfg.hidden_size)
        warm_up, reps = (1, repeats) if cfg.hidden_size < 1024 else (0, 1)
        best = {v: float("inf") for v in variants}
        outputs = {}
        for i in range(warm_up + reps):
            for variant, block in variants.items():
                seconds, outputs[variant] = _step(block, x)
                if i >= warm_up:
                    best[variant] = min(best[variant], seconds)
        ref = outputs["meshtron grouped_mm"]
        for variant, seconds in best.items():
            err = _rel(outputs[variant], ref)
            rows.append(
                dict(
                    shape=name,
                    variant=variant,
                    tokens=shape["tokens"],
                    seconds=seconds,
                    tokens_per_s=shape["tokens"] / seconds,
                    max_rel_diff=err,
                )
            )
            print(f"{name:30s} {variant:28s} {shape['tokens'] / seconds:10.0f} tok/s  (rel diff {err:.1e})", flush=True)
        del variants
    return rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check_count_bytes(out_path: str, local_tokens: int) -> None:
    """On every rank: count all-to-all bytes of one MoE layer's forward + backward for ep = 2, 4, 8."""
    import torch.distributed as dist

    from meshtron.mesh import build_mesh
    from meshtron.parallel.expert import apply_expert_parallel

    world = dist.get_world_size()
    cfg = _config(SHAPES["debug_moe"])
    rows = []
    for ep in (2, 4, 8):
        mesh = build_mesh(ep=ep, dp=world // ep)
        torch.manual_seed(1)
        block = MoE(cfg).train()
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.02)
        apply_expert_parallel(block, mesh)
        me = mesh["ep"].get_local_rank()
        counted = torch.zeros(3, dtype=torch.float64)  # token bytes, of which to other ranks, count bytes
        original = dist.all_to_all_single

        # B023: counting is installed and restored within this iteration, so it sees this iteration's names.
        def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
            size = input.numel() * input.element_size()
            if input.is_floating_point():
                row = size / max(input.shape[0], 1)
                counted[0] += size  # noqa: B023
                counted[1] += size - row * input_split_sizes[me]  # noqa: B023
            else:
                counted[2] += size  # noqa: B023
            return original(output, input, output_split_sizes, input_split_sizes, **kwargs)  # noqa: B023

        dist.all_to_all_single = counting
        try:
            torch.manual_seed(100 + dist.get_rank())
            x = torch.randn(local_tokens, cfg.hidden_size, requires_grad=True)
            block(x).square().mean().backward()
        finally:
            dist.all_to_all_single = original
        dist.all_reduce(counted, group=mesh["ep"].get_group())
        group_tokens = local_tokens * ep
        formula = group_tokens * cfg.num_experts_per_tok * cfg.hidden_size * 4
        rows.append(
            dict(
                ep=ep,
                tokens_in_ep_group=group_tokens,
                bytes_per_all_to_all=counted[0].item() / 4,
                formula_bytes_per_all_to_all=formula,
                off_rank_fraction=(counted[1] / counted[0]).item(),
                count_exchange_bytes=counted[2].item(),
            )
        )
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(rows))


def bench_bytes(local_tokens: int) -> list[dict]:
    import tempfile

    from meshtron.testing import run_checks

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bytes.json")
        run_checks([check_count_bytes], 8, path, local_tokens, timeout=300)
        return json.loads(Path(path).read_text())


def _recipe_bytes_table() -> list[str]:
    """Formula for the real recipe's shape: bf16 tokens, 4096 tokens per rank per micro-batch."""
    cfg = _config(SHAPES["qwen1.5-moe-a2.7b (1 layer)"])
    tokens, elem = 4096, 2
    per_a2a = tokens * cfg.num_experts_per_tok * cfg.hidden_size * elem
    lines = [
        "| ep | MiB per all-to-all per rank | MiB per layer (fwd+bwd, 4 all-to-alls) | of which leaves the rank "
        "(uniform routing) |",
        "|---:|---:|---:|---:|",
    ]
    for ep in (1, 2, 4, 8, 16):
        off = (ep - 1) / ep
        lines.append(f"| {ep} | {per_a2a / 2**20:.0f} | {4 * per_a2a / 2**20:.0f} | {4 * per_a2a * off / 2**20:.0f} |")
    return lines


def write_results(blocks: list[dict], traffic: list[dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "expert_parallel.json").write_text(json.dumps(dict(blocks=blocks, all_to_all=traffic), indent=1))
    load = os.getloadavg()[0]
    lines = [
        "# Expert parallelism benchmark (CPU)",
        "",
        f"torch {torch.__version__}, one thread, float32. Times are CPU seconds of the process (the "
        f"fastest step of each variant), because this 2-core machine is shared (load average {load:.1f} "
        "at the end of the run) and wall time mostly measures the other processes. Produced by "
        "`benchmarks/expert_parallel.py`.",
        "",
        "## One MoE block, forward + backward",
        "",
        "| shape | tokens | variant | tokens per CPU second | CPU ms/step | max rel diff vs grouped_mm |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in blocks:
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['variant']} | {r['tokens_per_s']:.0f} | "
            f"{1000 * r['seconds']:.1f} | {r['max_rel_diff']:.1e} |"
        )
    lines += [
        "",
        "Reading it: on the debug shape every variant is dominated by per-op overhead. On CPU,",
        "`grouped_mm` runs one matmul per group internally, so meshtron's and transformers' grouped_mm",
        "blocks cost the same. They beat the Python loop by 1.7x at the real shape; the loop adds, per",
        "expert, a `where`, a row gather and an `index_add` of the whole output (and their backward).",
        "transformers' eager experts index the stacked weights per expert",
        "(`w[e]`), and autograd then materialises, for every expert, a zero gradient the size of each stacked",
        "tensor it indexes (gate_up 1.4 GB + down 0.7 GB at the real shape), then adds them up:",
        "over 100 GB of memory traffic per step with 60 experts, hence its 1 token/s. The",
        "real shape is measured once without warm-up (its eager step alone takes over a minute).",
        "",
        "## All-to-all bytes per MoE layer vs ep (8 gloo ranks, debug shape, float32)",
        "",
        "Counted by wrapping `all_to_all_single` over one forward + backward; summed over the ep group.",
        "Each of the four token all-to-alls (dispatch, combine, and their reverses in backward) moves",
        "tokens x top-k x hidden x 4 bytes; the per-expert count exchange is separate.",
        "",
        "| ep | tokens in ep group | bytes per all-to-all (measured) | formula | fraction leaving the rank | "
        "count-exchange bytes |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in traffic:
        lines.append(
            f"| {r['ep']} | {r['tokens_in_ep_group']} | {r['bytes_per_all_to_all']:.0f} | "
            f"{r['formula_bytes_per_all_to_all']} | {r['off_rank_fraction']:.3f} | {r['count_exchange_bytes']:.0f} |"
        )
    lines += [
        "",
        "Formula for Qwen1.5-MoE-A2.7B (bf16, 4096 tokens per rank per micro-batch, top-4, hidden 2048;",
        "ep = 1 issues no all-to-all, the row shows what the same tokens would move):",
        "",
    ]
    lines += _recipe_bytes_table()
    (RESULTS / "expert_parallel.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--local-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    blocks = bench_blocks(args.repeats)
    traffic = bench_bytes(args.local_tokens)
    for r in traffic:
        print(r)
    write_results(blocks, traffic)


if __name__ == "__main__":
    main()
