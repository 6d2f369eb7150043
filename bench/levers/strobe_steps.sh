#!/usr/bin/env bash
# Steady-state step time of `strobe fit` on the seed configs, from the progress bar's cumulative
# rate (non-TTY lines every 10 batches): ms/step between batch A and batch B.
# Usage: [ROWS="vit_l16 lm_pack ..."] [A=50] [Z=150] bash bench/levers/strobe_steps.sh BUILD_DIR [extra --set ...]
# (GPU machine; ROWS picks rows by name, default all).
set -u
B=${1:-build-gpu}; shift || true
A=${A:-50}; Z=${Z:-150}
ROWS=${ROWS:-}
row() {  # name config sets...
  local name=$1 cfg=$2; shift 2
  if [ -n "$ROWS" ] && ! [[ " $ROWS " == *" $name "* ]]; then return; fi
  local log=$(mktemp)
  "$B/bin/strobe" fit -c "$cfg" --run-dir "$(mktemp -d)/run" --set trainer.max_steps=$Z \
    --set trainer.log_every_n_steps=10 --set trainer.num_sanity_val_steps=0 --set trainer.limit_val_batches=0 \
    "$@" >"$log" 2>&1
  local rc=$?
  python3 - "$log" "$name" "$A" "$Z" "$rc" <<'PY'
import re, sys
log, name, a, z, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
r = {}
for line in open(log, errors="replace"):
    m = re.search(r"batch (\d+)/\d+ step \d+ ([\d.]+)it/s", line)
    if m: r[int(m.group(1))] = float(m.group(2))
if a in r and z in r:
    print(f"STROBE {name}: {(z / r[z] - a / r[a]) / (z - a) * 1000:.1f} ms/step (batches {a}..{z}) rc={rc}", flush=True)
else:
    print(f"STROBE {name}: no rate (rc={rc}); log tail:", flush=True); print("".join(open(log, errors="replace").readlines()[-8:]))
PY
}
row vit_l16 configs/vit_l16.yaml "$@"
row resnet50_ce configs/resnet50_nan.yaml --set task.loss=cross_entropy --set callbacks=[] --set optimizer.name=sgd \
  --set optimizer.lr=0.001 --set optimizer.momentum=0.9 "$@"
row face_detector configs/face_detector_giou.yaml --set data.num_samples=204800 "$@"
row lm_pack configs/decoder_lm_varlen.yaml --set data.collate=pack "$@"
row lm_pad_to_max configs/decoder_lm_varlen.yaml --set data.collate=pad_to_max "$@"
row lm_pad_to_longest configs/decoder_lm_varlen.yaml --set data.collate=pad_to_longest "$@"
