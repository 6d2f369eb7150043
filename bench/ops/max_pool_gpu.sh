#!/usr/bin/env bash
# One GPU-machine call for strobe::max_pool2d (issue 14): build what it needs, the CUDA tests
# (MaxPool*) + compute-sanitizer memcheck on the small cases, the op benchmark (ours vs ATen, one
# process), then the whole training step of resnet50 and face_detector_giou through `strobe bench step`
# with model.custom_pool auto (our op) vs false (ATen), alternating, in one call. Logs under $OUT.
#   bash bench/ops/max_pool_gpu.sh [BUILD_DIR]   (project root, .gpu/ beside it)
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
B=${1:-build-gpu}
deps=/opt/gpudeps
if [ ! -f $deps/.done ]; then mkdir -p $deps && for f in .gpu/debs/*.deb; do dpkg -x "$f" $deps; done && touch $deps/.done; fi
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
prefix="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)');$deps/usr"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$(date +%s)
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$B" -j"$(nproc)" --target strobe test_gpu_ops > "$out/build.log" 2>&1 || { grep -B2 -A12 -m5 error "$out/build.log" | head -60; exit 1; }
echo "configure+build: $(( $(date +%s) - t0 )) s"

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 150 "$B/bin/test_gpu_ops" --gtest_filter='MaxPool*' > "$out/test_gpu_ops.log" 2>&1
  echo "test_gpu_ops MaxPool*: exit $?"; grep -E "^\[  (PASSED|FAILED) |FAILED|Failure|error|Expected|Which is|rel_err|  Actual" "$out/test_gpu_ops.log" | head -30
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/bin/test_gpu_ops" \
    --gtest_filter='MaxPoolCuda.SmallCasesForSanitizer' > "$out/memcheck.log" 2>&1
  echo "memcheck: exit $?"; tail -3 "$out/memcheck.log"
fi

timeout 120 python3 bench/ops/max_pool_bench.py "$B/lib/libstrobe_ops.so" --json "$out/max_pool_bench.json" 2>&1 | grep -v Warning | tail -8
timeout 90 python3 - "$B/lib/libstrobe_ops.so" <<'PY' 2>&1 | grep -v Warning | tail -4
import sys, torch
torch.ops.load_library(sys.argv[1])
op = torch.ops.strobe.max_pool2d.default
for dt in (torch.float32, torch.bfloat16):
    x = torch.randn(2, 8, 9, 7, device="cuda", dtype=dt)
    for args in ((x.clone().requires_grad_(), [3], [2], [1]),
                 (x.contiguous(memory_format=torch.channels_last).requires_grad_(), [2, 3], [2, 1], [1, 1])):
        res = torch.library.opcheck(op, args)
        print("opcheck cuda", dt, "ok" if all(v == "SUCCESS" for v in res.values()) else res, flush=True)
PY

# whole steps: auto (our op) and false (ATen), alternating, three rounds while time allows
budget=${STEP_BUDGET_S:-520}
for rep in 1 2 3; do
  for mode in auto false; do
    if [ $(( $(date +%s) - t0 )) -gt "$budget" ]; then echo "(time budget reached: skipping custom_pool=$mode run $rep)"; continue; fi
    timeout 120 "$B/bin/strobe" bench step --warmup ${WARMUP:-20} --steps ${STEPS:-50} --workload resnet50 \
      --workload face_detector_giou --set model.custom_pool=$mode --json "$out/step_${mode}_$rep.json" \
      > "$out/step_${mode}_$rep.log" 2>&1
    echo "== custom_pool=$mode run $rep: exit $? at $(( $(date +%s) - t0 )) s"; grep -E "resnet50|face_detector" "$out/step_${mode}_$rep.log" | tail -4
  done
done
echo "total: $(( $(date +%s) - t0 )) s"
