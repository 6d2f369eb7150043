"""strobe::max_pool2d vs ATen's max_pool2d (issue 14) on the models' shapes: ResNet-50's stem
(3x3 stride 2 padding 1, [128, 64, 112, 112] bf16 channels_last) and the face detector's stages 3-4
(2x2 stride 2, [1024, 64, 64, 64] and [1024, 256, 32, 32] bf16 NCHW, as under bf16-mixed autocast).
Forward (x requires grad, so ATen computes its int64 indices as in training) and forward + backward;
CUDA events, warm-up, median of many runs over rotating inputs; results checked against ATen first.
Usage (GPU machine): python3 bench/ops/max_pool_bench.py BUILD_DIR/lib/libstrobe_ops.so [--json F]
"""
import json, statistics, sys
import torch
import torch.nn.functional as F

torch.ops.load_library(sys.argv[1])
ours_op = torch.ops.strobe.max_pool2d
dev = "cuda"
WARM, RUNS = 5, 50

CASES = [
    ("resnet50 stem", (128, 64, 112, 112), torch.channels_last, (3, 2, 1)),
    ("detector stage 3", (1024, 64, 64, 64), torch.contiguous_format, (2, 2, 0)),
    ("detector stage 4", (1024, 256, 32, 32), torch.contiguous_format, (2, 2, 0)),
]


def timed(fn):
    for _ in range(WARM):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(RUNS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def rel_err(got, want):
    g, w = got.double(), want.double()
    return ((g - w).norm() / w.norm()).item()


rows = []
print(torch.cuda.get_device_name(), torch.__version__)
for name, shape, fmt, (k, s, p) in CASES:
    torch.manual_seed(0)
    xs = [torch.randn(shape, device=dev, dtype=torch.bfloat16).contiguous(memory_format=fmt).requires_grad_()
          for _ in range(2)]
    aten = lambda x: F.max_pool2d(x, k, s, p)
    ours = lambda x: ours_op(x, [k], [s], [p])
    # correctness on this shape first
    ya, yo = aten(xs[0]), ours(xs[0])
    gy = torch.randn_like(ya)
    ga, = torch.autograd.grad(ya, xs[0], gy)
    go, = torch.autograd.grad(yo, xs[0], gy)
    same_y = torch.equal(ya, yo)
    gerr = rel_err(go, ga)
    assert same_y and gerr < 4e-3, f"{name}: outputs equal {same_y}, grad rel err {gerr}"
    del ya, yo, ga, go
    it = [0]

    def fwd(f):
        def run():
            x = xs[it[0] % 2]; it[0] += 1
            f(x)
        return run

    def fwd_bwd(f):
        def run():
            x = xs[it[0] % 2]; it[0] += 1
            torch.autograd.grad(f(x), x, gy)  # no .grad accumulation kernel
        return run

    r = {"case": name, "shape": list(shape), "layout": "NHWC" if fmt == torch.channels_last else "NCHW",
         "kernel": k, "stride": s, "padding": p}
    for label, f in (("aten", aten), ("ours", ours)):
        r[f"{label}_fwd_ms"] = timed(fwd(f))
        r[f"{label}_fwd_bwd_ms"] = timed(fwd_bwd(f))
        r[f"{label}_bwd_ms"] = r[f"{label}_fwd_bwd_ms"] - r[f"{label}_fwd_ms"]
    n_in = xs[0].numel()
    n_out = n_in // (s * s) if p == 0 else shape[0] * shape[1] * ((shape[2] + 2 * p - k) // s + 1) * ((shape[3] + 2 * p - k) // s + 1)
    # bytes our kernels must move at least: fwd reads x, writes y + 1-byte index; bwd reads gy + index, writes gx
    r["ours_fwd_GBps"] = (2 * n_in + 3 * n_out) / r["ours_fwd_ms"] / 1e6
    r["ours_bwd_GBps"] = (3 * n_out + 2 * n_in) / max(r["ours_bwd_ms"], 1e-6) / 1e6
    r["grad_rel_err_vs_aten"] = gerr
    rows.append(r)
    print(f"{name:17s} {r['layout']} {shape}: fwd aten {r['aten_fwd_ms']:.3f} ours {r['ours_fwd_ms']:.3f} ms "
          f"(x{r['aten_fwd_ms'] / r['ours_fwd_ms']:.2f}); fwd+bwd aten {r['aten_fwd_bwd_ms']:.3f} ours "
          f"{r['ours_fwd_bwd_ms']:.3f} ms (x{r['aten_fwd_bwd_ms'] / r['ours_fwd_bwd_ms']:.2f}); bwd aten "
          f"{r['aten_bwd_ms']:.3f} ours {r['ours_bwd_ms']:.3f}; ours {r['ours_fwd_GBps']:.0f} / "
          f"{r['ours_bwd_GBps']:.0f} GB/s fwd / bwd; grad rel err {gerr:.1e}", flush=True)
    del xs, gy
    torch.cuda.empty_cache()

if "--json" in sys.argv:
    json.dump(rows, open(sys.argv[sys.argv.index("--json") + 1], "w"), indent=1)
