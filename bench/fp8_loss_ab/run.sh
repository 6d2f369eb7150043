#!/usr/bin/env bash
# The float8 loss A/B on one GPU: bf16-master and bf16-master + trainer.fp8 (every decoder
# projection) side by side, then compare.py. Usage: bash bench/fp8_loss_ab/run.sh STROBE_BIN DATA_DIR OUT
# [--set key=value ...] (extra overrides, given to both runs: e.g. --set data.batch_size=16).
set -uo pipefail
bin=$1; data=$2; out=$3; shift 3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for v in bf16 fp8; do
  sets=(--set "data.path=$data/train.bin" --set "data.val_path=$data/val.bin" --run-dir "$out/$v" "$@")
  [ $v = fp8 ] && sets+=(--set "trainer.fp8={min_size: 0}")
  "$bin" fit -c "$here/llama_fortunes.yaml" "${sets[@]}" > "$out/$v.log" 2>&1 &
done
wait
for v in bf16 fp8; do tail -n 3 "$out/$v.log"; done
python3 "$here/compare.py" "$out" "$data"
