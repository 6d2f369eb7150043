#!/usr/bin/env python3
"""Fashion-MNIST classes as tensor_file data (docs/MODELS.md, "Fine-tuning"): the images of the chosen
classes from Debian's dataset-fashion-mnist, as float32 [N, 1, 28, 28] in [0, 1] (`x`) with their
labels renumbered from 0 in the order given (`y`), written to OUT/train.safetensors and
OUT/test.safetensors.

    python3 scripts/fashion_mnist_tensors.py --classes 0-4 -o datasets/fmnist_0_4
    python3 scripts/fashion_mnist_tensors.py --classes 5-9 -o datasets/fmnist_5_9

Needs numpy and safetensors: run with a python3 that lacks them, it runs itself with the virtual
environment scripts/setup.sh makes."""
import argparse
import gzip
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import project_python  # noqa: E402

project_python.require("numpy", "safetensors")
import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    dims = magic & 0xFF
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def parse_classes(text):
    if "-" in text:
        a, b = (int(v) for v in text.split("-"))
        return list(range(a, b + 1))
    return [int(v) for v in text.split(",")]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--classes", required=True, help="e.g. 0-4 or 5,6,7")
    p.add_argument("-o", "--out", required=True)
    a = p.parse_args()
    classes = parse_classes(a.classes)
    if not classes or any(c < 0 or c > 9 for c in classes):
        sys.exit(f"--classes {a.classes}: expected Fashion-MNIST classes 0-9")
    os.makedirs(a.out, exist_ok=True)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = read_idx(os.path.join(a.root, f"{prefix}-images-idx3-ubyte.gz"))
        labels = read_idx(os.path.join(a.root, f"{prefix}-labels-idx1-ubyte.gz"))
        keep = np.isin(labels, classes)
        remap = np.zeros(10, dtype=np.int64)
        remap[classes] = np.arange(len(classes))
        x = (images[keep].astype(np.float32) / 255.0)[:, None, :, :]
        y = remap[labels[keep]]
        out = os.path.join(a.out, f"{split}.safetensors")
        save_file({"x": np.ascontiguousarray(x), "y": y}, out + ".tmp")
        os.replace(out + ".tmp", out)  # whole or not at all
        print(f"{split}: {len(y)} images of classes {classes} -> {os.path.join(a.out, split + '.safetensors')}")


if __name__ == "__main__":
    main()
