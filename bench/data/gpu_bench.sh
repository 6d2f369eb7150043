#!/usr/bin/env bash
# The loader benchmark on the GPU machine (16 cores), building only what it needs (no CUDA kernels):
#   bash bench/data/gpu_bench.sh   (from the project root, with .gpu/ beside it; logs to $OUT)
# Then: nvJPEG availability and torchvision's GPU decode_jpeg (nvJPEG) throughput on the same files.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
deps=/opt/gpudeps
if [ ! -f $deps/.done ]; then mkdir -p $deps && for f in .gpu/debs/*.deb; do dpkg -x "$f" $deps; done && touch $deps/.done; fi
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
prefix="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)');$deps/usr"
t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DSTROBE_CUDA=OFF -DSTROBE_BUILD_TESTS=OFF \
  > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j"$(nproc)" --target bench_image_loader strobe_data_tool > "$out/build.log" 2>&1 || { grep -m5 -A10 error "$out/build.log"; exit 1; }
echo "configure+build: $(( $(date +%s) - t0 )) s"
root=/tmp/strobe-bench-photos-3000
if [ ! -f $root/.done ]; then
  rm -rf $root; for k in $(seq 0 14); do build-gpu/bin/strobe_data_tool photo-folder $root/part$k 200 10 $((k + 1)) & done; wait; touch $root/.done
fi
echo "images: $(find $root -name '*.JPEG' | wc -l) ($(du -sh $root | cut -f1)); cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
for mode in train eval; do
  build-gpu/bin/bench_image_loader $root 16 128 3 $mode
  python3 bench/data/torchvision_loader.py $root 16 128 3 $mode
done
echo "== nvJPEG"
ls /usr/local/cuda/lib64/libnvjpeg* 2>/dev/null | head -3; ldconfig -p | grep -i nvjpeg | head -3
python3 - <<'PY'
import glob, time, torch, torchvision
from torchvision.io import decode_jpeg, read_file
files = sorted(glob.glob("/tmp/strobe-bench-photos-3000/**/*.JPEG", recursive=True))
data = [read_file(f) for f in files]
try:
    for _ in range(2):
        torch.cuda.synchronize(); t = time.perf_counter()
        for i in range(0, len(data), 128):
            decode_jpeg(data[i:i + 128], device="cuda")
        torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f"torchvision decode_jpeg(device='cuda') (nvJPEG), batches of 128: {len(data) / dt:.0f} images/s (decode only, full size)")
except Exception as e:
    print("GPU decode_jpeg failed:", e)
PY
