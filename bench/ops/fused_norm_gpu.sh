#!/usr/bin/env bash
# One GPU-machine call for issue 14's fused transformer ops (strobe::add_layer_norm,
# strobe::cross_entropy): build what they need, their CUDA tests (+ compute-sanitizer memcheck on the
# small cases), the Python opcheck/compile test, the training-curve check (fused vs ATen), the op
# benchmark (bench/ops/fused_norm_bench.py), then the end-to-end steps of vit_l16 and lm_pack with
# the fused ops on (the configs' auto) and off (model.fused_ops=false task.fused_loss=false).
# Logs under $OUT.   bash bench/ops/fused_norm_gpu.sh [BUILD_DIR]   (project root, .gpu/ beside it)
# Env: SKIP_E2E=1, E2E_STEPS (30), E2E_WARMUP (10), E2E_VARIANTS ("on off"; also "tanh" = on with
# model.gelu=tanh, i.e. the MLP through strobe::fused_mlp, and "off_tanh"), BENCH_ARGS (e.g. "mlp").
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
cmake --build "$B" -j"$(nproc)" --target strobe strobe_ops test_gpu_ops test_gpu_models > "$out/build.log" 2>&1 ||
  { grep -B2 -A12 -m5 error "$out/build.log" | head -60; exit 1; }
echo "configure+build: $(( $(date +%s) - t0 )) s"
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 150 "$B/bin/test_gpu_ops" --gtest_filter='*LayerNorm*:*CrossEntropy*:*FusedMlp*' > "$out/test_gpu_ops.log" 2>&1
  echo "test_gpu_ops rc=$?"; grep -E "^\[  (PASSED|FAILED) |Failure|rel_err|Expected|Which is|which is" "$out/test_gpu_ops.log" | head -40
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/bin/test_gpu_ops" \
    --gtest_filter='Shapes/AddLayerNormCuda.*/7:Shapes/AddLayerNormCuda.*/8:Shapes/AddLayerNormCuda.*/4:Shapes/CrossEntropyCuda.*/4:Shapes/CrossEntropyCuda.*/6' \
    > "$out/memcheck.log" 2>&1
  echo "memcheck rc=$?"; tail -4 "$out/memcheck.log"
  timeout 150 "$B/bin/test_gpu_models" --gtest_filter='GpuFusedOps*' > "$out/test_gpu_models.log" 2>&1
  echo "test_gpu_models rc=$?"; grep -E "^\[  (PASSED|FAILED) |Failure|loss|Expected|Which is|which is" "$out/test_gpu_models.log" | head -20
  STROBE_BUILD_DIR="$B" timeout 200 python3 tests/python/test_ops_compile.py > "$out/opcheck.log" 2>&1
  echo "opcheck rc=$?"; grep -E "FAIL|passed" "$out/opcheck.log" | head -20
fi

timeout 150 python3 bench/ops/fused_norm_bench.py "$B/lib/libstrobe_ops.so" ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tail -20

if [ "${SKIP_E2E:-0}" != 1 ]; then
  for mode in ${E2E_VARIANTS:-on off}; do
    case $mode in
      on) args="" ;;
      off) args="--set model.fused_ops=false --set task.fused_loss=false" ;;
      tanh) args="--set model.gelu=tanh" ;;
      off_tanh) args="--set model.gelu=tanh --set model.fused_ops=false --set task.fused_loss=false" ;;
    esac
    echo "== e2e fused $mode"
    OUT="$out/e2e_$mode" STROBE_BUILD_DIR="$B" WORKLOADS="vit_l16 lm_pack" BASELINES="" WARMUP=${E2E_WARMUP:-10} \
      STEPS=${E2E_STEPS:-30} STROBE_BENCH_ARGS="$args" timeout 240 bash bench/e2e/run_gpu.sh > "$out/e2e_$mode.log" 2>&1
    echo "rc=$?"; tail -8 "$out/e2e_$mode.log"
  done
fi
echo "total: $(( $(date +%s) - t0 )) s"
