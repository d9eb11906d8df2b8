"""GPU probe (issue 42): one forward of A non-causal and A causal (Gluon lanes with the
diagonal block peeled), each as planned by default, under Nsight Compute: every kernel's time,
tensor pipe busy share and stall reasons (why causal / non-causal misses cuDNN's ratio + 0.03).

    ncu --profile-from-start off ... python3 bench/tools/lanes_fwd_ncu.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dilgen  # noqa: E402
from toolkit import CONFIGS  # noqa: E402


def main():
    for name, causal in (("A", False), ("A", True)):
        c = CONFIGS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(c["B"], c["N"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        spec = dilgen.Spec(name=f"ncu_{name.lower()}{'_causal' if causal else ''}", num_heads=c["H"], head_dim=c["D"],
                           segment_lengths=c["ws"], dilation_rates=c["rs"], dtype="bfloat16", causal=causal,
                           hilbert=c.get("hilbert"))
        kern = dilgen.Kernel(spec)
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
