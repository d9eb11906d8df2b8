"""Probe (issue 42): the fused Gluon forward (bench/tools/gluon_fused.py) against dilgen's `tl`
forward and cuDNN on pre-gathered rows, configs A and C (non-causal), one H200.

    python3 bench/tools/gluon_fused_probe.py --out DIR

Per variant: out and lse poisoned (NaN), one call checked against a float64 reference of
LongNet's eq. 10 on three heads (each branch's lanes in float64, combined by their lse) and
against dilgen's forward on every head; then 20 calls back to back between two CUDA events,
median of 7 rounds. cuDNN: each branch's lanes gathered beforehand, one SDPA call per
branch (the merge not counted). Writes gluon_fused_probe.json."""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))
import triton  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

import dilgen  # noqa: E402
from gluon_fused import fused_fwd  # noqa: E402

CONFIGS = {"A": dict(B=1, H=16, N=32768, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4]),
           "C": dict(B=2, H=32, N=16384, D=64, ws=[1024, 2048, 4096], rs=[1, 2, 4])}
VARIANTS = {"n128s2": (128, 2), "n128s3": (128, 3), "n64s3": (64, 3), "n64s4": (64, 4), "n64s6": (64, 6)}
LOG2E = 1.4426950408889634


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
    ts.sort()
    return ts[len(ts) // 2]


def lanes(x, B, N, w, r, heads, D):
    """(B, N, H, D) -> (len(heads), B·N/w, L, D): the lane each head keeps (offset h mod r)."""
    L = w // r
    x6 = x.view(B, N // w, L, r, x.shape[2], D)
    return torch.stack([x6[:, :, :, h % r, h, :].reshape(B * N // w, L, D) for h in heads])


def reference64(q, k, v, cfg, heads):
    """LongNet eq. 10 in float64 for `heads`: (out (B, N, len, D), lse (B, len, N))."""
    B, N, D = cfg["B"], cfg["N"], cfg["D"]
    lses, outs = [], []
    for w, r in zip(cfg["ws"], cfg["rs"]):
        qg, kg, vg = (lanes(t, B, N, w, r, heads, D).double() for t in (q, k, v))
        s = qg @ kg.transpose(-1, -2) / math.sqrt(D)
        lse = torch.logsumexp(s, -1)                                   # (heads, lanes, L)
        o = torch.softmax(s, -1) @ vg
        full_o = torch.zeros(len(heads), B, N // w, w // r, r, D, dtype=torch.float64, device=q.device)
        full_l = torch.full((len(heads), B, N // w, w // r, r), float("-inf"), dtype=torch.float64, device=q.device)
        for i, h in enumerate(heads):
            full_o[i, :, :, :, h % r] = o[i].view(B, N // w, w // r, D)
            full_l[i, :, :, :, h % r] = lse[i].view(B, N // w, w // r)
        outs.append(full_o.reshape(len(heads), B, N, D))
        lses.append(full_l.reshape(len(heads), B, N))
    lse = torch.logsumexp(torch.stack(lses), 0)
    out = sum(torch.exp(l_ - lse).unsqueeze(-1) * o_ for l_, o_ in zip(lses, outs))
    return out.permute(1, 2, 0, 3), lse.permute(1, 0, 2)


def launcher(q, k, v, out, lse, cfg, BN, STAGES):
    B, H, N, D = cfg["B"], cfg["H"], cfg["N"], cfg["D"]
    Hkv, ws, rs = k.shape[2], cfg["ws"], cfg["rs"]
    L = max(rs)
    def desc(t, rows, block):
        view = t.view(B * N // rows, rows * t.shape[2], D)
        lay = gl.NVMMASharedLayout.get_default_for([block, 1, D], gl.bfloat16)
        return TensorDescriptor(view, list(view.shape), list(view.stride()), [block, 1, D], lay)
    qd, od = desc(q, L, 64), desc(out, L, 64)
    kds = tuple(desc(k, r, BN) for r in rs)
    vds = tuple(desc(v, r, BN) for r in rs)
    grid = (N // L // 128, B * H, L)
    scale = LOG2E / math.sqrt(D)
    return lambda: fused_fwd[grid](qd, od, *kds, *vds, lse, scale, N, H, Hkv, D, 3, ws[0], rs[0], ws[1], rs[1],
                                   ws[2], rs[2], L, BN, STAGES, 240, num_warps=4, maxnreg=168)


def one_config(name, log):
    cfg = CONFIGS[name]
    B, H, N, D = cfg["B"], cfg["H"], cfg["N"], cfg["D"]
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    flops = sum(4 * B * H * (N / w) * (w / r) ** 2 * D for w, r in zip(cfg["ws"], cfg["rs"]))
    row = {"config": name, "shape": cfg, "useful_gflop": flops / 1e9, "variants": {}}
    heads = [0, 1, H - 1]
    ref_o, ref_l = reference64(q, k, v, cfg, heads)
    spec = dilgen.Spec(name=f"gluon_probe_{name.lower()}", num_heads=H, head_dim=D, segment_lengths=cfg["ws"],
                       dilation_rates=cfg["rs"], dtype="bfloat16")
    kern = dilgen.compile(spec)
    with torch.no_grad():
        tl_o, tl_l = kern(q, k, v, return_lse=True)
        row["dilgen_tl_ms"] = b2b(lambda: kern(q, k, v))
    row["dilgen_tl_rel_err_fp64"] = ((tl_o[:, :, heads].double() - ref_o).norm() / ref_o.norm()).item()
    gathered = []
    for w, r in zip(cfg["ws"], cfg["rs"]):
        g = [lanes(t, B, N, w, r, list(range(H)), D).permute(1, 0, 2, 3).contiguous() for t in (q, k, v)]
        gathered.append(g)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["cudnn_gathered_ms_by_branch"] = [b2b(lambda g=g: F.scaled_dot_product_attention(*g)) for g in gathered]
    row["cudnn_gathered_ms"] = sum(row["cudnn_gathered_ms_by_branch"])
    del gathered
    for vname, (BN, STAGES) in VARIANTS.items():
        if STAGES * 2 * BN * D * 2 + 128 * D * 2 > 227 * 1024:
            continue
        out = torch.full_like(q, float("nan"))
        lse = torch.full((B, H, N), float("nan"), device="cuda", dtype=torch.float32)
        try:
            fn = launcher(q, k, v, out, lse, cfg, BN, STAGES)
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            res = dict(compile_s=round(time.time() - t0, 2), nan=bool(torch.isnan(out).any() or torch.isnan(lse).any()))
            res["rel_err_fp64"] = ((out[:, :, heads].double() - ref_o).norm() / ref_o.norm()).item()
            res["lse_max_abs_err_fp64"] = (lse[:, heads].double() - ref_l).abs().max().item()
            res["max_abs_diff_vs_tl"] = (out.float() - tl_o.float()).abs().max().item()
            res["ms"] = b2b(fn)
            res["tflops"] = round(flops / res["ms"] / 1e9, 1)
        except Exception as exc:  # noqa: BLE001 - recorded
            res = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
        row["variants"][vname] = res
        log(f"{name} {vname} {res}")
    log(f"{name}: dilgen tl {row['dilgen_tl_ms']:.3f} ms (rel err {row['dilgen_tl_rel_err_fp64']:.2e}), "
        f"cuDNN gathered {row['cudnn_gathered_ms']:.3f} {row['cudnn_gathered_ms_by_branch']}")
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--configs", default="A,C")
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    res = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, triton=triton.__version__,
               device=torch.cuda.get_device_name(), rows=[])
    for name in args.configs.split(","):
        res["rows"].append(one_config(name, lambda m: print(m, flush=True)))
        with open(os.path.join(args.out, "gluon_fused_probe.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
