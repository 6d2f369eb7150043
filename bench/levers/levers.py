"""What each issue-14 lever is worth, measured in PyTorch eager on the GPU machine before building it
into Strobe: bf16 weights (fp32 masters, no autocast re-casts) vs autocast for ViT-L/16 and the
decoder LM, channels_last and cudnn.benchmark for ResNet-50, and the detector's pieces.
Usage: python3 bench/levers/levers.py [vit] [resnet] [lm] [detector]   (prints ms/step, median)"""
import sys, time, torch, torch.nn as nn, torch.nn.functional as F

dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = True

def timed(step, warm=8, n=25):
    for _ in range(warm): step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); step(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return round(ts[len(ts) // 2], 2)

@torch.no_grad()
def master_step(model, masters, lr=1e-3):
    """SGD on fp32 masters from bf16 grads, then one multi-tensor copy back into the bf16 weights."""
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params]
    torch._foreach_add_(masters, [g.float() for g in grads], alpha=-lr)  # casts: upper bound
    torch._foreach_copy_(params, masters)

def run(name, model, make_loss, mode):
    opt = None
    if mode == "autocast":
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = make_loss(model)
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    else:
        keep = mode.endswith("bnfp32")
        masters = [p.detach().float().clone() for p in model.parameters()]
        model.to(torch.bfloat16)
        if keep:
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm): m.float()
        def step():
            loss = make_loss(model)
            for p in model.parameters(): p.grad = None
            loss.backward(); master_step(model, masters)
    print(f"{name} {mode}: {timed(step)} ms", flush=True)

def vit():
    from timm.models.vision_transformer import VisionTransformer
    x = torch.randn(128, 3, 224, 224, device=dev); y = torch.randint(0, 1000, (128,), device=dev)
    for mode in ("autocast", "bf16"):
        torch.manual_seed(0)
        m = VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=24, num_heads=16, class_token=False, global_pool="avg").to(dev)
        run("vit_l16_b128", m, lambda mm: F.cross_entropy(mm(x.to(next(mm.parameters()).dtype)).float(), y), mode)
        del m; torch.cuda.empty_cache()
    from torch.nn.attention import sdpa_kernel, SDPBackend
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        with sdpa_kernel([be]):
            torch.manual_seed(0)
            m = VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=24, num_heads=16, class_token=False, global_pool="avg").to(dev)
            run(f"vit_l16_b128 sdpa={be.name}", m, lambda mm: F.cross_entropy(mm(x.to(next(mm.parameters()).dtype)).float(), y), "bf16")
            del m; torch.cuda.empty_cache()

def resnet():
    import torchvision
    x = torch.randn(128, 3, 224, 224, device=dev); y = torch.randint(0, 20, (128,), device=dev)
    for bench_mode in (False, True):
        torch.backends.cudnn.benchmark = bench_mode
        for cl in (False, True):
            for mode in (("autocast", "bf16-bnfp32") if cl else ("autocast",)):
                torch.manual_seed(0); m = torchvision.models.resnet50(num_classes=20).to(dev)
                xx = x
                if cl: m = m.to(memory_format=torch.channels_last); xx = x.contiguous(memory_format=torch.channels_last)
                run(f"resnet50_b128 cl={cl} cudnn.benchmark={bench_mode}", m,
                    lambda mm: F.cross_entropy(mm(xx if mode == "autocast" else xx.bfloat16()).float(), y), mode)
                del m; torch.cuda.empty_cache()
    torch.backends.cudnn.benchmark = False

def lm():
    sys.path.insert(0, "bench"); import pytorch_baselines as pb
    g = torch.Generator().manual_seed(0); B, S = 32, 1024
    lens = torch.randint(1, S, (B,), generator=g)
    from torch.nn.attention.varlen import varlen_attn
    cu = F.pad(torch.cumsum(lens, 0), (1, 0)).to(dev, torch.int32)
    pids = torch.cat([torch.randint(1, 1024, (int(L),), generator=g) for L in lens]).to(dev)[None]
    ptgt = torch.roll(pids, -1, 1); ppos = torch.cat([torch.arange(int(L)) for L in lens]).to(dev)[None]
    import inspect
    sig = inspect.signature(varlen_attn)
    kw = {"is_causal": True} if "is_causal" in sig.parameters else ({"causal": True} if "causal" in sig.parameters else {"window_size": (-1, 0)})
    def va(q, k, v, meta): return varlen_attn(q[0], k[0], v[0], meta, meta, 1024, 1024, **kw)[None]
    for mode in ("autocast", "bf16"):
        torch.manual_seed(0); m = pb.Decoder(va).to(dev)
        run("lm_packed_varlen", m, lambda mm: F.cross_entropy(mm(pids, ppos, cu).view(-1, 1024).float(), ptgt.flatten()), mode)
        del m; torch.cuda.empty_cache()

def detector():
    sys.path.insert(0, "bench"); import pytorch_baselines as pb
    B = 1024; p, t, n = pb.make_boxes(B)
    img = torch.randint(0, 256, (B, 1, 256, 256), dtype=torch.uint8, device=dev); tgt = t.to(dev)
    torch.manual_seed(0); m = pb.FaceNet().to(dev)
    x = img.float()
    # pieces: the conv stack alone, fwd+bwd, NCHW vs channels_last; the linear head alone
    for cl in (False, True):
        conv = m.conv_layers
        xx = x.contiguous(memory_format=torch.channels_last) if cl else x
        if cl: conv = conv.to(memory_format=torch.channels_last)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                o = conv(xx)
            o.float().sum().backward()
        print(f"detector conv stack fwd+bwd cl={cl}: {timed(step)} ms", flush=True)
    feats = torch.randn(B, 65536, device=dev, dtype=torch.bfloat16)
    def head():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o = m.lin2(F.relu(m.lin1(feats)))
        o.float().sum().backward()
    print(f"detector head fwd+bwd autocast: {timed(head)} ms", flush=True)
    for mode in ("autocast", "bf16"):
        torch.manual_seed(0); mm_ = pb.FaceNet().to(dev)
        if mode == "bf16": mm_.forward = (lambda self_: (lambda x: self_.lin2(F.relu(self_.lin1(self_.conv_layers(x.bfloat16()).view(-1, 65536)))).view(-1, 256, 4)))(mm_)
        run("face_detector_b1024", mm_, lambda q: pb.loss_with_padding(q(img).float(), tgt), mode)
        del mm_; torch.cuda.empty_cache()

if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for s in sys.argv[1:] or ["vit", "resnet", "lm", "detector"]:
        t0 = time.time(); globals()[s](); print(f"[{s}] {time.time() - t0:.0f}s", flush=True)
