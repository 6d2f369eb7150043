"""strobe::fp8_linear against the bf16 linear layer, forward and backward, on the linear layers of
Llama-3.2-1B (16,384 tokens: batch 8 x 2048) and ViT-L/16 (25,216 tokens: batch 128 x 197), in one
process: CUDA events, warm-up, fresh random inputs each measured call, the quantization included
(docs/PERFORMANCE.md, "Float8 linear layers"). Each row: the bf16 time (at::linear and its two
backward GEMMs through autograd), the fp8 time (fp8_linear: three quantizations with transposes and
three float8 GEMMs), their ratio, and the GEMMs' float8 TFLOP/s; then the relative error of y, dx and
dw against an fp32 linear of the same bf16 inputs. Then Llama-3.2-1B's MLP (gate+up, SwiGLU, down)
forward and backward three ways: bf16, float8 with every cast making its own amax pass (fp8_linear,
swiglu, fp8_linear), and float8 with SwiGLU's kernels giving the amax of their outputs
(fp8_linear_swiglu, then fp8_linear with its x_amax).

Usage: python3 bench/fp8_linear_bench.py [BUILD_DIR] [--device cpu --small] [--mlp-only] (--small:
shapes / 64, a smoke run of the script itself; --mlp-only: the MLP comparison alone)."""
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
    return sum(event_ms(fn, make_inputs()) for _ in range(n)) / n


def event_ms(fn, args):
    """fn(*args) on the GPU, timed by CUDA events, ms."""
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    fn(*args)
    en.record()
    torch.cuda.synchronize()
    return st.elapsed_time(en)


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



def interleaved(variants, make_inputs, n):
    """{name: (median ms, mean ms)} of each fn(*inputs), the variants taking turns call by call (so a
    clock that drifts over the run reaches each alike), fresh inputs before each call (not timed)."""
    times = {name: [] for name in variants}
    for _ in range(3):
        for fn in variants.values():
            fn(*make_inputs())
    for _ in range(n):
        for name, fn in variants.items():
            times[name].append(event_ms(fn, make_inputs()))
    return {name: (sorted(t)[len(t) // 2], sum(t) / len(t)) for name, t in times.items()}


def mlp():
    m, k, f = (16384, 2048, 8192) if not small else (256, 32, 128)
    dt = torch.bfloat16
    wgu = (torch.randn(2 * f, k, device=device) * 0.02).to(dt).requires_grad_()
    wd = (torch.randn(k, f, device=device) * 0.02).to(dt).requires_grad_()

    def make():
        return torch.randn(m, k, device=device).to(dt).requires_grad_(), torch.randn(m, k, device=device).to(dt)

    def bf16(x, g):
        torch.nn.functional.linear(ops.swiglu(torch.nn.functional.linear(x, wgu)), wd).backward(g)

    def fp8_unfused(x, g):
        ops.fp8_linear(ops.swiglu(ops.fp8_linear(x, wgu)), wd).backward(g)

    def fp8_fused(x, g):
        h, h_amax = ops.fp8_linear_swiglu(x, wgu)
        ops.fp8_linear(h, wd, None, h_amax).backward(g)

    if device == "cpu":  # a smoke run of the script
        for fn in (bf16, fp8_unfused, fp8_fused):
            fn(*make())
        return
    n = 3 if small else 40
    t = interleaved({"bf16": bf16, "fp8": fp8_unfused, "fp8 fused": fp8_fused}, make, n)
    print(f"\nllama_1b MLP ({m} tokens, {k} -> 2 x {f} -> {k}), forward + backward, the variants in turn:")
    for name, (med, mean) in t.items():
        print(f"  {name:<10} median {med:8.3f} ms  mean {mean:8.3f} ms   {t['bf16'][0] / med:5.2f}x bf16 (median)")
    saved = t["fp8"][0] - t["fp8 fused"][0]
    print(f"  the producers' amax saves {saved:.3f} ms a layer (median; {saved * 16:.1f} ms over llama_1b's 16 layers)")

    # The kernels alone: swiglu with and without its amax, the e5m2 cast of d gate_up with and without a
    # given amax (its amax pass), at the MLP's shapes.
    gu = torch.randn(m, 2 * f, device=device).to(dt)
    dy = torch.randn(m, f, device=device).to(dt)
    amax = gu.float().abs().amax()
    k_t = interleaved({
        "swiglu_fwd": lambda: ops.swiglu_fwd(gu),
        "swiglu_fwd_amax": lambda: ops.swiglu_fwd_amax(gu),
        "swiglu_bwd": lambda: ops.swiglu_bwd(dy, gu),
        "swiglu_bwd_amax": lambda: ops.swiglu_bwd_amax(dy, gu),
        "cast d gate_up, amax pass": lambda: ops.fp8_quantize(gu, torch.float8_e5m2, True),
        "cast d gate_up, amax given": lambda: ops.fp8_quantize(gu, torch.float8_e5m2, True, amax),
    }, lambda: (), n)
    print(f"  kernels at [{m}, 2 x {f}] bf16, median ms:")
    for name, (med, _) in k_t.items():
        print(f"    {name:<28} {med:7.3f}")


if "--mlp-only" not in sys.argv:
    main()
mlp()
