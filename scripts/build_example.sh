#!/usr/bin/env bash
# Installs the Strobe that scripts/setup.sh built into a prefix, then builds examples/custom_model (or
# another project of the same kind) against that prefix alone: find_package(Strobe) and the libtorch
# the build used, no path into this source tree (docs/EXTENDING.md).
# Usage: scripts/build_example.sh [PREFIX (default ./prefix)] [PROJECT (default examples/custom_model)]
#        [BUILD_DIR (default PROJECT/build, where the example's spirals.yaml expects its plugin)].
#        Env: STROBE_BUILD_DIR (default build).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${STROBE_BUILD_DIR:-$root/build}
prefix=$(realpath -m "${1:-$root/prefix}")
project=$(realpath -m "${2:-$root/examples/custom_model}")
out=$(realpath -m "${3:-$project/build}")
if [ ! -f "$build/CMakeCache.txt" ]; then
  echo "build_example: $build is not a Strobe build (run scripts/setup.sh first)" >&2
  exit 2
fi
cmake --install "$build" --prefix "$prefix" >/dev/null
# The steps of docs/EXTENDING.md "Your own project": the package finds the libtorch Strobe was built with.
cmake -S "$project" -B "$out" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$out" -j 2
echo "build_example: $prefix/bin/strobe; plugin(s) in $out"
