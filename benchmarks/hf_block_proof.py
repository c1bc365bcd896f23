"""What the block check of ``parallelize_hf_model`` costs (``meshtron/hf/prove.py``): wall time of
``parallelize_hf_model`` with ``prove_blocks`` on and off, slowest of 2 CPU gloo ranks at tp = 2 + SP, for a
tiny Qwen2 block and for one Qwen2.5-7B-size block (hidden 3584, intermediate 18944, 28 heads, 4 KV heads;
one decoder layer and a 1,024-token vocabulary, since only the block is probed). Each case is built fresh,
parallelized once with the check and once without, alternately, three times; the fastest of each is kept.
The same for ``load_hf_checkpoint`` of the case saved to a folder (its check runs on a twin holding the
checkpoint's tensors whole up to the block: ``_check_twin`` in ``meshtron/hf/parallelize.py``).

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
    "tiny (hidden 64)": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    "Qwen2.5-7B block": dict(
        vocab_size=1024,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=1,
        num_attention_heads=28,
        num_key_value_heads=4,
    ),
}
REPEATS = 3


def _model(config: dict):
    import transformers

    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config, max_position_embeddings=64)).train()


def _slowest_seconds(run) -> float:
    """Wall seconds of ``run()``, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    run()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _fastest(run) -> dict[str, float]:
    """The fastest of REPEATS of ``run(prove)`` with the check and without, alternately."""
    times = {True: [], False: []}
    for _ in range(REPEATS):
        for prove in (True, False):
            times[prove].append(run(prove))
    return {"with": min(times[True]), "without": min(times[False])}


def measure(out: str) -> None:
    from meshtron import load_hf_checkpoint, parallelize_hf_model
    from meshtron.testing import cached_mesh

    mesh = cached_mesh(tp=2)
    rows = {}
    for name, config in CASES.items():
        folder = Path(out).parent / name.split()[0]
        if dist.get_rank() == 0:
            _model(config).save_pretrained(folder)
        # B023: _fastest calls the lambdas at once, within this iteration.
        rows[name] = {
            "parallelize": _fastest(
                lambda prove: _slowest_seconds(
                    lambda: parallelize_hf_model(_model(config), mesh, sp=True, prove_blocks=prove)  # noqa: B023
                )
            ),
            "load": _fastest(
                lambda prove: _slowest_seconds(
                    lambda: load_hf_checkpoint(folder, mesh, sp=True, prove_blocks=prove)  # noqa: B023
                )
            ),
        }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    from meshtron.testing import run_checks

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        run_checks([measure], 2, out, timeout=1800)
        rows = json.loads(Path(out).read_text())
    lines = [
        "# The block check's cost (`parallelize_hf_model(..., prove_blocks=True)`)",
        "",
        "Wall seconds of `parallelize_hf_model` (on a model with weights) and of `load_hf_checkpoint` (of the "
        "same model saved, float32) on 2 CPU gloo ranks, tp = 2 + SP; slowest rank, fastest "
        f"of {REPEATS} (`python benchmarks/hf_block_proof.py`). The check runs the first block of each kind "
        "whole and split on one probe row of 16 tokens per rank, forward and backward; `load_hf_checkpoint` "
        "first reads the tensors up to that block whole into a twin of the model, and proves the twin.",
        "",
        "| block | entry | with the check (s) | without (s) | the check (s) |",
        "|---|---|---|---|---|",
    ]
    for name, entries in rows.items():
        for entry, row in entries.items():
            lines.append(
                f"| {name} | `{entry}` | {row['with']:.2f} | {row['without']:.2f} | "
                f"{row['with'] - row['without']:.2f} |"
            )
    RESULT.write_text("\n".join(lines) + "\n")
    print(RESULT.read_text())


if __name__ == "__main__":
    main()
