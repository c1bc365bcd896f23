"""Tokenization throughput of ``prepare_tokens`` (what ``python -m meshtron.data.prepare`` runs).

Data: the built-in corpus (the standard library's documentation) repeated ``--copies`` times into one
parquet file, one document per row. Tokenizers: the byte tokenizer, and a BPE ``tokenizer.json``
(``--vocab`` tokens, ByteLevel pre-tokenizer as in GPT-2/Qwen) trained offline on the corpus with the
``tokenizers`` library. For each tokenizer and worker count a fresh cache is built; "tokens/s" is the
build's own figure (reading, encoding, writing; worker start-up included), "wall" the whole call.

With 1 worker the BPE encodes in this process, where ``tokenizers`` may use its own thread pool over
all cores; with N workers each worker is single-threaded and the processes are the parallelism.

    python benchmarks/tokenization.py [--copies 10] [--vocab 8192] [--workers 1 2]
        -> benchmarks/results/tokenization.md and tokenization.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from meshtron.config import Config  # noqa: E402
from meshtron.data import BUILTIN_PATH, DOC_SEPARATOR, prepare_tokens  # noqa: E402


def corpus_docs() -> list[str]:
    with gzip.open(BUILTIN_PATH, "rt", encoding="utf-8") as f:
        return [doc for doc in f.read().split(DOC_SEPARATOR) if doc]


def train_bpe(docs: list[str], vocab: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))


def measure(data: Path, tokenizer: str, vocab: int, workers: int, cache: Path) -> dict:
    cfg = Config()
    cfg.data.source, cfg.data.tokenizer, cfg.data.cache_dir = str(data), tokenizer, str(cache)
    cfg.model.vocab_size = max(vocab, 256)
    start = time.perf_counter()
    meta = json.loads(prepare_tokens(cfg, workers=workers, progress=sys.stderr).read_text())
    wall = time.perf_counter() - start
    # The host is shared: the 1-minute load average at the end tells how contended the cores were.
    return {
        "load_avg": round(os.getloadavg()[0], 1),
        "tokens": meta["num_tokens"],
        "documents": meta["num_documents"],
        "workers": workers,
        "seconds": meta["build"]["seconds"],
        "wall_s": round(wall, 3),
        "tokens_per_s": meta["build"]["tokens_per_s"],
        "sha256": meta["sha256"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    docs = corpus_docs()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "corpus.parquet"
        pq.write_table(pa.table({"text": docs * args.copies}), data, row_group_size=1000)
        chars = sum(map(len, docs)) * args.copies
        parquet_mib = round(data.stat().st_size / 2**20, 1)
        train_bpe(docs, args.vocab, tmp / "tokenizer.json")
        for name, spec, vocab in (
            ("bytes", "bytes", 256),
            (f"BPE {args.vocab}", str(tmp / "tokenizer.json"), args.vocab),
        ):
            for workers in args.workers:
                row = {"tokenizer": name, **measure(data, spec, vocab, workers, tmp / f"cache-{name}-{workers}")}
                rows.append(row)
                print(json.dumps(row), flush=True)
            # Same tokens whatever the worker count.
            assert len({r["sha256"] for r in rows if r["tokenizer"] == name}) == 1
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "chars": chars,
        "documents": len(docs) * args.copies,
        "parquet_mib": parquet_mib,
    }
    results = HERE / "results"
    (results / "tokenization.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    lines = [
        "# Tokenization throughput (`prepare_tokens`, `benchmarks/tokenization.py`)",
        "",
        f"Data: the built-in corpus x {args.copies} in one parquet file ({chars / 1e6:.1f}M characters, "
        f"{len(docs) * args.copies} documents). Machine: {os.cpu_count()} CPU cores, "
        f"{platform.platform()}, Python {platform.python_version()}.",
        "",
        "| tokenizer | workers | tokens | build s | wall s | tokens/s | load avg (1 min) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['tokenizer']} | {r['workers']} | {r['tokens']:,} | {r['seconds']:.2f} | {r['wall_s']:.2f} | "
        f"{r['tokens_per_s']:,} | {r['load_avg']} |"
        for r in rows
    ]
    lines += [
        "",
        "Each worker count wrote the identical token stream (same SHA-256). The byte tokenizer always "
        "encodes in-process (its workers = 2 row measures the same path): shipping text to a worker costs "
        "more than encoding it. With 1 worker the BPE runs in this process on the `tokenizers` thread pool "
        "(all cores); with N workers each is single-threaded. The load average (runnable processes "
        "sharing the cores) says how quiet the machine was: near 0 the figures are the machine's own.",
    ]
    (results / "tokenization.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
