"""GPU probe (issue 42): Nsight Compute of dilgen's forward + backward kernels on configs A
and C (bench/toolkit.py), default plans, bf16: one forward + backward between
cudaProfilerStart/Stop after two warm-up calls (ncu --profile-from-start off).

    ncu --profile-from-start off ... python3 bench/tools/bwd_ncu_probe.py A"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dilgen  # noqa: E402
import toolkit as tk  # noqa: E402

name = sys.argv[1]
c = tk.CONFIGS[name]
spec = dilgen.Spec(name=f"bncu_{name.lower()}", num_heads=c["H"], head_dim=c["D"], segment_lengths=c["ws"],
                   dilation_rates=c["rs"], dtype="bfloat16")
kern = dilgen.compile(spec)
gen = torch.Generator(device="cuda").manual_seed(5)
q, k, v = (torch.randn(c["B"], c["N"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, generator=gen)
           .requires_grad_() for _ in range(3))
g = torch.randn_like(q)
for _ in range(2):
    kern(q, k, v).backward(g)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
kern(q, k, v).backward(g)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
