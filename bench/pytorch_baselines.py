"""Copy of shared/bench/pytorch_baselines.py (the PyTorch anchors of the seed workloads), kept in the
repository so that a GPU call can run it beside strobe's benchmarks. Same workloads, unchanged.

PyTorch baselines for Strobe's benchmark workloads (the seeds' workloads), run on a GPU machine.
Run it in the same session as `strobe bench` so that ratios compare like with like.
Each section is independent; results are printed and written as JSON to $OUT (or /tmp).
Usage: python3 pytorch_baselines.py [giou] [attn] [vit] [lm] [nan] [metrics] [detector] [resnet50] [llama] [llama_plus] [vit_fp8] [llama_ops]
"""
import json, math, os, sys, time, traceback, functools, random
import torch, torch.nn as nn, torch.nn.functional as F

R = {}
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = True
torch.set_float32_matmul_precision("high")

def bench(fn, warmup=10, rep=50):
    for _ in range(warmup): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2]  # median ms

def section(name):
    def deco(f):
        def run():
            t0 = time.time()
            try: f()
            except Exception as ex:
                R[name + ".error"] = repr(ex)[:300]; traceback.print_exc()
            print(f"[{name}] {time.time()-t0:.1f}s", flush=True)
        run.__name__ = name; return run
    return deco

# ---------------- GIoU loss (seed: custom-cuda-giou-kernel.txt, triton-giou-kernel.txt) ----------------
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

def make_boxes(B, N=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = torch.clamp(torch.floor(torch.abs(torch.randn(B, generator=g) * 3)), 0, 255).long()
    tl = torch.randint(0, 255, (B, N, 2), generator=g); sz = torch.randint(1, 256, (B, N, 2), generator=g)
    br = torch.clamp(tl + sz, 0, 255); t = torch.cat([tl, br], -1).float()
    valid = torch.arange(N)[None, :] < n[:, None]
    t = t * valid[..., None]
    ptl = torch.rand(B, N, 2, generator=g) * 200; p = torch.cat([ptl, ptl + 1 + torch.rand(B, N, 2, generator=g) * 50], -1)
    return p, t, n

@section("giou")
def giou_section():
    B, N = 1024, 256
    p, t, n = make_boxes(B, N)
    res = {}
    for dt in (torch.float32, torch.bfloat16):
        tag = "fp32" if dt == torch.float32 else "bf16"
        pred = p.to(dev, dt).requires_grad_(); tgt = t.to(dev)
        tl = [tgt[i, :n[i]] for i in range(B)]
        def loop():
            s = 0.; tot = 0
            for i in range(B):
                k = int(n[i])
                if k: s = s + generalized_box_iou(pred[i, :k], tl[i]).sum(); tot += k
            return s / max(tot, 1)
        def concat():
            allt = torch.cat(tl); allp = torch.cat([pred[i, :int(n[i])] for i in range(B)])
            return generalized_box_iou(allt, allp).sum() / max(int(n.sum()), 1)
        pad = lambda: loss_with_padding(pred, tgt)
        comp = torch.compile(loss_with_padding)
        padc = lambda: comp(pred, tgt)
        import torchvision
        def tv():
            m = (tgt[..., 3] > 0)
            l = torchvision.ops.generalized_box_iou_loss(pred.float().reshape(-1, 4), tgt.reshape(-1, 4), reduction="none")
            return (l * m.reshape(-1)).sum() / m.sum().clamp(1)
        for name, f in [("loop", loop), ("concat", concat), ("padded_eager", pad), ("padded_compiled", padc), ("torchvision_padded", tv)]:
            rep = 3 if name == "loop" else 50
            fw = bench(lambda: f(), warmup=2 if name == "loop" else 10, rep=rep)
            fb = bench(lambda: f().backward(), warmup=2 if name == "loop" else 10, rep=rep)
            res[f"{tag}.{name}.fwd_us"] = round(fw * 1000, 1); res[f"{tag}.{name}.fwdbwd_us"] = round(fb * 1000, 1)
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
            res[f"{tag}.triton_seed.fwd_us"] = round(bench(tri) * 1000, 1)
        except Exception as ex:
            res[f"{tag}.triton_seed.error"] = repr(ex)[:200]
    # floor: bytes of bf16 preds + fp32 targets read once
    R["giou"] = res

# ---------------- attention kernels (seed: attention-kernels-vit.txt, varlen-transformer.txt) ----------------
def attn_flops(B, H, S, D, causal=False):
    f = 4 * B * H * S * S * D
    return f / 2 if causal else f

@section("attn")
def attn_section():
    from torch.nn.attention import sdpa_kernel, SDPBackend
    res = {}
    shapes = [("vit_b128_s196_h16_d64", 128, 16, 196, 64, False), ("long_b8_s3136_h12_d64", 8, 12, 3136, 64, False),
              ("lm_b32_s1024_h16_d64_causal", 32, 16, 1024, 64, True), ("b16_s2048_h16_d128_causal", 16, 16, 2048, 128, True)]
    for name, B, H, S, D, causal in shapes:
        q, k, v = [torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        do = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
        fl = attn_flops(B, H, S, D, causal)
        for be in ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]:
            if be == "MATH" and S > 2048: continue
            try:
                with sdpa_kernel([getattr(SDPBackend, be)]):
                    fw = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    fb = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(do))
                res[f"{name}.{be}.fwd_ms"] = round(fw, 3); res[f"{name}.{be}.fwd_tflops"] = round(fl / fw / 1e9, 1)
                res[f"{name}.{be}.fwdbwd_ms"] = round(fb, 3); res[f"{name}.{be}.fwdbwd_tflops"] = round(3.5 * fl / fb / 1e9, 1)
            except Exception as ex:
                res[f"{name}.{be}.error"] = repr(ex)[:160]
    # variable length: 32 sequences with lengths uniform in [1, 1023] (seed), causal, H16 D64
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 1024, (32,), generator=g)
    H, D = 16, 64
    useful = sum(4 * H * D * int(L) * int(L) / 2 for L in lens)
    res["varlen.total_tokens"] = int(lens.sum()); res["varlen.useful_gflop_fwd"] = round(useful / 1e9, 2)
    # padded with mask (what the seed's baseline does)
    S = 1024
    q, k, v = [torch.randn(32, H, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    keep = (torch.arange(S)[None, :] < lens[:, None]).to(dev)
    mask = keep[:, None, None, :] & torch.ones(S, S, dtype=torch.bool, device=dev).tril()[None, None]
    do = torch.randn_like(q)
    try:
        fw = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        fb = bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(do))
        res["varlen.padded_mask_sdpa.fwd_ms"] = round(fw, 3); res["varlen.padded_mask_sdpa.fwdbwd_ms"] = round(fb, 3)
        fw = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        fb = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do))
        res["varlen.padded_causal_flash.fwd_ms"] = round(fw, 3); res["varlen.padded_causal_flash.fwdbwd_ms"] = round(fb, 3)
    except Exception as ex: res["varlen.padded.error"] = repr(ex)[:160]
    T = int(lens.sum())
    qp, kp, vp = [torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    dop = torch.randn_like(qp)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(dev, torch.int32)
    try:
        from torch.nn.attention.varlen import varlen_attn
        import inspect
        sig = inspect.signature(varlen_attn); res["varlen.varlen_attn.signature"] = str(sig)[:300]
        kw = {"is_causal": True} if "is_causal" in sig.parameters else ({"causal": True} if "causal" in sig.parameters else {"window_size": (-1, 0)})
        f = lambda: varlen_attn(qp, kp, vp, cu, cu, 1024, 1024, **kw)
        fw = bench(f); fb = bench(lambda: f().backward(dop))
        res["varlen.varlen_attn.fwd_ms"] = round(fw, 3); res["varlen.varlen_attn.fwdbwd_ms"] = round(fb, 3)
        res["varlen.varlen_attn.fwd_useful_tflops"] = round(useful / fw / 1e9, 1)
        res["varlen.varlen_attn.fwdbwd_useful_tflops"] = round(3.5 * useful / fb / 1e9, 1)
    except Exception as ex: res["varlen.varlen_attn.error"] = repr(ex)[:200]
    try:
        nq = torch.nested.nested_tensor_from_jagged(qp.detach(), offsets=cu.long()).requires_grad_()
        # layout (B, j, H, D) -> (B, H, j, D)
        def nj():
            x = nq.transpose(1, 2)
            return F.scaled_dot_product_attention(x, x, x, is_causal=True)
        fw = bench(nj); res["varlen.nested_sdpa.fwd_ms"] = round(fw, 3)
    except Exception as ex: res["varlen.nested.error"] = repr(ex)[:200]
    try:
        from torch.nn.attention.flex_attention import flex_attention, create_block_mask
        doc = torch.repeat_interleave(torch.arange(32, device=dev), lens.to(dev))
        def doc_causal(b, h, qi, ki): return (doc[qi] == doc[ki]) & (qi >= ki)
        bm = create_block_mask(doc_causal, None, None, T, T, device="cuda")
        flex = torch.compile(flex_attention)
        q4, k4, v4 = [x.detach().transpose(0, 1)[None].contiguous().requires_grad_() for x in (qp, kp, vp)]
        f = lambda: flex(q4, k4, v4, block_mask=bm)
        do4 = torch.randn_like(q4)
        fw = bench(f); fb = bench(lambda: f().backward(do4))
        res["varlen.flex_doc_causal.fwd_ms"] = round(fw, 3); res["varlen.flex_doc_causal.fwdbwd_ms"] = round(fb, 3)
    except Exception as ex: res["varlen.flex.error"] = repr(ex)[:200]
    R["attn"] = res

# ---------------- full training steps ----------------
def time_steps(step, warm=8, n=30):
    for _ in range(warm): step()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): step()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / n * 1000

@section("vit")
def vit_section():
    from timm.models.vision_transformer import VisionTransformer
    res = {}
    for compile_ in (False, True):
        torch.manual_seed(0)
        m = VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=24, num_heads=16, class_token=False, global_pool="avg").to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        mm = torch.compile(m) if compile_ else m
        x = torch.randn(128, 3, 224, 224, device=dev); y = torch.randint(0, 1000, (128,), device=dev)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(mm(x), y)
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        res["vit_l16_b128.step_ms." + ("compiled" if compile_ else "eager")] = round(time_steps(step), 1)
        del m, opt, mm; torch.cuda.empty_cache()
    R["vit"] = res

class Block(nn.Module):
    def __init__(self, dim, heads, attn):
        super().__init__(); self.h = heads; self.attn = attn
        self.n1 = nn.LayerNorm(dim, bias=False); self.n2 = nn.LayerNorm(dim, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim); self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, 4 * dim); self.fc2 = nn.Linear(4 * dim, dim)
    def forward(self, x, meta):
        B, S, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, S, 3, self.h, C // self.h).unbind(2)
        a = self.attn(q, k, v, meta).reshape(B, S, C)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))

class Decoder(nn.Module):
    def __init__(self, attn, vocab=1024, dim=1024, heads=16, depth=24, maxlen=1024):
        super().__init__(); self.emb = nn.Embedding(vocab, dim); self.pos = nn.Embedding(maxlen, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, attn) for _ in range(depth)]); self.out = nn.Linear(dim, vocab)
    def forward(self, ids, pos, meta):
        x = self.emb(ids) + self.pos(pos)
        for b in self.blocks: x = b(x, meta)
        return self.out(x)

@section("lm")
def lm_section():
    res = {}
    g = torch.Generator().manual_seed(0)
    B, S = 32, 1024
    lens = torch.randint(1, S, (B,), generator=g)
    ids = torch.randint(1, 1024, (B, S), generator=g); keep = torch.arange(S)[None] < lens[:, None]
    ids = (ids * keep).to(dev); tgt = torch.roll(ids, -1, 1) * keep.to(dev)
    pos = torch.arange(S, device=dev)[None].expand(B, S)
    mask = keep.to(dev)[:, None, None, :] & torch.ones(S, S, dtype=torch.bool, device=dev).tril()[None, None]
    def padded_attn(q, k, v, meta):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=meta)
        return o.transpose(1, 2)
    def causal_attn(q, k, v, meta):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    for name, attn, meta in [("padded_mask_sdpa", padded_attn, mask), ("padded_causal_flash_nomask", causal_attn, None)]:
        torch.manual_seed(0); m = Decoder(attn).to(dev); opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(ids, pos, meta); loss = F.cross_entropy(out.view(-1, 1024), tgt.flatten(), ignore_index=0)
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        res[f"lm_d24_b32.{name}.step_ms"] = round(time_steps(step, warm=5, n=20), 1)
        del m, opt; torch.cuda.empty_cache()
    try:
        from torch.nn.attention.varlen import varlen_attn
        T = int(lens.sum()); cu = F.pad(torch.cumsum(lens, 0), (1, 0)).to(dev, torch.int32)
        pids = torch.cat([torch.randint(1, 1024, (int(L),), generator=g) for L in lens]).to(dev)[None]
        ptgt = torch.roll(pids, -1, 1); ppos = torch.cat([torch.arange(int(L)) for L in lens]).to(dev)[None]
        import inspect
        sig = inspect.signature(varlen_attn)
        kw = {"is_causal": True} if "is_causal" in sig.parameters else ({"causal": True} if "causal" in sig.parameters else {"window_size": (-1, 0)})
        def va(q, k, v, meta):
            return varlen_attn(q[0], k[0], v[0], meta, meta, 1024, 1024, **kw)[None]
        torch.manual_seed(0); m = Decoder(va).to(dev); opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(pids, ppos, cu); loss = F.cross_entropy(out.view(-1, 1024), ptgt.flatten())
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        res["lm_d24_b32.packed_varlen_attn.step_ms"] = round(time_steps(step, warm=5, n=20), 1)
    except Exception as ex: res["lm.varlen.error"] = repr(ex)[:200]; traceback.print_exc()
    R["lm"] = res

@section("nan")
def nan_section():
    import lightning.pytorch as pl, numpy as np, torchvision
    from copy import deepcopy
    from torch.utils.data import Dataset, DataLoader
    res = {}
    class NaNCapture(pl.Callback):
        def __init__(self): self.nan_captured = False; self.rng = {}
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.last_batch = deepcopy(batch)
            self.rng = {"torch": torch.random.get_rng_state(), "cuda": torch.cuda.get_rng_state_all(), "np": np.random.get_state(), "py": random.getstate()}
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad.view(-1) for p in pl_module.parameters() if p.grad is not None]
            if torch.isnan(torch.cat(grads)).any().item(): trainer.should_stop = True
    class Timer(pl.Callback):
        def __init__(self, warm): self.warm = warm; self.t0 = None; self.n = 0
        def on_train_batch_start(self, trainer, m, b, i):
            if i == self.warm: torch.cuda.synchronize(); self.t0 = time.perf_counter()
        def on_train_batch_end(self, trainer, m, o, b, i):
            if i >= self.warm: self.n += 1
        def on_train_end(self, trainer, m): torch.cuda.synchronize(); self.ms = (time.perf_counter() - self.t0) / self.n * 1000
    class DS(Dataset):
        def __init__(self): self.x = torch.randn(256, 3, 224, 224); self.y = torch.randint(0, 20, (256,))
        def __len__(self): return 128 * 60
        def __getitem__(self, i): return self.x[i % 256], self.y[i % 256]
    class M(pl.LightningModule):
        def __init__(self): super().__init__(); self.model = torchvision.models.resnet50(num_classes=20)
        def training_step(self, b, i): x, y = b; return F.cross_entropy(self.model(x), y)
        def configure_optimizers(self): return torch.optim.Adam(self.parameters(), lr=1e-4)
    for name in ("lightning_plain", "lightning_nancapture"):
        torch.manual_seed(0)
        tm = Timer(10); cbs = [tm] + ([NaNCapture()] if name.endswith("nancapture") else [])
        tr = pl.Trainer(max_steps=60, accelerator="gpu", devices=1, precision="bf16-mixed", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
        tr.fit(M(), DataLoader(DS(), batch_size=128, num_workers=8, pin_memory=True))
        res[f"resnet50_b128.{name}.step_ms"] = round(tm.ms, 1)
    # raw loop, same model, GPU-resident batch (framework-free floor)
    torch.manual_seed(0); m = torchvision.models.resnet50(num_classes=20).to(dev); opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    x = torch.randn(128, 3, 224, 224, device=dev); y = torch.randint(0, 20, (128,), device=dev)
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16): loss = F.cross_entropy(m(x), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    res["resnet50_b128.raw_loop_gpu_data.step_ms"] = round(time_steps(step), 1)
    R["nan"] = res

@section("metrics")
def metrics_section():
    import torchvision, torchmetrics
    from torchmetrics import MeanMetric, Accuracy, Precision, Recall, F1Score
    res = {}
    torch.manual_seed(0); m = torchvision.models.resnet18().to(dev); opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(128, 3, 224, 224, device=dev); y = torch.randint(0, 1000, (128,), device=dev)
    def mk():
        return {"avg_loss": MeanMetric().to(dev), "accuracy": Accuracy(task="multiclass", num_classes=1000).to(dev),
                "precision": Precision(task="multiclass", num_classes=1000).to(dev), "recall": Recall(task="multiclass", num_classes=1000).to(dev),
                "f1": F1Score(task="multiclass", num_classes=1000).to(dev)}
    for mode in ("none", "naive"):
        mets = mk() if mode != "none" else None
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16): out = m(x); loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
            if mets:
                mets["avg_loss"].update(loss)
                for k, v in mets.items():
                    if k != "avg_loss": v.update(out, y)
        res[f"resnet18_b128.metrics_{mode}.step_ms"] = round(time_steps(step, n=40), 2)
    R["metrics"] = res

class FaceNet(nn.Module):
    """The seed's face-detection toy: 4 conv stages and two linear layers to 256 boxes."""
    def __init__(self):
        super().__init__()
        layers = []
        for i in range(4):
            layers += [nn.Conv2d(4 ** i, 4 ** (i + 1), 3, padding="same"), nn.MaxPool2d(2, 2), nn.ReLU()]
        self.conv_layers = nn.Sequential(*layers)
        self.lin1 = nn.Linear(256 * 256, 256 * 64); self.lin2 = nn.Linear(256 * 64, 256 * 4)
    def forward(self, x):
        x = self.conv_layers(x.float())
        return self.lin2(F.relu(self.lin1(x.view(-1, 256 * 256)))).view(-1, 256, 4)

@section("detector")
def detector_section():
    res = {}
    B = 1024
    p, t, n = make_boxes(B)
    img = torch.randint(0, 256, (B, 1, 256, 256), dtype=torch.uint8, device=dev); tgt = t.to(dev)
    for compile_ in (False, True):
        torch.manual_seed(0); m = FaceNet().to(dev); opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        mm = torch.compile(m) if compile_ else m
        lf = torch.compile(loss_with_padding) if compile_ else loss_with_padding
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = mm(img)
            loss = lf(out.float(), tgt)
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        res["face_detector_b1024.step_ms." + ("compiled" if compile_ else "eager")] = round(time_steps(step, warm=5, n=20), 1)
        del m, opt, mm; torch.cuda.empty_cache()
    R["detector"] = res

@section("resnet50")
def resnet50_section():
    import torchvision
    res = {}
    x = torch.randn(128, 3, 224, 224, device=dev); y = torch.randint(0, 20, (128,), device=dev)
    for compile_ in (False, True):
        for cl in (False, True):
            torch.manual_seed(0); m = torchvision.models.resnet50(num_classes=20).to(dev)
            xx = x
            if cl: m = m.to(memory_format=torch.channels_last); xx = x.contiguous(memory_format=torch.channels_last)
            opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
            mm = torch.compile(m) if compile_ else m
            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(mm(xx), y)
                opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
            res["resnet50_b128.step_ms." + ("compiled" if compile_ else "eager") + (".channels_last" if cl else "")] = round(time_steps(step, warm=8, n=30), 1)
            del m, opt, mm; torch.cuda.empty_cache()
    R["resnet50"] = res

# ---------------- Llama-style decoder (Llama-3.2-1B shape), the LM users train today ----------------
class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__(); self.eps = eps; self.weight = nn.Parameter(torch.ones(d))
    def forward(self, x):
        xf = x.float(); return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

def rope_tables(S, hd, theta, device):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    f = torch.outer(torch.arange(S, device=device).float(), inv); emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()

def rotate_half(x):
    x1, x2 = x.chunk(2, -1); return torch.cat([-x2, x1], -1)

class LlamaBlock(nn.Module):
    def __init__(s, d, h, kvh, ffn, eps):
        super().__init__(); s.h, s.kvh, s.hd = h, kvh, d // h
        s.input_layernorm = RMSNorm(d, eps); s.post_attention_layernorm = RMSNorm(d, eps)
        s.q_proj = nn.Linear(d, h * s.hd, bias=False); s.k_proj = nn.Linear(d, kvh * s.hd, bias=False)
        s.v_proj = nn.Linear(d, kvh * s.hd, bias=False); s.o_proj = nn.Linear(h * s.hd, d, bias=False)
        s.gate_proj = nn.Linear(d, ffn, bias=False); s.up_proj = nn.Linear(d, ffn, bias=False); s.down_proj = nn.Linear(ffn, d, bias=False)
    def forward(s, x, cos, sin):
        B, S, D = x.shape; h = s.input_layernorm(x)
        q = s.q_proj(h).view(B, S, s.h, s.hd).transpose(1, 2); k = s.k_proj(h).view(B, S, s.kvh, s.hd).transpose(1, 2)
        v = s.v_proj(h).view(B, S, s.kvh, s.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin; k = k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + s.o_proj(a.transpose(1, 2).reshape(B, S, D))
        h = s.post_attention_layernorm(x)
        return x + s.down_proj(F.silu(s.gate_proj(h)) * s.up_proj(h))

class Llama(nn.Module):
    def __init__(s, vocab=128256, d=2048, depth=16, h=32, kvh=8, ffn=8192, eps=1e-5, theta=500000.0, tie=True):
        super().__init__(); s.theta = theta; s.hd = d // h
        s.embed_tokens = nn.Embedding(vocab, d); s.layers = nn.ModuleList([LlamaBlock(d, h, kvh, ffn, eps) for _ in range(depth)])
        s.norm = RMSNorm(d, eps); s.lm_head = nn.Linear(d, vocab, bias=False)
        if tie: s.lm_head.weight = s.embed_tokens.weight
    def forward(s, ids):
        cos, sin = rope_tables(ids.shape[1], s.hd, s.theta, ids.device)
        x = s.embed_tokens(ids)
        for l in s.layers: x = l(x, cos.to(x.dtype), sin.to(x.dtype))
        return s.lm_head(s.norm(x))

@section("llama")
def llama_section():
    """Llama-3.2-1B shape (d 2048, 16 layers, 32 heads, 8 KV heads, SwiGLU 8192, vocab 128256, tied,
    RoPE theta 5e5), batch 8 x 2048 tokens, bf16 autocast over fp32 weights, fused AdamW. Env LLAMA_TINY=1
    shrinks it for a smoke test; LLAMA_B sets the batch (default 8)."""
    res = {}
    tiny = os.environ.get("LLAMA_TINY") == "1"
    kw = dict(vocab=512, d=128, depth=2, h=4, kvh=2, ffn=256) if tiny else {}
    B, S = (2, 64) if tiny else (int(os.environ.get("LLAMA_B", "8")), 2048)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, kw.get("vocab", 128256), (B, S + 1), generator=g).to(dev)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    for compile_ in (False, True):
        torch.manual_seed(0); m = Llama(**kw).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1, fused=dev.type == "cuda")
        mm = torch.compile(m) if compile_ else m
        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = mm(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        if dev.type == "cuda": torch.cuda.reset_peak_memory_stats()
        ms = time_steps(step, warm=3 if tiny else 5, n=3 if tiny else 15) if dev.type == "cuda" else 0.0
        if dev.type != "cuda": step(); step()
        key = f"llama1b_b{B}_s2048." + ("compiled" if compile_ else "eager")
        res[key + ".step_ms"] = round(ms, 1)
        if ms: res[key + ".tokens_per_s"] = round(B * S / ms * 1000)
        if dev.type == "cuda": res[key + ".peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        n = sum(p.numel() for p in m.parameters()); res["llama.params"] = n
        del m, opt, mm
        if dev.type == "cuda": torch.cuda.empty_cache()
    R["llama"] = res

# ---------------- stronger anchors: Liger-Kernel (Triton) and torchao float8 (need those wheels) ----------------
@section("llama_plus")
def llama_plus_section():
    """The llama section's model with what a PyTorch user would add: (a) torch.compile of the body and
    Liger-Kernel's fused linear cross-entropy for the head (no [tokens, vocab] logits); (b) torchao
    float8 training (dynamic per-tensor scaling) on every Linear but the head, compiled."""
    res = {}
    tiny = os.environ.get("LLAMA_TINY") == "1"
    kw = dict(vocab=512, d=128, depth=2, h=4, kvh=2, ffn=256) if tiny else {}
    B, S = (2, 64) if tiny else (int(os.environ.get("LLAMA_B", "8")), 2048)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, kw.get("vocab", 128256), (B, S + 1), generator=g).to(dev)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    def body(m, ids_):
        cos, sin = rope_tables(ids_.shape[1], m.hd, m.theta, ids_.device)
        h = m.embed_tokens(ids_)
        for l in m.layers: h = l(h, cos.to(h.dtype), sin.to(h.dtype))
        return m.norm(h)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        torch.manual_seed(0); m = Llama(**kw).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        cbody = torch.compile(lambda ids_: body(m, ids_)); flce = LigerFusedLinearCrossEntropyLoss()
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                h = cbody(x)
                loss = flce(m.lm_head.weight, h.reshape(-1, h.shape[-1]), y.view(-1))
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        torch.cuda.reset_peak_memory_stats(); ms = time_steps(step, warm=5, n=15)
        k = f"llama1b_b{B}_s2048.compiled_liger_flce"; res[k + ".step_ms"] = round(ms, 1)
        res[k + ".tokens_per_s"] = round(B * S / ms * 1000); res[k + ".peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        del m, opt, cbody; torch.cuda.empty_cache()
    except Exception as ex: res["liger.error"] = repr(ex)[:300]; traceback.print_exc()
    try:
        from torchao.float8 import convert_to_float8_training
        torch.manual_seed(0); m = Llama(**kw).to(dev)
        convert_to_float8_training(m, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1, fused=True); mm = torch.compile(m)
        def step8():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = mm(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        torch.cuda.reset_peak_memory_stats(); ms = time_steps(step8, warm=5, n=15)
        k = f"llama1b_b{B}_s2048.compiled_torchao_float8"; res[k + ".step_ms"] = round(ms, 1)
        res[k + ".tokens_per_s"] = round(B * S / ms * 1000); res[k + ".peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        del m, opt, mm; torch.cuda.empty_cache()
    except Exception as ex: res["float8.error"] = repr(ex)[:300]; traceback.print_exc()
    R["llama_plus"] = res

@section("vit_fp8")
def vit_fp8_section():
    """The vit section's ViT-L/16 b128 with torchao float8 training on every Linear but the head, compiled."""
    from timm.models.vision_transformer import VisionTransformer
    from torchao.float8 import convert_to_float8_training
    res = {}
    torch.manual_seed(0)
    m = VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=24, num_heads=16, class_token=False, global_pool="avg").to(dev)
    convert_to_float8_training(m, module_filter_fn=lambda mod, fqn: fqn != "head" and isinstance(mod, nn.Linear))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3); mm = torch.compile(m)
    x = torch.randn(128, 3, 224, 224, device=dev); y = torch.randint(0, 1000, (128,), device=dev)
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(mm(x), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    res["vit_l16_b128.step_ms.compiled_torchao_float8"] = round(time_steps(step), 1)
    R["vit_fp8"] = res

@section("llama_ops")
def llama_ops_section():
    """Per-op anchors at the Llama-3.2-1B training shape (batch 8 x 2048 = 16384 tokens, d 2048, 32
    heads / 8 KV heads of 64, ffn 8192, vocab 128256), bf16, forward + backward, median ms: PyTorch
    eager, torch.compile, Liger-Kernel (needs its wheel) and, for the memory-bound ops, the time the
    bytes they must move take at the H200's 4.8 TB/s. Attention: SDPA with enable_gqa per backend, and
    cuDNN on K/V expanded to 32 heads. Head: linear + cross-entropy with logits vs Liger's fused chunks
    (time and peak memory above the inputs)."""
    res = {}
    T, D, H, KV, HD, FF, V = 8 * 2048, 2048, 32, 8, 64, 8192, 128256
    bw = 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.35e12  # HBM bandwidth of the card
    res["hbm_tb_per_s"] = bw / 1e12
    def fb(f, *xs):  # forward + backward with a random gradient for every output
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
        outs = f(*xs); outs = list(outs) if isinstance(outs, tuple) else [outs]
        gs = [torch.randn_like(o) for o in outs]
        def run():
            for x in xs: x.grad = None
            o = f(*xs); o = list(o) if isinstance(o, tuple) else [o]
            torch.autograd.backward(o, gs)
        return bench(run, warmup=5, rep=20)
    def put(name, fn):
        try: res[name] = round(fn(), 3)
        except Exception as ex: res[name + ".error"] = repr(ex)[:200]; traceback.print_exc()
    try:
        import liger_kernel.ops as LK
    except Exception as ex:
        LK = None; res["liger.error"] = repr(ex)[:200]
    # RMSNorm with the residual add: y = rmsnorm(x + r) * w, s = x + r
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16); r = torch.randn_like(x); w = torch.rand(D, device=dev, dtype=torch.bfloat16) + 0.5
    def add_rms(x, r, w):
        s_ = x + r; sf = s_.float()
        return (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(s_.dtype) * w, s_
    put("add_rmsnorm.eager_ms", lambda: fb(add_rms, x, r, w))
    put("add_rmsnorm.compiled_ms", lambda: fb(torch.compile(add_rms), x, r, w))
    if LK: put("add_rmsnorm.liger_ms", lambda: fb(lambda a, b, c: LK.LigerFusedAddRMSNormFunction.apply(a, b, c, 1e-5), x, r, w))
    # fwd reads x, r, writes y, s; bwd reads dy, ds, s (or x, r), writes dx(=dr) : ~9 x T x D x 2 bytes
    res["add_rmsnorm.bytes_bound_ms"] = round(9 * T * D * 2 / bw * 1e3, 3)
    # RoPE (Hugging Face rotate-half) on q [8, 32, 2048, 64] and k [8, 8, 2048, 64]
    q = torch.randn(8, H, 2048, HD, device=dev, dtype=torch.bfloat16); k = torch.randn(8, KV, 2048, HD, device=dev, dtype=torch.bfloat16)
    cos, sin = rope_tables(2048, HD, 500000.0, dev); cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    def rope(q, k):
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    put("rope_qk.eager_ms", lambda: fb(rope, q, k))
    put("rope_qk.compiled_ms", lambda: fb(torch.compile(rope), q, k))
    if LK: put("rope_qk.liger_ms", lambda: fb(lambda a, b: LK.LigerRopeFunction.apply(a, b, cos[None], sin[None]), q, k))
    res["rope_qk.bytes_bound_ms"] = round(4 * (q.numel() + k.numel()) * 2 / bw * 1e3, 3)
    # SwiGLU on one [T, 2 x ffn] projection output: silu(gate) * up
    gu = torch.randn(T, 2 * FF, device=dev, dtype=torch.bfloat16)
    def swiglu(gu):
        g_, u_ = gu.chunk(2, -1); return F.silu(g_) * u_
    put("swiglu.eager_ms", lambda: fb(swiglu, gu))
    put("swiglu.compiled_ms", lambda: fb(torch.compile(swiglu), gu))
    if LK: put("swiglu.liger_ms", lambda: fb(lambda a: LK.LigerSiLUMulFunction.apply(*a.chunk(2, -1)), gu))
    res["swiglu.bytes_bound_ms"] = round((3 * T * FF + 4 * T * FF) * 2 / bw * 1e3, 3)  # fwd: read 2, write 1; bwd: read 3 (dy, g, u), write 2 -> ~7 x T x FF
    del x, r, gu
    # attention, causal, GQA 32/8 heads, fwd + bwd
    qa = torch.randn(8, H, 2048, HD, device=dev, dtype=torch.bfloat16); ka = torch.randn(8, KV, 2048, HD, device=dev, dtype=torch.bfloat16); va = torch.randn_like(ka)
    from torch.nn.attention import sdpa_kernel, SDPBackend
    for nm, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def gqa(q, k, v, be=be):
            with sdpa_kernel([be]): return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        put(f"attn_gqa.{nm}_ms", lambda: fb(gqa, qa, ka, va))
    def cudnn_expanded(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1), is_causal=True)
    put("attn_gqa.cudnn_expanded_kv_ms", lambda: fb(cudnn_expanded, qa, ka, va))
    res["attn_gqa.tflop_per_call"] = round(attn_flops(8, H, 2048, HD, causal=True) * 3.5 / 1e12, 3)
    del qa, ka, va; torch.cuda.empty_cache()
    # head: hidden [T, D] x W [V, D] -> mean cross-entropy, bf16 weights
    hd = torch.randn(T, D, device=dev, dtype=torch.bfloat16) * 0.5; W = torch.randn(V, D, device=dev, dtype=torch.bfloat16) * 0.02
    y = torch.randint(0, V, (T,), device=dev)
    def head(h, W): return F.cross_entropy((h @ W.t()).float(), y)
    def mem(f):
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        f(); torch.cuda.synchronize(); return round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
    def fbh(f):
        h_, W_ = hd.detach().requires_grad_(), W.detach().requires_grad_()
        def run():
            h_.grad = None; W_.grad = None; f(h_, W_).backward()
        return run
    put("linear_ce.eager_ms", lambda: bench(fbh(head), warmup=3, rep=10))
    try: res["linear_ce.eager_peak_gib"] = mem(fbh(head))
    except Exception as ex: res["linear_ce.eager_peak.error"] = repr(ex)[:200]
    put("linear_ce.compiled_ms", lambda: bench(fbh(torch.compile(head)), warmup=3, rep=10))
    if LK:
        def flce(h, W): return LK.LigerFusedLinearCrossEntropyFunction.apply(h, W, y)[0]
        put("linear_ce.liger_flce_ms", lambda: bench(fbh(flce), warmup=3, rep=10))
        try: res["linear_ce.liger_flce_peak_gib"] = mem(fbh(flce))
        except Exception as ex: res["linear_ce.liger_peak.error"] = repr(ex)[:200]
    res["linear_ce.gemm_tflop"] = round(3 * 2 * T * D * V / 1e12, 2)
    R["llama_ops"] = res

if __name__ == "__main__":
    want = sys.argv[1:] or ["giou", "attn", "vit", "lm", "nan", "metrics", "detector"]
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    R["device"] = torch.cuda.get_device_name(); R["torch"] = torch.__version__
    for s in want: globals()[s + "_section"]()
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "pytorch_baselines_" + "_".join(want) + ".json"), "w") as f: json.dump(R, f, indent=1)
    for k, v in R.items():
        if isinstance(v, dict):
            for kk, vv in v.items(): print(f"{k}.{kk} = {vv}")
        else: print(k, "=", v)
