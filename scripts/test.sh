#!/usr/bin/env bash
# Sets up (scripts/setup.sh), runs the whole test suite (ctest; GPU tests skip without a GPU) and
# the libFuzzer targets (the config loader, the safetensors header parser) for a minute each.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
build=${STROBE_BUILD_DIR:-build}
# The tests write their runs under TMPDIR: one fresh folder for this run, removed however it ends,
# so repeated runs never fill the disk.
TMPDIR=$(mktemp -d "${TMPDIR:-/tmp}/strobe-test-run.XXXXXX")
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
(cd "$build" && ctest --output-on-failure -j"$(nproc)" --timeout 900)
bash scripts/fuzz.sh "${STROBE_FUZZ_SECONDS:-60}"
