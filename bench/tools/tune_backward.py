"""Backward tile sweep and per-kernel time breakdown on the GPU (H200), bf16.

    python bench/tools/tune_backward.py --out OUT [--configs A,Ac,C] [--profile] [--sweep kv,dq,fwd]
    python bench/tools/tune_backward.py --out /tmp/x --dry-run-cpu --configs A --sweep kv --profile
      (toy sizes in Triton's interpreter, one candidate per sweep, wall-clock times)

For each config: the time of forward alone and forward+backward (triton do_bench, median),
optionally a torch.profiler breakdown by kernel, and a sweep of candidate tiles for
the dkdv and dq kernels (tuning keys bwd_kv, bwd_dq) and the forward (block_m, ...).
Every candidate's gradients are compared with the default tiles' on the same inputs
(rel err must stay under 1e-2). Results: OUT/tune_backward.json, written after each row.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/
import toolkit  # noqa: E402
toolkit.setup_paths()
import dilgen  # noqa: E402
from dilgen.compiler import Kernel, target_for_device  # noqa: E402
SHAPES = toolkit.CONFIGS
DEV = torch.device("cuda")

# "A" = config A non-causal, "Ac" = causal A; any config of bench/toolkit.py (A-F)
CONFIGS = {**{n: (n, False) for n in SHAPES}, **{n + "c": (n, True) for n in SHAPES}}
KV = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 8, 3),
      (128, 32, 4, 3), (64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 4)]
DQ = [(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
      (64, 32, 4, 3), (128, 32, 4, 4)]
FWD = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 4, 3),
       (64, 64, 8, 3)]


def spec_of(name):
    shape, causal = CONFIGS[name]
    c = (toolkit.DRY_CONFIGS if DEV.type == "cpu" else SHAPES)[shape]
    return c, dilgen.Spec(name=f"tb_{name.lower()}", num_heads=c["H"], head_dim=c["D"],
                          segment_lengths=c["ws"], dilation_rates=c["rs"], causal=causal,
                          hilbert=c.get("hilbert"))


def run_case(kernel, q, k, v, g):
    q.grad = k.grad = v.grad = None
    out = kernel(q, k, v)
    out.backward(g)
    return out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


def bench(kernel, q, k, v, g):
    def fwd():
        with torch.no_grad():
            kernel(q, k, v)

    def fwdbwd():
        kernel(q, k, v).backward(g)
    if DEV.type == "cpu":   # dry run: one wall-clock call each
        return toolkit.time_ms(fwd, 0, 1, DEV)["median"], toolkit.time_ms(fwdbwd, 0, 1, DEV)["median"]
    f = triton.testing.do_bench(fwd, warmup=10, rep=50, return_mode="median")
    fb = triton.testing.do_bench(fwdbwd, warmup=10, rep=50, grad_to_none=[q, k, v],
                                 return_mode="median")
    return f, fb


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def profile(kernel, q, k, v, g):
    cuda = DEV.type == "cuda"
    return toolkit.kernel_times(lambda: run_case(kernel, q, k, v, g), warmup=3 if cuda else 0,
                                reps=5 if cuda else 1, device=DEV)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="A,Ac,C")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sweep", default="")
    ap.add_argument("--budget", type=float, default=480.0, help="stop sweeping after this many s")
    ap.add_argument("--dry-run-cpu", action="store_true", help="toy sizes on the CPU (interpreter)")
    args = ap.parse_args()
    global DEV
    if args.dry_run_cpu:
        DEV = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("tune_backward.py needs a CUDA GPU (--dry-run-cpu: toy sizes on the CPU)")
        return 2
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tune_backward.json")
    result = {**toolkit.header(DEV, args.dry_run_cpu), "rows": []}

    def save():
        toolkit.write_json_atomic(path, result)

    target = target_for_device(DEV)
    for name in args.configs.split(","):
        c, spec = spec_of(name)
        torch.manual_seed(0)
        q, k, v = (torch.randn(c["B"], c["N"], c["H"], c["D"], device=DEV, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        base = Kernel(spec, target)
        ref = run_case(base, q, k, v, g)
        f, fb = bench(base, q, k, v, g)
        row = dict(config=name, tuning="default", fwd_ms=f, fwdbwd_ms=fb, bwd_ms=fb - f)
        print(f"{name} default: fwd {f:.3f} fwd+bwd {fb:.3f} (bwd {fb - f:.3f}) ms", flush=True)
        if args.profile:
            row["kernels"] = profile(base, q, k, v, g)
            for kname, (ms, n) in row["kernels"].items():
                print(f"    {ms:8.3f} ms  x{n:<3d} {kname}", flush=True)
        result["rows"].append(row)
        save()
        cands = []
        for what in filter(None, args.sweep.split(",")):
            table = {"kv": KV, "dq": DQ, "fwd": FWD}[what]
            for t in table[1:2 if DEV.type == "cpu" else None]:
                cands.append({"bwd_kv": list(t)} if what == "kv" else {"bwd_dq": list(t)}
                             if what == "dq" else dict(zip(("block_m", "block_n", "num_warps",
                                                            "num_stages"), t)))
        for tuning in cands:
            if time.time() - t0 > args.budget:
                print("budget spent; stopping the sweep", flush=True)
                break
            try:
                kern = Kernel(spec, target, tuning=tuning)
                got = run_case(kern, q, k, v, g)
                errs = [rel(a, b) for a, b in zip(got, ref)]
                f, fb = bench(kern, q, k, v, g)
                row = dict(config=name, tuning=tuning, fwd_ms=f, fwdbwd_ms=fb, bwd_ms=fb - f,
                           rel_err_vs_default=errs, ok=max(errs) < 1e-2)
                print(f"{name} {tuning}: fwd {f:.3f} fwd+bwd {fb:.3f} (bwd {fb - f:.3f}) ms "
                      f"err {max(errs):.1e}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit just loses
                row = dict(config=name, tuning=tuning, error=f"{type(exc).__name__}: {str(exc)[:160]}")
                print(f"{name} {tuning}: {row['error']}", flush=True)
            result["rows"].append(row)
            save()
        del q, k, v, g, ref
        toolkit.cleanup(DEV)
    return 0


if __name__ == "__main__":
    sys.exit(main())
