#!/usr/bin/env bash
# Loader throughput, Strobe vs torchvision, in one call on one machine:
#   bash bench/data/run.sh BUILD_DIR PYTHON WORKERS [N_IMAGES]
# Generates N_IMAGES (default 3000) ImageNet-like JPEGs (~500x375, quality 90) into /tmp, then runs
# bench_image_loader and torchvision_loader.py with the same transforms, batch 128, WORKERS workers,
# 3 epochs each (train and eval transforms). One JSON line per run.
set -euo pipefail
build=$1 py=$2 workers=$3 n=${4:-3000}
here=$(cd "$(dirname "$0")" && pwd)
root=/tmp/strobe-bench-photos-$n
if [ ! -f $root/.done ]; then
  rm -rf $root && "$build/bin/strobe_data_tool" photo-folder $root $n 10 1 && touch $root/.done
fi
echo "images: $n in $root ($(du -sh $root | cut -f1)); cores: $(nproc); workers: $workers"
for mode in train eval; do
  "$build/bin/bench_image_loader" $root $workers 128 3 $mode
  "$py" "$here/torchvision_loader.py" $root $workers 128 3 $mode
done
