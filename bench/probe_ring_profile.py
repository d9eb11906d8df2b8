#!/usr/bin/env python3
"""Probe (issue 39; leaves the tree after its run, its JSON stays): where a ring call's time
goes at P GPUs. Per rank, one fwd+bwd call under torch.profiler: GPU time of dilgen's
kernels (by kernel), NCCL kernels (transfer + the wait for the peer), copies and
elementwise ops (compaction, zigzag, partial adds), the compute stream's idle time
inside the call, and the host time of the call; the single-device kernel on the rank's
share of the work (T_1(N) / P) beside it; and the link rates the cost model needs
(P2P ring shift, all-gather, all-to-all, at 256 MiB and 1 GiB per rank).

  python bench/probe_ring_profile.py --gpus 4 --out $OUT
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402
from bench_ring import GPU, chunks, make_spec, my_rows  # noqa: E402

# "local": Hilbert segment tiles whose segments all lie inside a rank (w <= tokens per GPU)
CASES = ("raster", "segment", "causal_gqa", "local", "sequence")


def category(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if any(x in low for x in ("fwd_kernel", "bwd_", "lane", "curve", "_fwd", "dkdv", "_dq")):
        return "dilgen"
    if "memcpy" in low or "memset" in low:
        return "memcpy"
    if "fill" in low:
        return "fill"
    return "aten"   # elementwise, index, cat, copy_: compaction, partial adds, casts


def union_ms(spans):
    total, end = 0.0, -1e30
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def profile_call(fn, dev):
    import torch
    from torch.profiler import ProfilerActivity, profile
    tk.sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        tk.sync(dev)
        wall = time.perf_counter() - t0
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_cat, by_kernel, spans, compute_spans = {}, {}, [], []
    for e in kern:
        s, t = e.time_range.start, e.time_range.end
        c = category(e.name)
        by_cat[c] = by_cat.get(c, 0.0) + (t - s) / 1e3
        if c == "dilgen":
            k = next((x for x in ("fwd_kernel", "preprocess", "dkdv_fused", "dkdv", "dq", "lane", "curve")
                      if x in e.name), e.name[-24:])
            by_kernel[k] = by_kernel.get(k, 0.0) + (t - s) / 1e3
        spans.append((s, t))
        if c != "nccl":
            compute_spans.append((s, t))
    first = min((s for s, _ in spans), default=0)
    last = max((t for _, t in spans), default=0)
    return {"wall_ms": wall * 1e3, "host_ms": host * 1e3, "gpu_span_ms": (last - first) / 1e3,
            "by_category_ms": by_cat, "dilgen_by_kernel_ms": by_kernel,
            "compute_busy_ms": union_ms(compute_spans),
            "compute_idle_in_span_ms": (last - first) / 1e3 - union_ms(compute_spans),
            "launches": len(kern)}


def spec_for(case, N, P):
    import dilgen
    if case == "local":
        return dilgen.Spec(name=f"probe_local_p{P}", num_heads=GPU["H"], num_kv_heads=GPU["H"], head_dim=GPU["D"],
                           dtype="bfloat16", segment_lengths=[2048, 8192, 32768, 131072],
                           dilation_rates=[1, 2, 4, 8], ring_size=P, hilbert={"scope": "segment"})
    return make_spec(GPU, case, N, P, name=f"probe_{case}_p{P}")


def links(dist, P, dev):
    """GB/s per rank (bytes one rank sends / time) of a P2P ring shift, all-gather, all-to-all."""
    import torch
    out = {}
    for mib in (256, 1024):
        n = mib * 2**20 // 2
        x = torch.randn(n, device=dev, dtype=torch.bfloat16)
        me = dist.get_rank()

        def shift():
            y = torch.empty_like(x)
            ops = [dist.P2POp(dist.isend, x, (me + 1) % P), dist.P2POp(dist.irecv, y, (me - 1) % P)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        def gather():
            dist.all_gather_into_tensor(torch.empty(n * P, device=dev, dtype=x.dtype), x)

        def a2a():
            dist.all_to_all_single(torch.empty_like(x), x)
        for name, fn, sent in (("p2p", shift, 1.0), ("allgather", gather, P - 1), ("alltoall", a2a, (P - 1) / P)):
            fn()
            tk.sync(dev)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            tk.sync(dev)
            dt = (time.perf_counter() - t0) / 5
            out[f"{name}_{mib}MiB_gbytes_s"] = mib * 2**20 * sent / dt / 1e9
            out[f"{name}_{mib}MiB_ms"] = dt * 1e3
        del x
    return out


def worker(rank, P, port, cases, T, out_path):
    import torch
    import torch.distributed as dist
    import dilgen
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=P, timeout=timedelta(seconds=300), device_id=dev)
    res = {"links": links(dist, P, dev), "cases": {}}
    for case in cases:
        t0 = time.time()
        try:
            N = T * P
            spec, one = spec_for(case, N, P), spec_for(case, N, 1)
            H, Hk = spec.num_heads, spec.num_kv_heads
            g = torch.Generator(device=dev).manual_seed(1 + rank)
            mine = [torch.randn(1, T, h, GPU["D"], device=dev, dtype=torch.bfloat16, generator=g)
                    for h in (H, Hk, Hk, H)]
            kernel = dilgen.compile(spec)
            leaves = [t.clone().requires_grad_(True) for t in mine[:3]]

            def fwd_bwd():
                for t in leaves:
                    t.grad = None
                kernel(*leaves, chunk_order=chunks(spec)).backward(mine[3])
            fwd_bwd()
            fwd_bwd()
            dist.barrier()
            row = {"ring": profile_call(fwd_bwd, dev)}
            dist.barrier()
            t1 = time.perf_counter()
            for _ in range(2):
                fwd_bwd()
            tk.sync(dev)
            row["ring_fwd_bwd_ms"] = (time.perf_counter() - t1) / 2 * 1e3
            del leaves, mine
            tk.cleanup(dev)
            dist.barrier()
            if rank == 0:       # T_1(N) on the full sequence, one GPU
                single = dilgen.compile(one)
                full = [torch.randn(1, N, h, GPU["D"], device=dev, dtype=torch.bfloat16).requires_grad_(i < 3)
                        for i, h in enumerate((H, Hk, Hk, H))]

                def s_fwd_bwd():
                    for t in full[:3]:
                        t.grad = None
                    single(*full[:3]).backward(full[3])
                s_fwd_bwd()
                row["single"] = profile_call(s_fwd_bwd, dev)
                t1 = time.perf_counter()
                s_fwd_bwd()
                tk.sync(dev)
                row["single_fwd_bwd_ms"] = (time.perf_counter() - t1) * 1e3
                del full
                tk.cleanup(dev)
        except Exception as e:  # noqa: BLE001
            row = {"error": tk.short_err(e, 800)}
            tk.cleanup(dev)
        row["wall_s"] = round(time.time() - t0, 1)
        res["cases"][case] = row
        every = [None] * P
        dist.all_gather_object(every, row)
        if rank == 0:
            ring = [r.get("ring_fwd_bwd_ms") for r in every]
            tk.log(f"  {case}: ring fwd+bwd per rank {ring} ms; single {row.get('single_fwd_bwd_ms')} ms"
                   f" {row.get('error', '')}")
            res["cases"][case] = {"ranks": every, "single_fwd_bwd_ms": row.get("single_fwd_bwd_ms"),
                                  "single": row.get("single")}
            tk.write_json_atomic(out_path, res)
    dist.destroy_process_group()


def main():
    import argparse
    import torch.multiprocessing as mp
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--tokens-per-gpu", type=int, default=GPU["tokens"])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    head = tk.header("cuda")
    tmp = Path(a.out) / "probe_tmp.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(worker, args=(a.gpus, port, a.cases.split(","), a.tokens_per_gpu, str(tmp)),
                           nprocs=a.gpus, join=True, start_method="spawn")
    finally:
        data = json.loads(tmp.read_text()) if tmp.exists() else {}
        path = tk.result_path(a.out, "ring_profile", tag=f"p{a.gpus}")
        tk.write_json_atomic(path, {**head, "device": f"{a.gpus} x {head['device']}", "gpus": a.gpus,
                                    "tokens_per_gpu": a.tokens_per_gpu, **data})
        tmp.unlink(missing_ok=True)
        tk.log(f"json: {path}")


if __name__ == "__main__":
    main()
