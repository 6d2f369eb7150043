#!/usr/bin/env bash
# GPU check of `strobe fit` launched by torchrun on 2 GPUs (NCCL), run by hand on a 2-GPU machine:
#   bash tests/gpu_distributed/torchrun_fit_check.sh build/bin/strobe OUT_DIR [mlp|llama]
# mlp (the default): an MLP on synthetic images. llama: a llama (GQA 4 heads over 2, tied embeddings,
# math attention) on windows of a learnable token file (documents with a stride, written here), so
# the validation loss tells weights apart; every window is full length, as the union-batch
# equivalence needs (each rank's mean is over the same number of tokens).
# 1. 2 ranks x batch 64 vs 1 process x batch 128, 24 steps (2 micro-batches, clipping, an epoch
#    boundary with validation): the validation means match, and `strobe validate` of both final
#    checkpoints (on one GPU) gives the same loss: the same parameters.
# 2. Only rank 0 prints and writes: one "strobe fit:" line, one version directory.
# 3. Resume: a 2-rank run stopped at step 12 and resumed to 24 logs the same per-step losses
#    (metrics.csv, 9 digits) for steps 13..24 as the uninterrupted run.
# 4. NaN stop: a learning rate that overflows the weights stops both ranks with exit 3; each rank
#    writes its capture (ranks started with plain env:// variables, to read each exit status).
# Prints PASS/FAIL per check; exits non-zero if any failed.
set -uo pipefail
HERE=$(dirname "$(realpath "${BASH_SOURCE[0]}")")  # before any cd
BIN=$(realpath "$1")
WHAT=${3:-mlp}
W=$(realpath -m "$2")/ddp-$WHAT
rm -rf "$W" && mkdir -p "$W" && cd "$W" || exit 1
export NCCL_NVLS_ENABLE=0
TR=(python3 -m torch.distributed.run --nproc-per-node=2 --no-python "$BIN")
cat > cfg.yaml <<'EOF'
name: ddp
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
  dist_timeout: 60
optimizer: {name: adamw, lr: 0.001, fused: false}  # this check builds without our CUDA kernels
scheduler: {name: none}
EOF
if [ "$WHAT" = llama ]; then
  source "$HERE/llama_strides.sh"
  write_llama_strides "$W"
  llama_strides_yaml "$W" >> cfg.yaml
else
  cat >> cfg.yaml <<'EOF'
model: {name: mlp, in_features: 768, hidden: [512, 256], num_classes: 10, dropout: 0.0}
data: {name: synthetic_images, image_size: 16, channels: 3, num_classes: 10, num_samples: 2048,
       num_val_samples: 512, noise: 2.0, batch_size: 64, num_workers: 2}
EOF
fi
fails=0
check() {  # check NAME CONDITION-EXIT-STATUS DETAIL
  if [ "$2" = 0 ]; then echo "PASS $1 $3"; else echo "FAIL $1 $3"; fails=$((fails + 1)); fi
}
t=$(date +%s.%N)
"${TR[@]}" fit -c cfg.yaml --set trainer.default_root_dir="$W/two" > two.log 2>&1; rc_two=$?
t_two=$(python3 -c "import time;print(round(time.time()-$t,1))")
"$BIN" fit -c cfg.yaml --set data.batch_size=128 --set trainer.default_root_dir="$W/one" > one.log 2>&1; rc_one=$?
check "fit-exit" $(( rc_two + rc_one )) "2 ranks: $rc_two (${t_two} s), 1 process: $rc_one"
check "one-fit-line" $([ "$(grep -c '^strobe fit: run directory' two.log)" = 1 ] && echo 0 || echo 1) \
  "$(grep '^strobe fit: run directory' two.log | head -2 | tr '\n' ' ')"
check "one-version-dir" $([ "$(ls two/ddp | wc -l)" = 1 ] && echo 0 || echo 1) "$(ls two/ddp | tr '\n' ' ')"
python3 - "$W/two/ddp/version_0/metrics.csv" "$W/one/ddp/version_0/metrics.csv" > cmp_val.txt <<'EOF'
import csv, sys
def rows(p):
    return {int(r["step"]): r for r in csv.DictReader(open(p))}
a, b = rows(sys.argv[1]), rows(sys.argv[2])
worst = 0.0
for step in sorted(a):
    for k in ("val/loss", "val/acc", "val/f1"):
        if a[step].get(k) and b.get(step, {}).get(k):
            x, y = float(a[step][k]), float(b[step][k])
            worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
            print(f"step {step} {k}: 2 ranks {x:.9g} 1 process {y:.9g}")
found = any(a[s].get("val/loss") for s in a)
print(f"worst relative difference {worst:.3g} (validation rows found: {found})")
sys.exit(0 if found and worst < 1e-4 else 1)
EOF
check "val-means-match" $? "$(tail -1 cmp_val.txt)"
"$BIN" validate -c cfg.yaml --ckpt two/ddp/version_0/checkpoints/last.ckpt > val_two.log 2>&1
"$BIN" validate -c cfg.yaml --ckpt one/ddp/version_0/checkpoints/last.ckpt > val_one.log 2>&1
a=$(awk '$1=="val/loss"{print $2}' val_two.log); b=$(awk '$1=="val/loss"{print $2}' val_one.log)
python3 -c "import sys;a,b=float('$a' or 'nan'),float('$b' or 'nan');sys.exit(0 if abs(a-b)<=1e-4*abs(b) else 1)"
check "params-match" $? "val/loss of the final weights: 2 ranks $a, 1 process $b"

"${TR[@]}" fit -c cfg.yaml --set trainer.max_steps=12 --set trainer.default_root_dir="$W/part" > part.log 2>&1; rc1=$?
"${TR[@]}" fit -c cfg.yaml --ckpt part/ddp/version_0/checkpoints/last.ckpt > resume.log 2>&1; rc2=$?
python3 - "$W/two/ddp/version_0/metrics.csv" "$W/part/ddp/version_0/metrics.csv" > cmp_resume.txt <<'EOF'
import csv, sys
def losses(p):
    return {int(r["step"]): r["train/loss"] for r in csv.DictReader(open(p)) if r.get("train/loss")}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
steps = [s for s in range(13, 25)]
same = [s for s in steps if s in a and s in b and a[s] == b[s]]
print(f"steps 13..24 with identical train/loss: {len(same)}/{len(steps)}; step 24: {a.get(24)} vs {b.get(24)}")
sys.exit(0 if len(same) == len(steps) else 1)
EOF
r=$?
check "resume-exact" $(( r + rc1 + rc2 )) "exits $rc1 $rc2; $(cat cmp_resume.txt)"

# Launched without torchrun (plain env:// variables) so that each rank's own exit status is seen:
# torchrun stops the other workers as soon as one exits non-zero.
port=$((20000 + RANDOM % 20000)); pids=()
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$BIN" fit -c cfg.yaml \
    --set optimizer.lr=1e30 --set trainer.default_root_dir="$W/nan" \
    --set 'callbacks=[{name: nan_capture, keep_last: 2}]' > nan$r.log 2>&1 &
  pids+=($!)
done
wait ${pids[0]}; e0=$?; wait ${pids[1]}; e1=$?
caps="$(ls -d nan/ddp/version_0/nan/step_* nan/ddp/version_0/nan/rank1/step_* 2>/dev/null | tr '\n' ' ')"
ok=1
[ "$e0" = 3 ] && [ "$e1" = 3 ] && [ "$(echo $caps | wc -w)" = 2 ] && ok=0
check "nan-stop" $ok "exit codes: rank 0 $e0, rank 1 $e1; captures: $caps; lines on rank 1: $(grep -c . nan1.log)"
grep -h "nan_capture:" nan0.log | head -3
echo "failed checks: $fails"
exit $fails
