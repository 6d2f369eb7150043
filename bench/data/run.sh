#!/usr/bin/env bash
# Loader throughput, Strobe vs torchvision, in one call on one machine:
#   bash bench/data/run.sh BUILD_DIR PYTHON WORKERS
# Generates 3000 ImageNet-like JPEGs (~500x375, quality 90; the same files as gpu_bench.sh) into
# /tmp, then runs bench_image_loader and torchvision_loader.py with the same transforms, batch 128,
# WORKERS workers, 3 epochs each (train and eval transforms). One JSON line per run.
set -euo pipefail
build=$1 py=$2 workers=$3
here=$(cd "$(dirname "$0")" && pwd)
root=/tmp/strobe-bench-photos-3000
if [ ! -f $root/.done ]; then
  rm -rf $root && for k in $(seq 0 14); do "$build/bin/strobe_data_tool" photo-folder $root/part$k 200 10 $((k + 1)); done && touch $root/.done
fi
echo "images: $(find $root -name '*.JPEG' | wc -l) ($(du -sh $root | cut -f1)); cores: $(nproc); workers: $workers; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for mode in train eval; do
  "$build/bin/bench_image_loader" $root $workers 128 3 $mode
  "$py" "$here/torchvision_loader.py" $root $workers 128 3 $mode
done
