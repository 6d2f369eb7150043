#!/usr/bin/env python3
"""A regression data file for configs/regression_tensor_file.yaml (tensor_file data): `x`, float32
[N, 8] standard normal, and `y`, float32 [N, 1] = x @ w + 0.01 noise, for a fixed seed. --outlier
INDEX=VALUE replaces sample INDEX's target with VALUE: the bad data of docs/NAN_CAPTURE.md's
investigation (a spike caught, diagnosed, bisected to that one sample and quarantined).

    python3 scripts/regression_tensors.py -o datasets/regression.safetensors
    python3 scripts/regression_tensors.py --rows 512 --outlier 325=1000 -o datasets/regression_outlier.safetensors

Draws with torch's CPU generator (seed 0 unless --seed), the same numbers a C++ program gets from
torch::randn after torch::manual_seed. Run with a python3 that lacks torch and safetensors, it runs
itself with the virtual environment scripts/setup.sh makes."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import project_python  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--out", required=True, help="the .safetensors file to write")
    p.add_argument("--rows", type=int, default=100_000, help="samples (default 100000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outlier", action="append", default=[], metavar="INDEX=VALUE",
                   help="set sample INDEX's target to VALUE (repeatable)")
    a = p.parse_args()
    if a.rows < 1:
        p.error(f"--rows {a.rows}: needs at least one sample")
    outliers = []
    for text in a.outlier:
        try:
            index, value = text.split("=")
            outliers.append((int(index), float(value)))
        except ValueError:
            p.error(f"--outlier {text}: expected INDEX=VALUE, e.g. 325=1000")
        if not 0 <= outliers[-1][0] < a.rows:
            p.error(f"--outlier {text}: index {outliers[-1][0]} is not a sample of {a.rows}")
    project_python.require("torch", "safetensors")
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(a.seed)
    x = torch.randn(a.rows, 8)
    y = x.mm(torch.randn(8, 1)) + 0.01 * torch.randn(a.rows, 1)
    for index, value in outliers:
        y[index][0] = value
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    save_file({"x": x, "y": y}, a.out + ".tmp")
    os.replace(a.out + ".tmp", a.out)  # whole or not at all
    print(f"{a.out}: {a.rows} samples (x [{a.rows}, 8], y [{a.rows}, 1])"
          + "".join(f"; sample {i}'s target is {v:g}" for i, v in outliers))


if __name__ == "__main__":
    main()
