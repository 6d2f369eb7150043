#!/usr/bin/env bash
# Sets up (scripts/setup.sh), runs the whole test suite (ctest; GPU tests skip without a GPU) and
# the libFuzzer targets (the config loader, the safetensors header parser) for a minute each.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
build=${STROBE_BUILD_DIR:-build}
(cd "$build" && ctest --output-on-failure -j"$(nproc)" --timeout 900)
bash scripts/fuzz.sh "${STROBE_FUZZ_SECONDS:-60}"
