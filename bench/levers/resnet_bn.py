#!/usr/bin/env python3
"""What BatchNorm costs in ResNet-50 b128 bf16 channels_last (issue 14), and whether cuDNN's BatchNorm
(ATen routes bf16 inputs to its own channels_last kernels, never to cuDNN) or dropping BN's separate
passes would pay. PyTorch eager, CUDA events, median of 25 steps on a GPU-resident batch:
  native   torchvision resnet50 as bench/pytorch_baselines.py resnet50 runs it (autocast bf16, NHWC)
  cudnn    every BatchNorm2d through torch.cudnn_batch_norm (cuDNN's persistent NHWC kernels)
  no_bn    BatchNorm2d replaced by identity: the floor any BN fusion could reach
  python3 bench/levers/resnet_bn.py
"""
import statistics, torch, torch.nn as nn, torch.nn.functional as F, torchvision

dev = "cuda"


class CudnnBN(nn.Module):
    def __init__(self, bn):
        super().__init__()
        self.weight, self.bias = bn.weight, bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.momentum, self.eps = bn.momentum, bn.eps

    def forward(self, x):
        return torch.cudnn_batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var,
                                      self.training, self.momentum, self.eps)[0]


def swap(m, fn):
    for name, c in m.named_children():
        if isinstance(c, nn.BatchNorm2d):
            setattr(m, name, fn(c))
        else:
            swap(c, fn)


def run(variant):
    torch.manual_seed(0)
    m = torchvision.models.resnet50(num_classes=20)
    if variant == "cudnn": swap(m, CudnnBN)
    if variant == "no_bn": swap(m, lambda bn: nn.Identity())
    m = m.to(dev).to(memory_format=torch.channels_last)
    x = torch.randn(128, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 20, (128,), device=dev)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        return loss
    for _ in range(8): step()
    ts = []
    for _ in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); loss = step(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts), float(loss)


for v in ("native", "cudnn", "no_bn"):
    try:
        ms, loss = run(v)
        print(f"resnet50_bn.{v}.step_ms = {ms:.2f} (loss {loss:.4f})", flush=True)
    except Exception as ex:
        print(f"resnet50_bn.{v}.error = {repr(ex)[:300]}", flush=True)
