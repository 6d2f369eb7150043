#!/usr/bin/env bash
# Strobe's training steps next to the PyTorch anchors, in ONE device call (issue 14), after a build
# into build-gpu/ (or $STROBE_BUILD_DIR):
#   1. `strobe bench step` on the GPU-sized seed configs (warm-up, then CUDA-event step times:
#      median, p10/p90, min/max, and the host's input-wait per step);
#   2. bench/pytorch_baselines.py on the same GPU, the same minute (eager and torch.compile);
#   3. one table: workload, Strobe median [p10-p90], input-wait, PyTorch eager, torch.compile, ratios
#      (bench/e2e/compare.py; also $OUT/e2e.json).
# Env: WARMUP (30) and STEPS (50) for strobe; WORKLOADS (default all: vit_l16 face_detector_giou
# resnet50 lm_pack lm_pad_to_max lm_pad_to_longest); BASELINES (default "vit lm detector resnet50",
# the sections of pytorch_baselines.py; "" skips them); STROBE_BENCH_ARGS (extra `strobe bench`
# arguments, e.g. "--set trainer.precision=bf16-mixed").
#   bash bench/e2e/run_gpu.sh
#   WORKLOADS="resnet50" BASELINES="resnet50" WARMUP=10 STEPS=20 bash bench/e2e/run_gpu.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${OUT:-/tmp/out}; mkdir -p "$out"
bin=${STROBE_BUILD_DIR:-$root/build-gpu}/bin
WARMUP=${WARMUP:-30}; STEPS=${STEPS:-50}
WORKLOADS=${WORKLOADS:-}
BASELINES=${BASELINES-vit lm detector resnet50}
export PYTHONUNBUFFERED=1
cd "$root"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rc=0
wl_args=()
for w in $WORKLOADS; do wl_args+=(--workload "$w"); done
echo "== strobe bench step (warm-up $WARMUP, timed $STEPS)"
"$bin/strobe" bench step --warmup "$WARMUP" --steps "$STEPS" "${wl_args[@]}" ${STROBE_BENCH_ARGS:-} \
  --json "$out/strobe_step.json" || { echo "!! strobe bench exit $?"; rc=1; }
base_json=""
if [ -n "$BASELINES" ]; then
  echo "== pytorch_baselines.py $BASELINES"
  # shellcheck disable=SC2086
  OUT="$out" python3 bench/pytorch_baselines.py $BASELINES > "$out/pytorch_baselines.log" 2>&1 || { echo "!! baselines exit $?"; rc=1; }
  grep -E "step_ms|error" "$out/pytorch_baselines.log" | grep -v Warning | tail -20
  base_json="$out/pytorch_baselines_$(echo $BASELINES | tr ' ' '_').json"
fi
echo "== Strobe vs PyTorch"
python3 "$here/compare.py" "$out/strobe_step.json" ${base_json:+"$base_json"} --json "$out/e2e.json" || rc=1
exit $rc
