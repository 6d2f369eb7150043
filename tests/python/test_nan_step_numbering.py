"""One step numbering everywhere, for one injected fault.

The seed's NaN workload (configs/cpu/resnet50_nan.yaml: per-class BCE divided by each class's count,
+Inf when a class is missing from a batch) goes non-finite at some step N. Every place that names
that step must say N: the console line, the capture directory nan/step_N and its summary.txt and
record, the end-of-fit summary, the metrics.csv row holding the inf loss, TensorBoard's step of that
value, and `strobe replay`'s report. With `action: skip_step`, `train/skipped_steps` first appears in
row N (metrics.csv and TensorBoard) and the console names step N.
Exit code 77 (skipped) when the tensorboard package is not importable.
"""
import csv
import json
import math
import os
import re
import subprocess
import sys
import tempfile

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:  # pragma: no cover
    print(f"SKIP: tensorboard not importable: {e}")
    sys.exit(77)


def csv_column(run_dir, column):
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        return {int(r["step"]): float(r[column]) for r in csv.DictReader(f) if r.get(column)}


def tb_scalars(run_dir, tag):
    ea = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    ea.Reload()
    assert tag in ea.Tags()["scalars"], f"{tag} not in TensorBoard: {ea.Tags()['scalars']}"
    return {e.step: e.value for e in ea.Scalars(tag)}


def fit(strobe, config, run_dir, *sets):
    args = [strobe, "fit", "-c", config, "--run-dir", run_dir, "--set", "trainer.enable_progress_bar=false",
            "--set", "logger.tensorboard=true"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True)


def main():
    strobe = os.environ.get("STROBE_BIN")
    source = os.environ.get("STROBE_SOURCE_DIR")
    assert strobe and os.path.exists(strobe) and source, "STROBE_BIN / STROBE_SOURCE_DIR are not set (ctest sets them)"
    config = os.path.join(source, "configs", "cpu", "resnet50_nan.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        # --- action: stop ---
        run = os.path.join(tmp, "stop")
        r = fit(strobe, config, run)
        assert r.returncode == 3, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        m = re.search(r"nan_capture: non-finite [a-z ]+ at step (\d+) \(epoch 0, batch (\d+)\)", r.stderr)
        assert m, r.stderr
        n = int(m.group(1))
        assert n >= 2, f"the fault should come after a few finite steps, got step {n}"
        assert int(m.group(2)) == n - 1, "the batch index within the epoch is 0-based: step N is batch N - 1 of epoch 0"
        assert f"capture written to {run}/nan/step_{n}\n" in r.stderr, r.stderr
        assert f"strobe fit: stopped by the NaN capture at step {n}," in r.stdout, r.stdout
        assert os.listdir(os.path.join(run, "nan")) == [f"step_{n}"], os.listdir(os.path.join(run, "nan"))
        with open(os.path.join(run, "nan", f"step_{n}", "summary.txt")) as f:
            summary = f.read()
        assert f" at step {n} (epoch 0, batch {n - 1} of the epoch)" in summary, summary

        loss = csv_column(run, "train/loss")
        assert sorted(loss) == list(range(1, n + 1)), f"metrics.csv rows {sorted(loss)}"
        assert all(math.isfinite(loss[s]) for s in range(1, n)), loss
        assert not math.isfinite(loss[n]), f"row {n} should hold the non-finite loss: {loss}"
        tb = tb_scalars(run, "train/loss")
        assert sorted(tb) == list(range(1, n + 1)), f"TensorBoard steps {sorted(tb)}"
        assert all(math.isfinite(tb[s]) for s in range(1, n)) and not math.isfinite(tb[n]), tb

        report_path = os.path.join(tmp, "report.json")
        rep = subprocess.run([strobe, "replay", os.path.join(run, "nan"), "--report", report_path], capture_output=True, text=True)
        assert rep.returncode == 0, rep.stdout + rep.stderr
        with open(report_path) as f:
            report = json.load(f)
        assert report["step"] == n, report["step"]
        assert f"\n  step {n} (epoch 0, batch {n - 1} of the epoch)" in rep.stdout, rep.stdout

        # --- action: skip_step: the skipped step's own row ---
        run = os.path.join(tmp, "skip")
        r = fit(strobe, config, run, "callbacks=[{name: nan_capture, action: skip_step}]", f"trainer.max_steps={n + 1}")
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        assert re.search(rf"nan_capture: non-finite [a-z ]+ at step {n} \(epoch 0, batch {n - 1}\): step skipped \(1 so far\)", r.stderr), r.stderr
        skipped = csv_column(run, "train/skipped_steps")
        assert min(skipped) == n and skipped[n] == 1.0, f"train/skipped_steps rows {skipped}"
        tb = tb_scalars(run, "train/skipped_steps")
        assert min(tb) == n and tb[n] == 1.0, f"TensorBoard train/skipped_steps {tb}"
    print(f"step numbering: the fault at step {n} is step {n} on the console, in nan/step_{n}, summary.txt, the fit summary, "
          f"metrics.csv, TensorBoard and replay; skip_step logs it in row {n}")


if __name__ == "__main__":
    main()
