"""The docs' recipes run from the repository as written (README, 'Documentation'): the fine-tuning
recipe (docs/MODELS.md), the regression file (docs/CONFIG.md, tensor_file) and the NaN walk-through
(docs/NAN_CAPTURE.md) are read from the docs and run line by line in a folder that holds the
repository's scripts/, configs/ and build/, with a python3 that is not the project's (the scripts
must hand over to its virtual environment themselves). The walk-through runs exactly as written
and must find what it says; the other recipes' trainings are cut to a few batches."""
import os, re, shutil, subprocess, sys, tempfile

SRC = os.path.realpath(os.environ.get("STROBE_SOURCE_DIR", "."))
BUILD = os.environ.get("STROBE_BUILD_DIR", os.path.join(SRC, "build"))
failures = []
if not os.path.exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"):
    print("SKIP: dataset-fashion-mnist is not installed")
    sys.exit(77)
system_python = shutil.which("python3", path="/usr/bin:/bin")
if system_python is None:
    print("SKIP: no python3 in /usr/bin")
    sys.exit(77)

CUT = " --set trainer.max_epochs=1 --set trainer.limit_train_batches=4 --set trainer.limit_val_batches=2 --set trainer.limit_test_batches=2"


def block(doc, first):
    """The commands of the fenced block in docs/DOC whose first line starts with `first`, a
    backslash-continued command joined into one line."""
    text = open(os.path.join(SRC, "docs", doc)).read()
    for body in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        if body.lstrip().startswith(first):
            return [c.strip() for c in body.replace("\\\n", " ").splitlines() if c.strip()]
    failures.append(f"docs/{doc}: no command block starting with {first!r}")
    return []


def run_recipe(name, commands, cut, expect):
    """Runs the commands in a new folder; `expect` maps a command's index to (exit code, text its
    output holds)."""
    with tempfile.TemporaryDirectory() as tmp:
        for d in ("scripts", "configs"):
            os.symlink(os.path.join(SRC, d), os.path.join(tmp, d))
        os.symlink(BUILD, os.path.join(tmp, "build"))
        bindir = os.path.join(tmp, ".bin")
        os.makedirs(bindir)
        os.symlink(system_python, os.path.join(bindir, "python3"))
        env = dict(os.environ, PATH=bindir + ":/usr/bin:/bin", STROBE_VENV=sys.prefix)
        for i, cmd in enumerate(commands):
            if cut and re.match(r"build/bin/strobe (fit|test) ", cmd):
                cmd = re.sub(r"\s+#.*$", "", cmd) + CUT
            r = subprocess.run(["bash", "-c", cmd], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
            code, text = expect.get(i, (0, ""))
            if r.returncode != code or text not in r.stdout + r.stderr:
                failures.append(f"{name}, command {i + 1} `{cmd}`: exit {r.returncode} (want {code}"
                                + (f" and {text!r}" if text else "") + f")\n{(r.stdout + r.stderr)[-2500:]}")
                return


run_recipe("docs/MODELS.md fine-tuning recipe", block("MODELS.md", "python3 scripts/fashion_mnist_tensors.py"), True,
           {0: (0, "train: 30000 images of classes [0, 1, 2, 3, 4]"), 9: (0, "test/acc")})
run_recipe("docs/CONFIG.md regression file", block("CONFIG.md", "python3 scripts/regression_tensors.py"), True,
           {0: (0, "100000 samples"), 1: (0, "val/mse")})
run_recipe("docs/NAN_CAPTURE.md walk-through", block("NAN_CAPTURE.md", "python3 scripts/regression_tensors.py"), False, {
    0: (0, "sample 325's target is 1000"),
    1: (3, "nan_capture: loss spike 31253.5 (mean 9.46667, std 2.55166, z 12244.6) at step 11 (epoch 0, batch 10)"),
    2: (0, "verdict: data"),
    3: (0, "dataset index 325 (train split; row 5 of micro-batch 0)"),
    4: (0, "data.exclude: 1 sample(s) of the training data left out from epoch 1 on (resumed mid-way through epoch 0)"),
})

for f in failures:
    print("FAIL:", f)
print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
