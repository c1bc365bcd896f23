"""``python -m meshtron.data.prepare --recipe R [--workers N] [--section.key value ...]``.

Tokenizes every source of the recipe's ``[data]`` (``source`` or each ``sources`` entry) into the token cache
the trainer maps, with ``N`` processes (default: every core), printing a progress line and the throughput. A
trainer started afterwards with the same recipe finds the caches and starts at once; run it on each node whose
cache folder the others cannot see. See docs/data.md, 'Pre-tokenizing'.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from meshtron.config import ConfigError, load_config
from meshtron.data.packing import prepare_tokens
from meshtron.data.sources import data_sources


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m meshtron.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="TOML recipe whose [data] to tokenize")
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: every core)"
    )
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {args.workers}.")
        cfg = load_config(args.recipe, overrides)
        for spec in data_sources(cfg.data):
            start = time.perf_counter()
            meta = json.loads(prepare_tokens(cfg, source=spec, workers=args.workers, progress=sys.stderr).read_text())
            # A cache that was already there reports the figures of the run that built it.
            print(
                json.dumps(
                    {
                        "source": spec.path,
                        "cache": meta["key"],
                        "tokens": meta["num_tokens"],
                        "documents": meta["num_documents"],
                        "seconds": round(time.perf_counter() - start, 3),
                        "build": meta["build"],
                    }
                ),
                flush=True,
            )
    except ConfigError as err:
        print(f"meshtron: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
