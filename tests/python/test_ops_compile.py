"""Every strobe op under torch.library.opcheck (schema, fake/Meta kernels, autograd registration,
AOT dispatch) and torch.compile(fullgraph=True) tracing through them, plus flash_attention from
Python against the reference.

CPU always; CUDA too when a GPU is visible and the library has its kernels. Exit 77 (ctest: skipped)
only if the library was not built. Run: STROBE_BUILD_DIR=build python tests/python/test_ops_compile.py
"""
import os
import sys

# Inductor's compiled kernels are kept between runs (scripts/test.sh gives every run a fresh TMPDIR,
# where inductor would otherwise cache them and compile each one again).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "strobe", "torchinductor"))

import torch

LIB = os.path.join(os.environ.get("STROBE_BUILD_DIR", "build"), "lib", "libstrobe_ops.so")
if not os.path.exists(LIB):
    print(f"skipped: {LIB} not built")
    sys.exit(77)
torch.ops.load_library(LIB)
ops = torch.ops.strobe
FAILS = []


def check(cond, msg):
    if not cond:
        FAILS.append(msg)
        print("FAIL:", msg)


def opcheck(op, args, kwargs=None, tag=""):
    try:
        res = torch.library.opcheck(op, args, kwargs or {})
        bad = {k: v for k, v in res.items() if v != "SUCCESS"}
        check(not bad, f"opcheck {tag}: {bad}")
    except Exception as ex:  # opcheck raises on the first failing sub-test
        check(False, f"opcheck {tag}: {type(ex).__name__}: {str(ex)[:400]}")


def boxes(n, device, dtype=torch.float32, valid_frac=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    tl = torch.rand(n, 2, generator=g) * 100
    t = torch.cat([tl, tl + 1 + torch.rand(n, 2, generator=g) * 50], -1)
    t = t * (torch.rand(n, 1, generator=g) < valid_frac)
    pl = torch.rand(n, 2, generator=g) * 100
    p = torch.cat([pl, pl + 1 + torch.rand(n, 2, generator=g) * 50], -1)
    return p.to(device, dtype), t.to(device)


def run(device):
    print(f"== {device}")
    # --- GIoU
    p, t = boxes(2 * 8, device)
    p, t = p.view(2, 8, 4), t.view(2, 8, 4)
    for r in ["mean", "sum", "none"]:
        opcheck(ops.giou.default, (p.clone().requires_grad_(), t, r), tag=f"giou {device} {r}")
        opcheck(ops.generalized_box_iou_loss.default, (p.clone().requires_grad_(), t + 1, r),
                tag=f"generalized_box_iou_loss {device} {r}")
    off = torch.tensor([0, 3, 8], dtype=torch.long, device=device)
    packed_t = t.view(-1, 4)[:8] + torch.tensor([0, 0, 1, 1.0], device=device)
    opcheck(ops.giou_packed.default, (p.clone().requires_grad_(), packed_t, off, "mean"), tag=f"giou_packed {device}")
    # --- non-finite check
    xs = [torch.randn(5, device=device), torch.randn(3, 2, device=device, dtype=torch.bfloat16)]
    opcheck(ops.nonfinite_check.default, (xs, True), tag=f"nonfinite_check {device}")
    # --- fused optimizers (mutating)
    def state(n):
        return [torch.randn(n, device=device) for _ in range(1)]
    params, grads = [torch.randn(6, device=device)], [torch.randn(6, device=device)]
    ea, eas, mx = [torch.zeros(6, device=device)], [torch.zeros(6, device=device)], []
    steps = [torch.zeros((), device=device)]
    opcheck(ops.fused_adamw_.default, (params, grads, ea, eas, mx, steps), {"lr": 1e-3}, tag=f"fused_adamw_ {device}")
    opcheck(ops.fused_adam_.default, (params, grads, ea, eas, mx, steps), {"lr": 1e-3}, tag=f"fused_adam_ {device}")
    mb, st = [torch.zeros(6, device=device)], [torch.zeros((), device=device)]
    opcheck(ops.fused_sgd_.default, (params, grads, mb, st), {"lr": 1e-2, "momentum": 0.9}, tag=f"fused_sgd_ {device}")
    # --- flash attention (bf16 on CUDA, fp32 on CPU), fixed and varlen
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = [torch.randn(2, 33, 2, 64, device=device, dtype=dt, requires_grad=True) for _ in range(3)]
    for causal in (False, True):
        opcheck(ops.flash_attention.default, (q, k, v), {"causal": causal}, tag=f"flash_attention {device} causal={causal}")
    cu = torch.tensor([0, 5, 40], dtype=torch.int32, device=device)
    qp, kp, vp = [torch.randn(40, 2, 64, device=device, dtype=dt, requires_grad=True) for _ in range(3)]
    opcheck(ops.flash_attention.default, (qp, kp, vp, cu, cu, 35, 35), {"causal": True}, tag=f"flash_attention varlen {device}")

    # --- fused conv3x3 + max-pool + ReLU: float input (all gradients), uint8 input to bf16
    x = torch.randn(2, 4, 10, 12, device=device, requires_grad=True)
    w = torch.randn(16, 4, 3, 3, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    opcheck(ops.conv3x3_maxpool_relu.default, (x, w, b), tag=f"conv3x3_maxpool_relu {device}")
    img = torch.randint(0, 256, (2, 1, 10, 12), dtype=torch.uint8, device=device)
    w1 = torch.randn(4, 1, 3, 3, device=device, requires_grad=True)
    b1 = torch.randn(4, device=device, requires_grad=True)
    opcheck(ops.conv3x3_maxpool_relu.default, (img, w1, b1, 1 / 255, torch.bfloat16),
            tag=f"conv3x3_maxpool_relu uint8 {device}")

    # --- fused residual add + LayerNorm (with / without bias and delta), cross-entropy
    for dt in ([torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]):
        x = torch.randn(3, 5, 24, device=device, dtype=dt, requires_grad=True)
        d = torch.randn(3, 5, 24, device=device, dtype=dt, requires_grad=True)
        w = torch.randn(24, device=device, dtype=dt, requires_grad=True)
        b = torch.randn(24, device=device, dtype=dt, requires_grad=True)
        opcheck(ops.add_layer_norm.default, (x, d, w, b, 1e-6), tag=f"add_layer_norm {device} {dt}")
        opcheck(ops.add_layer_norm.default, (x, d, w), tag=f"add_layer_norm no bias {device} {dt}")
        opcheck(ops.layer_norm.default, (x, w, b), tag=f"layer_norm {device} {dt}")
        opcheck(ops.add_rms_norm.default, (x, d, w, 1e-6), tag=f"add_rms_norm {device} {dt}")
        opcheck(ops.rms_norm.default, (x, w), tag=f"rms_norm {device} {dt}")
        opcheck(ops.add_layer_norm_amax.default, (x, d, w, b, 1e-6), tag=f"add_layer_norm_amax {device} {dt}")
        opcheck(ops.add_rms_norm_amax.default, (x, d, w, 1e-6), tag=f"add_rms_norm_amax {device} {dt}")
        rq = torch.randn(3, 5, 4, 8, device=device, dtype=dt, requires_grad=True)
        rk = torch.randn(3, 5, 2, 8, device=device, dtype=dt, requires_grad=True)
        ang = torch.rand(3, 5, 8, device=device)
        opcheck(ops.rotary_qk.default, (rq, rk, ang.cos(), ang.sin()), tag=f"rotary_qk {device} {dt}")
        gu = torch.randn(3, 5, 2 * 24, device=device, dtype=dt, requires_grad=True)
        opcheck(ops.swiglu.default, (gu,), tag=f"swiglu {device} {dt}")
        lh = torch.randn(13, 16, device=device, dtype=dt, requires_grad=True)
        lw = torch.randn(37, 16, device=device, dtype=dt, requires_grad=True)
        lt = torch.randint(0, 37, (13,), device=device)
        lt[::4] = -100
        opcheck(ops.linear_cross_entropy.default, (lh, lw, None, lt, -100, 5), tag=f"linear_cross_entropy {device} {dt}")
        lg = torch.randn(11, 37, device=device, dtype=dt, requires_grad=True)
        tg = torch.randint(0, 37, (11,), device=device)
        tg[3] = -100
        for red in ("mean", "sum", "none"):
            opcheck(ops.cross_entropy.default, (lg, tg, -100, red), tag=f"cross_entropy {device} {dt} {red}")
        mx = torch.randn(2, 3, 16, device=device, dtype=dt, requires_grad=True)
        mw = [torch.randn(*s, device=device, dtype=dt, requires_grad=True) for s in ((32, 16), (32,), (8, 32), (8,))]
        opcheck(ops.fused_mlp.default, (mx, *mw), tag=f"fused_mlp {device} {dt}")

    # --- batch_norm_act (CUDA kernels take channels_last, C % 8 == 0, fp32 BatchNorm parameters)
    for dt in (torch.float32,) + ((torch.bfloat16,) if device == "cuda" else ()):
        bx = torch.randn(2, 16, 3, 3, device=device, dtype=dt).contiguous(memory_format=torch.channels_last).requires_grad_()
        br = torch.randn_like(bx).requires_grad_()
        bw = (torch.rand(16, device=device) + 0.5).requires_grad_()
        bb = torch.randn(16, device=device).requires_grad_()
        rm, rv = torch.zeros(16, device=device), torch.ones(16, device=device)
        opcheck(ops.batch_norm_act.default, (bx, bw, bb, rm, rv), tag=f"batch_norm_act {device} {dt}")
        opcheck(ops.batch_norm_act.default, (bx, bw, bb, rm, rv, br, 0.1, 1e-5, False),
                tag=f"batch_norm_act residual {device} {dt}")

    # --- fp8_quantize (not differentiable: a scaled GEMM's operands), both formats, with and without q_t
    for dt in (torch.float32, torch.bfloat16):
        fx = torch.randn(33, 48, device=device, dtype=dt)
        for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
            opcheck(ops.fp8_quantize.default, (fx, fmt, True), tag=f"fp8_quantize {device} {dt} {fmt}")
        opcheck(ops.fp8_quantize.default, (fx, torch.float8_e4m3fn, False), tag=f"fp8_quantize no q_t {device} {dt}")
        opcheck(ops.fp8_quantize_sum.default, (fx, torch.float8_e5m2, True), tag=f"fp8_quantize_sum {device} {dt}")
        # fp8_linear: 3 x 7 tokens (d weight's reduction padded to 16), with and without bias
        lx = torch.randn(3, 7, 32, device=device, dtype=dt, requires_grad=True)
        lw = torch.randn(16, 32, device=device, dtype=dt, requires_grad=True)
        lb = torch.randn(16, device=device, dtype=dt, requires_grad=True)
        opcheck(ops.fp8_linear.default, (lx, lw, lb), tag=f"fp8_linear {device} {dt}")
        opcheck(ops.fp8_linear.default, (lx, lw), tag=f"fp8_linear no bias {device} {dt}")
        # a producer's amax (fp8_quantize and fp8_linear), and fp8_linear_swiglu (gate + up: 2 x 16 rows)
        opcheck(ops.fp8_quantize.default, (fx, torch.float8_e4m3fn, True, fx.float().abs().amax()),
                tag=f"fp8_quantize given amax {device} {dt}")
        opcheck(ops.fp8_linear.default, (lx, lw, None, lx.detach().float().abs().amax()),
                tag=f"fp8_linear given amax {device} {dt}")
        sw = torch.randn(32, 32, device=device, dtype=dt, requires_grad=True)
        opcheck(ops.fp8_linear_swiglu.default, (lx, sw), tag=f"fp8_linear_swiglu {device} {dt}")
        opcheck(ops.fp8_linear_swiglu.default, (lx, sw, lx.detach().float().abs().amax()),
                tag=f"fp8_linear_swiglu given amax {device} {dt}")

    # --- max_pool2d (CUDA kernels: fp32/bf16/fp16, NCHW or channels_last; scalar and vectorized C)
    for dt in (torch.float32,) + ((torch.bfloat16,) if device == "cuda" else ()):
        px = torch.randn(2, 8, 9, 7, device=device, dtype=dt)
        opcheck(ops.max_pool2d.default, (px.clone().requires_grad_(), [3], [2], [1]), tag=f"max_pool2d {device} {dt}")
        opcheck(ops.max_pool2d.default,
                (px.contiguous(memory_format=torch.channels_last).requires_grad_(), [2, 3], [2, 1], [1, 1]),
                tag=f"max_pool2d channels_last {device} {dt}")
        opcheck(ops.max_pool2d.default, (px[:, :3].clone().requires_grad_(), [2]), tag=f"max_pool2d C=3 {device} {dt}")

    # --- torch.compile(fullgraph=True) through every op, forward and backward
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def attn_loss(q, k, v):
        out, lse = ops.flash_attention(q, k, v, causal=True)
        return (out.float() ** 2).sum()

    try:
        loss = attn_loss(q, k, v)
        loss.backward()
        ref = ops.flash_attention(q.detach(), k.detach(), v.detach(), causal=True)[0]
        check(abs(loss.item() - (ref.float() ** 2).sum().item()) <= 1e-2 * abs(loss.item()) + 1e-3,
              f"compiled flash_attention {device}: value {loss.item()} vs eager")
        check(q.grad is not None and torch.isfinite(q.grad).all().item(), f"compiled flash_attention {device}: grad")
    except Exception as ex:
        check(False, f"torch.compile flash_attention {device}: {type(ex).__name__}: {str(ex)[:400]}")

    @torch.compile(fullgraph=True)
    def giou_and_check(p, t):
        loss = ops.generalized_box_iou_loss(p, t + 1, "mean") + ops.giou(p, t, "mean")
        found, norm = ops.nonfinite_check([p, t], True)
        return loss, found, norm

    try:
        pp = p.clone().requires_grad_()
        loss, found, norm = giou_and_check(pp, t)
        loss.backward()
        eager = ops.generalized_box_iou_loss(p, t + 1, "mean") + ops.giou(p, t, "mean")
        check(abs(loss.item() - eager.item()) < 1e-5, f"compiled giou {device}")
        check(found.item() == 0.0, f"compiled nonfinite_check {device}")
        check(pp.grad is not None, f"compiled giou grad {device}")
    except Exception as ex:
        check(False, f"torch.compile giou/nonfinite {device}: {type(ex).__name__}: {str(ex)[:400]}")

    @torch.compile(fullgraph=True)
    def sgd_step(params, grads, mb, st):
        ops.fused_sgd_(params, grads, mb, st, lr=0.1, momentum=0.9)

    try:
        ps = [torch.ones(4, device=device)]
        gs = [torch.ones(4, device=device)]
        sgd_step(ps, gs, [torch.zeros(4, device=device)], [torch.zeros((), device=device)])
        check(torch.allclose(ps[0], torch.full_like(ps[0], 0.9)), f"compiled fused_sgd_ {device}: {ps[0].tolist()}")
    except Exception as ex:
        check(False, f"torch.compile fused_sgd_ {device}: {type(ex).__name__}: {str(ex)[:400]}")

    @torch.compile(fullgraph=True)
    def pool_loss(x):
        return (ops.max_pool2d(x, [3], [2], [1]).float() ** 2).sum()

    try:
        px = torch.randn(2, 8, 11, 9, device=device).contiguous(memory_format=torch.channels_last)
        pa, pb = px.clone().requires_grad_(), px.clone().requires_grad_()
        pool_loss(pa).backward()
        (torch.nn.functional.max_pool2d(pb, 3, 2, 1) ** 2).sum().backward()
        check(torch.equal(pa.grad, pb.grad), f"compiled max_pool2d {device}: gradient differs from ATen's")
    except Exception as ex:
        check(False, f"torch.compile max_pool2d {device}: {type(ex).__name__}: {str(ex)[:400]}")

    @torch.compile(fullgraph=True)
    def fp8_loss(x, w, b):
        return (ops.fp8_linear(x, w, b).float() ** 2).sum()

    try:
        fx = torch.randn(3, 7, 32, device=device)
        fw = torch.randn(16, 32, device=device)
        fb = torch.randn(16, device=device)
        xa, wa = fx.clone().requires_grad_(), fw.clone().requires_grad_()
        xb, wb = fx.clone().requires_grad_(), fw.clone().requires_grad_()
        la = fp8_loss(xa, wa, fb)
        la.backward()
        lb = (ops.fp8_linear(xb, wb, fb).float() ** 2).sum()
        lb.backward()
        close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        check(close(la, lb) and close(xa.grad, xb.grad) and close(wa.grad, wb.grad),
              f"compiled fp8_linear {device}: loss {la.item()} vs eager {lb.item()}, or its gradients differ")
    except Exception as ex:
        check(False, f"torch.compile fp8_linear {device}: {type(ex).__name__}: {str(ex)[:400]}")


run("cpu")
if torch.cuda.is_available() and os.environ.get("STROBE_SKIP_CUDA") != "1":
    run("cuda")
else:
    print("CUDA part skipped: no GPU visible")
print("FAILED:" if FAILS else "all passed", len(FAILS))
sys.exit(1 if FAILS else 0)
