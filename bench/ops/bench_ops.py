"""Benchmarks of the strobe ops beside their PyTorch baselines, on one GPU, in one process.

  STROBE_BUILD_DIR=build python bench/ops/bench_ops.py [giou] [optim] [nonfinite]

Timing is bench/pytorch_baselines.py's: CUDA events around one call, median of 50 (host launch
overhead included, as for the baselines). For our ops we also report `graph` times: the same
calls captured in a CUDA graph and replayed 20x per timing, i.e. GPU time without host overhead.
Each result carries the memory-bound floor (bytes that must move / peak DRAM bandwidth).
Results print and go to $OUT/bench_ops.json (or /tmp).
"""
import json, os, sys, time

import torch

torch.ops.load_library(os.path.join(os.environ.get("STROBE_BUILD_DIR", "build"), "lib", "libstrobe_ops.so"))
ops = torch.ops.strobe
dev = torch.device("cuda")
R = {"device": torch.cuda.get_device_name()}
# H100 SXM 3.35 TB/s, H200 4.8 TB/s (HBM3e); floors use the nameplate number.
PEAK_BW = 4.8e12 if "H200" in R["device"] else 3.35e12


def bench(fn, warmup=10, rep=50):
    for _ in range(warmup): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]


def bench_graph(fn, inner=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner): fn()
    return bench(g.replay, warmup=3, rep=20) / inner


def us(ms): return round(ms * 1000, 2)


# The baseline's workload, verbatim from bench/pytorch_baselines.py (giou section).
def generalized_box_iou(boxes1, boxes2):
    eps = 1e-5
    area1 = (boxes1[..., 2]-boxes1[..., 0])*(boxes1[..., 3]-boxes1[..., 1])
    area2 = (boxes2[..., 2]-boxes2[..., 0])*(boxes2[..., 3]-boxes2[..., 1])
    lt = torch.max(boxes1[..., :2], boxes2[..., :2]); rb = torch.min(boxes1[..., 2:], boxes2[..., 2:])
    wh = rb - lt; inter = wh[..., 0] * wh[..., 1]
    union = area1 + area2 - inter; iou = inter / union.clamp(eps)
    lti = torch.min(boxes1[..., :2], boxes2[..., :2]); rbi = torch.max(boxes1[..., 2:], boxes2[..., 2:])
    whi = rbi - lti; areai = (whi[..., 0] * whi[..., 1]).clamp(eps)
    return iou - (areai - union) / areai


def loss_with_padding(pred, targets):
    mask = (targets[..., 3] > 0).to(pred.dtype)
    loss = generalized_box_iou(targets, pred) * mask
    return loss.sum() / torch.clamp(mask.sum(), 1)


# Correctness reference: the standard GIoU (torchvision.ops.generalized_box_iou), i.e. the baseline's
# formula with the intersection sides clamped at 0, which is what strobe::giou_loss computes. The
# seed's unclamped variants above are timed as baselines only (they diverge for boxes disjoint on
# both axes, so their values are not a reference).
def loss_with_padding_clamped(pred, targets):
    lt = torch.max(targets[..., :2], pred[..., :2]); rb = torch.min(targets[..., 2:], pred[..., 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = (targets[..., 2:] - targets[..., :2]).prod(-1) + (pred[..., 2:] - pred[..., :2]).prod(-1) - inter
    whi = torch.max(targets[..., 2:], pred[..., 2:]) - torch.min(targets[..., :2], pred[..., :2])
    areai = whi.prod(-1).clamp(1e-5)
    mask = (targets[..., 3] > 0).to(pred.dtype)
    loss = (inter / union.clamp(1e-5) - (areai - union) / areai) * mask
    return loss.sum() / torch.clamp(mask.sum(), 1)


def make_boxes(B, N=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = torch.clamp(torch.floor(torch.abs(torch.randn(B, generator=g) * 3)), 0, 255).long()
    tl = torch.randint(0, 255, (B, N, 2), generator=g); sz = torch.randint(1, 256, (B, N, 2), generator=g)
    br = torch.clamp(tl + sz, 0, 255); t = torch.cat([tl, br], -1).float()
    valid = torch.arange(N)[None, :] < n[:, None]
    t = t * valid[..., None]
    ptl = torch.rand(B, N, 2, generator=g) * 200; p = torch.cat([ptl, ptl + 1 + torch.rand(B, N, 2, generator=g) * 50], -1)
    return p, t, n


def giou():
    gbi = generalized_box_iou
    B, N = 1024, 256
    p, t, n = make_boxes(B, N)
    res = {}
    for dt in (torch.float32, torch.bfloat16):
        tag = "fp32" if dt == torch.float32 else "bf16"
        pred = p.to(dev, dt).requires_grad_(); tgt = t.to(dev)
        tl = [tgt[i, :n[i]] for i in range(B)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]).to(dev)
        packed = torch.cat(tl)
        comp = torch.compile(loss_with_padding)

        def loop():
            s = 0.; tot = 0
            for i in range(B):
                k = int(n[i])
                if k: s = s + gbi(pred[i, :k], tl[i]).sum(); tot += k
            return s / max(tot, 1)

        def concat():
            allt = torch.cat(tl); allp = torch.cat([pred[i, :int(n[i])] for i in range(B)])
            return gbi(allt, allp).sum() / max(int(n.sum()), 1)

        fns = [("loop", loop), ("concat", concat), ("padded_eager", lambda: loss_with_padding(pred, tgt)),
               ("padded_compiled", lambda: comp(pred, tgt)),
               ("strobe_padded", lambda: ops.giou_loss(pred, tgt)),
               ("strobe_packed", lambda: ops.giou_loss_packed(pred, packed, offsets))]
        for name, f in fns:
            slow = name == "loop"
            res[f"{tag}.{name}.fwd_us"] = us(bench(f, warmup=2 if slow else 10, rep=3 if slow else 50))
            res[f"{tag}.{name}.fwdbwd_us"] = us(bench(lambda: f().backward(), warmup=2 if slow else 10, rep=3 if slow else 50))
        with torch.no_grad():
            res[f"{tag}.strobe_padded.fwd_nograd_us"] = us(bench(lambda: ops.giou_loss(pred, tgt)))
        # GPU time alone: graph-captured forward+backward via autograd.grad (no .grad accumulation).
        res[f"{tag}.strobe_padded.fwdbwd_graph_us"] = us(bench_graph(lambda: torch.autograd.grad(ops.giou_loss(pred, tgt), pred)))
        with torch.no_grad():
            res[f"{tag}.strobe_padded.fwd_graph_us"] = us(bench_graph(lambda: ops.giou_loss(pred, tgt)))
        res[f"{tag}.padded_compiled.fwdbwd_graph_us"] = us(bench_graph(lambda: torch.autograd.grad(comp(pred, tgt), pred)))
        try:
            import triton, triton.language as tl_

            @triton.jit
            def giou_kernel(preds_ptr, targets_ptr, output_ptr, valid_ptr, BLOCK_SIZE: tl_.constexpr):
                pid = tl_.program_id(axis=0); box_id = tl_.arange(0, BLOCK_SIZE); off = pid * BLOCK_SIZE + box_id
                pl = tl_.load(preds_ptr + 0 + 4 * off).to(tl_.float32); pt = tl_.load(preds_ptr + 1 + 4 * off).to(tl_.float32)
                pr = tl_.load(preds_ptr + 2 + 4 * off).to(tl_.float32); pb = tl_.load(preds_ptr + 3 + 4 * off).to(tl_.float32)
                gl = tl_.load(targets_ptr + 0 + 4 * off); gt = tl_.load(targets_ptr + 1 + 4 * off)
                gr = tl_.load(targets_ptr + 2 + 4 * off); gb = tl_.load(targets_ptr + 3 + 4 * off)
                eps = 1e-5
                a1 = (pr - pl) * (pb - pt); a2 = (gr - gl) * (gb - gt)
                iw = tl_.minimum(pr, gr) - tl_.maximum(pl, gl); ih = tl_.minimum(pb, gb) - tl_.maximum(pt, gt)
                inter = iw * ih; uni = a1 + a2 - inter; iou = inter / tl_.maximum(uni, eps)
                ew = tl_.maximum(pr, gr) - tl_.minimum(pl, gl); eh = tl_.maximum(pb, gb) - tl_.minimum(pt, gt)
                ea = ew * eh; g = iou - (ea - uni) / tl_.maximum(ea, eps)
                tl_.store(output_ptr + off, tl_.where(gb > 0, g, 0)); tl_.store(valid_ptr + off, gb > 0)

            def tri():
                out = torch.empty(B, N, device=dev); val = torch.empty(B, N, device=dev, dtype=torch.bool)
                giou_kernel[(B,)](pred.detach(), tgt, out, val, BLOCK_SIZE=N)
                return out.sum() / val.sum().clamp(1)
            res[f"{tag}.triton_seed.fwd_us"] = us(bench(tri))
        except Exception as ex:
            res[f"{tag}.triton_seed.error"] = repr(ex)[:200]
        # Floors: fwd reads pred + targets; fwd+bwd also writes grad_pred once.
        pb, tb = pred.element_size() * 4 * B * N, tgt.element_size() * 4 * B * N
        res[f"{tag}.floor.fwd_us"] = round((pb + tb) / PEAK_BW * 1e6, 2)
        res[f"{tag}.floor.fwdbwd_us"] = round((2 * pb + tb) / PEAK_BW * 1e6, 2)
        ref_p = pred.detach().double().requires_grad_()
        ref = loss_with_padding_clamped(ref_p, tgt.double())
        g_ref, = torch.autograd.grad(ref, ref_p)
        ours = ops.giou_loss(pred, tgt)
        g_ours, = torch.autograd.grad(ours, pred)
        res[f"{tag}.strobe_padded.rel_err_vs_fp64"] = abs(float(ours) - float(ref)) / abs(float(ref))
        res[f"{tag}.strobe_padded.grad_rel_err_vs_fp64"] = float((g_ours.double() - g_ref).norm() / g_ref.norm())
    R["giou"] = res


def vit_l16_shapes():
    d, mlp, depth = 1024, 4096, 24
    shapes = [(d, 3, 16, 16), (d,), (1, 1, d), (1, 197, d)]
    for _ in range(depth):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (mlp, d), (mlp,), (d, mlp), (d,)]
    return shapes + [(d,), (d,), (1000, d), (1000,)]


def optim():
    shapes = vit_l16_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    res = {"params": numel, "tensors": len(shapes)}
    torch.manual_seed(0)
    params = [torch.randn(s, device=dev) * 0.02 for s in shapes]
    for gdt, tag in ((torch.float32, "fp32_grads"), (torch.bfloat16, "bf16_grads")):
        grads = [torch.randn(s, device=dev, dtype=gdt) * 1e-3 for s in shapes]
        ps = [p.clone() for p in params]
        m = [torch.zeros_like(p) for p in ps]; v = [torch.zeros_like(p) for p in ps]
        st = [torch.zeros((), device=dev) for _ in ps]
        found = torch.zeros((), device=dev)

        def ours():
            ops.fused_adamw_(ps, grads, m, v, [], st, lr=1e-4, weight_decay=0.05, found_nonfinite=found)
        res[f"{tag}.strobe_fused_adamw_ms"] = round(bench(ours, warmup=5, rep=20), 3)
        if gdt == torch.float32:
            tp = [p.clone().requires_grad_() for p in params]
            for p, g in zip(tp, grads): p.grad = g
            for kind, kw in (("torch_fused", {"fused": True}), ("torch_foreach", {"foreach": True})):
                opt = torch.optim.AdamW(tp, lr=1e-4, weight_decay=0.05, **kw)
                res[f"{tag}.{kind}_adamw_ms"] = round(bench(opt.step, warmup=5, rep=20), 3)
                del opt
        # Floor: read p, g, m, v and write p, m, v once.
        bytes_ = numel * (4 * 3 + torch.tensor([], dtype=gdt).element_size() + 4 * 3)
        res[f"{tag}.floor_ms"] = round(bytes_ / PEAK_BW * 1e3, 3)
        del ps, m, v, grads
    R["optim"] = res


def nonfinite():
    shapes = vit_l16_shapes()
    grads = [torch.randn(s, device=dev) for s in shapes]
    res = {}
    res["strobe_nonfinite_check_ms"] = round(bench(lambda: ops.nonfinite_check(grads, False)), 3)
    res["strobe_nonfinite_check_with_norm_ms"] = round(bench(lambda: ops.nonfinite_check(grads, True)), 3)
    found = torch.zeros((), device=dev); inv = torch.ones((), device=dev)
    res["torch_amp_foreach_non_finite_check_and_unscale_ms"] = round(bench(lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)), 3)
    res["torch_foreach_total_norm_ms"] = round(bench(lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))), 3)
    res["floor_ms"] = round(sum(g.numel() for g in grads) * 4 / PEAK_BW * 1e3, 3)
    R["nonfinite"] = res


if __name__ == "__main__":
    want = sys.argv[1:] or ["giou", "optim", "nonfinite"]
    for name in want:
        t0 = time.time()
        try:
            globals()[name]()
        except Exception as ex:
            import traceback; traceback.print_exc(); R[name + ".error"] = repr(ex)[:300]
        print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
    print(json.dumps(R, indent=1))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "bench_ops.json"), "w") as f:
        json.dump(R, f, indent=1)
