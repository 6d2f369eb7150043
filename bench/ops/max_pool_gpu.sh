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

# whole steps: auto (our op) and false (ATen), twice each, alternating
for rep in 1 2; do
  for mode in auto false; do
    timeout 150 "$B/bin/strobe" bench step --warmup ${WARMUP:-25} --steps ${STEPS:-50} --workload resnet50 \
      --workload face_detector_giou --set model.custom_pool=$mode --json "$out/step_${mode}_$rep.json" \
      > "$out/step_${mode}_$rep.log" 2>&1
    echo "== custom_pool=$mode run $rep: exit $?"; grep -E "resnet50|face_detector" "$out/step_${mode}_$rep.log" | tail -4
  done
done
echo "total: $(( $(date +%s) - t0 )) s"
