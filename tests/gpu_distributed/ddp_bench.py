"""PyTorch DDP side of the scaling benchmark in docs/PERFORMANCE.md (Strobe's side is the test
GpuDDP.ScalingBenchmark). Launch: torchrun --nproc-per-node=N ddp_bench.py MODEL OUT.json
MODEL: resnet50 (torchvision) | vit_l16 (timm VisionTransformer, no class token, avg pool, as the
seed configures it). b128 per GPU, bf16 autocast, SGD momentum 0.9, eager; 1 process = no DDP
wrapper (as Strobe's single-device strategy), N > 1 = DistributedDataParallel with its defaults.
Timing as Strobe's: 5 warm-up steps, a barrier, then 15 steps between two CUDA events."""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main():
    model_name, out = sys.argv[1], sys.argv[2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if world > 1:
        dist.init_process_group("nccl", device_id=dev)
    torch.manual_seed(0)
    if model_name == "resnet50":
        import torchvision
        m = torchvision.models.resnet50(num_classes=1000).to(dev)
    else:
        from timm.models.vision_transformer import VisionTransformer
        m = VisionTransformer(img_size=224, patch_size=16, embed_dim=1024, depth=24, num_heads=16,
                              class_token=False, global_pool="avg").to(dev)
    net = torch.nn.parallel.DistributedDataParallel(m, device_ids=[local]) if world > 1 else m
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    b = 128
    x = torch.randn(b, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (b,), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    if world > 1:
        dist.barrier()
    torch.cuda.synchronize()
    n = 15
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    stop.record()
    stop.synchronize()
    ms = start.elapsed_time(stop) / n
    if rank == 0:
        rec = {"impl": "pytorch_ddp", "model": model_name, "gpus": world, "step_ms": ms, "images_per_s": world * b * 1000.0 / ms}
        print("pytorch ddp bench:", json.dumps(rec))
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
