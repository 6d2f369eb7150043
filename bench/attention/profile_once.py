"""One forward + backward of strobe::flash_attention on a bench shape, for Nsight Compute:
  ncu -k regex:flash --section SpeedOfLight --section Occupancy --section LaunchStats \
      python bench/attention/profile_once.py B S H D [causal]
"""
import os, sys
import torch
torch.ops.load_library(os.path.join(os.environ.get("STROBE_BUILD_DIR", "build"), "lib", "libstrobe_ops.so"))
B, S, H, D = map(int, sys.argv[1:5]); causal = len(sys.argv) > 5
q, k, v = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
out = torch.ops.strobe.flash_attention(q, k, v, causal=causal)[0]
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
