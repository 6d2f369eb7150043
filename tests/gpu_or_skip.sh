#!/bin/sh
# Runs one of the CUDA test executables (tests/gpu_*) as ctest asks, or, on a machine with no GPU
# device node at all, says the test is skipped without starting it: a test process loads libtorch
# and the CUDA libraries before its first line (0.4 s on a 2-core machine, ~150 GPU tests), only to
# find no device and skip. Where any NVIDIA device node exists (/dev/nvidia*: Linux; /dev/dxg: WSL;
# /dev/nvhost*, /dev/nvgpu: Jetson), the test itself runs and decides: it skips when CUDA sees no
# device (CUDA_VISIBLE_DEVICES=, a broken driver) and fails when our kernels are missing.
# Discovery (--gtest_list_tests) always runs the executable.
# Usage: gpu_or_skip.sh EXECUTABLE [ARGS...]. STROBE_GPU_DEVICE_NODES (tests only): the globs to look
# for instead of the ones above.
exe=$1
for arg in "$@"; do
  [ "$arg" = "--gtest_list_tests" ] && exec "$@"
done
nodes=${STROBE_GPU_DEVICE_NODES:-/dev/nvidia* /dev/dxg /dev/nvhost* /dev/nvgpu*}
for node in $nodes; do
  [ -e "$node" ] && exec "$@"
done
# GoogleTest's own skip line: ctest reports the test as skipped (gtest_discover_tests' SKIP_REGULAR_EXPRESSION).
echo "[  SKIPPED ] no GPU device node on this machine ($nodes): $(basename "$exe") not started"
exit 0
