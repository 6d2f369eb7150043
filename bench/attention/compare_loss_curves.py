"""Training with `attention: custom` against `attention: sdpa`: the same config, seed and data,
N optimizer steps each, loss logged every step; prints both curves and their largest difference.

  python bench/attention/compare_loss_curves.py BUILD_DIR CONFIG STEPS [--set KEY=VALUE]...

Writes $OUT/loss_curves_<config name>.json (or /tmp).
"""
import csv, json, os, subprocess, sys, tempfile


def run(build, config, steps, backend, extra, root):
    run_dir = os.path.join(root, backend)
    cmd = [os.path.join(build, "bin", "strobe"), "fit", "-c", config, "--run-dir", run_dir,
           "--set", f"trainer.max_steps={steps}", "--set", "trainer.log_every_n_steps=1",
           "--set", "trainer.num_sanity_val_steps=0",
           "--set", f"model.attention={backend}"] + extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:])
        raise SystemExit(f"{backend}: exit {p.returncode}")
    with open(os.path.join(run_dir, "metrics.csv")) as fh:
        rows = list(csv.DictReader(fh))
    key = next(k for k in rows[0] if k.startswith("train") and "loss" in k)
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key) not in (None, "")}, key


def main():
    build, config, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = sys.argv[4:]
    root = tempfile.mkdtemp(prefix="curves_")
    a, key = run(build, config, steps, "sdpa", extra, root)
    b, _ = run(build, config, steps, "custom", extra, root)
    common = sorted(set(a) & set(b))
    diffs = [abs(a[s] - b[s]) for s in common]
    print(f"{config}: {key}, {len(common)} common steps")
    for s in common:
        print(f"  step {s:4d}  sdpa {a[s]:.5f}  custom {b[s]:.5f}  diff {a[s] - b[s]:+.2e}")
    rel = max(d / max(abs(a[s]), 1e-12) for d, s in zip(diffs, common))
    print(f"max |diff| {max(diffs):.3e}, max relative {rel:.3e}")
    name = os.path.splitext(os.path.basename(config))[0]
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"loss_curves_{name}.json"), "w") as fh:
        json.dump({"config": config, "steps": steps, "metric": key, "sdpa": a, "custom": b,
                   "max_abs_diff": max(diffs), "max_rel_diff": rel}, fh, indent=1)


if __name__ == "__main__":
    main()
