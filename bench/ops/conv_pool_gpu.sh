#!/usr/bin/env bash
# One GPU-machine call for the fused conv3x3+max-pool+ReLU op (issue 14): build what it needs, the
# CUDA tests (+ compute-sanitizer memcheck on a small shape), the conv-stack benchmark (fused vs
# cuDNN, one process), then the face detector's whole step in Strobe (fused vs fused_conv=false,
# 120 steps; ms/step from the progress bar between batches 50 and 120) beside
# bench/pytorch_baselines.py detector (eager and torch.compile). Logs under $OUT.
#   bash bench/ops/conv_pool_gpu.sh [BUILD_DIR]   (project root, .gpu/ beside it)
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
B=${1:-build-gpu}
deps=/opt/gpudeps
if [ ! -f $deps/.done ]; then mkdir -p $deps && for f in .gpu/debs/*.deb; do dpkg -x "$f" $deps; done && touch $deps/.done; fi
export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
prefix="$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)');$deps/usr"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$(date +%s)
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" > "$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build "$B" -j"$(nproc)" --target strobe test_gpu_ops > "$out/build.log" 2>&1 || { grep -B2 -A12 -m5 error "$out/build.log" | head -60; exit 1; }
echo "configure+build: $(( $(date +%s) - t0 )) s"
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 120 "$B/bin/test_gpu_ops" --gtest_filter='ConvPool*' 2>&1 | tail -25
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/bin/test_gpu_ops" \
    --gtest_filter='ConvPoolCudaOp.SmallShapeForMemcheck' 2>&1 | tail -6
fi

timeout 150 python3 bench/ops/conv_pool_bench.py "$B/lib/libstrobe_ops.so" 2>&1 | grep -v Warning | tail -30

steps() {  # name sets...: ms/step between batches 50 and 120
  local name=$1; shift
  local rd=$(mktemp -d)/run
  timeout 100 "$B/bin/strobe" fit -c configs/face_detector_giou.yaml --run-dir "$rd" \
    --set data.num_samples=204800 --set trainer.max_steps=120 --set trainer.num_sanity_val_steps=0 \
    --set trainer.limit_val_batches=0 --set trainer.log_every_n_steps=10 "$@" > "$out/fit_$name.log" 2>&1
  local rc=$?
  cp "$rd/metrics.csv" "$out/metrics_$name.csv" 2>/dev/null
  python3 - "$out/fit_$name.log" "$name" "$rc" <<'PY'
import re, sys
log, name, rc = sys.argv[1], sys.argv[2], sys.argv[3]
r = {}
for line in open(log, errors="replace"):
    m = re.search(r"batch (\d+)/\d+ step \d+ ([\d.]+)it/s", line)
    if m: r[int(m.group(1))] = float(m.group(2))
a, z = 50, 120
if a in r and z in r:
    print(f"STROBE {name}: {(z / r[z] - a / r[a]) / (z - a) * 1000:.1f} ms/step (batches {a}..{z}) rc={rc}", flush=True)
else:
    print(f"STROBE {name}: no rate (rc={rc}); log tail:", flush=True); print("".join(open(log, errors="replace").readlines()[-8:]))
PY
}
steps fused
steps cudnn --set model.fused_conv=false
python3 - "$out" <<'PY'
import csv, sys, os
d = sys.argv[1]
def losses(n):
    p = os.path.join(d, f"metrics_{n}.csv")
    if not os.path.exists(p): return {}
    rows = list(csv.DictReader(open(p)))
    k = next((c for c in rows[0] if "loss" in c and "val" not in c), None) if rows else None
    return {int(r["step"]): float(r[k]) for r in rows if k and r.get(k)}
a, b = losses("fused"), losses("cudnn")
for s in sorted(set(a) & set(b)):
    print(f"LOSS step {s}: fused {a[s]:.5f} cudnn {b[s]:.5f} rel {abs(a[s]-b[s])/max(abs(b[s]),1e-9):.2e}")
PY
timeout 240 python3 bench/pytorch_baselines.py detector 2>&1 | grep -v Warning | tail -6
steps fused_hidden16 --set model.hidden_dim=16   # ~ the loader's rate when the model is cheap
echo "total: $(( $(date +%s) - t0 )) s"
