"""Dilated attention over P GPUs (or P CPU processes) with dilgen's ring.

    torchrun --nproc-per-node 4 examples/ring_torchrun.py                # 4 GPUs, NCCL
    torchrun --nproc-per-node 2 examples/ring_torchrun.py --cpu          # CPU, gloo, interpreter
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr HOST0 \
        --master-port 29500 examples/ring_torchrun.py    # on node 0; --node-rank 1 on node 1

Every rank compiles the same spec (ring_size = world size), makes its own rows of q, k, v
(B, N/P, H, D) on its device (seeded by rank: no rank builds the full tensors, 3 x 8 GiB of
float32 at the default N), gets its rows of the output back and, after backward, its rows
of the gradients. With --check (N <= 8192) the ranks gather the inputs and the output and
split the float64 reference between them by heads (rank r: heads r, r + P, ..., on its
share of the CPU cores); every rank prints the relative error over all heads and rows and
exits 1 past the tolerance.
"""
import argparse
import os

import torch
import torch.distributed as dist

import dilgen
from dilgen.runtime.ring import unshard


def gathered(t: torch.Tensor, P: int) -> torch.Tensor:
    """The full (B, N, ...) float64 tensor on the CPU from every rank's rows of `t`."""
    rows = [torch.empty_like(t) for _ in range(P)]
    dist.all_gather(rows, t.detach().contiguous())
    return unshard(rows).cpu().double()


def relative_error(spec, q, k, v, out, P: int, rank: int) -> float:
    """||out - reference|| / ||reference|| over every head and row: this rank computes the
    float64 reference of heads rank, rank + P, ... alone (Spec.head_base keeps each head's
    offsets), on its share of the cores (torchrun sets OMP_NUM_THREADS=1): the dense (N, N)
    reference of all heads on every rank, one thread each, took minutes at N = 8192, H = 16."""
    from dilgen.reference import reference_attention
    fq, fk, fv, fo = (gathered(t, P) for t in (q, k, v, out))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", P))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local))
    group = spec.num_heads // spec.num_kv_heads
    sums = torch.zeros(2, dtype=torch.float64)
    for h in range(rank, spec.num_heads, P):
        one = spec.replace(num_heads=1, num_kv_heads=1, head_base=h, ring_size=1)
        kv = slice(h // group, h // group + 1)
        ref = reference_attention(fq[:, :, h:h + 1], fk[:, :, kv], fv[:, :, kv], one)
        sums += torch.stack([(fo[:, :, h:h + 1] - ref).square().sum(), ref.square().sum()])
    sums = sums.to(out.device)
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).sqrt().item()


# The spec every rank compiles (name "ring_example", ring_size = the world size): the GPU's,
# and the one --cpu runs, shrunk for Triton's interpreter (which runs each tile op in numpy).
GPU_SPEC = dict(num_heads=16, head_dim=128, dtype="bfloat16",
                segment_lengths=[2048, 8192, 32768, 131072, 524288], dilation_rates=[1, 2, 4, 8, 16])
CPU_SPEC = dict(num_heads=2, head_dim=16, dtype="float32", segment_lengths=[16, 64], dilation_rates=[1, 2])
GPU_TOKENS, CPU_TOKENS = 1 << 20, 128


def _words(spec: dict) -> str:
    return (f"{spec['num_heads']} heads, head_dim {spec['head_dim']}, {spec['dtype']}, "
            f"w = {spec['segment_lengths']}, r = {spec['dilation_rates']}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Dilated attention over the ranks of torchrun with dilgen's ring: every rank "
                    "compiles the spec \"ring_example\" (non-causal, ring_size = the world size), "
                    f"{_words(GPU_SPEC)}, runs forward and backward on its rows of q, k, v and "
                    "prints their shapes.",
        epilog="Run it through torchrun, e.g. torchrun --nproc-per-node 2 examples/ring_torchrun.py "
               "--cpu --check")
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"total tokens N over all ranks, a multiple of the rank count (default "
                         f"{GPU_TOKENS}; {CPU_TOKENS} with --cpu)")
    ap.add_argument("--cpu", action="store_true",
                    help="run on the CPU: gloo instead of NCCL, Triton's interpreter instead of "
                         f"GPU kernels, and a smaller spec ({_words(CPU_SPEC)}) with N = "
                         f"{CPU_TOKENS} by default (taken without a GPU too)")
    ap.add_argument("--check", action="store_true",
                    help="compare with the float64 reference (N <= 8192); exit 1 past the tolerance")
    return ap


def main():
    args = parser().parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    if args.tokens is None:
        args.tokens = CPU_TOKENS if cpu else GPU_TOKENS
    dist.init_process_group("gloo" if cpu else "nccl")
    P, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not cpu:
        torch.cuda.set_device(dev)
    spec = dilgen.Spec(name="ring_example", ring_size=P, **(CPU_SPEC if cpu else GPU_SPEC))
    if args.tokens % P:
        raise SystemExit(f"--tokens {args.tokens} is not divisible by the {P} ranks")
    kernel = dilgen.compile(spec)
    gen = torch.Generator(device=dev).manual_seed(1000 + rank)    # my rows (rank's contiguous chunk)
    q, k, v = (torch.randn(1, args.tokens // P, spec.num_heads, spec.head_dim, generator=gen, device=dev)
               .to(getattr(torch, spec.dtype)).requires_grad_(True) for _ in range(3))
    out = kernel(q, k, v)                                  # my rows of the output
    out.float().square().mean().backward()                 # my rows of dq, dk, dv
    if args.check and args.tokens <= 8192:
        err = relative_error(spec, q, k, v, out, P, rank)
        print(f"rank {rank}: relative error against float64 {err:.2e}")
        bound = 1e-4 if spec.dtype == "float32" else 2e-2
        if not err < bound:
            raise SystemExit(f"rank {rank}: relative error {err:.2e} against float64 is above {bound}")
    print(f"rank {rank}/{P}: out {tuple(out.shape)} dq {tuple(q.grad.shape)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
