"""Dilated attention over P GPUs (or P CPU processes) with dilgen's ring.

    torchrun --nproc-per-node 4 examples/ring_torchrun.py                # 4 GPUs, NCCL
    torchrun --nproc-per-node 2 examples/ring_torchrun.py --cpu --tokens 128  # CPU, gloo, interpreter
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr HOST0 \
        --master-port 29500 examples/ring_torchrun.py    # on node 0; --node-rank 1 on node 1

Every rank compiles the same spec (ring_size = world size), passes its rows of q, k, v
(B, N/P, H, D), gets its rows of the output back and, after backward, its rows of the
gradients. With --check (N <= 8192), every rank compares its rows with the float64
reference and exits 1 past the tolerance.
"""
import argparse
import os

import torch
import torch.distributed as dist

import dilgen
from dilgen.runtime.ring import shard


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1 << 20, help="total tokens N")
    ap.add_argument("--cpu", action="store_true", help="gloo + Triton's interpreter")
    ap.add_argument("--check", action="store_true", help="compare with the float64 reference")
    args = ap.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    dist.init_process_group("gloo" if cpu else "nccl")
    P, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not cpu:
        torch.cuda.set_device(dev)
    spec = dilgen.Spec(name="ring_example", num_heads=2 if cpu else 16, head_dim=16 if cpu else 128,
                       dtype="float32" if cpu else "bfloat16",
                       segment_lengths=[16, 64] if cpu else [2048, 8192, 32768, 131072, 524288],
                       dilation_rates=[1, 2] if cpu else [1, 2, 4, 8, 16], ring_size=P)
    kernel = dilgen.compile(spec)
    gen = torch.Generator().manual_seed(0)                 # the same full tensors on every rank
    full = [torch.randn(1, args.tokens, spec.num_heads, spec.head_dim, generator=gen) for _ in range(3)]
    q, k, v = (shard(t, P, rank).to(dev, getattr(torch, spec.dtype)).requires_grad_(True) for t in full)
    out = kernel(q, k, v)                                  # my rows of the output
    out.float().square().mean().backward()                 # my rows of dq, dk, dv
    if args.check and args.tokens <= 8192:
        from dilgen.reference import reference_attention
        ref = shard(reference_attention(*full, spec), P, rank)
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        print(f"rank {rank}: relative error against float64 {err:.2e}")
        bound = 1e-4 if spec.dtype == "float32" else 2e-2
        if not err < bound:
            raise SystemExit(f"rank {rank}: relative error {err:.2e} against float64 is above {bound}")
    print(f"rank {rank}/{P}: out {tuple(out.shape)} dq {tuple(q.grad.shape)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
