#!/usr/bin/env bash
# The step-overhead A/B: bench/e2e/tiny_overhead.yaml's step (`strobe bench step`) with this tree's
# build and with an earlier revision's, alternating 3 times (one machine, one call).
#   bench/e2e/step_overhead_ab.sh BASE_TARBALL [BUILD_DIR]
# BASE_TARBALL: `git archive REV | gzip > FILE` of the earlier revision (made where git is); it is
# configured like BUILD_DIR (its CMAKE_PREFIX_PATH and compilers) into /tmp/strobe-ab-base and only
# the `strobe` target is built. Env: STEPS (400), WARMUP (50), AB_ROUNDS (3); AB_BUILD_ONLY=1 builds the base and
# stops; AB_REUSE_BASE=1 times an earlier call's base build when it is there (a warm GPU machine: the
# builds in one call, the timing in the next).
set -uo pipefail
base_tar=$1
build=$(cd "${2:-build}" && pwd)
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
base=/tmp/strobe-ab-base
if [ "${AB_REUSE_BASE:-0}" = 1 ] && [ -x "$base/build/bin/strobe" ]; then
  echo "base: reusing $base/build/bin/strobe"
else
  rm -rf "$base" && mkdir -p "$base" && tar -xzf "$base_tar" -C "$base"
  args=(-S "$base" -B "$base/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$(cache CMAKE_PREFIX_PATH)"
        -DCMAKE_CXX_COMPILER="$(cache CMAKE_CXX_COMPILER)")
  cuda=$(cache CMAKE_CUDA_COMPILER)
  [ -n "$cuda" ] && args+=(-DCMAKE_CUDA_COMPILER="$cuda")
  cmake "${args[@]}" > "$base/configure.log" 2>&1 && cmake --build "$base/build" --target strobe > "$base/build.log" 2>&1 \
  || { tail -20 "$base/build.log"; exit 1; }
fi
[ "${AB_BUILD_ONLY:-0}" = 1 ] && { echo "base: built $base/build/bin/strobe"; exit 0; }
cfg=$(cd "$(dirname "$0")" && pwd)/tiny_overhead.yaml
for i in $(seq "${AB_ROUNDS:-3}"); do
  for v in this base; do
    b=$build/bin/strobe; [ $v = base ] && b=$base/build/bin/strobe
    echo -n "$v: "
    "$b" bench step --config "$cfg" --warmup "${WARMUP:-50}" --steps "${STEPS:-400}" 2>&1 | grep "^step"
  done
done
