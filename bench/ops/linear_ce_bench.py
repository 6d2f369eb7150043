"""strobe::linear_cross_entropy against the logits path at Llama-3.2-1B's head (hidden [16384, 2048],
weight [128256, 2048], bf16, mean cross-entropy over int64 targets), forward + backward, one GPU:
  eager     F.cross_entropy((h @ W.t()).float(), y), as a PyTorch training loop computes it
  compiled  torch.compile of the same function
  liger     Liger-Kernel's LigerFusedLinearCrossEntropyFunction (when its wheel is installed)
  strobe    ops.linear_cross_entropy(h, W, None, y) with chunk_rows 0 (automatic) and fixed sizes
CUDA events around each call, warm-ups, median (and mean) of REP calls over two fresh input sets;
peak memory above the inputs (gradients included, as the PyTorch anchors count it); then the
profiler's kernel times of one Strobe call, grouped (GEMMs, the cross_entropy_rows kernel, the rest),
with the kernel's HBM bound (the bf16 logits read twice and written once); the automatic call
replayed from a CUDA graph (the GPU's own time); one call's timeline (the GPU's span against its
kernels, the longest waits between kernels, slow host runtime calls, host synchronisations); and
the 6th of 6 back-to-back calls of Strobe and torch.compile under the profiler. Usage (GPU machine):
  python3 bench/ops/linear_ce_bench.py BUILD_DIR/lib/libstrobe_ops.so   (HBM_TBS: bandwidth, TB/s)
Writes $OUT/linear_ce_bench.json and the two traces.
"""
import json, os, statistics, sys

import torch
import torch.nn.functional as F

torch.ops.load_library(sys.argv[1])
ops = torch.ops.strobe
dev, bf16 = "cuda", torch.bfloat16
T, D, V = int(os.environ.get("LCE_T", 16384)), 2048, 128256
REP = int(os.environ.get("REP", 10))
bw = float(os.environ.get("HBM_TBS", "4.8")) * 1e12
R = {"device": torch.cuda.get_device_name(), "shape": [T, D, V], "rows": []}

sets = []
for _ in range(2):
    h = (torch.randn(T, D, device=dev, dtype=bf16) * 0.5).requires_grad_()
    W = (torch.randn(V, D, device=dev, dtype=bf16) * 0.02).requires_grad_()
    y = torch.randint(0, V, (T,), device=dev)
    y[::9] = -100
    sets.append((h, W, y))


def step(f, h, W, y):
    h.grad = None; W.grad = None
    f(h, W, y).backward()


def timeit(f, warmup=3):
    for i in range(warmup):
        step(f, *sets[i % 2])
    torch.cuda.synchronize()
    ts = []
    for i in range(REP):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); step(f, *sets[i % 2]); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts), statistics.mean(ts)


def peak_gib(f):
    h, W, y = sets[0]
    h.grad = None; W.grad = None
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    f(h, W, y).backward(); torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def eager(h, W, y):
    return F.cross_entropy((h @ W.t()).float(), y)


def strobe(chunk):
    return lambda h, W, y: ops.linear_cross_entropy(h, W, None, y, -100, chunk)


cases = [("eager (logits path)", eager), ("torch.compile (logits path)", torch.compile(eager))]
try:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as LF
    cases.append(("Liger fused linear cross-entropy", lambda h, W, y: LF.apply(h, W, y)[0]))
except Exception as ex:  # the wheel is optional
    R["liger_error"] = repr(ex)[:200]
    print("liger:", R["liger_error"])
for c in (0, 1024, 1536, 1792, 2048, 4096):
    cases.append((f"strobe chunk_rows={c}" + (" (auto)" if c == 0 else ""), strobe(c)))

# The automatic call captured once in a CUDA graph and replayed: the GPU's own time, without the
# host's launches and allocations between its kernels.
def graphed_ms():
    h, W, y = sets[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(strobe(0), h, W, y)
    torch.cuda.current_stream().wait_stream(side)
    h.grad = None; W.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        strobe(0)(h, W, y).backward()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(REP):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); g.replay(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    h.grad = None; W.grad = None
    del g
    return statistics.median(ts), statistics.mean(ts)


# Correctness at this shape first: Strobe's loss and gradients against the eager logits path.
h, W, y = sets[0]
step(eager, h, W, y); ref = (eager(h, W, y).detach(), h.grad.clone(), W.grad.clone())
step(strobe(0), h, W, y); got = (strobe(0)(h, W, y).detach(), h.grad.clone(), W.grad.clone())
rel = [((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(got, ref)]
R["rel_err_vs_eager"] = {"loss": rel[0], "dhidden": rel[1], "dweight": rel[2]}
print(f"rel. error vs the eager logits path: loss {rel[0]:.2e}  dhidden {rel[1]:.2e}  dweight {rel[2]:.2e}")
del ref, got
torch.cuda.empty_cache()

gemm_tflop = 3 * 2 * T * D * V / 1e12
for name, f in cases:
    try:
        med, mean = timeit(f)
        pk = peak_gib(f)
    except Exception as ex:
        print(f"{name}: {ex!r}"[:300]); R["rows"].append({"name": name, "error": repr(ex)[:300]}); continue
    R["rows"].append({"name": name, "median_ms": round(med, 2), "mean_ms": round(mean, 2), "peak_gib": round(pk, 2),
                      "gemm_tflops": round(gemm_tflop / med * 1e3, 1)})
    print(f"{name:40s} median {med:7.2f} ms  mean {mean:7.2f} ms  peak +{pk:5.2f} GiB  ({gemm_tflop / med * 1e3:5.0f} TFLOP/s of GEMM)")
    torch.cuda.empty_cache()

try:
    med, mean = graphed_ms()
    R["rows"].append({"name": "strobe chunk_rows=0 (auto), CUDA graph replay", "median_ms": round(med, 2),
                      "mean_ms": round(mean, 2), "gemm_tflops": round(gemm_tflop / med * 1e3, 1)})
    print(f"{'strobe auto, CUDA graph replay':40s} median {med:7.2f} ms  mean {mean:7.2f} ms")
except Exception as ex:
    print(f"graph replay: {ex!r}"[:300])
torch.cuda.empty_cache()

# Kernel times of one automatic-chunk call from the profiler.
from torch.profiler import profile, ProfilerActivity
h, W, y = sets[1]
step(strobe(0), h, W, y); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step(strobe(0), h, W, y); torch.cuda.synchronize()
groups = {}
for ev in prof.key_averages():
    if ev.device_type != torch.autograd.DeviceType.CUDA:
        continue
    n = ev.key
    g = ("cross_entropy_rows kernel" if "ce_rows_kernel" in n else
         "GEMMs" if any(k in n.lower() for k in ("gemm", "nvjet", "xmma", "cutlass", "sm90")) else "other: " + n[:60])
    groups[g] = groups.get(g, 0.0) + ev.device_time_total / 1e3  # us -> ms
R["profile_ms"] = {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}
bound = 3 * T * V * 2 / bw * 1e3
R["ce_rows_hbm_bound_ms"] = round(bound, 3)
print("profile of one strobe call (kernel ms):")
for k, v in R["profile_ms"].items():
    print(f"  {k:70s} {v:8.3f}")
print(f"  cross_entropy_rows HBM bound (2 reads + 1 write of bf16 logits at {bw / 1e12:.2f} TB/s): {bound:.3f} ms")

# The timeline of one automatic call (CPU and CUDA activities): the GPU's span from its first kernel
# to its last against the sum of its kernels, the longest waits between kernels with their
# neighbours, and the host's CUDA runtime calls that took long (an allocation, a synchronisation).
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(strobe(0), h, W, y); torch.cuda.synchronize()
trace = os.path.join(os.environ.get("OUT", "/tmp"), "linear_ce_trace.json")
prof.export_chrome_trace(trace)
with open(trace) as fh:
    tev = json.load(fh)["traceEvents"]
gpu = sorted((e for e in tev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
if gpu:
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy = sum(e["dur"] for e in gpu)
    gaps = sorted(((b["ts"] - (a["ts"] + a["dur"]), a["name"][:50], b["name"][:50]) for a, b in zip(gpu, gpu[1:])),
                  reverse=True)
    R["timeline_ms"] = {"gpu_span": round(span / 1e3, 3), "kernels": round(busy / 1e3, 3), "kernel_count": len(gpu),
                        "gaps": [[round(g / 1e3, 3), a, b] for g, a, b in gaps[:10]]}
    print(f"timeline: GPU span {span / 1e3:.2f} ms, kernels {busy / 1e3:.2f} ms ({len(gpu)}), longest gaps:")
    for g, a, b in gaps[:10]:
        print(f"  {g / 1e3:7.3f} ms  after {a}  before {b}")
slow = sorted((e for e in tev if e.get("cat") == "cuda_runtime" and e.get("dur", 0) > 50), key=lambda e: -e["dur"])
R["slow_runtime_calls_ms"] = [[e["name"], round(e["dur"] / 1e3, 3)] for e in slow[:10]]
for e in slow[:10]:
    print(f"  host: {e['name']} {e['dur'] / 1e3:.3f} ms")
# Back to back, as the timed loop runs them: the last of 6 calls' kernel time and GPU span, for
# Strobe and torch.compile (a GPU kept busy clocks lower than one that runs a single call).
def sustained(f):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for i in range(6):
            step(f, *sets[i % 2])
        torch.cuda.synchronize()
    path = os.path.join(os.environ.get("OUT", "/tmp"), "linear_ce_sustained_trace.json")
    p.export_chrome_trace(path)
    with open(path) as fh:
        ks = sorted((e for e in json.load(fh)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                    key=lambda e: e["ts"])
    n = len(ks) // 6
    last = ks[-n:]
    return round(sum(e["dur"] for e in last) / 1e3, 3), round((last[-1]["ts"] + last[-1]["dur"] - last[0]["ts"]) / 1e3, 3)


R["sustained_last_call_ms"] = {}
for name, f in (("strobe auto", strobe(0)), ("torch.compile", cases[1][1])):
    ksum, span = sustained(f)
    R["sustained_last_call_ms"][name] = {"kernels": ksum, "span": span}
    print(f"back to back, 6th call: {name}: kernels {ksum:.2f} ms, GPU span {span:.2f} ms")
torch.cuda.set_sync_debug_mode("warn")
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step(strobe(0), h, W, y)
torch.cuda.set_sync_debug_mode(0)
R["host_syncs"] = [str(w.message)[:120] for w in caught]
print(f"host synchronisations in one call: {len(caught)}", *R["host_syncs"][:3], sep="\n  ")
with open(os.path.join(os.environ.get("OUT", "/tmp"), "linear_ce_bench.json"), "w") as fh:
    json.dump(R, fh, indent=1)
