#!/usr/bin/env bash
# Sets up and builds the `strobe` executable alone (scripts/setup.sh strobe), trains the quickstart
# experiment with its live progress bar, then tests the run's best checkpoint (the top-1 by val/acc).
# Usage: quickstart.sh [--run-dir DIR] [--set key=value ...]: the run directory is DIR, else a new
# runs/quickstart/version_<n> (the next free number); every other argument is passed to both
# `strobe fit` and `strobe test` (`--set trainer.max_steps=20` is the one-minute check).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${STROBE_BUILD_DIR:-build}
run_dir=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --run-dir) [ $# -ge 2 ] || { echo "quickstart: --run-dir needs a directory" >&2; exit 2; }
               run_dir=$2; shift 2 ;;
    --run-dir=*) run_dir=${1#--run-dir=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
bash scripts/setup.sh strobe
if [ -z "$run_dir" ]; then
  # Claims the next version_<n> with mkdir (never -p), as `strobe fit` does, so that two quickstarts
  # started at once never share a directory.
  mkdir -p runs/quickstart
  n=0
  until mkdir "runs/quickstart/version_$n" 2>/dev/null; do n=$((n + 1)); done
  run_dir=runs/quickstart/version_$n
  claimed=1
fi
# No pipe: on a terminal `strobe fit` draws its live progress bar.
if ! "$build/bin/strobe" fit -c configs/quickstart.yaml --run-dir "$run_dir" "${args[@]}"; then
  rc=$?
  # A run refused before it wrote anything leaves no empty directory behind.
  if [ -n "${claimed:-}" ]; then rmdir "$run_dir" 2>/dev/null || true; fi
  exit $rc
fi
best=""
for f in "$run_dir"/checkpoints/*.ckpt; do
  case "$(basename "$f")" in last.ckpt) ;; *) best=$f ;; esac
done
if [ -z "$best" ]; then
  best=$run_dir/checkpoints/last.ckpt
  echo "quickstart: no validation ended this run (it stopped before the epoch's end): testing $best"
else
  echo "quickstart: testing the best checkpoint, $best"
fi
"$build/bin/strobe" test -c configs/quickstart.yaml --ckpt "$best" "${args[@]}"
