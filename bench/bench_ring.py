"""Ring benchmark (issue 5): weak scaling at a fixed number of tokens per GPU, forward and
forward+backward, dilgen's ring (P2P steps overlapped with kernels) against LongNet's
all-gather of the sparse rows built on the same local kernels, and a dense ring of flash
attention (the upper bound users know; modelled as P x one measured flash step with the
transfer hidden). Then the longest sequence that runs forward+backward per GPU count.

    python bench/bench_ring.py [--gpus 1 2 4] [--tokens-per-gpu 262144] [--out bench/results]

One process per GPU (torch.multiprocessing + NCCL). Spec (the same for every P):
H16 D128 bf16, w = [2048, 8192, 32768, 131072, 524288, 1048576], r = [1, 2, 4, 8, 16, 32];
a segment longer than N is one short segment (SPEC §2). Useful FLOPs count
Σ_i 4·B·H·(N/w_i)·(w_i/r_i)²·D with w_i capped at N, x3.5 for forward+backward
(backward = 2.5 forward), per GPU = / P. Before timing, each GPU count checks the bf16
ring against the float64 reference on a small N (the error must not grow with P).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # device README: no NVLink multicast
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

W = [2048, 8192, 32768, 131072, 524288, 1048576]
R = [1, 2, 4, 8, 16, 32]
H, D = 16, 128


def _spec(P: int, heads=H, head_dim=D, dtype="bfloat16"):
    import dilgen
    return dilgen.Spec(name="ring_bench", num_heads=heads, head_dim=head_dim, dtype=dtype,
                       segment_lengths=W, dilation_rates=R, ring_size=P)


def useful_flops_per_gpu(N: int, P: int, fwd_bwd: bool) -> float:
    from dilgen.stats import forward_flops
    f = forward_flops(W, R, H, D, False, N) / P
    return f * 3.5 if fwd_bwd else f


def _time(fn, reps: int, dist) -> float:
    """Wall time per call in ms, the slowest rank's (barriers around the loop)."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    ms = torch.tensor([(time.perf_counter() - t0) / reps * 1e3], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _bf16_error(P, rank, dist) -> float:
    """bf16 ring vs float64 reference on a small N (H = 2, D = 64, same w and r)."""
    from dilgen.reference import reference_attention
    from dilgen.runtime.ring import shard
    import dilgen
    N = 2048 * 4
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, N, 2, 64, generator=gen) for _ in range(3))
    spec = dilgen.Spec(name="ring_err", num_heads=2, head_dim=64, dtype="bfloat16",
                       segment_lengths=W, dilation_rates=R, ring_size=P)
    mine = [shard(t, P, rank).to(torch.bfloat16).cuda() for t in (q, k, v)]
    out = dilgen.compile(spec)(*mine)
    ref = shard(reference_attention(q, k, v, spec), P, rank)
    num = torch.tensor([(out.double().cpu() - ref).norm().item() ** 2, ref.norm().item() ** 2],
                       device="cuda", dtype=torch.float64)
    dist.all_reduce(num)
    return (num[0] / num[1]).sqrt().item()


def worker(rank, P, port, args, result_path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import torch.distributed as dist
    import dilgen
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=P, timeout=timedelta(seconds=180),
                            device_id=torch.device("cuda", rank))
    res = {"gpus": P, "tokens_per_gpu": args.tokens_per_gpu}
    try:
        res["bf16_rel_error_vs_fp64"] = _bf16_error(P, rank, dist)
        T = args.tokens_per_gpu
        N = T * P
        spec = _spec(P)
        kernel = dilgen.compile(spec)
        gen = torch.Generator(device="cuda").manual_seed(rank)
        q, k, v = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        gout = torch.randn_like(q)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

        def fwd():
            with torch.no_grad():
                kernel(q, k, v)

        def fwd_bwd():
            out = kernel(*leaves)
            out.backward(gout)

        transports = ["ring", "allgather"] if P > 1 else ["local"]
        for tr in transports:
            os.environ["DILGEN_RING_TRANSPORT"] = "ring" if tr == "local" else tr
            torch.cuda.reset_peak_memory_stats()
            key = "" if tr in ("ring", "local") else "allgather_"
            res[f"{key}fwd_ms"] = _time(fwd, args.reps, dist)
            res[f"{key}fwd_bwd_ms"] = _time(fwd_bwd, max(1, args.reps // 2), dist)
            res[f"{key}peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        os.environ["DILGEN_RING_TRANSPORT"] = "auto"
        if P > 1:
            from dilgen.ir import ring_schedule
            sched = ring_schedule(kernel.compiled_for(q.device).attention.plan["ring"], N)
            res["remote_steps"] = len(sched["steps"]) - 1
            res["bytes_fraction"] = sched["bytes_fraction"]
        res["useful_tflops_per_gpu_fwd"] = useful_flops_per_gpu(N, P, False) / res["fwd_ms"] / 1e9
        res["useful_tflops_per_gpu_fwd_bwd"] = useful_flops_per_gpu(N, P, True) / res["fwd_bwd_ms"] / 1e9
        if rank == 0 and P == 1:
            # dense ring flash: one step = flash attention of T queries against T keys
            qd, kd, vd = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            sd = [t.clone().requires_grad_(True) for t in (qd, kd, vd)]
            from torch.nn.attention import SDPBackend, sdpa_kernel
            F = torch.nn.functional
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                def flash_fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(qd, kd, vd)

                def flash_fwd_bwd():
                    F.scaled_dot_product_attention(*sd).backward(gout.transpose(1, 2))
                res["flash_step_fwd_ms"] = _time(flash_fwd, 2, dist)
                res["flash_step_fwd_bwd_ms"] = _time(flash_fwd_bwd, 1, dist)
        # longest sequence (forward+backward) at this GPU count: grow tokens per GPU while
        # the measured peak, scaled, fits; every rank agrees before trying (no lone OOM)
        per_token = res["peak_gib"] * 2**30 / T
        free = torch.cuda.mem_get_info()[1] * 0.92
        best = T
        for t_try in args.max_tokens:
            fits = torch.tensor([1 if per_token * t_try * 1.1 < free else 0], device="cuda")
            dist.all_reduce(fits, op=dist.ReduceOp.MIN)
            if not fits.item():
                break
            del leaves
            torch.cuda.empty_cache()
            ok = torch.tensor([1], device="cuda")
            try:
                big = [torch.randn(1, t_try, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
                       for _ in range(3)]
                t0 = time.perf_counter()
                kernel(*big).backward(torch.randn(1, t_try, H, D, device="cuda", dtype=torch.bfloat16))
                torch.cuda.synchronize()
                res[f"fwd_bwd_ms_at_{t_try}"] = (time.perf_counter() - t0) * 1e3
                del big
            except torch.OutOfMemoryError:
                ok[0] = 0
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            leaves = []
            torch.cuda.empty_cache()
            if not ok.item():
                break
            best = t_try
        res["max_tokens_per_gpu_fwd_bwd"] = best
    except Exception:  # noqa: BLE001
        res["error"] = traceback.format_exc()
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    rows = [r for r in result["rows"] if "fwd_bwd_ms" in r]
    g = [r["gpus"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(g, [r["useful_tflops_per_gpu_fwd_bwd"] for r in rows], "o-", label="dilgen ring")
    ag = [r.get("allgather_fwd_bwd_ms") for r in rows]
    if any(ag):
        ax[0].plot([x for x, a in zip(g, ag) if a], [useful_flops_per_gpu(r["tokens_per_gpu"] * r["gpus"], r["gpus"], True) / a / 1e9
                                                   for r, a in zip(rows, ag) if a], "s--", label="all-gather (LongNet)")
    for r in rows:
        if "efficiency_fwd_bwd" in r:
            ax[0].annotate(f"{r['efficiency_fwd_bwd']:.0%}", (r["gpus"], r["useful_tflops_per_gpu_fwd_bwd"]),
                           textcoords="offset points", xytext=(0, 8), ha="center")
    ax[0].set_ylim(0, 1.2 * max(r["useful_tflops_per_gpu_fwd_bwd"] for r in rows))
    ax[0].set_xlabel("GPUs")
    ax[0].set_ylabel("useful TFLOP/s per GPU (fwd+bwd)")
    ax[0].set_xticks(g)
    ax[0].legend()
    ax[0].set_title(f"weak scaling, {rows[0]['tokens_per_gpu'] // 1024}K tokens per GPU")
    ax[1].bar([str(x) for x in g], [r["fwd_bwd_ms"] for r in rows], label="dilgen ring")
    ax[1].set_ylabel("fwd+bwd ms")
    ax[1].set_xlabel("GPUs")
    ax[1].set_title("time per step (same tokens per GPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens-per-gpu", type=int, default=262144)
    ap.add_argument("--max-tokens", type=int, nargs="*", default=[1 << 20, 3 << 19, 2 << 20])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--resume", help="a ring-*.json whose rows for other GPU counts to keep")
    args = ap.parse_args()
    import torch.multiprocessing as mp
    import triton
    n_dev = torch.cuda.device_count()
    gpus = [p for p in args.gpus if p <= n_dev]
    rows = []
    if args.resume:
        with open(args.resume) as f:
            rows = [r for r in json.load(f)["rows"] if r["gpus"] not in gpus]
    for i, P in enumerate(gpus):
        print(f"[{i + 1}/{len(gpus)}] {P} GPU(s), {args.tokens_per_gpu} tokens per GPU ...", flush=True)
        path = os.path.join(args.out, f".ring_tmp_{P}.json")
        os.makedirs(args.out, exist_ok=True)
        t0 = time.time()
        mp.start_processes(worker, args=(P, _free_port(), args, path), nprocs=P, join=True,
                           start_method="spawn")
        with open(path) as f:
            row = json.load(f)
        os.remove(path)
        row["wall_s"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    rows.sort(key=lambda r: r["gpus"])
    base = next((r for r in rows if r["gpus"] == 1 and "fwd_bwd_ms" in r), None)
    for r in rows:
        if base and "fwd_bwd_ms" in r:
            r["efficiency_fwd_bwd"] = r["useful_tflops_per_gpu_fwd_bwd"] / base["useful_tflops_per_gpu_fwd_bwd"]
            r["efficiency_fwd"] = r["useful_tflops_per_gpu_fwd"] / base["useful_tflops_per_gpu_fwd"]
        if base and "flash_step_fwd_ms" in base:
            r["dense_ring_flash_fwd_ms_modelled"] = base["flash_step_fwd_ms"] * r["gpus"]
            r["dense_ring_flash_fwd_bwd_ms_modelled"] = base["flash_step_fwd_bwd_ms"] * r["gpus"]
    date = dt.date.today().isoformat()
    result = {
        "device": f"{n_dev} x {torch.cuda.get_device_name(0)}", "date": date,
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "python": sys.version.split()[0], "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
        "spec": {"segment_lengths": W, "dilation_rates": R, "num_heads": H, "head_dim": D,
                 "dtype": "bfloat16", "batch": 1},
        "rows": rows,
        "max_tokens_fwd_bwd": {str(r["gpus"]): r.get("max_tokens_per_gpu_fwd_bwd", 0) * r["gpus"] for r in rows},
    }
    print(f"\n{'GPUs':>4} {'tok/GPU':>8} {'fwd ms':>8} {'f+b ms':>8} {'TF/s/GPU':>9} {'eff':>6} "
          f"{'AG f+b':>8} {'flash ring f+b':>14} {'bf16 err':>9}")
    for r in rows:
        if "fwd_bwd_ms" not in r:
            print(f"{r['gpus']:>4} failed: {r.get('error', '?')[-300:]}")
            continue
        print(f"{r['gpus']:>4} {r['tokens_per_gpu']:>8} {r['fwd_ms']:>8.1f} {r['fwd_bwd_ms']:>8.1f} "
              f"{r['useful_tflops_per_gpu_fwd_bwd']:>9.1f} {r.get('efficiency_fwd_bwd', 0):>6.2f} "
              f"{r.get('allgather_fwd_bwd_ms', float('nan')):>8.1f} "
              f"{r.get('dense_ring_flash_fwd_bwd_ms_modelled', float('nan')):>14.1f} "
              f"{r['bf16_rel_error_vs_fp64']:>9.2e}")
    print("longest fwd+bwd sequence:", result["max_tokens_fwd_bwd"])
    out = os.path.join(args.out, f"ring-{date}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    _plot(result, os.path.join(args.out, f"ring-{date}.png"))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--plot":      # re-draw from a result file
        with open(sys.argv[2]) as f:
            _plot(json.load(f), sys.argv[2].replace(".json", ".png"))
    else:
        main()
