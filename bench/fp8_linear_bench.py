"""strobe::fp8_linear against the bf16 linear layer, forward and backward, on the linear layers of
Llama-3.2-1B (16,384 tokens: batch 8 x 2048) and ViT-L/16 (25,216 tokens: batch 128 x 197), in one
process: CUDA events, warm-up, fresh random inputs each measured call, the quantization included
(docs/PERFORMANCE.md, "Float8 linear layers"). Each row: the bf16 time (at::linear and its two
backward GEMMs through autograd), the fp8 time (fp8_linear: three quantizations with transposes and
three float8 GEMMs), their ratio, and the GEMMs' float8 TFLOP/s; then the relative error of y, dx and
dw against an fp32 linear of the same bf16 inputs.

Usage: python3 bench/fp8_linear_bench.py [BUILD_DIR] [--device cpu --small] (--small: shapes / 64,
a smoke run of the script itself)."""
import sys
import torch

args = [a for a in sys.argv[1:] if not a.startswith("--")]
device = "cpu" if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu" else "cuda"
small = "--small" in sys.argv
torch.ops.load_library(f"{args[0] if args and args[0] != 'cpu' else 'build'}/lib/libstrobe_ops.so")
ops = torch.ops.strobe

# (name, tokens, in_features K, out_features N, bias)
LAYERS = [
    ("llama_1b q_proj / o_proj", 16384, 2048, 2048, False),
    ("llama_1b k_proj / v_proj", 16384, 2048, 512, False),
    ("llama_1b gate+up", 16384, 2048, 16384, False),
    ("llama_1b down_proj", 16384, 8192, 2048, False),
    ("vit_l16 qkv", 25216, 1024, 3072, True),
    ("vit_l16 proj", 25216, 1024, 1024, True),
    ("vit_l16 fc1", 25216, 1024, 4096, True),
    ("vit_l16 fc2", 25216, 4096, 1024, True),
]


def timed(fn, make_inputs, n):
    """Mean ms of fn(*inputs) over n calls, fresh inputs made before each (not timed)."""
    inputs = [make_inputs() for _ in range(3)]
    for i in range(3):
        fn(*inputs[i])
    if device == "cpu":
        import time
        total = 0.0
        for _ in range(n):
            a = make_inputs()
            t0 = time.perf_counter()
            fn(*a)
            total += time.perf_counter() - t0
        return total / n * 1e3
    total = 0.0
    for _ in range(n):
        a = make_inputs()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        fn(*a)
        en.record()
        torch.cuda.synchronize()
        total += st.elapsed_time(en)
    return total / n


def main():
    n = 3 if small else 30
    print(f"{'layer':<26} {'M x K x N':>20} {'bf16 ms':>9} {'fp8 ms':>9} {'ratio':>6} {'fp8 TFLOP/s':>12}   "
          f"rel. error y / dx / dw vs fp32")
    for name, m, k, nf, bias in LAYERS:
        if small:
            m, k, nf = max(m // 64, 16), max(k // 64, 16), max(nf // 64, 16)
        dt = torch.bfloat16
        w = (torch.randn(nf, k, device=device) * 0.02).to(dt).requires_grad_()
        b = torch.randn(nf, device=device).to(dt).requires_grad_() if bias else None

        def make():
            x = torch.randn(m, k, device=device).to(dt).requires_grad_()
            return x, torch.randn(m, nf, device=device).to(dt)

        def bf16_step(x, g):
            torch.nn.functional.linear(x, w, b).backward(g)

        def fp8_step(x, g):
            ops.fp8_linear(x, w, b).backward(g)

        t_bf16 = timed(bf16_step, make, n)
        t_fp8 = timed(fp8_step, make, n)
        tflops = 3 * 2 * m * k * nf / (t_fp8 * 1e-3) / 1e12
        # Accuracy against fp32 on one input.
        x, g = make()
        w.grad = None
        y = ops.fp8_linear(x, w, b)
        y.backward(g)
        dx, dw = x.grad.clone(), w.grad.clone()
        x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        y32 = torch.nn.functional.linear(x32, w32, b.detach().float() if b is not None else None)
        y32.backward(g.float())
        rel = lambda a, r: ((a.float() - r).norm() / r.norm()).item()
        print(f"{name:<26} {f'{m}x{k}x{nf}':>20} {t_bf16:9.3f} {t_fp8:9.3f} {t_bf16 / t_fp8:6.2f} {tflops:12.1f}   "
              f"{rel(y, y32):.4f} / {rel(dx, x32.grad):.4f} / {rel(dw, w32.grad):.4f}")


main()
