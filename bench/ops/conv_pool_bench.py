"""Face detector conv stack (4 x conv3x3 same + max-pool 2 + ReLU, 1->4->16->64->256 channels, batch
1024, 256x256 uint8 images, bf16 autocast): forward + backward of strobe::conv3x3_maxpool_relu for
the first k stages (ATen/cuDNN for the rest) against the all-cuDNN stack, per stage and whole, in
one process. CUDA events, warm-up, median over fresh inputs. Usage (GPU machine):
  python3 bench/ops/conv_pool_bench.py BUILD_DIR/lib/libstrobe_ops.so
"""
import json, os, statistics, sys
import torch
import torch.nn.functional as F

torch.ops.load_library(sys.argv[1])
dev = "cuda"
torch.backends.cudnn.benchmark = "--cudnn-benchmark" in sys.argv
B = int(os.environ.get("B", 1024))
op = torch.ops.strobe.conv3x3_maxpool_relu


def timed(fn, warm=3, n=15):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts), min(ts), max(ts)


torch.manual_seed(0)
chans = [1, 4, 16, 64, 256]
W = [(torch.randn(chans[i + 1], chans[i], 3, 3, device=dev) / (3 * chans[i] ** 0.5)).requires_grad_()
     for i in range(4)]
Bs = [torch.zeros(chans[i + 1], device=dev).requires_grad_() for i in range(4)]
imgs = [torch.randint(0, 256, (B, 1, 256, 256), dtype=torch.uint8, device=dev) for _ in range(3)]
it = [0]


def stack(k):
    """k fused stages, then cuDNN (autocast bf16, as the model)."""
    def run():
        x = imgs[it[0] % len(imgs)]; it[0] += 1
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scale = 1 / 255
            for i in range(k):
                x = op(x, W[i], Bs[i], scale, torch.bfloat16); scale = 1.0
            if k == 0:
                x = x.float() / 255
            for i in range(k, 4):
                x = F.relu(F.max_pool2d(F.conv2d(x, W[i], Bs[i], padding=1), 2))
        x.float().square().mean().backward()
    return run


def stage(i, fused):
    """One stage alone, bf16 activations in (a leaf that needs grad, except stage 0's uint8)."""
    s = 256 >> i
    if i == 0:
        xs = imgs
    else:
        xs = [torch.randn(B, chans[i], s, s, device=dev, dtype=torch.bfloat16).relu_().requires_grad_() for _ in range(2)]
    gy = torch.randn(B, chans[i + 1], s // 2, s // 2, device=dev, dtype=torch.bfloat16)
    def run():
        x = xs[it[0] % len(xs)]; it[0] += 1
        if fused:
            y = op(x, W[i], Bs[i], 1 / 255 if i == 0 else 1.0, torch.bfloat16)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                xin = x.float() / 255 if i == 0 else x
                y = F.relu(F.max_pool2d(F.conv2d(xin, W[i], Bs[i], padding=1), 2))
        y.backward(gy)
    return run


R = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": B,
     "cudnn_benchmark": torch.backends.cudnn.benchmark}
for i in range(4):
    for fused in (False, True):
        R[f"stage{i + 1}.{'fused' if fused else 'cudnn'}_ms"] = round(timed(stage(i, fused))[0], 2)
for k in (0, 2, 3, 4):
    med, lo, hi = timed(stack(k))
    R[f"stack.fused_stages_{k}_ms"] = round(med, 2)
    R[f"stack.fused_stages_{k}_spread"] = [round(lo, 2), round(hi, 2)]
for k, v in R.items():
    print(f"CONVPOOL {k}: {v}", flush=True)
out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "conv_pool_bench.json"), "w") as f:
    json.dump(R, f, indent=1)
