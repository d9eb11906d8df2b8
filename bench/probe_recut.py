"""Probe (issue 59): where a P = 2 "recut" call's time goes. Per spec: fwd+bwd ms back to back and
alone, the agreement's host ms, the same with the agreement replaced by its cached answer, the
single-device twin alone on this rank's recut rows (the kernels' floor), and the profiler's top CUDA
rows of one fwd+bwd on each rank. Usage: probe_recut.py OUT name[,name...]"""
import json, os, socket, sys, time
from pathlib import Path
for _v, _o in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_v, _o)
OUT, NAMES = Path(sys.argv[1]), sys.argv[2].split(",")


def worker(rank, P, port):
    import torch, torch.distributed as dist
    import dilgen
    from dilgen.runtime.ring import run as rrun
    from dilgen.schedule import recut_pieces
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    timer = {"agree": 0.0}
    real_agree, cached = rrun._agree, {}

    def agree(*a, **kw):
        t0 = time.perf_counter()
        kind = kw.get("kind", "forward")
        if os.environ.get("PROBE_SKIP_AGREE") and kind in cached:
            r = cached[kind]
        else:
            r = cached[kind] = real_agree(*a, **kw)
        timer["agree"] += time.perf_counter() - t0
        return r
    rrun._agree = agree
    users = {u["name"]: u for u in json.loads(Path("bench/specs/ring_users.json").read_text())}
    rows = []
    for name in NAMES:
        u = users[name]
        f = {k: v for k, v in u.items() if k not in ("name", "tokens_per_gpu")}
        T = u["tokens_per_gpu"]
        spec = dilgen.Spec(**f, name=f"probe_{name}", dtype="bfloat16", ring_size=P)
        one = dilgen.compile(spec.replace(ring_size=1, name=f"probe_{name}_one"))
        kern = dilgen.compile(spec)
        order = "zigzag" if spec.causal else "contiguous"
        g = torch.Generator(device=dev).manual_seed(rank)
        q, k, v, go = (torch.randn(1, T, h, spec.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
                       for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads, spec.num_heads))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

        def fb(fn, args, grad):
            for t in args:
                t.grad = None
            fn(*args).backward(grad)

        def timed(fn):
            for _ in range(3):
                fn()
            sync(); dist.barrier(); sync()
            alone = []
            for _ in range(3):
                timer["agree"] = 0.0
                sync(); dist.barrier(); sync()
                t0 = time.perf_counter(); fn(); sync(); alone.append((time.perf_counter() - t0) * 1e3)
            sync(); dist.barrier(); t0 = time.perf_counter()
            for _ in range(8):
                fn()
            sync()
            return sorted(alone)[1], (time.perf_counter() - t0) / 8 * 1e3, timer["agree"] * 1e3
        row = {"spec": name, "rank": rank, "tokens_per_gpu": T}
        for tr in ("recut", "heads", "auto"):
            os.environ["DILGEN_RING_TRANSPORT"] = tr
            if tr == "heads" and (spec.num_kv_heads % P):
                continue
            for skip in ("", "1"):
                os.environ["PROBE_SKIP_AGREE"] = skip
                call = lambda: fb(lambda *x: kern(*x, chunk_order=order), leaves, go)  # noqa: E731
                a, b, ag = timed(call)
                tag = f"{tr}{'_skip_agree' if skip else ''}"
                row[f"{tag}_alone_ms"], row[f"{tag}_b2b_ms"], row[f"{tag}_agree_ms"] = a, b, ag
            row[f"{tr}_ran"] = kern.compiled_for(dev).attention.last_ring_transport
            os.environ["PROBE_SKIP_AGREE"] = ""
        os.environ["DILGEN_RING_TRANSPORT"] = "auto"
        mine = recut_pieces(kern.compiled_for(dev).attention.plan["ring"], T * P, order)
        n_mine = sum(ln for _, ln in mine[rank]) if mine else T
        row["recut_rows"] = n_mine
        Q, K, V, G = (torch.randn(1, n_mine, h, spec.head_dim, device=dev, dtype=torch.bfloat16)
                      for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads, spec.num_heads))
        L = [t.clone().requires_grad_(True) for t in (Q, K, V)]
        row["twin_on_recut_rows_alone_ms"], row["twin_on_recut_rows_b2b_ms"], _ = timed(lambda: fb(one, L, G))
        from torch.profiler import profile, ProfilerActivity
        os.environ["DILGEN_RING_TRANSPORT"] = "recut"
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fb(lambda *x: kern(*x, chunk_order=order), leaves, go); sync()
        os.environ["DILGEN_RING_TRANSPORT"] = "auto"
        (OUT / f"profile_{name}_rank{rank}.txt").write_text(prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        rows.append(row)
        print(json.dumps(row), flush=True)
        dist.barrier()
    (OUT / f"probe_recut_rank{rank}.json").write_text(json.dumps({"rows": rows, "torch": torch.__version__,
        "commit": os.environ.get("DILGEN_COMMIT"), "device": torch.cuda.get_device_name()}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    OUT.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.start_processes(worker, args=(2, port), nprocs=2, join=True, start_method="spawn")
