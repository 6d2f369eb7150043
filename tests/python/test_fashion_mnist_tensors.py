"""scripts/fashion_mnist_tensors.py (docs/MODELS.md, "Fine-tuning recipe, offline"): the files it writes
hold exactly the chosen classes' images of Debian's dataset-fashion-mnist, in their order, as float32
[N, 1, 28, 28] = bytes / 255, with labels renumbered from 0 in the order the classes were given, for
the train and the test split. numpy and safetensors come from scripts/setup.sh's venv: without them,
or without the dataset, this test is skipped (exit 77) on a developer machine and fails under CI."""
import gzip
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    from safetensors.numpy import load_file
except ImportError as e:
    print(f"test_fashion_mnist_tensors: {e}")
    sys.exit(1 if os.environ.get("CI") else 77)

ROOT = "/usr/share/datasets/fashion-mnist"
if not os.path.exists(os.path.join(ROOT, "t10k-labels-idx1-ubyte.gz")):
    print(f"test_fashion_mnist_tensors: {ROOT} is missing (scripts/setup.sh installs dataset-fashion-mnist)")
    sys.exit(1 if os.environ.get("CI") else 77)

SRC = os.environ.get("STROBE_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def idx(path, header):
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=header)


failures = []
with tempfile.TemporaryDirectory(prefix="strobe-fmnist-") as out:
    r = subprocess.run([sys.executable, os.path.join(SRC, "scripts", "fashion_mnist_tensors.py"), "--classes", "9,7",
                        "-o", out], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        failures.append(f"the script failed: {r.stderr.strip()}")
    else:
        for split, prefix in (("train", "train"), ("test", "t10k")):
            images = idx(os.path.join(ROOT, f"{prefix}-images-idx3-ubyte.gz"), 16).reshape(-1, 28, 28)
            labels = idx(os.path.join(ROOT, f"{prefix}-labels-idx1-ubyte.gz"), 8)
            keep = (labels == 9) | (labels == 7)
            got = load_file(os.path.join(out, f"{split}.safetensors"))
            x, y = got["x"], got["y"]
            if x.dtype != np.float32 or x.shape != (int(keep.sum()), 1, 28, 28):
                failures.append(f"{split}: x {x.dtype} {x.shape}, want float32 ({int(keep.sum())}, 1, 28, 28)")
                continue
            if not np.array_equal(x[:, 0], images[keep].astype(np.float32) / 255.0):
                failures.append(f"{split}: x is not the chosen images / 255 in their order")
            if y.dtype != np.int64 or not np.array_equal(y, np.where(labels[keep] == 9, 0, 1)):
                failures.append(f"{split}: y is not the labels renumbered in the given order (9 -> 0, 7 -> 1)")
for f in failures:
    print("FAIL:", f)
print(f"test_fashion_mnist_tensors: {len(failures)} failures")
sys.exit(1 if failures else 0)
