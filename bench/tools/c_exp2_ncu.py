"""GPU probe (issue 42): one forward of C (head_dim 64) as planned by default (the Gluon forward,
one exponential in 8 on the FMA pipe) and with gluon_exp2 0, under Nsight Compute: time, tensor
pipe busy share, pipe utilisation (ComputeWorkloadAnalysis: XU = the MUFU unit, FMA), stalls.

    ncu --profile-from-start off ... python3 bench/tools/c_exp2_ncu.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dilgen  # noqa: E402
from toolkit import CONFIGS  # noqa: E402


def main():
    c = CONFIGS["C"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(c["B"], c["N"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    for tag, tuning in (("default", None), ("mufu_only", {"gluon_exp2": 0})):
        spec = dilgen.Spec(name=f"ncu_c_{tag}", num_heads=c["H"], head_dim=c["D"], segment_lengths=c["ws"],
                           dilation_rates=c["rs"], dtype="bfloat16")
        kern = dilgen.Kernel(spec, None, tuning)
        with torch.no_grad():
            for _ in range(2):
                kern(q, k, v)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            kern(q, k, v)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
