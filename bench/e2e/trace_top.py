#!/usr/bin/env python3
"""Where the GPU time of a training step goes, from a Kineto trace (strobe fit --profile, or
torch.profiler's export_chrome_trace).

  python3 bench/e2e/trace_top.py TRACE.json [--top 30] [--json OUT.json]

Sums the device-side events (kernels, memcpy, memset) that fall inside the trace's ProfilerStep#N
ranges, per step (mean over the profiled steps), by kernel name and by category (gemm, attention,
conv, norm, elementwise, reduce, optimizer, copy/cast, memcpy, other). The categories are a
name-based guess: read the top kernels to check them.
"""
import argparse
import collections
import json
import re
import sys

CATEGORIES = [
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("optimizer", r"multi_tensor|adam|sgd|foreach|fused_optim|nonfinite"),
    # trainer.fp8's quantization (strobe::fp8_quantize: the amax pass and the cast with its transpose),
    # before the GEMMs and casts its kernel names would otherwise fall under
    ("float8 cast", r"fp8_kernels|amax_kernel|amax_v2_kernel|cast_kernel|cast_v2_kernel"),
    ("gemm", r"gemm|sm90_xmma|cutlass|cublas|nvjet|matmul|wgmma|xmma_gemm|splitk"),
    ("conv", r"conv|implicit|winograd|dgrad|wgrad|fprop|cudnn|nchwToNhwc|nhwcToNchw"),
    ("norm", r"layer_norm|layernorm|batch_norm|batchnorm|bn_|welford|LayerNorm|BatchNorm"),
    ("copy/cast", r"copy|cast|to_copy|contiguous|transpose|permute|cat_|CatArray|index"),
    ("reduce", r"reduce|sum|mean|norm_kernel|nll|cross_entropy|log_softmax|max_pool|avg_pool|pool"),
    ("elementwise", r"elementwise|vectorized|gelu|relu|add|mul|fill|where|dropout|silu|unrolled"),
]


def category(name: str) -> str:
    for cat, pat in CATEGORIES:
        if re.search(pat, name, re.IGNORECASE):
            return cat
    return "other"


def who(events, pat, n):
    """Which CPU ops launched the kernels matching pat: innermost aten op around the launch plus
    its two outer ops, with the innermost op's input dims and strides."""
    import bisect
    ops_by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            ops_by_tid[e.get("tid")].append(e)
    for v in ops_by_tid.values():
        v.sort(key=lambda e: e["ts"])
    starts_by_tid = {tid: [o["ts"] for o in v] for tid, v in ops_by_tid.items()}
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime":
            c = e.get("args", {}).get("correlation")
            if c is not None:
                launches[c] = e
    stacks = collections.Counter()
    dur = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel" or pat not in e.get("name", ""):
            continue
        l = launches.get(e.get("args", {}).get("correlation"))
        if l is None:
            continue
        ops = ops_by_tid.get(l.get("tid"), [])
        i = bisect.bisect_right(starts_by_tid.get(l.get("tid"), []), l["ts"])
        chain = [o for o in ops[:i] if o["ts"] <= l["ts"] <= o["ts"] + o["dur"]]
        chain.sort(key=lambda o: o["dur"])  # innermost first
        if not chain:
            continue
        inner = chain[0]
        args = inner.get("args", {})
        key = " <- ".join(o["name"] for o in chain[:4]) + f"  dims={args.get('Input Dims')} strides={args.get('Input Strides')}"
        stacks[key] += 1
        dur[key] += e["dur"]
    print(f"\nlaunchers of kernels containing '{pat}' (ms/step, calls/step):")
    for k, v in dur.most_common(12):
        print(f"{v / n / 1000:>9.3f}{stacks[k] // n:>6}  {k[:400]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--who", action="append", default=[],
                    help="for kernels whose name contains this, list the launching ops (with input "
                         "dims/strides when the trace was recorded with record_shapes: true)")
    a = ap.parse_args()
    with open(a.trace) as f:
        tr = json.load(f)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    # the host-side ProfilerStep#N ranges (Kineto also writes GPU-side copies of the annotations)
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
             and not str(e.get("cat", "")).startswith("gpu_")]
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not dev:
        print(f"{a.trace}: no device events (a CPU run?)", file=sys.stderr)
        return 1
    # device events are matched to steps through their launching runtime call's correlation id
    corr_ts = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = e.get("args", {}).get("correlation")
            if c is not None:
                corr_ts[c] = e["ts"]
    steps.sort(key=lambda e: e["ts"])

    def step_of(ts):
        for s in steps:
            if s["ts"] <= ts <= s["ts"] + s["dur"]:
                return s["name"]
        return None

    by_name = collections.Counter()
    count = collections.Counter()
    per_step = collections.Counter()
    used = 0
    for e in dev:
        launch = corr_ts.get(e.get("args", {}).get("correlation"), e["ts"])
        s = step_of(launch) if steps else "all"
        if s is None:
            continue
        name = e["name"] if e.get("cat") == "kernel" else e.get("cat")
        by_name[name] += e["dur"]
        count[name] += 1
        per_step[s] += e["dur"]
        used += 1
    n = max(1, len({s["name"] for s in steps}) if steps else 1)
    total = sum(by_name.values()) / n / 1000.0
    cats = collections.Counter()
    for k, v in by_name.items():
        cats["memcpy/memset" if k in ("gpu_memcpy", "gpu_memset") else category(k)] += v
    wall = [s["dur"] / 1000.0 for s in steps]
    print(f"{a.trace}: {n} steps, {used} device events; GPU busy {total:.2f} ms/step"
          + (f"; step wall (host ranges) {', '.join(f'{w:.1f}' for w in wall)} ms" if wall else ""))
    print(f"{'category':<16}{'ms/step':>10}{'share':>8}")
    for k, v in cats.most_common():
        print(f"{k:<16}{v / n / 1000:>10.2f}{100 * v / max(1, sum(cats.values())):>7.1f}%")
    print(f"\n{'ms/step':>9}{'calls':>7}  kernel (top {a.top})")
    for k, v in by_name.most_common(a.top):
        print(f"{v / n / 1000:>9.3f}{count[k] // n:>7}  [{category(k)}] {k[:150]}")
    for pat in a.who:
        who(events, pat, n)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "steps": len(per_step), "gpu_ms_per_step": total,
                       "categories": {k: v / n / 1000 for k, v in cats.items()},
                       "kernels": [{"name": k, "ms_per_step": v / n / 1000, "calls_per_step": count[k] // n}
                                   for k, v in by_name.most_common()]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
