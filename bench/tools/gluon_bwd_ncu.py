"""GPU probe (issue 42): one forward + backward of config A (and C) under Nsight Compute, the
Gluon dK/dV and the `tl` one, for the tensor pipe's busy share and the stall reasons.

    ncu --profile-from-start off ... python3 bench/tools/gluon_dkdv_ncu.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dilgen  # noqa: E402
from toolkit import CONFIGS  # noqa: E402


def main():
    for name, tunings in (("A", ({},)), ("C", ({},))):
        c = CONFIGS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(c["B"], c["N"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(c["B"], c["N"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        g = torch.randn_like(q)
        for tuning in tunings:
            spec = dilgen.Spec(name=f"ncu_{name.lower()}", num_heads=c["H"], head_dim=c["D"], segment_lengths=c["ws"],
                               dilation_rates=c["rs"], dtype="bfloat16")
            kern = dilgen.Kernel(spec, None, tuning)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            for _ in range(2):
                kern(*leaves).backward(g)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            kern(*leaves).backward(g)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
