"""fp8_quantize against eager ATen on one [16384, 8192] bf16 tensor (docs/PERFORMANCE.md, "Float8 quantization"),
and _scaled_mm of its operands against the fp32 product. Usage: python3 bench/fp8_quantize_bench.py [BUILD_DIR]"""
import torch, sys
torch.ops.load_library(f"{sys.argv[1] if len(sys.argv) > 1 else 'build'}/lib/libstrobe_ops.so")
x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
def eager(x):
    a = x.abs().amax().float().clamp_min(1e-12); s = 448.0 / a
    q = (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, q.t().contiguous(), s.reciprocal()
def t(f, n=50):
    for _ in range(5): f()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(n): f()
    en.record(); torch.cuda.synchronize()
    return st.elapsed_time(en) / n
ms_t = t(lambda: torch.ops.strobe.fp8_quantize(x, torch.float8_e4m3fn, True))
ms_n = t(lambda: torch.ops.strobe.fp8_quantize(x, torch.float8_e4m3fn, False))
ms_e = t(lambda: eager(x))
gb = x.numel() * 2 / 1e9
print(f"[16384, 8192] bf16 -> e4m3: strobe with q_t {ms_t:.3f} ms, without {ms_n:.3f} ms; eager ATen (amax, cast, transpose copy) {ms_e:.3f} ms")
print(f"HBM floor (4.8 TB/s): two reads of x + q (+ q_t): {(2*gb + gb/2*2)/4.8:.3f} ms with q_t, {(2*gb + gb/2)/4.8:.3f} ms without")
q, qt, s = torch.ops.strobe.fp8_quantize(x, torch.float8_e4m3fn, True)
w = x[:4096]
qw, _, sw = torch.ops.strobe.fp8_quantize(w, torch.float8_e4m3fn, False)
y = torch._scaled_mm(q, qw.t(), scale_a=s, scale_b=sw, out_dtype=torch.bfloat16)
ref = x.float() @ w.float().t()
print("_scaled_mm of our operands (y = x w^T, [16384, 8192] x [8192, 4096]): relative error vs fp32", ((y.float() - ref).norm() / ref.norm()).item())
