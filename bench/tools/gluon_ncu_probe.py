"""GPU probe (issue 42): where the Gluon forward and the `tl` forward spend their time on
configs A, B, C (bench/toolkit.py), and what a Gluon call costs on the host.

    python3 bench/tools/gluon_ncu_probe.py --profile A        # under ncu: one call of each plan
    python3 bench/tools/gluon_ncu_probe.py --host --out DIR   # host pieces, one call vs back to back

--profile warms both plans, then calls each once between cudaProfilerStart/Stop (ncu
--profile-from-start off). --host times, per config: back to back (20 calls, median of 7),
one call alone (events, best of 9), the host time of a call (perf_counter over 200 calls,
no sync), and the Gluon launch's pieces: its descriptors (gluon_launch) and the TMA encodes
the launcher makes of them (fill_tma_descriptor)."""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dilgen  # noqa: E402
import toolkit as tk  # noqa: E402
from dilgen.runtime.gluon_launch import gluon_launch  # noqa: E402


def plans(name):
    c = tk.CONFIGS[name]
    spec = dilgen.Spec(name=f"ncu_{name.lower()}", num_heads=c["H"], head_dim=c["D"], segment_lengths=c["ws"],
                       dilation_rates=c["rs"], dtype="bfloat16")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(c["B"], c["N"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    return c, q, k, v, dilgen.Kernel(spec, None, {"gluon_fwd": True}), dilgen.Kernel(spec, None, {"gluon_fwd": False})


def b2b(fn, calls=20, rounds=7):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return sorted(ts)[len(ts) // 2]


def one_call(fn, rounds=9):
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def host_us(fn, calls=200):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return dt


def profile(name):
    c, q, k, v, kg, kt = plans(name)
    with torch.no_grad():
        for _ in range(2):
            kg(q, k, v), kt(q, k, v)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        kg(q, k, v)
        kt(q, k, v)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def host(names, out):
    from triton.runtime.driver import driver
    rows = []
    for name in names:
        c, q, k, v, kg, kt = plans(name)
        row = {"config": name}
        with torch.no_grad():
            og, lg = kg(q, k, v, return_lse=True)
            ot, lt = kt(q, k, v, return_lse=True)
            row["out_equal_tl"] = bool(torch.equal(og, ot))
            row["lse_max_abs_diff_tl"] = (lg - lt).abs().max().item()
            for tag, kern in (("gluon", kg), ("tl", kt)):
                fn = lambda kern=kern: kern(q, k, v)  # noqa: E731
                row[f"{tag}_b2b_ms"] = round(b2b(fn), 4)
                row[f"{tag}_one_call_ms"] = round(one_call(fn), 4)
                row[f"{tag}_host_us"] = round(host_us(fn), 1)
            attn = kg.compiled_for(q.device).attention
            B, N = q.shape[0], q.shape[1]
            out_, lse = torch.empty_like(q), torch.empty(B, c["H"], N, device="cuda")
            row["gluon_descriptors_us"] = round(host_us(lambda: gluon_launch(attn, q, k, v, out_, lse, B, N), 500), 1)
            _, _, args, _ = gluon_launch(attn, q, k, v, out_, lse, B, N)
            descs = [a for a in args if hasattr(a, "block_shape")]
            fill = driver.active.utils.fill_tma_descriptor
            try:
                t = time.perf_counter()
                for _ in range(500):
                    for d in descs:
                        fill(d.base.data_ptr(), 128, 2, 9, d.block_shape, d.shape, d.strides, 0)
                row["tma_encodes_us"] = round((time.perf_counter() - t) / 500 * 1e6, 1)
            except Exception as exc:  # noqa: BLE001 - recorded
                row["tma_encodes_error"] = repr(exc)[:300]
            row["descriptors"] = len(descs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, rows=rows)
    with open(os.path.join(out, "gluon_host.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--configs", default="A,B,C")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    if a.profile:
        profile(a.profile)
    if a.host:
        host(a.configs.split(","), a.out)
