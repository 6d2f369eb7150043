#!/usr/bin/env bash
# Kineto traces of Strobe's seed workloads (issue 14) and where their GPU time goes, after a build
# into build-gpu/ (or $STROBE_BUILD_DIR). For each workload: `strobe fit` for STEPS steps with
# `trainer.profiler: {steps: [A, B]}`, then bench/e2e/trace_top.py on the trace (kernels by name and
# category, per step). Traces and JSON summaries stay in $RUNS (default /tmp/strobe_prof); tables go to stdout.
#   bash bench/e2e/profile_gpu.sh                      # all workloads
#   WORKLOADS="vit_l16 resnet50" bash bench/e2e/profile_gpu.sh   (also: llama_1b)
#   EXTRA="--set trainer.precision=bf16-mixed" WORKLOADS=resnet50 bash bench/e2e/profile_gpu.sh
#   RECORD_SHAPES=true WHO="CUDAFunctor_add direct_copy" bash bench/e2e/profile_gpu.sh   # who launched them
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${OUT:-/tmp/out}; mkdir -p "$out"
runs=${RUNS:-/tmp/strobe_prof}
bin=${STROBE_BUILD_DIR:-$root/build-gpu}/bin
A=${A:-20}; B=${B:-22}; STEPS=${STEPS:-24}
WORKLOADS=${WORKLOADS:-vit_l16 face_detector_giou resnet50 lm_pack lm_pad_to_longest}
cd "$root"
rc=0
for w in $WORKLOADS; do
  case $w in
    vit_l16) cfg=configs/vit_l16.yaml; sets=() ;;
    face_detector_giou) cfg=configs/face_detector_giou.yaml; sets=() ;;
    resnet50) cfg=configs/resnet50_nan.yaml
      sets=(--set task.loss=cross_entropy --set 'callbacks=[]' --set optimizer.name=sgd --set optimizer.lr=0.001 --set optimizer.momentum=0.9) ;;
    lm_pack|lm_pad_to_max|lm_pad_to_longest) cfg=configs/decoder_lm_varlen.yaml; sets=(--set "data.collate=${w#lm_}") ;;
    llama_1b) cfg=configs/llama_1b.yaml; sets=() ;;
    *) echo "unknown workload $w"; rc=2; continue ;;
  esac
  rm -rf "$runs/$w"; mkdir -p "$runs/$w"
  echo "== $w"
  # shellcheck disable=SC2086
  "$bin/strobe" fit -c "$cfg" "${sets[@]}" --set trainer.max_steps="$STEPS" --set trainer.limit_val_batches=0 \
    --set trainer.num_sanity_val_steps=0 --set trainer.default_root_dir="$runs/$w" \
    --set "trainer.profiler={steps: [$A, $B], path: $runs/$w/trace, record_shapes: ${RECORD_SHAPES:-false}}" ${EXTRA:-} > "$out/prof_$w.log" 2>&1 \
    || { echo "!! strobe fit exit $?"; tail -5 "$out/prof_$w.log"; rc=1; continue; }
  t=$(ls "$runs/$w"/trace/*.json 2>/dev/null | head -1)
  [ -n "$t" ] || { echo "!! no trace"; rc=1; continue; }
  who=(); for p in ${WHO:-}; do who+=(--who "$p"); done
  python3 "$here/trace_top.py" "$t" --top "${TOP:-25}" "${who[@]}" --json "$runs/$w/summary.json"
done
exit $rc
