"""strobe::flash_attention beside PyTorch's SDPA flash and cuDNN backends (and varlen_attn for the
packed row), bf16, on one GPU, in one process, on the shapes of the issue's anchor table.

  STROBE_BUILD_DIR=build python bench/attention/bench_attention.py

Timing is bench/pytorch_baselines.py's: CUDA events around one call, warm-up 10, median of 50.
fwd+bwd = one forward and one backward (the backward includes every pre/post kernel). FLOPs as in
ATTENTION_NOTES §8: forward 4*B*H*Sq*Sk*D (halved for causal, summed per sequence for varlen),
fwd+bwd 3.5x forward. The GPU's bf16 matrix rate is measured here too (8192^3 torch.matmul), so
TFLOP/s can be read as a fraction of what the tensor cores deliver on this machine.
Results print and go to $OUT/bench_attention.json (or /tmp). Our kernels are the wgmma ones (v4) on
an H100/H200; STROBE_FLASH_ATTN=mma runs the mma.sync ones (forward v3, backward v1) instead, as
every other GPU does (results then go to bench_attention_mma.json).
"""
import json, os, sys

import torch
import torch.nn.functional as F

torch.ops.load_library(os.path.join(os.environ.get("STROBE_BUILD_DIR", "build"), "lib", "libstrobe_ops.so"))
ops = torch.ops.strobe
dev = torch.device("cuda")
R = {"device": torch.cuda.get_device_name()}


def bench(fn, warmup=10, rep=50):
    for _ in range(warmup): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]


def matmul_rate():
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, warmup=5, rep=20)
    return 2 * 8192 ** 3 / ms / 1e9


def row(name, fl, fwd, fwdbwd):
    fw = bench(fwd); fb = bench(fwdbwd)
    R[f"{name}.fwd_ms"] = round(fw, 3); R[f"{name}.fwd_tflops"] = round(fl / fw / 1e9, 1)
    R[f"{name}.fwdbwd_ms"] = round(fb, 3); R[f"{name}.fwdbwd_tflops"] = round(3.5 * fl / fb / 1e9, 1)
    print(f"{name:58s} fwd {fw:7.3f} ms {fl / fw / 1e9:6.1f} TF/s   fwd+bwd {fb:7.3f} ms {3.5 * fl / fb / 1e9:6.1f} TF/s",
          flush=True)


def main():
    from torch.nn.attention import sdpa_kernel, SDPBackend
    R["bf16_matmul_tflops"] = round(matmul_rate(), 1)
    print(f"device {R['device']}, bf16 matmul 8192^3: {R['bf16_matmul_tflops']} TFLOP/s", flush=True)
    shapes = [("vit_b128_s196_h16_d64", 128, 16, 196, 64, False), ("lm_b32_s1024_h16_d64_causal", 32, 16, 1024, 64, True),
              ("long_b8_s3136_h12_d64", 8, 12, 3136, 64, False), ("b16_s2048_h16_d128_causal", 16, 16, 2048, 128, True)]
    only = sys.argv[1:]
    for name, B, H, S, D, causal in shapes:
        if only and not any(o in name for o in only): continue
        fl = 4 * B * H * S * S * D / (2 if causal else 1)
        # ours: [B, S, H, D]
        q, k, v = [torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        do = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
        f = lambda: ops.flash_attention(q, k, v, causal=causal)[0]
        row(f"{name}.strobe", fl, f, lambda: f().backward(do))
        # SDPA: [B, H, S, D]
        qt, kt, vt = [torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        dot = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
        for be in ["FLASH_ATTENTION", "CUDNN_ATTENTION"]:
            try:
                with sdpa_kernel([getattr(SDPBackend, be)]):
                    g = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    row(f"{name}.sdpa_{be.split('_')[0].lower()}", fl, g, lambda: g().backward(dot))
            except Exception as ex:
                R[f"{name}.{be}.error"] = repr(ex)[:160]; print(name, be, "error", repr(ex)[:160])
        del q, k, v, do, qt, kt, vt, dot
    if not only or any("varlen" in o for o in only):
        # 32 sequences, lengths uniform in [1, 1023] (the seed's, pytorch_baselines.py's generator), causal.
        g = torch.Generator().manual_seed(0)
        lens = torch.randint(1, 1024, (32,), generator=g)
        H, D = 16, 64
        fl = sum(4 * H * D * int(L) * int(L) / 2 for L in lens)
        T = int(lens.sum()); R["varlen.total_tokens"] = T
        cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(dev, torch.int32)
        qp, kp, vp = [torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        dop = torch.randn_like(qp)
        f = lambda: ops.flash_attention(qp, kp, vp, cu, cu, 1024, 1024, causal=True)[0]
        row("varlen_32seq_causal_h16_d64.strobe", fl, f, lambda: f().backward(dop))
        try:
            from torch.nn.attention.varlen import varlen_attn
            import inspect
            sig = inspect.signature(varlen_attn)
            kw = {"is_causal": True} if "is_causal" in sig.parameters else ({"causal": True} if "causal" in sig.parameters else {"window_size": (-1, 0)})
            h = lambda: varlen_attn(qp, kp, vp, cu, cu, 1024, 1024, **kw)
            row("varlen_32seq_causal_h16_d64.varlen_attn_fa2", fl, h, lambda: h().backward(dop))
        except Exception as ex:
            R["varlen.varlen_attn.error"] = repr(ex)[:200]; print("varlen_attn error", repr(ex)[:200])
    tag = os.environ.get("STROBE_FLASH_ATTN", "")
    R["strobe_flash_attn_env"] = tag
    out = os.path.join(os.environ.get("OUT", "/tmp"), f"bench_attention{'_' + tag if tag else ''}.json")
    with open(out, "w") as fh: json.dump(R, fh, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
