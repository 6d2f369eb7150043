#!/usr/bin/env bash
# The step-overhead A/B: bench/e2e/tiny_overhead.yaml's step (`strobe bench step`) with this tree's
# build and with an earlier revision's, alternating 3 times (one machine, one call).
#   bench/e2e/step_overhead_ab.sh BASE_TARBALL [BUILD_DIR]
# BASE_TARBALL: `git archive REV | gzip > FILE` of the earlier revision (made where git is); it is
# configured like BUILD_DIR (its CMAKE_PREFIX_PATH and compilers) into /tmp/strobe-ab-base and only
# the `strobe` target is built. Env: STEPS (400), WARMUP (50).
set -uo pipefail
base_tar=$1
build=$(cd "${2:-build}" && pwd)
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
base=/tmp/strobe-ab-base
rm -rf "$base" && mkdir -p "$base" && tar -xzf "$base_tar" -C "$base"
args=(-S "$base" -B "$base/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$(cache CMAKE_PREFIX_PATH)"
      -DCMAKE_CXX_COMPILER="$(cache CMAKE_CXX_COMPILER)")
cuda=$(cache CMAKE_CUDA_COMPILER)
[ -n "$cuda" ] && args+=(-DCMAKE_CUDA_COMPILER="$cuda")
cmake "${args[@]}" > "$base/configure.log" 2>&1 && cmake --build "$base/build" --target strobe > "$base/build.log" 2>&1 \
  || { tail -20 "$base/build.log"; exit 1; }
cfg=$(cd "$(dirname "$0")" && pwd)/tiny_overhead.yaml
for i in 1 2 3; do
  for v in this base; do
    b=$build/bin/strobe; [ $v = base ] && b=$base/build/bin/strobe
    echo -n "$v: "
    "$b" bench step --config "$cfg" --warmup "${WARMUP:-50}" --steps "${STEPS:-400}" 2>&1 | grep "^step"
  done
done
