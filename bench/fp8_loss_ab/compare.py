"""Compares the two runs of run.sh: the training loss smoothed over the last 100 steps of each, their
relative difference (the bar: within 1.5%), the validation losses, whether either run captured a
spike or a NaN, the epochs trained (steps x batch / the training file's documents), and the two
curves (a 10-step moving average of the logged losses) in one SVG: OUT/fp8_loss_ab.svg.
Usage: python3 bench/fp8_loss_ab/compare.py OUT DATA_DIR"""
import array
import csv
import json
import os
import sys

out, data = sys.argv[1], sys.argv[2]
tokens = array.array("H")
with open(os.path.join(data, "train.bin"), "rb") as f:
    tokens.frombytes(f.read())
documents = tokens.count(0)  # every document ends with <eot>, token 0


def batch_size(run):
    with open(os.path.join(out, run, "config.yaml")) as f:
        lines = f.read().splitlines()
    section = None
    for line in lines:
        if line and not line.startswith(" "):
            section = line.rstrip(":")
        elif section == "data" and line.strip().startswith("batch_size:"):
            return int(line.split(":")[1])
    raise SystemExit(f"no data.batch_size in {run}/config.yaml")


def series(run, col):
    rows = {}
    with open(os.path.join(out, run, "metrics.csv")) as f:
        for r in csv.DictReader(f):
            if r.get(col):
                rows[int(r["step"])] = float(r[col])
    return sorted(rows.items())


def smooth(points, k):
    out_pts = []
    for i in range(len(points)):
        w = [v for _, v in points[max(0, i - k + 1):i + 1]]
        out_pts.append((points[i][0], sum(w) / len(w)))
    return out_pts


res = {}
curves = {}
for run in ("bf16", "fp8"):
    loss = series(run, "train/loss")
    last = [v for s, v in loss if s > loss[-1][0] - 100]
    val = series(run, "val/loss")
    captures = os.listdir(os.path.join(out, run, "nan")) if os.path.isdir(os.path.join(out, run, "nan")) else []
    steps = loss[-1][0]
    res[run] = {"steps": steps, "batch_size": batch_size(run),
                "epochs": round(steps * batch_size(run) / documents, 2),
                "final_smoothed_train_loss": sum(last) / len(last),
                "val_loss": val[-1][1] if val else None, "captures": captures}
    curves[run] = smooth(loss, 10)
a, b = res["bf16"]["final_smoothed_train_loss"], res["fp8"]["final_smoothed_train_loss"]
res["relative_difference"] = (b - a) / a
res["within_1.5%"] = abs(b - a) / a <= 0.015 and not res["bf16"]["captures"] and not res["fp8"]["captures"]
print(json.dumps(res, indent=1))
json.dump(res, open(os.path.join(out, "fp8_loss_ab.json"), "w"), indent=1)

# The SVG: both curves, step on x, loss on y.
W, H, L, B = 720, 420, 60, 40
pts = [p for c in curves.values() for p in c]
x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
sx = lambda x: L + (x - x0) / (x1 - x0) * (W - L - 20)
sy = lambda y: H - B - (y - y0) / (y1 - y0) * (H - B - 20)
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="black"/>',
       f'<line x1="{L}" y1="20" x2="{L}" y2="{H - B}" stroke="black"/>']
for i in range(6):
    y = y0 + (y1 - y0) * i / 5
    svg.append(f'<text x="{L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
    x = x0 + (x1 - x0) * i / 5
    svg.append(f'<text x="{sx(x):.1f}" y="{H - B + 16}" text-anchor="middle">{int(x)}</text>')
svg.append(f'<text x="{(W + L) / 2}" y="{H - 6}" text-anchor="middle">optimizer step</text>')
svg.append(f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">training loss (10-step mean)</text>')
for (run, c), color in zip(curves.items(), ("#1f77b4", "#d62728")):
    d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in c)
    svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{d}"/>')
    label = "bf16-master" if run == "bf16" else "bf16-master + trainer.fp8 (every projection)"
    k = list(curves).index(run)
    svg.append(f'<text x="{W - 30}" y="{40 + 16 * k}" text-anchor="end" fill="{color}">{label}: final {res[run]["final_smoothed_train_loss"]:.4f}</text>')
svg.append("</svg>")
open(os.path.join(out, "fp8_loss_ab.svg"), "w").write("\n".join(svg))
