#!/usr/bin/env bash
# logger.mlflow's cost per step (docs/PERFORMANCE.md, "The MLflow logger"): vit_l16 for STEPS steps
# at log_every_n_steps 1 with the throughput monitor every step, PAIRS times without the logger and
# with it, alternated, against an `mlflow server` on this host (SQLite; started here on PORT unless
# one answers there). Prints each run's mean and median step time over steps 21 on (the throughput
# monitor's throughput/step_ms in metrics.csv) and reads each MLflow run back: its status and
# train/loss values beside metrics.csv's.
# Usage: [CONFIG=configs/vit_l16.yaml] bench/logging/mlflow_overhead.sh STROBE_BIN OUT_DIR [PAIRS] [STEPS] [PORT]
# The server needs `mlflow` importable by python3 (PYTHONPATH is passed through); it runs with
# MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false (no job runner: the tracking API alone).
set -uo pipefail
bin=$1; out=$2; pairs=${3:-3}; steps=${4:-200}; port=${5:-5123}; config=${CONFIG:-configs/vit_l16.yaml}
uri=http://127.0.0.1:$port
mkdir -p "$out"
if ! curl -sf $uri/health > /dev/null; then
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false python3 -m mlflow server --host 127.0.0.1 --port $port --workers 1 \
    --backend-store-uri sqlite:///$out/mlflow.db --artifacts-destination $out/artifacts > $out/server.log 2>&1 &
  for i in $(seq 1 120); do curl -sf $uri/health > /dev/null && break; sleep 0.5; done
  curl -sf $uri/health > /dev/null || { echo "mlflow server did not start:"; tail -20 $out/server.log; exit 1; }
fi
common=(--set trainer.max_epochs=1 --set trainer.limit_train_batches=$steps --set trainer.log_every_n_steps=1
        --set trainer.num_sanity_val_steps=0 --set trainer.limit_val_batches=0 --set trainer.enable_checkpointing=false
        --set "callbacks=[{name: throughput_monitor, every_n_steps: 1}]")
experiment=overhead_$(date +%s)
for i in $(seq 1 $pairs); do
  for mode in plain mlflow; do
    rd=$out/${mode}_$i; rm -rf $rd
    extra=()
    [ $mode = mlflow ] && extra=(--set logger.mlflow.tracking_uri=$uri --set logger.mlflow.experiment_name=$experiment)
    t0=$(date +%s.%N)
    "$bin" fit -c "$config" "${common[@]}" "${extra[@]}" --run-dir $rd > $rd.log 2>&1
    r=$?
    echo "$mode $i: exit $r, process $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')") s; $(grep -E 'finished at step' $rd.log)"
    [ $r -eq 0 ] || { tail -5 $rd.log; exit 1; }
  done
done
python3 - "$out" "$pairs" "$uri" "$experiment" <<'PY'
import csv, statistics as st, sys
out, pairs, uri, experiment = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
means = {}
for mode in ("plain", "mlflow"):
    for i in range(1, pairs + 1):
        rows = list(csv.DictReader(open(f"{out}/{mode}_{i}/metrics.csv")))
        ms = [float(r["throughput/step_ms"]) for r in rows if r.get("throughput/step_ms") and int(r["step"]) > 20]
        means.setdefault(mode, []).append(st.mean(ms))
        print(f"{mode} {i}: steps 21-{rows[-1]['step']}: step_ms mean {st.mean(ms):.3f} median {st.median(ms):.3f} (n {len(ms)})")
p, m = st.mean(means["plain"]), st.mean(means["mlflow"])
print(f"mean of the runs' means: without {p:.3f} ms, with logger.mlflow {m:.3f} ms: {100 * (m / p - 1):+.2f}%")
from mlflow.tracking import MlflowClient
c = MlflowClient(uri)
exp = c.get_experiment_by_name(experiment)
for r in c.search_runs([exp.experiment_id]):
    rd = r.data.tags.get("strobe.run_dir")
    want = [(int(row["step"]), float(row["train/loss"])) for row in csv.DictReader(open(rd + "/metrics.csv")) if row.get("train/loss")]
    got = sorted((h.step, h.value) for h in c.get_metric_history(r.info.run_id, "train/loss"))
    same = len(got) == len(want) and all(a[0] == b[0] and abs(a[1] - b[1]) <= 1e-6 * max(1.0, abs(b[1])) for a, b in zip(got, sorted(want)))
    print(f"MLflow run {r.info.run_name}: {r.info.status}, {len(got)} train/loss values "
          f"({'equal to' if same else 'DIFFERENT FROM'} metrics.csv's {len(want)}), {len(r.data.params)} params")
PY
