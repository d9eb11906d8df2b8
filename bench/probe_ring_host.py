"""Probe (issue 59): where a P=2 ring call's milliseconds go on short specs. Per spec: host ms of
fwd and fwd+bwd call (no sync), alone and back-to-back ms, time inside the agreement and the set-up,
the same with the agreement replaced by its cached answer, and the profiler's top kernels (rank 0)."""
import json, os, socket, sys, time
from pathlib import Path
for _v, _o in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_v, _o)
NAMES = sys.argv[2].split(",")
OUT = Path(sys.argv[1])


def worker(rank, P, port, toy):
    import torch, torch.distributed as dist
    import dilgen
    from dilgen.runtime.ring import run as rrun, shard
    cuda = torch.cuda.is_available() and not toy
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    timers = {"agree": 0.0, "setup": 0.0}
    real_agree, real_setup = rrun._agree, rrun.RingRun._setup
    cached = {}

    def agree(*a, **kw):
        t0 = time.perf_counter()
        if os.environ.get("PROBE_SKIP_AGREE") and kw.get("kind", "forward") in cached:
            r = cached[kw.get("kind", "forward")]
        else:
            r = cached[kw.get("kind", "forward")] = real_agree(*a, **kw)
        timers["agree"] += time.perf_counter() - t0
        return r

    def setup(self, *a, **kw):
        t0 = time.perf_counter()
        r = real_setup(self, *a, **kw)
        timers["setup"] += time.perf_counter() - t0
        return r
    rrun._agree, rrun.RingRun._setup = agree, setup
    users = {u["name"]: u for u in json.loads(Path("bench/specs/ring_users.json").read_text())}
    rows = []
    for name in NAMES:
        u = users[name]
        f = {k: v for k, v in u.items() if k not in ("name", "tokens_per_gpu")}
        T = u["tokens_per_gpu"]
        if toy:
            f.update(segment_lengths=[8, 32], dilation_rates=[1, 2], num_heads=2, num_kv_heads=1 if f["num_kv_heads"] < f["num_heads"] else 2, head_dim=16)
            f.pop("hilbert", None)
            T = 64
        spec = dilgen.Spec(**f, name=f"probe_{name}", dtype="bfloat16" if cuda else "float32", ring_size=P)
        kern = dilgen.compile(spec)
        order = "zigzag" if spec.causal else "contiguous"
        g = torch.Generator(device=dev).manual_seed(rank)
        dt = torch.bfloat16 if cuda else torch.float32
        q, k, v, go = (torch.randn(1, T, h, spec.head_dim, device=dev, dtype=dt, generator=g)
                       for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads, spec.num_heads))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

        def fwd():
            with torch.no_grad():
                return kern(q, k, v, chunk_order=order)

        def fb():
            for t in leaves:
                t.grad = None
            kern(*leaves, chunk_order=order).backward(go)
        row = {"spec": name, "tokens_per_gpu": T}
        for skip in ("", "1"):
            os.environ["PROBE_SKIP_AGREE"] = skip
            tag = "skip_agree_" if skip else ""
            for fn, what in ((fwd, "fwd"), (fb, "fwd_bwd")):
                for _ in range(3):
                    fn()
                sync(); dist.barrier(); sync()
                host, alone, ag, st = [], [], [], []
                for _ in range(5):
                    timers.update(agree=0.0, setup=0.0)
                    sync(); dist.barrier(); sync()
                    t0 = time.perf_counter(); fn(); t1 = time.perf_counter(); sync(); t2 = time.perf_counter()
                    host.append((t1 - t0) * 1e3); alone.append((t2 - t0) * 1e3)
                    ag.append(timers["agree"] * 1e3); st.append(timers["setup"] * 1e3)
                sync(); dist.barrier(); t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                sync(); b2b = (time.perf_counter() - t0) / 10 * 1e3
                med = lambda x: sorted(x)[len(x) // 2]
                row.update({f"{tag}{what}_host_ms": med(host), f"{tag}{what}_alone_ms": med(alone),
                            f"{tag}{what}_b2b_ms": b2b, f"{tag}{what}_agree_ms": med(ag), f"{tag}{what}_setup_ms": med(st)})
        os.environ["PROBE_SKIP_AGREE"] = ""
        # single device on this rank's T*P rows for reference
        if cuda and rank == 0:
            one = dilgen.compile(dilgen.Spec(**f, name=f"probe_{name}_one", dtype="bfloat16"))
            Q, K, V, G = (torch.randn(1, T * P, h, spec.head_dim, device=dev, dtype=dt) for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads, spec.num_heads))
            L = [t.clone().requires_grad_(True) for t in (Q, K, V)]
            def sfb():
                one(*L).backward(G)
            for _ in range(3): sfb()
            sync(); t0 = time.perf_counter()
            for _ in range(5): sfb()
            sync(); row["single_full_fwd_bwd_b2b_ms"] = (time.perf_counter() - t0) / 5 * 1e3
            t0 = time.perf_counter(); sfb(); t1 = time.perf_counter(); sync()
            row["single_full_fwd_bwd_host_ms"] = (t1 - t0) * 1e3; row["single_full_fwd_bwd_alone_ms"] = (time.perf_counter() - t0) * 1e3
        dist.barrier()
        from torch.profiler import profile, ProfilerActivity
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            fb(); sync()
        if rank == 0:
            (OUT / f"profile_{name}.txt").write_text(prof.key_averages().table(
                sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40, max_name_column_width=70))
            (OUT / f"profile_{name}_cpu.txt").write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))
            row["transport"] = kern.compiled_for(dev).attention.last_ring_transport
            rows.append(row)
            print(json.dumps(row), flush=True)
        dist.barrier()
    if rank == 0:
        (OUT / "ring_host_probe.json").write_text(json.dumps({"rows": rows, "torch": torch.__version__,
              "commit": os.environ.get("DILGEN_COMMIT"), "device": torch.cuda.get_device_name() if cuda else "cpu"}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    OUT.mkdir(parents=True, exist_ok=True)
    toy = len(sys.argv) > 3 and sys.argv[3] == "toy"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.start_processes(worker, args=(2, port, toy), nprocs=2, join=True, start_method="spawn")
