"""Python side of the metrics benchmark (issue 4): resnet18, batch 128, 1000 classes, bf16 autocast,
SGD, on the GPU. Step time without metrics, with TorchMetrics used naively (as in the seed article:
MeanMetric(loss) with its default weight and NaN check, multiclass Accuracy/Precision/Recall/F1,
compute + .item() every `--log-every` steps), and with TorchMetrics used carefully (weight tensor,
nan_strategy="disable"). Modes are interleaved in rounds and the median per mode is reported, so
the numbers are comparable side by side; the C++ `strobe bench` prints its own numbers in the same
call (see docs/PERFORMANCE.md). Also counts host-device synchronizations per step with
torch.cuda.set_sync_debug_mode("warn").

  python bench/metrics/torchmetrics_baseline.py [--steps 200] [--rounds 3] [--json out.json]
  python bench/metrics/torchmetrics_baseline.py --device cpu --batch 4 --steps 2 --rounds 1   # smoke
"""
import argparse
import json
import statistics
import sys
import time
import warnings

import torch
import torchvision

try:
    import torchmetrics
    from torchmetrics import MeanMetric
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score, MulticlassPrecision, MulticlassRecall
except ImportError as e:
    print(f"torchmetrics is required: {e}", file=sys.stderr)
    sys.exit(2)


def make_metrics(device, classes, careful):
    kw = {"nan_strategy": "disable"} if careful else {}
    return {
        "avg_loss": MeanMetric(**kw).to(device),
        "accuracy": MulticlassAccuracy(num_classes=classes).to(device),
        "precision": MulticlassPrecision(num_classes=classes).to(device),
        "recall": MulticlassRecall(num_classes=classes).to(device),
        "f1_score": MulticlassF1Score(num_classes=classes).to(device),
    }


def run(mode, model, opt, data, target, args, count_syncs=False):
    device = data.device
    metrics = None if mode == "none" else make_metrics(device, args.classes, careful=(mode == "careful"))
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    criterion = torch.nn.CrossEntropyLoss()
    syncs = 0

    def step(i):
        opt.zero_grad(set_to_none=True)
        with amp:
            out = model(data)
            loss = criterion(out, target)
        loss.backward()
        opt.step()
        if metrics is not None:
            if mode == "careful":
                metrics["avg_loss"].update(loss.detach(), weight=torch.ones_like(loss))
            else:
                metrics["avg_loss"].update(loss.detach())
            for name, m in metrics.items():
                if name != "avg_loss":
                    m.update(out.detach(), target)
            if (i + 1) % args.log_every == 0:
                _ = {name: m.compute().item() for name, m in metrics.items()}
                for m in metrics.values():
                    m.reset()

    for i in range(args.warmup):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if count_syncs and device.type == "cuda":
        # Count synchronizations over a window that contains no logging step.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            window = [i for i in range(args.warmup, args.warmup + 11) if (i + 1) % args.log_every != 0][:10]
            for i in window:
                step(i)
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught) / 10.0
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / args.steps * 1e3, syncs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--json", help="write the results here as JSON")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible; use --device cpu for a smoke run", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet18(num_classes=args.classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = torch.randn(args.batch, 3, 224, 224, device=device)
    target = torch.arange(args.batch, device=device) % args.classes

    modes = ["none", "naive", "careful"]
    times = {m: [] for m in modes}
    syncs = {}
    for r in range(args.rounds):
        for m in modes:
            ms, s = run(m, model, opt, data, target, args, count_syncs=(r == 0))
            times[m].append(ms)
            if r == 0:
                syncs[m] = s
    base = statistics.median(times["none"])
    result = {
        "workload": f"resnet18 b{args.batch} {args.classes} classes {'bf16-mixed' if args.bf16 else 'fp32'}",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "torchmetrics": torchmetrics.__version__,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "modes": {
            m: {"step_ms_median": statistics.median(times[m]), "step_ms_rounds": times[m],
                "overhead_pct": (statistics.median(times[m]) / base - 1) * 100, "syncs_per_step": syncs.get(m)}
            for m in modes
        },
    }
    for m in modes:
        r = result["modes"][m]
        print(f"python {m:8s} {r['step_ms_median']:8.3f} ms/step  overhead {r['overhead_pct']:+6.2f}%  "
              f"syncs/step {r['syncs_per_step']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
