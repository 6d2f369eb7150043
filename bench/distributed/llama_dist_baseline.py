"""PyTorch's data-parallel baselines for Strobe's llama_1b under ddp and zero2 (docs/DISTRIBUTED.md,
"Measured"): the Llama-3.2-1B shape in plain PyTorch (the same model as the single-GPU anchor's
llama section: d 2048, 16 layers, 32 heads over 8 KV heads, SwiGLU 8192, vocab 128256, tied head,
SDPA), trained with fused AdamW (lr 3e-4, weight decay 0.1) on batch B x S tokens per GPU (--seq, 2048), under

  ddp    torch.nn.parallel.DistributedDataParallel, bf16 autocast over fp32 weights (its default:
         fp32 gradients all-reduced in 25 MiB buckets)
  fsdp2  torch.distributed.fsdp.fully_shard on every block and the root with
         reshard_after_forward=False (parameters stay gathered between forward and backward: the
         ZeRO-2-like setting), MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16): bf16
         compute and gradient reduce-scatter, fp32 sharded parameters and moments
  fsdp2_reshard  the same with reshard_after_forward=True on every block (each block's parameters
         freed after its forward and gathered again for its backward: fully sharded, as Strobe's
         fsdp); the root keeps False (its parameters stay gathered, as Strobe's root unit)

each with and without activation checkpointing (torch.utils.checkpoint, non-reentrant, per block).

Run under torchrun, one process per GPU:
  NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node=2 bench/distributed/llama_dist_baseline.py \
      --mode fsdp2 --ac blocks --batch 8 --json out.json [--shape 8b] [--seq 4096]
Prints (rank 0) and writes one JSON object: mean and median step ms over the timed steps (CUDA
events around each step, 10 warm-up steps), tokens/s of the job (world x B x S / mean step), the
largest per-GPU peak allocated memory and the largest per-GPU memory allocated between steps (the
model state: weights, gradient buffers, optimizer state), both in GiB, with the largest peak the
caching allocator reserved and the most memory in use on a GPU at the end (its reservation plus the
CUDA context and NCCL's buffers), tokens/s per GPU and the MFU by torchtitan's count (6 N + 12 L H d S
FLOPs a token, N without the token embedding; an H200's 989.4 dense bf16 TFLOP/s). Env LLAMA_TINY=1 shrinks the model for a smoke test.

--depth N gives the 8b shape N layers (bench/distributed/largest_shape.sh); --memory-limit-gib G caps
each GPU's caching allocator at G GiB (torch.cuda.set_per_process_memory_fraction), as a GPU of
that size would hold the run: a run past it prints {"error": "out of memory", ...} and exits 1.
FSDP2 over an untied shape is built on the meta device, sharded, then materialized shard by shard
on the GPU (torchtitan's way), so no GPU ever holds the whole fp32 model.
"""
import argparse
import datetime
import json
import math
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(S, hd, theta, device):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    f = torch.outer(torch.arange(S, device=device).float(), inv)
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


class LlamaBlock(nn.Module):
    def __init__(s, d, h, kvh, ffn, eps):
        super().__init__()
        s.h, s.kvh, s.hd = h, kvh, d // h
        s.input_layernorm = RMSNorm(d, eps)
        s.post_attention_layernorm = RMSNorm(d, eps)
        s.q_proj = nn.Linear(d, h * s.hd, bias=False)
        s.k_proj = nn.Linear(d, kvh * s.hd, bias=False)
        s.v_proj = nn.Linear(d, kvh * s.hd, bias=False)
        s.o_proj = nn.Linear(h * s.hd, d, bias=False)
        s.gate_proj = nn.Linear(d, ffn, bias=False)
        s.up_proj = nn.Linear(d, ffn, bias=False)
        s.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(s, x, cos, sin):
        B, S, D = x.shape
        h = s.input_layernorm(x)
        q = s.q_proj(h).view(B, S, s.h, s.hd).transpose(1, 2)
        k = s.k_proj(h).view(B, S, s.kvh, s.hd).transpose(1, 2)
        v = s.v_proj(h).view(B, S, s.kvh, s.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + s.o_proj(a.transpose(1, 2).reshape(B, S, D))
        h = s.post_attention_layernorm(x)
        return x + s.down_proj(F.silu(s.gate_proj(h)) * s.up_proj(h))


class Llama(nn.Module):
    def __init__(s, vocab=128256, d=2048, depth=16, h=32, kvh=8, ffn=8192, eps=1e-5, theta=500000.0, ac=False, tie=True):
        super().__init__()
        s.theta, s.hd, s.ac = theta, d // h, ac
        s.embed_tokens = nn.Embedding(vocab, d)
        s.layers = nn.ModuleList([LlamaBlock(d, h, kvh, ffn, eps) for _ in range(depth)])
        s.norm = RMSNorm(d, eps)
        s.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            s.lm_head.weight = s.embed_tokens.weight

    def forward(s, ids):
        cos, sin = rope_tables(ids.shape[1], s.hd, s.theta, ids.device)
        x = s.embed_tokens(ids)
        cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
        for layer in s.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if s.ac else layer(x, cos, sin)
        return s.lm_head(s.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "fsdp2", "fsdp2_reshard"], required=True)
    ap.add_argument("--ac", choices=["none", "blocks"], default="none")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--shape", choices=["1b", "8b"], default="1b",
                    help="8b: Llama-3-8B's shape (d 4096, 32 layers, 32 heads over 8, SwiGLU 14336, untied head)")
    ap.add_argument("--depth", type=int, help="with --shape 8b: this many layers instead of 32")
    ap.add_argument("--memory-limit-gib", type=float, help="cap each GPU's caching allocator at this many GiB")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence (the batch is B x SEQ per GPU)")
    a = ap.parse_args()

    # A rank that runs out of memory leaves the others in a collective: NCCL's watchdog ends them.
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    total = torch.cuda.mem_get_info(dev)[1]
    if a.memory_limit_gib:
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.memory_limit_gib * 2**30 / total), dev)
    tiny = os.environ.get("LLAMA_TINY") == "1"
    kw = dict(vocab=512, d=128, depth=2, h=4, kvh=2, ffn=256) if tiny else {}
    if a.shape == "8b" and not tiny:
        kw = dict(d=4096, depth=32, h=32, kvh=8, ffn=14336, tie=False)
    if a.depth:
        kw["depth"] = a.depth
    B, S = a.batch, 64 if tiny else a.seq
    torch.manual_seed(0)
    meta = a.mode.startswith("fsdp2") and not kw.get("tie", True)
    try:
        with torch.device("meta" if meta else "cpu"):
            m = Llama(ac=a.ac == "blocks", **kw)
        params = sum(p.numel() for p in m.parameters())
        if not meta:
            m = m.to(dev)
        if a.mode == "ddp":
            model = nn.parallel.DistributedDataParallel(m, device_ids=[dev.index])
            autocast = True
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for layer in m.layers:
                fully_shard(layer, reshard_after_forward=a.mode == "fsdp2_reshard", mp_policy=mp)
            fully_shard(m, reshard_after_forward=False, mp_policy=mp)
            if meta:  # each rank materializes and initializes its own shards only
                m.to_empty(device=dev)
                with torch.no_grad():
                    for name, p in m.named_parameters():
                        if name.endswith("layernorm.weight") or name == "norm.weight":
                            p.fill_(1.0)
                        else:
                            p.normal_(0.0, 0.02 if "embed" in name else 1.0 / math.sqrt(p.shape[-1]))
            model = m
            autocast = False  # the policy casts the parameters; activations follow
        train(a, model, autocast, params, kw, B, S, rank, world, dev, total)
    except torch.OutOfMemoryError as e:
        print(json.dumps({"impl": "pytorch", "mode": a.mode, "rank": rank, "error": "out of memory",
                          "memory_limit_gib": a.memory_limit_gib, "depth": kw.get("depth", 16),
                          "what": str(e).splitlines()[0]}), flush=True)
        os._exit(1)  # the other ranks may sit in a collective this rank never joins
    dist.destroy_process_group()


def train(a, model, autocast, params, kw, B, S, rank, world, dev, total):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, kw.get("vocab", 128256), (B, S + 1), generator=g).to(dev) for _ in range(4)]

    def step(i):
        ids = batches[i % len(batches)]
        x, y = ids[:, :-1], ids[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(a.warmup):
        step(i)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    state = torch.cuda.memory_allocated()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.steps)]
    for i, (s, e) in enumerate(events):
        s.record()
        step(i)
        e.record()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in events]
    used = total - torch.cuda.mem_get_info(dev)[0]
    mine = torch.tensor([torch.cuda.max_memory_allocated() / 2**30, state / 2**30, statistics.mean(ms),
                         torch.cuda.max_memory_reserved() / 2**30, used / 2**30], device=dev)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    out = {
        "impl": "pytorch", "mode": a.mode, "activation_checkpointing": a.ac, "world_size": world,
        "batch_per_gpu": B, "seq": S, "steps": a.steps, "step_ms_mean": round(mine[2].item(), 2),
        "step_ms_median_rank0": round(statistics.median(ms), 2),
        "tokens_per_s": round(world * B * S / mine[2].item() * 1000),
        "peak_gib_max_rank": round(mine[0].item(), 2), "state_gib_max_rank": round(mine[1].item(), 2),
        "peak_reserved_gib_max_rank": round(mine[3].item(), 2), "device_used_gib_max_rank": round(mine[4].item(), 2),
        "shape": a.shape, "depth": kw.get("depth", 16), "params": params, "memory_limit_gib": a.memory_limit_gib,
    }
    # torchtitan's MFU: 6 N_non-embedding + 12 L H (d / H) S FLOPs a token (N less the token
    # embedding; an untied head counts), over an H200's 989.4 dense bf16 TFLOP/s.
    d, depth, h = kw.get("d", 2048), kw.get("depth", 16), kw.get("h", 32)
    flops_per_token = 6 * (params - kw.get("vocab", 128256) * d) + 12 * depth * h * (d // h) * S
    out["tokens_per_s_per_gpu"] = round(B * S / mine[2].item() * 1000)
    out["mfu_torchtitan"] = round(out["tokens_per_s_per_gpu"] * flops_per_token / 989.4e12, 4)
    if rank == 0:
        print(json.dumps(out))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f)


if __name__ == "__main__":
    main()
