"""strobe ops loaded from Python (torch.ops.load_library) against PyTorch.

CPU checks always run; CUDA checks run when a GPU is visible and the library has its CUDA kernels
(otherwise they are skipped with a message). Exit 77 (ctest: skipped) only if the library was not
built. Run: STROBE_BUILD_DIR=build python tests/python/test_ops.py
"""
import math
import os
import sys

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


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    d = (a - b).norm().item()
    n = b.norm().item()
    return d / n if n else d


# generalized_box_iou / loss_with_padding of bench/pytorch_baselines.py, with the standard clamp of
# the intersection sides at 0 (torchvision.ops.generalized_box_iou); clamp=False is the seed's
# formula, which diverges for boxes disjoint on both axes.
def generalized_box_iou(boxes1, boxes2, clamp=True):
    eps = 1e-5
    area1 = (boxes1[..., 2]-boxes1[..., 0])*(boxes1[..., 3]-boxes1[..., 1])
    area2 = (boxes2[..., 2]-boxes2[..., 0])*(boxes2[..., 3]-boxes2[..., 1])
    lt = torch.max(boxes1[..., :2], boxes2[..., :2]); rb = torch.min(boxes1[..., 2:], boxes2[..., 2:])
    wh = rb - lt
    if clamp:
        wh = wh.clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = area1 + area2 - inter; iou = inter / union.clamp(eps)
    lti = torch.min(boxes1[..., :2], boxes2[..., :2]); rbi = torch.max(boxes1[..., 2:], boxes2[..., 2:])
    whi = rbi - lti; areai = (whi[..., 0] * whi[..., 1]).clamp(eps)
    return iou - (areai - union) / areai


def loss_with_padding(pred, targets):
    mask = (targets[..., 3] > 0).to(pred.dtype)
    loss = generalized_box_iou(targets, pred) * mask
    return loss.sum() / torch.clamp(mask.sum(), 1)


def make_boxes(B, N, seed):
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(0, N + 1, (B,), generator=g)
    tl = torch.randint(0, 255, (B, N, 2), generator=g); sz = torch.randint(1, 256, (B, N, 2), generator=g)
    t = torch.cat([tl, torch.clamp(tl + sz, 0, 255)], -1).float() * (torch.arange(N)[None, :] < n[:, None])[..., None]
    ptl = torch.rand(B, N, 2, generator=g) * 200
    return torch.cat([ptl, ptl + 1 + torch.rand(B, N, 2, generator=g) * 50], -1), t


def giou_case(device, dtype, B, N, seed, bound):
    p, t = make_boxes(B, N, seed)
    p = p.to(dtype)
    ref_p = p.double().requires_grad_()
    ref = loss_with_padding(ref_p, t.double()); ref.backward()
    got_p = p.to(device).requires_grad_()
    got = ops.giou(got_p, t.to(device), "mean"); got.backward()
    tag = f"giou {device} {dtype} B={B} N={N}"
    check(got.dtype == torch.float32, f"{tag}: loss dtype {got.dtype}")
    check(rel(got, ref) < bound, f"{tag}: loss rel err {rel(got, ref):.2e}")
    # The gradient has pred's dtype: compare with the reference rounded to it (fp16 gradients of a
    # mean over many boxes are fp16 subnormals or 0).
    g_ref = ref_p.grad.to(dtype)
    check(rel(got_p.grad, g_ref) < bound, f"{tag}: grad rel err {rel(got_p.grad, g_ref):.2e}")


def giou_disjoint_case(device, dtype):
    # Predictions disjoint from their targets on both axes (near and far): finite, in [-1, 1] per box,
    # finite gradients, equal to the clamped float64 autograd reference. The seed's formula gives
    # ~2e7 on the second box (positive "intersection", union < eps).
    t = torch.tensor([[[0, 0, 1e-3, 1e-3], [0, 0, 10, 10], [100, 100, 110, 120], [0, 0, 4, 4],
                       [50, 50, 51, 51]]], dtype=torch.float64)
    p = torch.tensor([[[2e-3, 2e-3, 3e-3, 3e-3], [20, 30, 25, 31], [0, 0, 90, 95], [4.5, 4.5, 5, 5],
                       [51.001, 51.001, 51.002, 51.002]]], dtype=torch.float64).to(dtype)
    tag = f"giou disjoint {device} {dtype}"
    seed = generalized_box_iou(t, p.double(), clamp=False)
    check(not bool(((seed >= -1) & (seed <= 1)).all()), f"{tag}: seed formula unexpectedly bounded")
    ref_p = p.double().requires_grad_()
    ref = generalized_box_iou(t, ref_p); ref.backward(torch.linspace(-1, 1, ref.numel(), dtype=torch.float64).view_as(ref))
    got_p = p.to(device).requires_grad_()
    got = ops.giou(got_p, t.to(device).to(dtype), "none")
    got.backward(torch.linspace(-1, 1, got.numel(), device=device).view_as(got).to(got.dtype))
    check(bool(torch.isfinite(got).all()), f"{tag}: non-finite loss {got}")
    check(bool(((got >= -1) & (got <= 1)).all()), f"{tag}: loss outside [-1, 1]: {got}")
    check(bool(torch.isfinite(got_p.grad).all()), f"{tag}: non-finite grad {got_p.grad}")
    bound = 1e-12 if dtype == torch.float64 else 1e-5
    check(rel(got, ref) < bound, f"{tag}: loss rel err {rel(got, ref):.2e}")
    check(rel(got_p.grad, ref_p.grad) < bound, f"{tag}: grad rel err {rel(got_p.grad, ref_p.grad):.2e}")
    gm_p = p.to(device).requires_grad_()
    m = ops.giou(gm_p, t.to(device).to(dtype), "mean"); (1 - m).backward()
    check(bool(torch.isfinite(m)) and -1 <= float(m) <= 1, f"{tag}: mean {float(m)}")
    check(bool(torch.isfinite(gm_p.grad).all()), f"{tag}: non-finite grad of the mean {gm_p.grad}")


def adamw_case(device, grad_dtype, steps=100):
    torch.manual_seed(0)
    shapes = [(7,), (3, 5), (64, 33), (1,), (2, 3, 4)]
    ref_p = [torch.randn(s, device=device, requires_grad=True) for s in shapes]
    ours = [p.detach().clone() for p in ref_p]
    m = [torch.zeros_like(p) for p in ours]; v = [torch.zeros_like(p) for p in ours]
    st = [torch.zeros((), device=device) for _ in ours]
    kw = {"fused": True} if device == "cuda" else {"foreach": False}
    opt = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, **kw)
    for s in range(steps):
        grads = [torch.randn_like(p) for p in ours]
        for p, g in zip(ref_p, grads):
            p.grad = g.to(grad_dtype).float()
        found = torch.tensor(float(s % 10 == 9), device=device)
        if s % 10 != 9:
            opt.step()
        with torch.no_grad():
            ops.fused_adamw_(ours, [g.to(grad_dtype) for g in grads], m, v, [], st, lr=1e-2,
                             weight_decay=0.1, found_nonfinite=found)
    worst = max(rel(a, b) for a, b in zip(ours, ref_p))
    check(worst < 1e-4, f"fused_adamw_ {device} {grad_dtype}: rel diff {worst:.2e} after {steps} steps")
    check(all(float(x) == steps - steps // 10 for x in st), f"fused_adamw_ {device}: step counts {st[0]}")


def nonfinite_case(device):
    ts = [torch.randn(1000, device=device), torch.randn(33, device=device).bfloat16(), torch.randn(5, device=device).half()]
    found, norm = ops.nonfinite_check(ts, True)
    want = math.sqrt(sum(float(t.double().square().sum()) for t in ts))
    check(float(found) == 0.0, f"nonfinite_check {device}: clean list flagged")
    check(abs(float(norm) - want) < 1e-5 * want, f"nonfinite_check {device}: norm {float(norm)} vs {want}")
    ts[1][7] = float("nan")
    found, norm = ops.nonfinite_check(ts, False)
    check(float(found) == 1.0 and norm is None, f"nonfinite_check {device}: NaN not flagged")


def gloss_case(device, dtype):
    """generalized_box_iou_loss against torchvision.ops.generalized_box_iou_loss (1 - GIoU)."""
    try:
        from torchvision.ops import generalized_box_iou_loss as tv_loss
    except ImportError:
        print("generalized_box_iou_loss: torchvision missing, compared with 1 - generalized_box_iou")
        tv_loss = None
    p, t = make_boxes(4, 33, 7)
    t = t + torch.tensor([0, 0, 1.0, 1.0])  # every pair counts here: no zero (padding) rows
    for red in ("none", "mean", "sum"):
        ref_p = p.detach().to(dtype).double().requires_grad_()  # the same (rounded) boxes
        ref = tv_loss(ref_p, t.double(), reduction=red) if tv_loss else {
            "none": lambda x: x, "mean": torch.mean, "sum": torch.sum}[red](1 - generalized_box_iou(t.double(), ref_p))
        (ref.sum()).backward()
        got_p = p.detach().to(device, dtype).clone().requires_grad_()
        got = ops.generalized_box_iou_loss(got_p, t.to(device), red)
        got.sum().backward()
        tag = f"generalized_box_iou_loss {device} {dtype} {red}"
        check(got.shape == ref.shape, f"{tag}: shape {tuple(got.shape)} vs {tuple(ref.shape)}")
        bound = 1e-6 if dtype == torch.float32 else 1e-2
        check(rel(got, ref) < bound, f"{tag}: rel err {rel(got, ref):.2e}")
        check(rel(got_p.grad, ref_p.grad) < (1e-5 if dtype == torch.float32 else 2e-2), f"{tag}: grad rel err {rel(got_p.grad, ref_p.grad):.2e}")
        # The seed-compatible value is GIoU itself: loss = 1 - giou per pair.
        if red == "none":
            g = ops.giou_packed(p.reshape(-1, 4).to(device, dtype), t.reshape(-1, 4).to(device),
                                torch.tensor([0, p.numel() // 4], device=device), "none")
            check(rel(got.reshape(-1), 1 - g) < 1e-6, f"{tag}: not 1 - giou")


# ---- CPU ----
gloss_case("cpu", torch.float32)
for B, N in [(1, 1), (3, 7), (3, 256), (2, 1000)]:
    giou_case("cpu", torch.float32, B, N, B * N, 1e-5)
giou_case("cpu", torch.bfloat16, 16, 256, 5, 1e-2)
giou_disjoint_case("cpu", torch.float64)
giou_disjoint_case("cpu", torch.float32)
try:
    ops.giou(torch.rand(2, 3, 4), torch.rand(2, 3, 4), "avg")
    check(False, "giou_loss accepted reduction 'avg'")
except RuntimeError:
    pass
nonfinite_case("cpu")
adamw_case("cpu", torch.float32)

# ---- CUDA ----
cuda_ok = torch.cuda.is_available()
if cuda_ok:
    try:
        ops.giou(torch.rand(1, 1, 4, device="cuda"), torch.rand(1, 1, 4, device="cuda"))
    except (RuntimeError, NotImplementedError) as ex:
        print("CUDA checks skipped: library built without CUDA kernels:", str(ex).splitlines()[0])
        cuda_ok = False
if cuda_ok:
    seed = 100
    for dtype, bound in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)]:
        for N in (1, 7, 256, 1000):
            for B in (1, 3, 1024):
                seed += 1
                giou_case("cuda", dtype, B, N, seed, bound)
    giou_disjoint_case("cuda", torch.float32)
    gloss_case("cuda", torch.float32)
    gloss_case("cuda", torch.bfloat16)
    # Against the PyTorch fp32 (clamped) reference on the GPU (same data the benchmarks use).
    p, t = make_boxes(1024, 256, 0)
    p, t = p.cuda().requires_grad_(), t.cuda()
    base = loss_with_padding(p, t); base.backward(); g_base = p.grad.clone(); p.grad = None
    ours = ops.giou(p, t); ours.backward()
    check(rel(ours, base) < 1e-4, f"giou cuda vs PyTorch fp32 reference: {rel(ours, base):.2e}")
    check(rel(p.grad, g_base) < 1e-4, f"giou grad cuda vs PyTorch fp32 reference: {rel(p.grad, g_base):.2e}")
    nonfinite_case("cuda")
    adamw_case("cuda", torch.float32)
    adamw_case("cuda", torch.bfloat16)
else:
    print("CUDA checks skipped: no CUDA device visible" if not torch.cuda.is_available() else "")

print("FAILED:" if FAILS else "all checks passed", *FAILS, sep="\n  ")
sys.exit(1 if FAILS else 0)
