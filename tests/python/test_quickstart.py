"""scripts/quickstart.sh (README, 'Quickstart'): it builds the `strobe` executable alone, trains with
fit's output on the user's terminal (the live progress bar redraws in place, no pipe in between) and
tests the run's best checkpoint, not last.ckpt; in 30 steps the loss goes down and the validation
accuracy passes 0.5; a bad target for scripts/setup.sh is one line, exit 2.
Run under a pseudo-terminal, on 30 steps of the quickstart experiment, in this build directory."""
import csv, os, pty, re, select, subprocess, sys, tempfile, time

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
BUILD = os.environ.get("STROBE_BUILD_DIR", os.path.join(SRC, "build"))
failures = []
if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
    print("SKIP: dataset-fashion-mnist is not installed")
    sys.exit(77)

env = dict(os.environ, STROBE_BUILD_DIR=BUILD, STROBE_VENV=sys.prefix, COLUMNS="120")


def on_terminal(args, timeout=300):
    """Runs args with stdin/stdout/stderr on a new pseudo-terminal; returns (exit code, output)."""
    master, slave = pty.openpty()
    p = subprocess.Popen(args, cwd=SRC, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out, deadline = b"", time.time() + timeout
    while time.time() < deadline:
        r, _, _ = select.select([master], [], [], 1.0)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    if p.poll() is None:
        p.kill()
    os.close(master)
    return p.wait(), out.decode(errors="replace")


with tempfile.TemporaryDirectory() as tmp:
    run = os.path.join(tmp, "run")
    code, out = on_terminal(["bash", "scripts/quickstart.sh", "--run-dir", run,
                             "--set", "trainer.limit_train_batches=30", "--set", "trainer.limit_val_batches=4",
                             "--set", "data.val_size=1000", "--set", "trainer.limit_test_batches=4"])
    if code != 0:
        failures.append(f"quickstart exited {code}:\n{out[-3000:]}")
    if not re.search(r"^setup: building strobe \(", out, re.M):
        failures.append("setup did not build the strobe target alone:\n" + out[:2000])
    redraws = re.findall(r"\r[Ee]poch 0", out)
    if len(redraws) < 2:
        failures.append(f"the progress bar was not redrawn on the terminal ({len(redraws)} draws): fit's output "
                        "does not reach the terminal\n" + out[-3000:])
    best = [f for f in os.listdir(os.path.join(run, "checkpoints")) if f != "last.ckpt"] \
        if os.path.isdir(os.path.join(run, "checkpoints")) else []
    if len(best) != 1:
        failures.append(f"want one top-1 checkpoint beside last.ckpt, found {best}")
    else:
        want = f"quickstart: testing the best checkpoint, {run}/checkpoints/{best[0]}"
        if want not in out or f"strobe test: checkpoint {run}/checkpoints/{best[0]}" not in out:
            failures.append(f"the test did not run on the best checkpoint ({want!r}):\n" + out[-2000:])
    if "test/acc" not in out:
        failures.append("no test/acc line")
    # It learns: the loss of the last logged step below the first's, the validation accuracy above 0.5.
    try:
        with open(os.path.join(run, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
        loss = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
        acc = [float(r["val/acc"]) for r in rows if r.get("val/acc")]
        print(f"quickstart: train/loss {loss[0] if loss else None} -> {loss[-1] if loss else None}, val/acc {acc[-1] if acc else None}")
        if len(loss) < 2 or not loss[-1] < loss[0]:
            failures.append(f"the loss did not go down in 30 steps: {loss}")
        if not acc or not acc[-1] > 0.5:
            failures.append(f"the validation accuracy after 30 steps is not above 0.5: {acc}")
    except (OSError, KeyError, ValueError) as e:
        failures.append(f"{run}/metrics.csv: {e}")

    # setup.sh with a target the build does not have: one line, exit 2, nothing built.
    r = subprocess.run(["bash", "scripts/setup.sh", "no_such_target"], cwd=SRC, env=env, capture_output=True,
                       text=True, timeout=300)
    want = f"setup: 'no_such_target' is not a target of {BUILD} (strobe builds the executable; no target builds everything)"
    if r.returncode != 2 or r.stderr.strip().splitlines() != [want]:
        failures.append(f"setup.sh no_such_target: exit {r.returncode}, stderr {r.stderr!r}; want exit 2 and {want!r}")

for f in failures:
    print("FAIL:", f)
print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
