"""strobe::add_layer_norm and strobe::cross_entropy against the ATen ops they replace, forward +
backward, bf16, at the seed workloads' shapes, on one GPU in one process:
  add+LN:  vit_l16 (rows 128*196 = 25088, C 1024, bias) and decoder_lm (rows 16384 ~ a packed batch
           of 32, C 1024, no bias): ATen `s = x + d; y = layer_norm(s)` vs ops.add_layer_norm; plain
           LayerNorm (no delta) too. Backward gets gradients for both s and y (the residual path).
  CE:      vit_l16 (N 128, V 1000) and decoder_lm (N 16384, V 1024): ATen as the tasks call it
           without the fused op (cross_entropy on an fp32 copy of the logits) and on the bf16 logits,
           vs ops.cross_entropy on the bf16 logits.
CUDA events around each call, 10 warm-ups, median of 50, inputs rotated over 4 fresh sets (more than
L2 holds). Prints a table and writes $OUT/fused_norm_bench.json. Usage (GPU machine):
  python3 bench/ops/fused_norm_bench.py BUILD_DIR/lib/libstrobe_ops.so [mlp]
MLP: fc1 -> gelu(tanh) -> fc2 fwd+bwd, ATen's F.linear / F.gelu / F.linear vs ops.fused_mlp (cuBLASLt
GELU_AUX_BIAS / DGELU_BGRAD epilogues), vit_l16 [25088, 1024] -> 4096 and decoder_lm [16384, 1024] -> 4096.
With `mlp` only the MLP rows run. With `rms` only llama's add + RMSNorm [16384, 2048] (eager, torch.compile,
ops.add_rms_norm; HBM_TBS sets the bandwidth the bound is computed at).
"""
import json, os, statistics, sys

import torch
import torch.nn.functional as F

torch.ops.load_library(sys.argv[1])
ops = torch.ops.strobe
dev = "cuda"
bf16 = torch.bfloat16
R = {"device": torch.cuda.get_device_name(), "results": []}


def timeit(fn, sets, warmup=10, rep=50):
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    ts = []
    for i in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = sets[i % len(sets)]
        s.record(); fn(*args); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def kernel_ms(fn, sets, pattern, rep=20):
    """Mean device time per launch (ms) of each kernel whose name contains `pattern`, from the profiler
    over `rep` calls of fn: kernel time alone, without launch gaps."""
    from torch.profiler import profile, ProfilerActivity
    for i in range(3):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(rep):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / e.count / 1e3 for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and pattern in e.key}


def row(name, ms_aten, ms_ours, extra=""):
    r = {"name": name, "aten_ms": round(ms_aten, 4), "strobe_ms": round(ms_ours, 4), "speedup": round(ms_aten / ms_ours, 2)}
    R["results"].append(r)
    print(f"{name:55s} ATen {ms_aten:8.3f} ms  strobe {ms_ours:8.3f} ms  x{ms_aten / ms_ours:5.2f} {extra}")


def ln_case(tag, rows, c, bias):
    sets = []
    for _ in range(4):
        x = torch.randn(rows, c, device=dev, dtype=bf16, requires_grad=True)
        d = torch.randn(rows, c, device=dev, dtype=bf16, requires_grad=True)
        gy = torch.randn(rows, c, device=dev, dtype=bf16)
        gs = torch.randn(rows, c, device=dev, dtype=bf16)
        sets.append((x, d, gy, gs))
    w = torch.randn(c, device=dev, dtype=bf16, requires_grad=True)
    b = torch.randn(c, device=dev, dtype=bf16, requires_grad=True) if bias else None

    def aten_fwd(x, d, gy, gs):
        with torch.no_grad():
            s = x + d
            F.layer_norm(s, (c,), w, b, 1e-6)

    def ours_fwd(x, d, gy, gs):
        with torch.no_grad():
            ops.add_layer_norm(x, d, w, b, 1e-6)

    def aten_fb(x, d, gy, gs):
        s = x + d
        y = F.layer_norm(s, (c,), w, b, 1e-6)
        torch.autograd.backward([s, y], [gs, gy])

    def ours_fb(x, d, gy, gs):
        s, y = ops.add_layer_norm(x, d, w, b, 1e-6)
        torch.autograd.backward([s, y], [gs, gy])

    def aten_ln_fb(x, d, gy, gs):
        F.layer_norm(x, (c,), w, b, 1e-6).backward(gy)

    def ours_ln_fb(x, d, gy, gs):
        ops.layer_norm(x, w, b, 1e-6).backward(gy)

    # Bytes that must move (bf16): fwd reads x, d, writes s, y; bwd reads s, dy, dsum, writes dx.
    gb = rows * c * 2 / 1e9
    row(f"{tag} add+LN fwd [{rows}, {c}]", timeit(aten_fwd, sets), timeit(ours_fwd, sets), f"(min traffic {4 * gb:.3f} GB)")
    row(f"{tag} add+LN fwd+bwd [{rows}, {c}]", timeit(aten_fb, sets), timeit(ours_fb, sets), f"(min traffic {8 * gb:.3f} GB)")
    row(f"{tag} LN fwd+bwd [{rows}, {c}]", timeit(aten_ln_fb, sets), timeit(ours_ln_fb, sets))
    for p in [w] + ([b] if bias else []):
        p.grad = None


def ce_case(tag, n, v):
    sets = []
    for _ in range(4):
        lg = (torch.randn(n, v, device=dev) * 3).to(bf16).requires_grad_()
        t = torch.randint(0, v, (n,), device=dev)
        t[::7] = -100
        sets.append((lg, t))

    def aten_fp32(lg, t):
        F.cross_entropy(lg.float(), t, ignore_index=-100).backward()

    def aten_bf16(lg, t):
        F.cross_entropy(lg, t, ignore_index=-100).backward()

    def ours(lg, t):
        ops.cross_entropy(lg, t, -100, "mean").backward()

    o = timeit(ours, sets)
    row(f"{tag} CE fwd+bwd [{n}, {v}] vs ATen on fp32 copy (the task's)", timeit(aten_fp32, sets), o)
    row(f"{tag} CE fwd+bwd [{n}, {v}] vs ATen on bf16 logits", timeit(aten_bf16, sets), o)


def mlp_case(tag, rows, c, h):
    sets = []
    for _ in range(4):
        x = torch.randn(rows, c, device=dev, dtype=bf16, requires_grad=True)
        sets.append((x, torch.randn(rows, c, device=dev, dtype=bf16)))
    w1 = (torch.randn(h, c, device=dev) / c ** 0.5).to(bf16).requires_grad_()
    b1 = torch.zeros(h, device=dev, dtype=bf16, requires_grad=True)
    w2 = (torch.randn(c, h, device=dev) / h ** 0.5).to(bf16).requires_grad_()
    b2 = torch.zeros(c, device=dev, dtype=bf16, requires_grad=True)

    def aten(x, g):
        F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2).backward(g)

    def ours(x, g):
        ops.fused_mlp(x, w1, b1, w2, b2).backward(g)

    def aten_f(x, g):
        with torch.no_grad():
            F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    def ours_f(x, g):
        with torch.no_grad():
            ops.fused_mlp(x, w1, b1, w2, b2)

    row(f"{tag} MLP fwd [{rows}, {c}] -> {h} -> {c}", timeit(aten_f, sets), timeit(ours_f, sets))
    row(f"{tag} MLP fwd+bwd [{rows}, {c}] -> {h} -> {c}", timeit(aten, sets), timeit(ours, sets))


def rms_case(tag, rows, c):
    """llama's residual add + RMSNorm (Hugging Face's numerics), fwd+bwd with gradients into both
    outputs: eager ATen, torch.compile of the same function (mode default, dynamic=False), and
    ops.add_rms_norm. Kernel time is what the CUDA events see around one call."""
    sets = []
    for _ in range(4):
        x = torch.randn(rows, c, device=dev, dtype=bf16, requires_grad=True)
        d = torch.randn(rows, c, device=dev, dtype=bf16, requires_grad=True)
        sets.append((x, d, torch.randn(rows, c, device=dev, dtype=bf16), torch.randn(rows, c, device=dev, dtype=bf16)))
    w = (torch.rand(c, device=dev) + 0.5).to(bf16).requires_grad_()

    def hf(x, d):
        s = x + d
        sf = s.float()
        return s, w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(s.dtype)

    compiled = torch.compile(hf, dynamic=False)

    def eager_fb(x, d, gy, gs):
        torch.autograd.backward(list(hf(x, d)), [gs, gy])

    def compiled_fb(x, d, gy, gs):
        torch.autograd.backward(list(compiled(x, d)), [gs, gy])

    def ours_fb(x, d, gy, gs):
        torch.autograd.backward(list(ops.add_rms_norm(x, d, w, 1e-5)), [gs, gy])

    def eager_f(x, d, gy, gs):
        with torch.no_grad():
            hf(x, d)

    def ours_f(x, d, gy, gs):
        with torch.no_grad():
            ops.add_rms_norm(x, d, w, 1e-5)

    gb = rows * c * 2 / 1e9
    bw = float(os.environ.get("HBM_TBS", "3.35"))  # H100 SXM; 4.8 on an H200
    t_c, t_o = timeit(compiled_fb, sets), timeit(ours_fb, sets)
    row(f"{tag} add+RMSNorm fwd [{rows}, {c}]", timeit(eager_f, sets), timeit(ours_f, sets),
        f"(HBM bound {4 * gb / bw:.3f} ms at {bw} TB/s)")
    row(f"{tag} add+RMSNorm fwd+bwd [{rows}, {c}] vs eager", timeit(eager_fb, sets), t_o,
        f"(HBM bound {8 * gb / bw:.3f} ms)")
    row(f"{tag} add+RMSNorm fwd+bwd [{rows}, {c}] vs torch.compile", t_c, t_o)
    w.grad = None


def rope_case(tag, b, s, hq, hk, d):
    """llama's rotary embedding on q [b, s, hq, d] and k [b, s, hk, d] (Hugging Face's rotate-half),
    fwd+bwd: eager ATen, torch.compile of the same function, ops.rotary_qk (both tensors, one kernel)."""
    ang = torch.rand(b, s, d, device=dev) * 100
    cos, sin = ang.cos(), ang.sin()
    sets = []
    for _ in range(4):
        q = torch.randn(b, s, hq, d, device=dev, dtype=bf16, requires_grad=True)
        k = torch.randn(b, s, hk, d, device=dev, dtype=bf16, requires_grad=True)
        sets.append((q, k, torch.randn_like(q), torch.randn_like(k)))

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], -1)

    def hf(q, k):
        c, s_ = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
        return q * c + rot(q) * s_, k * c + rot(k) * s_

    compiled = torch.compile(hf, dynamic=False)

    def eager_fb(q, k, gq, gk):
        torch.autograd.backward(list(hf(q, k)), [gq, gk])

    def compiled_fb(q, k, gq, gk):
        torch.autograd.backward(list(compiled(q, k)), [gq, gk])

    def ours_fb(q, k, gq, gk):
        torch.autograd.backward(list(ops.rotary_qk(q, k, cos, sin)), [gq, gk])

    gb = b * s * (hq + hk) * d * 2 / 1e9
    bw = float(os.environ.get("HBM_TBS", "3.35"))
    t_o = timeit(ours_fb, sets)
    row(f"{tag} rotary q+k fwd+bwd [{b}x{s}, {hq}+{hk} heads, {d}] vs eager", timeit(eager_fb, sets), t_o,
        f"(HBM bound {4 * gb / bw:.3f} ms at {bw} TB/s)")
    row(f"{tag} rotary q+k fwd+bwd vs torch.compile", timeit(compiled_fb, sets), t_o)
    for name, ms in sorted(kernel_ms(ours_fb, sets, "rotary").items()):
        direction = "backward" if "true>" in name else "forward"
        print(f"{tag} rotary kernel ({direction}) {ms:.4f} ms per launch from the profiler: {ms / (2 * gb / bw):.2f}x "
              f"its HBM bound {2 * gb / bw:.4f} ms")
        R["results"].append({"name": f"{tag} rotary kernel {direction}", "kernel_ms": round(ms, 4),
                             "bound_ms": round(2 * gb / bw, 4)})


def swiglu_case(tag, rows, f):
    """llama's SwiGLU on one [rows, 2 x f] projection output, fwd+bwd: eager silu(gate) * up (the
    two halves as views), torch.compile of the same function, ops.swiglu."""
    sets = []
    for _ in range(4):
        gu = torch.randn(rows, 2 * f, device=dev, dtype=bf16, requires_grad=True)
        sets.append((gu, torch.randn(rows, f, device=dev, dtype=bf16)))

    def hf(gu):
        g, u = gu.chunk(2, -1)
        return F.silu(g) * u

    compiled = torch.compile(hf, dynamic=False)
    gb = rows * f * 2 / 1e9
    bw = float(os.environ.get("HBM_TBS", "3.35"))
    t_o = timeit(lambda gu, dy: ops.swiglu(gu).backward(dy), sets)
    # fwd reads 2, writes 1; bwd reads 3 (dy, gate, up), writes 2
    row(f"{tag} SwiGLU fwd+bwd [{rows}, 2 x {f}] vs eager", timeit(lambda gu, dy: hf(gu).backward(dy), sets), t_o,
        f"(HBM bound {8 * gb / bw:.3f} ms at {bw} TB/s)")
    row(f"{tag} SwiGLU fwd+bwd vs torch.compile", timeit(lambda gu, dy: compiled(gu).backward(dy), sets), t_o)


print(R["device"])
if "rms" in sys.argv[2:]:
    rms_case("llama_1b", 16384, 2048)
    rope_case("llama_1b", 8, 2048, 32, 8, 64)
    swiglu_case("llama_1b", 16384, 8192)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "fused_norm_bench_rms.json"), "w") as f:
        json.dump(R, f, indent=1)
    sys.exit(0)
if "mlp" in sys.argv[2:] or len(sys.argv) == 2:
    mlp_case("vit_l16", 25088, 1024, 4096)
    mlp_case("decoder_lm", 16384, 1024, 4096)
if "mlp" in sys.argv[2:]:
    sys.exit(0)
ln_case("vit_l16", 25088, 1024, True)
ln_case("decoder_lm", 16384, 1024, False)
ce_case("vit_l16", 128, 1000)
ce_case("decoder_lm", 16384, 1024)
out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, "fused_norm_bench.json"), "w") as f:
    json.dump(R, f, indent=1)
