#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the quickstart experiment, then tests its best checkpoint.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
run_dir=$(build/bin/strobe fit -c configs/quickstart.yaml "$@" | tee /dev/stderr | sed -n 's/^strobe fit: run directory \([^ ]*\).*/\1/p')
echo "quickstart: testing $run_dir/checkpoints/last.ckpt"
build/bin/strobe test -c configs/quickstart.yaml --ckpt "$run_dir/checkpoints/last.ckpt"
