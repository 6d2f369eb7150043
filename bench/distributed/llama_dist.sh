#!/usr/bin/env bash
# llama_1b data parallel on one host: Strobe's `strobe bench step` under ddp, zero2 and fsdp, with
# and without activation checkpointing, and PyTorch's DDP and FSDP2 (llama_dist_baseline.py; FSDP2
# with and without resharding after the forward), one line of JSON each (docs/PERFORMANCE.md,
# "ZeRO-2"). STRATEGIES and PYTORCH_MODES pick a subset (default: all of them).
# Usage: bench/distributed/llama_dist.sh STROBE_BIN WORLD OUT_DIR [strobe|pytorch|all]
# Each Strobe rank is started with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*)
# and writes its own JSON; the line printed takes the slowest rank's mean step and each metric's
# largest per-GPU value. Batch 8 x 2048 tokens per GPU, 10 warm-up and 20 timed steps.
set -uo pipefail
bin=$1; world=$2; out=$3; which=${4:-all}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
port=29600
strobe_run() {  # strategy activation_checkpointing
  port=$((port + 1))
  local tag="strobe_${1}_${2}_w${world}"
  for ((r = 0; r < world; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$bin" bench step --workload llama_1b --warmup 10 --steps 20 --set "trainer.strategy=$1" \
      --set "model.activation_checkpointing=$2" --json "$out/$tag.r$r.json" > "$out/$tag.r$r.log" 2>&1 &
  done
  wait
  python3 - "$out" "$tag" "$world" <<'PY'
import json, sys
out, tag, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
def find(x):
    if isinstance(x, dict) and "tokens_per_s" in x:
        return x
    for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else []):
        f = find(v)
        if f:
            return f
rows = []
for r in range(world):
    try:
        rows.append(find(json.load(open(f"{out}/{tag}.r{r}.json"))))
    except Exception as e:
        print(json.dumps({"tag": tag, "rank": r, "error": str(e)}))
        sys.exit(0)
mean = max(x["ms"]["mean"] for x in rows)
print(json.dumps({"impl": "strobe", "tag": tag, "world_size": world, "step_ms_mean": round(mean, 2),
                  "step_ms_median_rank0": round(rows[0]["ms"]["median"], 2),
                  "tokens_per_s": round(world * rows[0]["tokens_per_step"] * 1000 / mean),
                  "peak_gib_max_rank": round(max(x["peak_memory_gib"] for x in rows), 2),
                  "state_gib_max_rank": round(max(x["state_memory_gib"] for x in rows), 2)}))
PY
}
pytorch_run() {  # mode activation_checkpointing
  port=$((port + 1))
  local tag="pytorch_${1}_${2}_w${world}"
  python3 -m torch.distributed.run --nproc-per-node="$world" --master-port=$port "$here/llama_dist_baseline.py" \
    --mode "$1" --ac "$2" --batch 8 --warmup 10 --steps 20 --json "$out/$tag.json" > "$out/$tag.log" 2>&1 ||
    tail -20 "$out/$tag.log"
  cat "$out/$tag.json" 2>/dev/null && echo
}
if [ "$which" = strobe ] || [ "$which" = all ]; then
  for s in ${STRATEGIES:-ddp zero2 fsdp}; do for ac in none blocks; do strobe_run $s $ac; done; done
fi
if [ "$which" = pytorch ] || [ "$which" = all ]; then
  for m in ${PYTORCH_MODES:-ddp fsdp2 fsdp2_reshard}; do for ac in none blocks; do pytorch_run $m $ac; done; done
fi
