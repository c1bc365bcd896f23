"""What the block check of ``parallelize_hf_model`` costs (``meshtron/hf/prove.py``): wall time of
``parallelize_hf_model`` with ``prove_blocks`` on and off, slowest of 2 CPU gloo ranks at tp = 2 + SP, for a
tiny Qwen2 block and for one Qwen2.5-7B-size block (hidden 3584, intermediate 18944, 28 heads, 4 KV heads;
one decoder layer and a 1,024-token vocabulary, since only the block is probed). Each case is built fresh,
parallelized once with the check and once without, alternately, three times; the fastest of each is kept.

    python benchmarks/hf_block_proof.py    # writes benchmarks/results/hf_block_proof.md
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULT = Path(__file__).parent / "results" / "hf_block_proof.md"
CASES = {
    "tiny (hidden 64)": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4),
    "Qwen2.5-7B block": dict(vocab_size=1024, hidden_size=3584, intermediate_size=18944, num_hidden_layers=1,
                             num_attention_heads=28, num_key_value_heads=4),
}
REPEATS = 3


def _seconds(config: dict, prove: bool, mesh) -> float:
    import transformers

    from meshtron import parallelize_hf_model

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config, max_position_embeddings=64)).train()
    dist.barrier()
    start = time.perf_counter()
    parallelize_hf_model(model, mesh, sp=True, prove_blocks=prove)
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def measure(out: str) -> None:
    from meshtron.testing import cached_mesh

    mesh = cached_mesh(tp=2)
    rows = {}
    for name, config in CASES.items():
        times = {True: [], False: []}
        for _ in range(REPEATS):
            for prove in (True, False):
                times[prove].append(_seconds(config, prove, mesh))
        rows[name] = {"with": min(times[True]), "without": min(times[False])}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    from meshtron.testing import run_checks

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        run_checks([measure], 2, out, timeout=1800)
        rows = json.loads(Path(out).read_text())
    lines = ["# The block check's cost (`parallelize_hf_model(..., prove_blocks=True)`)", "",
             "Wall seconds of `parallelize_hf_model` on 2 CPU gloo ranks, tp = 2 + SP, float32; slowest rank, fastest "
             f"of {REPEATS} (`python benchmarks/hf_block_proof.py`). The check runs the first block of each kind "
             "whole and split on one probe row of 16 tokens per rank, forward and backward.", "",
             "| block | with the check (s) | without (s) | the check (s) |", "|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['with']:.2f} | {row['without']:.2f} | {row['with'] - row['without']:.2f} |")
    RESULT.write_text("\n".join(lines) + "\n")
    print(RESULT.read_text())


if __name__ == "__main__":
    main()
