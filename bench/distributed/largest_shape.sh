#!/usr/bin/env bash
# The deepest Llama of width 4096 that trains on WORLD GPUs of CAP GiB each (docs/PERFORMANCE.md,
# "ZeRO-2"): Llama-3-8B's blocks (32 heads over 8 KV heads, SwiGLU 14336, untied 128256-token
# vocabulary), batch 8 x 2048 tokens per GPU, activation checkpointing on every block, bisected over
# the depth. Each GPU's caching allocator is capped at CAP GiB (default 78: an 80 GB H100's
# 79.6 GiB less the CUDA context and NCCL's buffers, which live outside the allocator; each trial's
# JSON gives device_used_gib - reserved_gib, what they took), so a larger GPU answers for a smaller one.
#   strobe         `strobe bench step` on each rank, trainer.strategy=zero2, the fused linear + cross-entropy
#   strobe_fsdp    the same under trainer.strategy=fsdp (the parameters sharded too)
#   fsdp2          llama_dist_baseline.py --mode fsdp2 (reshard_after_forward=False) under torchrun
#   fsdp2_reshard  llama_dist_baseline.py --mode fsdp2_reshard (the blocks resharded after the forward)
# Usage: bench/distributed/largest_shape.sh STROBE_BIN WORLD OUT_DIR strobe|strobe_fsdp|fsdp2|fsdp2_reshard LO HI [CAP]
# LO layers must train and HI must not (each is tried first); prints one JSON line per trial and a
# last line {"largest_depth", "params", ...}. A trial that fails for another reason than running out
# of memory stops the search (exit 1): a crash is not an answer about memory.
set -uo pipefail
bin=$1; world=$2; out=$3; impl=$4; lo=$5; hi=$6; cap=${7:-78}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
port=29800
params() { python3 -c "d=$1; D=4096; print(d * (2 * D * D + 2 * D * 1024 + 3 * D * 14336 + 2 * D) + 2 * 128256 * D + D)"; }

# trial DEPTH: 0 when it trained, 1 when it ran out of memory, 2 for any other failure.
trial() {
  local depth=$1 tag="${impl}_d$1_w${world}_cap${cap}" rc=0
  port=$((port + 1))
  if [ "$impl" = strobe ] || [ "$impl" = strobe_fsdp ]; then
    local sets=() strategy=zero2
    [ "$impl" = strobe_fsdp ] && strategy=fsdp
    for s in model.embed_dim=4096 "model.depth=$depth" model.num_heads=32 model.num_kv_heads=8 model.ffn_dim=14336 \
      model.tie_embeddings=false task.fused_linear_loss=true "trainer.strategy=$strategy" model.activation_checkpointing=blocks; do
      sets+=(--set "$s")
    done
    local pids=()
    for ((r = 0; r < world; r++)); do
      RANK=$r LOCAL_RANK=$r WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 900 \
        "$bin" bench step --workload llama_1b --warmup 2 --steps 3 --memory-limit-gib "$cap" "${sets[@]}" \
        --json "$out/$tag.r$r.json" > "$out/$tag.r$r.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
  else
    timeout 900 python3 -m torch.distributed.run --nproc-per-node="$world" --master-port=$port "$here/llama_dist_baseline.py" \
      --mode "$impl" --ac blocks --batch 8 --warmup 2 --steps 3 --shape 8b --depth "$depth" --memory-limit-gib "$cap" \
      --json "$out/$tag.json" > "$out/$tag.log" 2>&1 || rc=1
  fi
  python3 - "$out" "$tag" "$world" "$impl" "$depth" "$(params "$depth")" "$rc" <<'PY'
import glob, json, sys
out, tag, world, impl, depth, params, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
logs = "".join(open(f).read() for f in sorted(glob.glob(f"{out}/{tag}*.log")))
row = {"impl": impl, "depth": depth, "params": params, "world_size": world}
if rc == 0:
    if impl.startswith("strobe"):
        ws = [json.load(open(f"{out}/{tag}.r{r}.json"))["suites"]["step"]["workloads"][0] for r in range(world)]
        row.update(step_ms_mean=round(max(w["ms"]["mean"] for w in ws), 1),
                   peak_gib=round(max(w["peak_memory_gib"] for w in ws), 2),
                   peak_reserved_gib=round(max(w["peak_reserved_gib"] for w in ws), 2),
                   state_gib=round(max(w["state_memory_gib"] for w in ws), 2),
                   outside_allocator_gib=round(max(w["device_used_gib"] - w["reserved_gib"] for w in ws), 2))
    else:
        j = json.load(open(f"{out}/{tag}.json"))
        row.update(step_ms_mean=j["step_ms_mean"], peak_gib=j["peak_gib_max_rank"],
                   peak_reserved_gib=j["peak_reserved_gib_max_rank"], state_gib=j["state_gib_max_rank"])
    row["trains"] = True
    code = 0
elif "out of memory" in logs:
    row["trains"] = False
    code = 1
else:
    row["error"] = "failed, not out of memory: see " + f"{out}/{tag}*.log"
    print(logs[-3000:], file=sys.stderr)
    code = 2
print(json.dumps(row), flush=True)
sys.exit(code)
PY
}

result() { echo "{\"impl\": \"$impl\", \"world_size\": $world, \"memory_limit_gib\": $cap, \"width\": 4096, $1}"; }
trial "$lo"; rc=$?
[ $rc = 2 ] && exit 1
[ $rc = 1 ] && { result "\"largest_depth\": null, \"note\": \"$lo layers do not train\""; exit 0; }
trial "$hi"; rc=$?
[ $rc = 2 ] && exit 1
[ $rc = 0 ] && { result "\"largest_depth\": $hi, \"params\": $(params "$hi"), \"note\": \"HI trains: the largest is HI or more\""; exit 0; }
while [ $((hi - lo)) -gt 1 ]; do
  mid=$(((lo + hi) / 2))
  trial "$mid"; rc=$?
  [ $rc = 2 ] && exit 1
  if [ $rc = 0 ]; then lo=$mid; else hi=$mid; fi
done
result "\"largest_depth\": $lo, \"params\": $(params "$lo")"
