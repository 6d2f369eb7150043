#!/usr/bin/env bash
# GPU-machine calls for the llama kernels (strobe::add_rms_norm, rotary_qk, swiglu, grouped K/V through SDPA, and the
# shared kernel home every op now uses). Phases (first argument):
#   tests  build; every CUDA op test (test_gpu_ops: all kernels share cuda/common.cuh); the llama GPU
#          tests (bf16 vs the float64 reference on every backend, CUDA graphs, bf16-master vs fp32,
#          NaN capture + replay, fused vs ATen curve); compute-sanitizer memcheck on the small
#          add_rms_norm, rotary_qk and swiglu cases; opcheck of every op on CUDA.
#   lce    strobe::linear_cross_entropy: its CUDA tests and memcheck, linear_ce_bench.py (vs the logits
#          path eager / torch.compile and Liger's fused linear cross-entropy, when .gpu/whl holds its
#          wheel), then `strobe bench step` on llama_1b with task.fused_linear_loss true and false.
#   attn   the flash-attention kernels (their shared prologue lives in cuda/flash_common.cuh):
#          test_gpu_attention under the wgmma and the mma.sync family, compute-sanitizer memcheck
#          and racecheck on *ForSanitizer*, opcheck of every op, bench_attention.py (both families).
#   bench  the add + RMSNorm, rotary and SwiGLU ops vs eager / torch.compile (fused_norm_bench.py rms); then
#          `strobe bench step` on configs/llama_1b.yaml with the fused ops on (auto) and off
#          (model.fused_ops=false, task.fused_linear_loss=false), and pytorch_baselines.py llama (eager, torch.compile) in the same call.
# Logs under $OUT.   bash bench/ops/llama_ops_gpu.sh tests|lce|attn|bench [BUILD_DIR]   (project root, .gpu/ beside it)
# Env: STEPS (30), WARMUP (10), LLAMA_B (8), SKIP_BASELINE=1.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
phase=${1:-tests}
B=${2:-build-gpu}
deps=/opt/gpudeps
if [ ! -f $deps/.done ]; then mkdir -p $deps && for f in .gpu/debs/*.deb; do dpkg -x "$f" $deps; done && touch $deps/.done; fi
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
prefix="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)');$deps/usr"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$(date +%s)
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$B" -j"$(nproc)" --target strobe strobe_ops test_gpu_ops test_gpu_models test_gpu_trainer test_gpu_attention \
  > "$out/build.log" 2>&1 || { grep -B2 -A12 -m5 error "$out/build.log" | head -60; exit 1; }
echo "configure+build: $(( $(date +%s) - t0 )) s"

if [ "$phase" = tests ]; then
  timeout 240 "$B/bin/test_gpu_ops" > "$out/test_gpu_ops.log" 2>&1
  echo "test_gpu_ops rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|rel_err|Expected|Which is|which is" "$out/test_gpu_ops.log" | head -40
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/bin/test_gpu_ops" \
    --gtest_filter='Shapes/AddRmsNormCuda.*/4:Shapes/AddRmsNormCuda.*/5:Shapes/AddRmsNormCuda.*/7:AddRmsNormCudaNan.*:Shapes/RotaryCuda.*/4:Shapes/RotaryCuda.*/5:RotaryCudaNan.*:Shapes/SwigluCuda.*/2:Shapes/SwigluCuda.*/5:SwigluCudaNan.*' \
    > "$out/memcheck.log" 2>&1
  echo "memcheck rc=$?"; tail -3 "$out/memcheck.log"
  timeout 200 "$B/bin/test_gpu_models" --gtest_filter='*Llama*:GpuFusedOps*' > "$out/test_gpu_models.log" 2>&1
  echo "test_gpu_models rc=$?"; grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which is|which is" "$out/test_gpu_models.log" | head -20
  timeout 300 "$B/bin/test_gpu_trainer" --gtest_filter='LlamaCuda*' > "$out/test_gpu_trainer.log" 2>&1
  echo "test_gpu_trainer rc=$?"; grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which is|which is|loss" "$out/test_gpu_trainer.log" | head -30
  STROBE_BUILD_DIR="$B" timeout 200 python3 tests/python/test_ops_compile.py > "$out/opcheck.log" 2>&1
  echo "opcheck rc=$?"; grep -E "FAIL|passed" "$out/opcheck.log" | head -20
fi

if [ "$phase" = lce ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H200*) export HBM_TBS=4.8 ;; *) export HBM_TBS=3.35 ;; esac
  timeout 120 "$B/bin/test_gpu_ops" --gtest_filter='LinearCrossEntropy*' > "$out/test_lce.log" 2>&1
  echo "test_gpu_ops LinearCrossEntropy* rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|which is" "$out/test_lce.log" | head -20
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/bin/test_gpu_ops" \
    --gtest_filter='LinearCrossEntropyCuda.ScalarPath*:LinearCrossEntropyCuda.NonFinite*' > "$out/memcheck_lce.log" 2>&1
  echo "memcheck rc=$?"; tail -3 "$out/memcheck_lce.log"
  if ls .gpu/whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/pyx .gpu/whl/*.whl > /dev/null 2>&1; export PYTHONPATH=/tmp/pyx
  fi
  timeout 300 python3 bench/ops/linear_ce_bench.py "$B/lib/libstrobe_ops.so" 2>&1 | grep -v -i warning | tail -20
  for mode in true false; do
    echo "== strobe bench step llama_1b task.fused_linear_loss=$mode"
    timeout 200 "$B/bin/strobe" bench step --workload llama_1b --warmup "${WARMUP:-10}" --steps "${STEPS:-30}" \
      --set data.batch_size="${LLAMA_B:-8}" --set task.fused_linear_loss=$mode --json "$out/llama_lce_$mode.json" \
      > "$out/llama_lce_$mode.log" 2>&1
    echo "rc=$?"; tail -6 "$out/llama_lce_$mode.log"
  done
fi

if [ "$phase" = attn ]; then
  for fam in wgmma mma; do
    STROBE_FLASH_ATTN=$fam timeout 150 "$B/bin/test_gpu_attention" > "$out/test_attn_$fam.log" 2>&1
    echo "test_gpu_attention ($fam) rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|which is" "$out/test_attn_$fam.log" | head -10
  done
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 "$B/bin/test_gpu_attention" --gtest_filter='*ForSanitizer*' \
      > "$out/$tool.log" 2>&1
    echo "$tool rc=$?"; tail -2 "$out/$tool.log"
  done
  STROBE_BUILD_DIR="$B" timeout 200 python3 tests/python/test_ops_compile.py > "$out/opcheck.log" 2>&1
  echo "opcheck rc=$?"; grep -E "FAIL|passed" "$out/opcheck.log" | head -20
  for fam in wgmma mma; do
    echo "== bench_attention.py ($fam)"
    STROBE_FLASH_ATTN=$fam STROBE_BUILD_DIR="$B" OUT="$out" timeout 150 python3 bench/attention/bench_attention.py 2>&1 | grep -v -i warn | tail -9
  done
fi

if [ "$phase" = bench ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H200*) export HBM_TBS=4.8 ;; *) export HBM_TBS=3.35 ;; esac
  timeout 240 python3 bench/ops/fused_norm_bench.py "$B/lib/libstrobe_ops.so" rms 2>&1 | grep -v Warning | tail -10
  for mode in on off; do
    args=""; [ $mode = off ] && args="--set model.fused_ops=false --set task.fused_linear_loss=false"
    echo "== strobe bench step llama_1b fused $mode"
    # shellcheck disable=SC2086
    timeout 200 "$B/bin/strobe" bench step --workload llama_1b --warmup "${WARMUP:-10}" --steps "${STEPS:-30}" \
      --set data.batch_size="${LLAMA_B:-8}" $args --json "$out/llama_$mode.json" > "$out/llama_$mode.log" 2>&1
    echo "rc=$?"; tail -6 "$out/llama_$mode.log"
  done
  if [ "${SKIP_BASELINE:-0}" != 1 ]; then
    echo "== pytorch_baselines.py llama (LLAMA_B=${LLAMA_B:-8})"
    LLAMA_B=${LLAMA_B:-8} OUT="$out" timeout 300 python3 bench/pytorch_baselines.py llama > "$out/baseline_llama.log" 2>&1
    echo "rc=$?"; grep -vi warning "$out/baseline_llama.log" | tail -8
  fi
fi
echo "total: $(( $(date +%s) - t0 )) s"
