#!/usr/bin/env bash
# Issue 9's GPU measurements in one device call, after a build into build-gpu/:
# 1. strobe_bench_nan: ResNet-50 b128 bf16-mixed step time without / with nan_capture / with
#    nan_capture + spike detection (interleaved) and the host syncs of the two capture runs;
# 2. the seed's Lightning NaNCapture next to plain Lightning on the same GPU (bench/pytorch_baselines.py nan);
# 3. configs/resnet50_nan.yaml (the seed's NaN workload) on CUDA: exit 3, then `strobe replay` on
#    CUDA and on the CPU.
# Results: $OUT/nan_bench.json, $OUT/baselines (pytorch JSON), $OUT/replay_cuda.json, printed summary.
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
bin=${STROBE_BUILD_DIR:-build-gpu}/bin
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== strobe_bench_nan"
"$bin/strobe_bench_nan" --json "$out/nan_bench.json"
echo "== pytorch_baselines.py nan (Lightning NaNCapture)"
OUT="$out" python3 bench/pytorch_baselines.py nan 2>&1 | grep -v Warning | tail -5
ls "$out"/*.json 2>/dev/null
python3 - "$out" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
s = json.load(open(os.path.join(out, "nan_bench.json")))
base = {}
for f in glob.glob(os.path.join(out, "*.json")):
    try:
        d = json.load(open(f))
    except Exception:
        continue
    if isinstance(d, dict) and "nan" in d: base = d["nan"]
p, n = s["plain_median_ms"], s["nan_capture_median_ms"]
print(f"strobe    plain {p:.2f} ms  nan_capture {n:.2f} ms  overhead {100*(n/p-1):+.2f}%  syncs {s['nan_capture_syncs_in_block']}/{s['block_steps']} steps")
if "spike_median_ms" in s:
    m = s["spike_median_ms"]
    print(f"strobe    nan_capture + spike (both) {m:.2f} ms  overhead {100*(m/p-1):+.2f}%  syncs {s['spike_syncs_in_block']}/{s['block_steps']} steps")
lp, ln = base.get("resnet50_b128.lightning_plain.step_ms"), base.get("resnet50_b128.lightning_nancapture.step_ms")
if lp and ln: print(f"lightning plain {lp:.1f} ms  nancapture {ln:.1f} ms  overhead {100*(ln/lp-1):+.2f}%")
raw = base.get("resnet50_b128.raw_loop_gpu_data.step_ms")
if raw: print(f"pytorch raw loop (GPU-resident batch) {raw:.1f} ms; strobe plain / raw = {p/raw:.3f}")
PY
echo "== resnet50_nan on CUDA"
rm -rf /tmp/r50
"$bin/strobe" fit -c configs/resnet50_nan.yaml --run-dir /tmp/r50 --set trainer.enable_progress_bar=false 2>&1 | tail -4
echo "fit exit: ${PIPESTATUS[0]}"
"$bin/strobe" replay /tmp/r50/nan --report "$out/replay_cuda.json"
echo "replay exit: $?"
timeout 240 "$bin/strobe" replay /tmp/r50/nan --device cpu | tail -8
