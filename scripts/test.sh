#!/usr/bin/env bash
# Sets up (scripts/setup.sh), runs the whole test suite (ctest; GPU tests skip without a GPU) and
# the config loader's libFuzzer target for a minute on our configs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
build=${STROBE_BUILD_DIR:-build}
(cd "$build" && ctest --output-on-failure -j"$(nproc)" --timeout 900)
bash scripts/fuzz_config.sh "${STROBE_FUZZ_SECONDS:-60}"
