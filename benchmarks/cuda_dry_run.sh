#!/usr/bin/env bash
# The dry run on fake CUDA devices (issue 44) over the shipped recipes and one layout of each parallelism.
# Makes the CUDA environment if missing (torch's CUDA wheel, ~5 GB, outside the project's own CPU-only one),
# then runs benchmarks/cuda_dry_run.py with it: benchmarks/results/cuda_dry_run.{json,md}.
#   benchmarks/cuda_dry_run.sh [CASE ...]     # default: every case; MESHTRON_CUDA_VENV picks the environment
#   benchmarks/cuda_dry_run.sh --replan       # no tracing: the stored traces against today's planner
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${MESHTRON_CUDA_VENV:-$HOME/.cache/meshtron/venv-cuda}"
if ! "$VENV/bin/python" -c "import torch; assert torch.version.cuda" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install torch==2.14.1
    "$VENV/bin/pip" install safetensors pyarrow "transformers>=4.57" pytest  # the project's own deps, not its torch
fi
cd "$ROOT"
MESHTRON_DEVICE=cuda PYTHONPATH="$ROOT" "$VENV/bin/python" benchmarks/cuda_dry_run.py "$@"
