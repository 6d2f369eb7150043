#!/usr/bin/env python3
"""Kineto traces of the PyTorch anchors (bench/pytorch_baselines.py's vit and resnet50 steps, eager or
torch.compile) so that Strobe's traces (bench/e2e/profile_gpu.sh) have something to compare with.

  python3 bench/e2e/torch_profile.py vit_compiled resnet50_cl_compiled [--out DIR]

Each workload: 10 warm-up steps, then 3 profiled steps (ProfilerStep#N ranges, as Strobe's), then
bench/e2e/trace_top.py on the trace.
"""
import argparse, os, subprocess, sys
import torch, torch.nn.functional as F

dev = "cuda"


def vit(compile_):
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    m = VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=24, num_heads=16,
                          class_token=False, global_pool="avg").to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    mm = torch.compile(m) if compile_ else m
    x = torch.randn(128, 3, 224, 224, device=dev); y = torch.randint(0, 1000, (128,), device=dev)
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(mm(x), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return step


def resnet50(compile_):
    import torchvision
    torch.manual_seed(0)
    m = torchvision.models.resnet50(num_classes=20).to(dev).to(memory_format=torch.channels_last)
    x = torch.randn(128, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 20, (128,), device=dev)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    mm = torch.compile(m) if compile_ else m
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(mm(x), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return step


WORKLOADS = {"vit_eager": lambda: vit(False), "vit_compiled": lambda: vit(True),
             "resnet50_cl_eager": lambda: resnet50(False), "resnet50_cl_compiled": lambda: resnet50(True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="+", choices=sorted(WORKLOADS))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    for w in a.workloads:
        step = WORKLOADS[w]()
        for _ in range(10): step()
        torch.cuda.synchronize()
        trace = f"/tmp/torch_prof_{w}.json"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
            for i in range(3):
                with torch.profiler.record_function(f"ProfilerStep#{i + 1}"):
                    step()
            torch.cuda.synchronize()
        p.export_chrome_trace(trace)
        print(f"== {w}", flush=True)
        subprocess.run([sys.executable, os.path.join(here, "trace_top.py"), trace, "--top", "25",
                        "--json", os.path.join(a.out, f"torch_prof_{w}.json")], check=False)
        del step; torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
