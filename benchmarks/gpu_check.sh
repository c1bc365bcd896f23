#!/usr/bin/env bash
# The GPU bring-up in one device call per part (each fits the device tool's 10-minute limit):
#
#   bash benchmarks/gpu_check.sh tests   # environment + tests/gpu (CUDA parity, kernels, no host sync,
#                                        # fused loss at 7B vocabulary, planner vs allocator peak)
#   bash benchmarks/gpu_check.sh mfu     # environment + benchmarks/mfu.py: 0.5B, 1.5B, 7B truncated,
#                                        # eager and compiled, next to transformers
#
# Results go to $OUT (the device tool's folder that comes back) or, without it, benchmarks/results/gpu;
# commit them as benchmarks/results/{cuda_tests.log,mfu.md,mfu.json}. Nothing is installed: the
# machine's own torch, transformers, safetensors and pytest are used, and meshtron from this checkout.
# The lent machines had torch 2.11 and transformers 5.17 (meshtron needs torch 2.13 and is tested on
# 5.23): these one-rank checks use nothing 2.11 lacks (checked on CPU), while sequence parallelism,
# the allgather CP mode, the MoE token gather (dist.all_gather_single / reduce_scatter_single are new
# in 2.13) and the zero-bubble W pass (FSDPState._fsdp_param_groups) would not run there.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: gpu_check.sh tests|mfu}
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

environment() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"
}

environment 2>&1 | tee "$out/environment_$part.txt"
case "$part" in
    tests)
        timeout 560 python3 -m pytest -q -rA --durations=15 tests/gpu 2>&1 | tee "$out/cuda_tests.log"
        ;;
    mfu)
        timeout 570 python3 benchmarks/mfu.py --modes eager compiled --out "$out/mfu" 2>&1 | tee "$out/mfu.log"
        ;;
    *)
        echo "gpu_check.sh: unknown part '$part' (tests or mfu)" >&2
        exit 2
        ;;
esac
