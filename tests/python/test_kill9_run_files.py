"""kill -9 at random moments: what a run leaves behind is always usable.

One run directory, 20 trials. Each trial starts `strobe fit` (resuming from checkpoints/last.ckpt
when there is one) and kills it with SIGKILL after a random delay: during start-up, between steps,
in the middle of a checkpoint write, of a metrics.csv or TensorBoard write. After every kill:
  - checkpoints/last.ckpt, if present, loads (`strobe validate --ckpt` exits 0 and names its step T);
  - TensorBoard (its own EventAccumulator, orphaned-data purging on) holds train/loss for every step
    1..T, each once, and metrics.csv holds a row for each of them;
  - no partial checkpoint is taken for a real one (temp files are removed at the next start).
Finally the run is resumed to its end: TensorBoard then holds steps 1..N exactly once, with the
losses of an uninterrupted run (resume is exact on CPU) - the restart markers purged every step
that a killed run had logged after its last checkpoint.
Exit code 77 (skipped) when the tensorboard package is not importable.
"""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:  # pragma: no cover
    print(f"SKIP: tensorboard not importable: {e}")
    sys.exit(77)

TRIALS = 20
STEPS = 400

CONFIG = f"""name: kill9
seed: 3
trainer:
  max_epochs: 1
  max_steps: {STEPS}
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
  device: cpu
logger:
  tensorboard: true
model:
  name: mlp
  in_features: 64
  hidden: [64, 32]
  num_classes: 4
data:
  name: synthetic_images
  image_size: 8
  channels: 1
  num_classes: 4
  num_samples: {STEPS * 8}
  num_val_samples: 8
  batch_size: 8
  num_workers: 1
optimizer:
  name: adamw
  lr: 0.01
scheduler:
  name: cosine
  warmup_steps: 5
callbacks:
  - name: model_checkpoint
    every_n_steps: 7
    save_top_k: 1
"""


def tb_losses(run_dir):
    ea = EventAccumulator(run_dir, size_guidance={"scalars": 0}, purge_orphaned_data=True)
    ea.Reload()
    if "train/loss" not in ea.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in ea.Scalars("train/loss")]


def csv_steps(run_dir):
    path = os.path.join(run_dir, "metrics.csv")
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        lines = f.read().splitlines()[1:]
    return {int(line.split(",")[0]) for line in lines if line}


def main():
    strobe = os.environ.get("STROBE_BIN")
    assert strobe and os.path.exists(strobe), "STROBE_BIN is not set (ctest sets it)"
    rng = random.Random(int(os.environ.get("STROBE_KILL_SEED", "10")))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "kill9.yaml")
        with open(cfg, "w") as f:
            f.write(CONFIG)

        straight = os.path.join(tmp, "straight")
        t0 = time.monotonic()
        subprocess.run([strobe, "fit", "-c", cfg, "--run-dir", straight], check=True, capture_output=True)
        # Kill delays scale with how long a whole run takes on this machine (a fixed range lets fast
        # machines finish before the kill and slow ones die during start-up). A run timed while the
        # machine was busier than during the trials (other tests beside it) would leave the kills
        # too late: each trial whose run finishes first shortens the scale (to 0.3 of the measure).
        duration = measured = time.monotonic() - t0
        reference = dict(tb_losses(straight))
        assert sorted(reference) == list(range(1, STEPS + 1)), "the uninterrupted run is incomplete"

        run = os.path.join(tmp, "run")
        last = os.path.join(run, "checkpoints", "last.ckpt")
        killed_with_ckpt = 0
        for trial in range(TRIALS):
            args = [strobe, "fit", "-c", cfg, "--run-dir", run]
            if os.path.exists(last):
                args += ["--ckpt", last]
            else:
                shutil.rmtree(run, ignore_errors=True)  # nothing to resume: a fresh run
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(max(0.05, rng.uniform(0.05, 0.7) * duration))
            proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate()
            if proc.returncode == 0:
                print(f"trial {trial}: finished before the kill")
                duration = max(0.3 * measured, 0.75 * duration)
                shutil.rmtree(run)  # start again so that later trials still kill a live writer
                continue
            assert proc.returncode == -signal.SIGKILL, (proc.returncode, err.decode())
            if not os.path.exists(last):
                print(f"trial {trial}: killed before the first checkpoint")
                continue
            v = subprocess.run([strobe, "validate", "-c", cfg, "--ckpt", last], capture_output=True, text=True)
            assert v.returncode == 0, f"trial {trial}: last.ckpt does not load: {v.stderr}"
            m = re.search(r"checkpoint \S+ \(step (\d+), epoch \d+\)", v.stdout)
            assert m, v.stdout
            step = int(m.group(1))
            losses = tb_losses(run)
            steps = [s for s, _ in losses]
            assert len(steps) == len(set(steps)), f"trial {trial}: a step shows twice in TensorBoard"
            missing = set(range(1, step + 1)) - set(steps)
            assert not missing, f"trial {trial}: TensorBoard lacks steps {sorted(missing)[:10]} of 1..{step}"
            for s, value in losses:
                if s <= step:
                    assert value == reference[s], f"trial {trial}: step {s} loss {value} != {reference[s]}"
            missing_csv = set(range(1, step + 1)) - csv_steps(run)
            assert not missing_csv, f"trial {trial}: metrics.csv lacks steps {sorted(missing_csv)[:10]}"
            killed_with_ckpt += 1
            print(f"trial {trial}: killed; last.ckpt at step {step} loads, TensorBoard and metrics.csv hold steps 1..{step}")

        # At least a quarter of the trials must have exercised the checks above (a resumed run near
        # the end often finishes before its kill; such trials start the run afresh).
        assert killed_with_ckpt >= TRIALS // 4, f"only {killed_with_ckpt} of {TRIALS} kills came after a checkpoint"
        args = [strobe, "fit", "-c", cfg, "--run-dir", run] + (["--ckpt", last] if os.path.exists(last) else [])
        subprocess.run(args, check=True, capture_output=True)
        losses = tb_losses(run)
        assert [s for s, _ in losses] == list(range(1, STEPS + 1)), [s for s, _ in losses][:20]
        assert all(v == reference[s] for s, v in losses), "the resumed losses differ from the uninterrupted run"
        leftovers = [f for f in os.listdir(os.path.join(run, "checkpoints")) if ".tmp." in f]
        assert not leftovers, leftovers
    print(f"OK: {TRIALS} kills ({killed_with_ckpt} after a checkpoint); every last.ckpt loaded and TensorBoard held every step up to it")


if __name__ == "__main__":
    main()
