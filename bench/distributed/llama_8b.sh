#!/usr/bin/env bash
# Llama-3-8B's shape (d 4096, 32 layers, 32 heads over 8 KV heads, SwiGLU 14336, untied 128256-token
# vocabulary) trained data-parallel on WORLD GPUs of one host with activation checkpointing on every
# block (docs/PERFORMANCE.md, "Fully sharded parameters"): Strobe's `strobe bench step` (bf16-master,
# fused AdamW, the fused linear cross-entropy) under trainer.strategy fsdp and zero2, and PyTorch FSDP2
# resharding the blocks after the forward (llama_dist_baseline.py --mode fsdp2_reshard), each at
# every "BxS" of SHAPES (batch B x S tokens per GPU; default "2x4096 8x2048": the batch FSDP2's
# Llama-3-8B figures are usually given at, and Strobe's llama_1b one). One JSON line per run: the
# slowest rank's mean step, tokens/s per GPU, the largest per-GPU peak (allocated and reserved) and
# model state, and the MFU (6 N + 12 L d S FLOPs a token, N the linear weights: torchtitan's count;
# an H200's 989.4 dense bf16 TFLOP/s).
# Usage: bench/distributed/llama_8b.sh STROBE_BIN WORLD OUT_DIR [strobe|pytorch|all]
# Env: SHAPES, STRATEGIES (default "fsdp zero2"), WARMUP (5), STEPS (10).
set -uo pipefail
bin=$1; world=$2; out=$3; which=${4:-all}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
shapes=${SHAPES:-"2x4096 8x2048"}; strategies=${STRATEGIES:-"fsdp zero2"}; warmup=${WARMUP:-5}; steps=${STEPS:-10}
port=29900

strobe_run() {  # strategy batch seq
  local strategy=$1 b=$2 s=$3 tag="strobe_${1}_b${2}_s${3}_w${world}" pids=() rc=0
  port=$((port + 1))
  local sets=()
  for kv in model.embed_dim=4096 model.depth=32 model.num_heads=32 model.num_kv_heads=8 model.ffn_dim=14336 \
    model.tie_embeddings=false "model.max_seq_len=$s" "data.max_seq_len=$s" "data.batch_size=$b" \
    task.fused_linear_loss=true model.activation_checkpointing=blocks "trainer.strategy=$strategy"; do
    sets+=(--set "$kv")
  done
  for ((r = 0; r < world; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 1200 \
      "$bin" bench step --workload llama_1b --warmup "$warmup" --steps "$steps" "${sets[@]}" \
      --json "$out/$tag.r$r.json" > "$out/$tag.r$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  python3 - "$out" "$tag" "$world" "$strategy" "$b" "$s" "$rc" <<'PY'
import json, sys
out, tag, world, strategy, b, s, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
row = {"impl": "strobe", "strategy": strategy, "activation_checkpointing": "blocks", "world_size": world,
       "batch_per_gpu": b, "seq": s}
try:
    ws = [json.load(open(f"{out}/{tag}.r{r}.json"))["suites"]["step"]["workloads"][0] for r in range(world)]
    ms = max(w["ms"]["mean"] for w in ws)
    row.update(step_ms_mean=round(ms, 1), step_ms_median_rank0=round(ws[0]["ms"]["median"], 1),
               tokens_per_s_per_gpu=round(b * s / ms * 1000), mfu=round(min(w["mfu"] for w in ws), 4),
               peak_gib=round(max(w["peak_memory_gib"] for w in ws), 2),
               peak_reserved_gib=round(max(w["peak_reserved_gib"] for w in ws), 2),
               state_gib=round(max(w["state_memory_gib"] for w in ws), 2))
except Exception as e:  # a rank that failed: its log says why
    logs = "".join(open(f"{out}/{tag}.r{r}.log").read() for r in range(world))
    row["error"] = ("out of memory" if "out of memory" in logs else f"exit {rc}: {e}") + f" (see {out}/{tag}.r*.log)"
print(json.dumps(row), flush=True)
PY
}

pytorch_run() {  # batch seq
  local b=$1 s=$2 tag="pytorch_fsdp2_reshard_b${1}_s${2}_w${world}"
  port=$((port + 1))
  timeout 1200 python3 -m torch.distributed.run --nproc-per-node="$world" --master-port=$port "$here/llama_dist_baseline.py" \
    --mode fsdp2_reshard --ac blocks --shape 8b --batch "$b" --seq "$s" --warmup "$warmup" --steps "$steps" \
    --json "$out/$tag.json" > "$out/$tag.log" 2>&1
  if [ -f "$out/$tag.json" ]; then cat "$out/$tag.json"; echo; else
    echo "{\"impl\": \"pytorch\", \"mode\": \"fsdp2_reshard\", \"batch_per_gpu\": $b, \"seq\": $s, \"error\": \"see $out/$tag.log\"}"
  fi
}

for shape in $shapes; do
  b=${shape%x*}; s=${shape#*x}
  if [ "$which" = strobe ] || [ "$which" = all ]; then
    for strategy in $strategies; do strobe_run "$strategy" "$b" "$s"; done
  fi
  if [ "$which" = pytorch ] || [ "$which" = all ]; then pytorch_run "$b" "$s"; fi
done
