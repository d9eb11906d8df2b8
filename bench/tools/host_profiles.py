"""Probe (issue 41): where the host time of two eager paths goes, by cProfile.

    torchrun --nproc-per-node 2 bench/tools/host_profiles.py --out DIR

1. A ring forward (no gradient) over NCCL at N = 16K, P = 2, transports "ring" and
   "heads": per-call ms with a sync after each call and back to back, then rank 0's
   profile of 30 calls (eager 1.1 and 8.2 ms against 0.16 and 0.55 replayed from a graph,
   bench/results/ring_capture_check-2026-11-27-h200x2.json).
2. Rank 0 alone: one transformers decode layer-step through the doorway (bench_transformers'
   decode_one: 73 us against sdpa's 25): its profile, beside kernel.decode timed alone.
Writes host_profiles.json (timings) and *.prof.txt (pstats, top 40) under --out."""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

import dilgen


def stats_text(prof) -> str:
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(40)
    st.sort_stats("tottime").print_stats(25)
    return s.getvalue()


def per_call_ms(fn, n=30):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        torch.cuda.synchronize()
    synced = (time.perf_counter() - t0) / n * 1e3
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return round(synced, 4), round((time.perf_counter() - t0) / n * 1e3, 4)


def ring_part(out_dir, rank, dev, P, res):
    spec = dilgen.Spec(name="hostprof", num_heads=8, num_kv_heads=8, head_dim=64,
                       segment_lengths=[2048, 8192], dilation_rates=[1, 4], ring_size=P, dtype="bfloat16")
    kern = dilgen.compile(spec)
    q, k, v = (torch.randn(1, 16384 // P, 8, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for transport in ("ring", "heads"):
        os.environ["DILGEN_RING_TRANSPORT"] = transport
        with torch.no_grad():
            call = lambda: kern(q, k, v)  # noqa: E731
            for _ in range(3):
                call()
            res[f"ring_{transport}_ms_synced_b2b"] = per_call_ms(call)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(30):
                call()
            torch.cuda.synchronize()
            prof.disable()
        if rank == 0:
            with open(os.path.join(out_dir, f"ring_{transport}.prof.txt"), "w") as f:
                f.write(stats_text(prof))


def decode_part(out_dir, dev, res):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench_transformers import make_model
    from transformers import AttentionInterface
    S = 32768
    for impl in ("dilgen", "sdpa"):
        model = make_model(impl, S + 1, False, dev)
        attn = model.model.layers[0].self_attn
        fn = AttentionInterface().get_interface(impl, None)
        H, Hkv, D = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
        q = torch.randn(1, H, 1, D, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, Hkv, S, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        call = lambda: fn(attn, q, k, v, None, scaling=attn.scaling)[0]  # noqa: E731
        with torch.inference_mode():
            for _ in range(5):
                call()
            res[f"doorway_decode_{impl}_ms_synced_b2b"] = per_call_ms(call, 300)
            if impl == "dilgen":
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(300):
                    call()
                torch.cuda.synchronize()
                prof.disable()
                with open(os.path.join(out_dir, "doorway_decode.prof.txt"), "w") as f:
                    f.write(stats_text(prof))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    res = {"torch": torch.__version__, "triton": __import__("triton").__version__,
           "device": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%d")}
    ring_part(args.out, rank, dev, dist.get_world_size(), res)
    dist.barrier()
    if rank == 0:
        decode_part(args.out, dev, res)
        with open(os.path.join(args.out, "host_profiles.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
