#!/usr/bin/env bash
# GPU check of `strobe fit` on two "nodes" emulated on one host of 2 GPUs, run by hand:
#   bash tests/gpu_distributed/two_node_check.sh build/bin/strobe OUT_DIR [ddp zero2 kill]
# (the checks named, all three by default)
# Each node is its own torchrun (`--nnodes 2 --node-rank N --nproc-per-node 1`, static rendezvous on
# 127.0.0.1) with its own CUDA_VISIBLE_DEVICES, so both workers get LOCAL_RANK 0 and cuda:0, as on
# two machines; NCCL_HOSTID differs per node, so NCCL takes its inter-node (network) transport
# instead of the host's NVLink. The model: the llama of llama_strides.sh on its learnable token file.
# For ddp and for zero2:
# 1. The two-node run trains (both agents exit 0, one `strobe fit:` line naming cuda:0 and 2
#    processes, one version directory) and its validation means equal one process's on the union
#    batch (2 x 64 against 1 x 128) to 1e-4 relative.
# 2. A two-node run stopped at step 12 and resumed on two nodes with --ckpt logs the uninterrupted
#    run's train/loss (metrics.csv, 9 digits) for all of steps 13..24.
# Then: node 1 (its agent and its worker) is killed with SIGKILL while both train; node 0 must end,
# non-zero, within trainer.dist_timeout (20 s) with the health monitor's line naming rank 1.
# Prints PASS/FAIL per check; exits with the number of failed checks.
set -uo pipefail
HERE=$(dirname "$(realpath "${BASH_SOURCE[0]}")")  # before any cd
BIN=$(realpath "$1")
W=$(realpath -m "$2")/two-node
shift 2
WHAT=" ${*:-ddp zero2 kill} "
rm -rf "$W" && mkdir -p "$W" && cd "$W" || exit 1
export NCCL_NVLS_ENABLE=0
source "$HERE/llama_strides.sh"
write_llama_strides "$W"
cat > cfg.yaml <<EOF
name: twonode
seed: 11
trainer:
  max_epochs: -1
  max_steps: 24
  accumulate_grad_batches: 2
  gradient_clip_val: 1.0
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  deterministic: true
  device: auto
  dist_timeout: 20
optimizer: {name: adamw, lr: 0.001}
scheduler: {name: none}
EOF
llama_strides_yaml "$W" >> cfg.yaml
fails=0
check() {  # check NAME CONDITION-EXIT-STATUS DETAIL
  if [ "$2" = 0 ]; then echo "PASS $1 $3"; else echo "FAIL $1 $3"; fails=$((fails + 1)); fi
}
# start_nodes TAG ARGS...: both nodes in the background, each in its own process group (setsid), so
# that a node can be killed whole; their pids in NODE0/NODE1.
start_nodes() {
  local tag=$1; shift
  local port=$((20000 + RANDOM % 20000))
  for n in 0 1; do
    CUDA_VISIBLE_DEVICES=$n NCCL_HOSTID=strobe-node$n setsid python3 -m torch.distributed.run \
      --nnodes 2 --node-rank $n --nproc-per-node 1 --master-addr 127.0.0.1 --master-port $port \
      --no-python "$BIN" fit -c cfg.yaml "$@" > "$tag.node$n.log" 2>&1 &
    eval NODE$n=$!
  done
}
run_nodes() {  # run_nodes TAG ARGS...: returns the sum of both agents' exit statuses
  start_nodes "$@"
  wait $NODE0; local e0=$?; wait $NODE1; local e1=$?
  return $((e0 + e1))
}
for strategy in ddp zero2; do
  [[ $WHAT == *" $strategy "* ]] || continue
  S=(--set trainer.strategy=$strategy)
  t=$(date +%s.%N)
  run_nodes $strategy "${S[@]}" --set trainer.default_root_dir="$W/$strategy/two"; rc_two=$?
  t_two=$(python3 -c "import time;print(round(time.time()-$t,1))")
  "$BIN" fit -c cfg.yaml "${S[@]}" --set data.batch_size=128 --set trainer.default_root_dir="$W/$strategy/one" \
    > $strategy.one.log 2>&1; rc_one=$?
  check "$strategy-fit-exit" $((rc_two + rc_one)) "two nodes: $rc_two (${t_two} s), 1 process: $rc_one"
  line=$(grep '^strobe fit: run directory' $strategy.node0.log $strategy.node1.log)
  check "$strategy-one-fit-line" $([ "$(echo "$line" | grep -c 'cuda:0, 2 processes')" = 1 ] && echo 0 || echo 1) "$line"
  check "$strategy-one-version-dir" $([ "$(ls $strategy/two/twonode | wc -l)" = 1 ] && echo 0 || echo 1) \
    "$(ls $strategy/two/twonode | tr '\n' ' ')"
  python3 - "$W/$strategy/two/twonode/version_0/metrics.csv" "$W/$strategy/one/twonode/version_0/metrics.csv" \
    > $strategy.cmp_val.txt <<'EOF'
import csv, sys
def rows(p):
    return {int(r["step"]): r for r in csv.DictReader(open(p))}
a, b = rows(sys.argv[1]), rows(sys.argv[2])
worst, n = 0.0, 0
for step in sorted(a):
    if a[step].get("val/loss") and b.get(step, {}).get("val/loss"):
        x, y = float(a[step]["val/loss"]), float(b[step]["val/loss"])
        worst, n = max(worst, abs(x - y) / max(abs(y), 1e-12)), n + 1
        print(f"step {step} val/loss: two nodes {x:.9g} 1 process {y:.9g}")
print(f"{n} validations; worst relative difference {worst:.3g}")
sys.exit(0 if n >= 2 and worst < 1e-4 else 1)
EOF
  check "$strategy-val-means-match" $? "$(tr '\n' ';' < $strategy.cmp_val.txt)"

  run_nodes $strategy.part "${S[@]}" --set trainer.max_steps=12 --set trainer.default_root_dir="$W/$strategy/part"; rc1=$?
  run_nodes $strategy.resume "${S[@]}" --ckpt $strategy/part/twonode/version_0/checkpoints/last.ckpt; rc2=$?
  python3 - "$W/$strategy/two/twonode/version_0/metrics.csv" "$W/$strategy/part/twonode/version_0/metrics.csv" \
    > $strategy.cmp_resume.txt <<'EOF'
import csv, sys
def losses(p):
    return {int(r["step"]): r["train/loss"] for r in csv.DictReader(open(p)) if r.get("train/loss")}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
steps = list(range(13, 25))
same = [s for s in steps if s in a and s in b and a[s] == b[s]]
print(f"steps 13..24 with identical train/loss: {len(same)}/{len(steps)}; step 24: {a.get(24)} vs {b.get(24)}")
sys.exit(0 if len(same) == len(steps) else 1)
EOF
  r=$?
  check "$strategy-resume-exact" $((r + rc1 + rc2)) "exits $rc1 $rc2; $(cat $strategy.cmp_resume.txt)"
done

# A node lost mid-run: both train a long run; once node 0 has logged 20 steps, node 1 is killed whole.
if [[ $WHAT == *" kill "* ]]; then
start_nodes kill --set trainer.max_steps=1000000 --set trainer.default_root_dir="$W/kill"
csv=$W/kill/twonode/version_0/metrics.csv
for _ in $(seq 1 600); do
  [ "$(grep -c . "$csv" 2>/dev/null || echo 0)" -gt 20 ] && break
  sleep 0.1
done
steps_before=$(($(grep -c . "$csv" 2>/dev/null || echo 1) - 1))
tree() {  # tree PID: PID and all its descendants (torchrun starts its workers in their own sessions)
  echo "$1"; for c in $(ps -o pid= --ppid "$1"); do tree "$c"; done
}
t=$(date +%s.%N)
kill -9 $(tree $NODE1) 2>/dev/null
for _ in $(seq 1 600); do kill -0 $NODE0 2>/dev/null || break; sleep 0.1; done  # at most 60 s
if kill -0 $NODE0 2>/dev/null; then kill -9 $(tree $NODE0) 2>/dev/null; fi
wait $NODE0; e0=$?
t_end=$(python3 -c "import time;print(round(time.time()-$t,1))")
wait $NODE1 2>/dev/null
why=$(grep -h 'distributed job failed' kill.node0.log | head -1)
ok=1
[ "$e0" != 0 ] && echo "$why" | grep -q 'rank 1' && python3 -c "import sys;sys.exit(0 if $t_end < 20 else 1)" && ok=0
check "lost-node-ends-the-other" $ok "node 1 killed after $steps_before logged steps; node 0 ended in $t_end s with exit $e0: $why"
fi
echo "failed checks: $fails"
exit $fails
