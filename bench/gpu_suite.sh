#!/usr/bin/env bash
# The GPU benchmark suite, run on the GPU machine after a build into build-gpu/ (see
# ../shared/gpu/build-and-test.sh): our ops next to their PyTorch baselines in the same process or
# right after it, the metrics overhead, and the quickstart on CUDA. Results: $OUT/bench.log and JSON.
# Usage: bash bench/gpu_suite.sh [BASELINES_PY]   (default: ../shared/bench/pytorch_baselines.py)
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
baselines=${1:-../shared/bench/pytorch_baselines.py}
export STROBE_BUILD_DIR=build-gpu PYTHONUNBUFFERED=1
rc=0
step() { echo "== $*"; "$@" || { echo "!! exit $?: $*"; rc=1; }; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  step python3 bench/ops/bench_ops.py giou optim nonfinite
  step python3 "$baselines" giou
  step build-gpu/bin/strobe bench giou optimizer --json "$out/strobe_bench_ops.json"
  step build-gpu/bin/strobe_bench_metrics --python python3 --json "$out/bench_metrics.json"
  echo "== quickstart on CUDA"
  t0=$(date +%s.%N)
  step build-gpu/bin/strobe fit -c configs/quickstart.yaml --run-dir /tmp/quickstart-gpu --set trainer.enable_progress_bar=false
  echo "quickstart wall time: $(echo "$(date +%s.%N) - $t0" | bc) s"
  step build-gpu/bin/strobe test -c configs/quickstart.yaml --ckpt /tmp/quickstart-gpu/checkpoints/last.ckpt
} 2>&1 | tee "$out/bench.log"
cp /tmp/bench_ops.json "$out/" 2>/dev/null || true
exit $rc
