"""Quick timing of dilgen's forward on the issue's configs (no peers): for tuning runs.
Usage: python bench/probe_forward.py [--configs A,B,C,D] [--causal]"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

import dilgen
from dilgen.stats import forward_flops

CONFIGS = {
    "A": dict(B=1, H=16, N=32768, D=128, w=[2048, 4096, 8192], r=[1, 2, 4]),
    "B": dict(B=1, H=16, N=131072, D=128, w=[2048, 4096, 8192, 16384, 32768], r=[1, 2, 4, 8, 16]),
    "C": dict(B=2, H=32, N=16384, D=64, w=[1024, 2048, 4096], r=[1, 2, 4]),
    "D": dict(B=1, H=16, N=65536, D=128, w=[4096, 16384], r=[4, 16]),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="A,B,C,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.configs.split(","):
        c = CONFIGS[name]
        for causal in ([False, True] if args.causal else [False]):
            spec = dilgen.Spec(name=f"probe_{name.lower()}", num_heads=c["H"], head_dim=c["D"],
                               segment_lengths=c["w"], dilation_rates=c["r"], causal=causal)
            q = torch.randn(c["B"], c["N"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn_like(q), torch.randn_like(q)
            kern = dilgen.compile(spec)
            kern(q, k, v)
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(lambda: kern(q, k, v), warmup=25, rep=100, return_mode="median")
            fl = forward_flops(c["w"], c["r"], c["H"], c["D"], causal, c["N"], c["B"])
            rows.append(dict(config=name, causal=causal, ms=ms, tflops=fl / ms / 1e9))
            print(f"{name} causal={causal}: {ms:.3f} ms  {fl / ms / 1e9:.0f} TFLOP/s", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
