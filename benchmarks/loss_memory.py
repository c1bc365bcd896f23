"""Peak host memory of the loss stage, before (logits + cross-entropy) and after (fused, chunked lm_head +
cross-entropy), and of a whole 1-rank training step at Qwen2.5's vocabulary.

Part ``loss``: for each (tokens, vocabulary) one fresh process allocates the hidden states, the head
weight and the labels, records its peak RSS, runs the loss forward and backward, and reports the peak
RSS increase (Linux ``ru_maxrss``: the CPU allocator's real high-water mark, not an estimate).
"before" is what the training path did until the fused loss: ``logits = h @ W.T`` in fp32, then
cross-entropy (log-softmax kept for backward, a logits-sized gradient). Configurations whose "before"
would not fit this 24 GiB machine are not run; their size is given from the logits buffer alone.

Part ``step``: ``torchrun --nproc_per_node 1 -m meshtron.train`` on the tiny dense recipe widened to
vocab 151,936 (every other shape tiny), ``--tree`` picks the checkout to run (e.g. a worktree of the
commit before the fused loss), peak RSS of the worker from ``ru_maxrss`` of waited-for children.

    python benchmarks/loss_memory.py                   # both parts -> benchmarks/results/loss_memory.md
    python benchmarks/loss_memory.py --parts step --tree /path/to/old/checkout --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
HIDDEN = 128
CHUNK = 1024
GRID = [(1024, 32768), (4096, 32768), (16384, 32768), (1024, 151936), (4096, 151936), (16384, 151936)]
BEFORE_LIMIT_GIB = 9.0  # 3 logits-sized fp32 buffers must fit beside everything else on 24 GiB


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one(method: str, tokens: int, vocab: int) -> dict:
    """Runs in a fresh process: peak RSS growth of one loss forward + backward."""
    import torch
    import torch.nn.functional as F

    from meshtron.models.chunked_loss import linear_cross_entropy_sum

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, HIDDEN, generator=gen).requires_grad_()
    w = (torch.randn(vocab, HIDDEN, generator=gen) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    # Warm-up on a tiny problem so allocator and library start-up are not counted.
    linear_cross_entropy_sum(h[:8], w[:64], labels[:8] % 64).backward()
    F.cross_entropy(h[:8] @ w[:64].t(), labels[:8] % 64).backward()
    h.grad = w.grad = None
    base = _peak_bytes()
    if method == "before":
        loss = F.cross_entropy((h @ w.t()).float(), labels, reduction="sum")
    else:
        loss = linear_cross_entropy_sum(h, w, labels, CHUNK)
    loss.backward()
    return {
        "method": method,
        "tokens": tokens,
        "vocab": vocab,
        "peak_extra_bytes": _peak_bytes() - base,
        "loss": float(loss),
    }


def _run_one(method: str, tokens: int, vocab: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", method, str(tokens), str(vocab)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def loss_part() -> list[dict]:
    rows = []
    for tokens, vocab in GRID:
        logits_gib = tokens * vocab * 4 / 2**30
        before = _run_one("before", tokens, vocab) if logits_gib <= BEFORE_LIMIT_GIB / 3 else None
        after = _run_one("after", tokens, vocab)
        rows.append({"tokens": tokens, "vocab": vocab, "logits_fp32_gib": logits_gib, "before": before, "after": after})
        print(rows[-1], flush=True)
    return rows


def step_part(tree: Path, tokens: int) -> dict:
    """One rank trains 2 steps of the tiny dense model with vocab 151,936 and ``tokens`` per step."""
    seq = 4096
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "1",
            "-m",
            "meshtron.train",
            "--recipe",
            str(tree / "recipes" / "debug_dense.toml"),
            "--parallel.dp",
            "1",
            "--model.vocab_size",
            "151936",
            "--model.max_position_embeddings",
            str(seq),
            "--train.seq_len",
            str(seq),
            "--train.global_batch_size",
            str(tokens // seq),
            "--train.steps",
            "2",
            "--train.output_dir",
            out,
        ]
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="2")
        log = Path(out, "log.txt")
        with log.open("w") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=tree)
            # wait4's usage covers the child and its waited-for descendants: the torchrun worker.
            _, status, usage = os.wait4(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        metrics = Path(out, "metrics.jsonl")
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        errors = [line for line in log.read_text().splitlines() if "Error" in line or line.startswith("meshtron:")]
        tail = errors[-1:] if code else []
    return {
        "tree": str(tree),
        "tokens": tokens,
        "returncode": code,
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "losses": [r["loss"] for r in records],
        "step_times": [r["step_time"] for r in records],
        "error": tail,
    }


def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f}"


def write_table(loss_rows: list[dict], steps: list[dict]) -> str:
    lines = [
        "# Loss-stage memory: logits + cross-entropy vs the fused, chunked lm_head + cross-entropy",
        "",
        "Measured on the 2-core CPU development machine with `benchmarks/loss_memory.py` (fp32, hidden "
        f"{HIDDEN}, chunk {CHUNK} tokens, one thread). Peak extra = growth of the process's peak RSS during "
        "one loss forward + backward, over the hidden states, weight and labels already allocated.",
        "",
        "| tokens | vocab | fp32 logits (GiB) | before: peak extra (GiB) | after: peak extra (GiB) | after / before |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in loss_rows:
        before = r["before"]["peak_extra_bytes"] if r["before"] else None
        after = r["after"]["peak_extra_bytes"]
        ratio = f"{after / before:.3f}" if before else "before not run (does not fit)"
        lines.append(
            f"| {r['tokens']} | {r['vocab']} | {r['logits_fp32_gib']:.2f} | {_gib(before)} | {_gib(after)} | {ratio} |"
        )
    if steps:
        lines += [
            "",
            "## A whole training step on one rank, vocab 151,936",
            "",
            "`torchrun --nproc_per_node 1 -m meshtron.train --recipe recipes/debug_dense.toml --parallel.dp 1 "
            "--model.vocab_size 151936 --model.max_position_embeddings 4096 --train.seq_len 4096 "
            "--train.global_batch_size B --train.steps 2` (peak RSS of the training process).",
            "",
            "| code | tokens per step | exit | peak RSS (GiB) | losses |",
            "|---|---:|---:|---:|---|",
        ]
        for s in steps:
            losses = ", ".join(f"{v:.4f}" for v in s["losses"]) or " ".join(s["error"])
            lines.append(
                f"| {s['label']} | {s['tokens']} | {s['returncode']} | {_gib(s['peak_rss_bytes'])} | {losses} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "TOKENS", "VOCAB"))
    parser.add_argument("--parts", default="loss,step")
    parser.add_argument("--tree", default=str(ROOT), help="checkout whose meshtron the step part runs")
    parser.add_argument("--label", default="fused loss")
    parser.add_argument("--tokens", type=int, nargs="*", default=[16384])
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), int(args.one[2]))))
        return
    store = RESULTS / "loss_memory.json"
    saved = json.loads(store.read_text()) if store.exists() else {"loss": [], "steps": []}
    parts = args.parts.split(",")
    if "loss" in parts:
        saved["loss"] = loss_part()
    if "step" in parts:
        for tokens in args.tokens:
            run = step_part(Path(args.tree).resolve(), tokens)
            run["label"] = args.label
            print(run, flush=True)
            saved["steps"] = [s for s in saved["steps"] if (s["label"], s["tokens"]) != (args.label, tokens)]
            saved["steps"].append(run)
    store.write_text(json.dumps(saved, indent=1) + "\n")
    (RESULTS / "loss_memory.md").write_text(write_table(saved["loss"], saved["steps"]))


if __name__ == "__main__":
    main()
