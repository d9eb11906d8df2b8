"""Probe (issue 42): the Gluon lane kernel (bench/tools/gluon_lane.py) against cuDNN on the
same lanes gathered beforehand and dilgen's `tl` kernel of the one-branch spec, one H200.

    python3 bench/tools/gluon_lane_probe.py --out DIR [--quick]

Per branch of configs A and C (each alone: spec segment_lengths [w], dilation_rates [r]):
every variant's output poisoned (NaN), run, checked against float32 math on the gathered
rows (all lanes) and float64 (two lanes), then timed (CUDA events, median of 30 after 5
warm-up calls). Writes gluon_lane_probe.json."""
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
from gluon_lane import LOG2E, lane_fwd, lane_fwd_ws  # noqa: E402

BRANCHES = {   # name: B, H, N, D, w, r
    "A_w2048_r1": (1, 16, 32768, 128, 2048, 1), "A_w4096_r2": (1, 16, 32768, 128, 4096, 2),
    "A_w8192_r4": (1, 16, 32768, 128, 8192, 4),
    "C_w1024_r1": (2, 32, 16384, 64, 1024, 1), "C_w2048_r2": (2, 32, 16384, 64, 2048, 2),
    "C_w4096_r4": (2, 32, 16384, 64, 4096, 4),
}
VARIANTS = {   # BM, BN, STAGES, PIPE, num_warps; ("ws", BMW): lane_fwd_ws, two consumer warpgroups of
    # BMW rows; its PIPE bits: 1 softmax during the previous P V, 2 ping-pong; its last: maxnreg
    "m128n128s2": (128, 128, 2, 0, 8), "m128n128s3": (128, 128, 3, 0, 8),
    "ws_n128s3p": (("ws", 64), 128, 3, 1, 168), "ws_n64s4p": (("ws", 64), 64, 4, 1, 168),
    "ws_n128s3pp": (("ws", 64), 128, 3, 3, 168), "ws_n64s4pp": (("ws", 64), 64, 4, 3, 168),
    "ws_n128s2pp": (("ws", 64), 128, 2, 3, 168), "ws_m128n64s3": (("ws", 128), 64, 3, 0, 168),
    "ws_m128n128s2": (("ws", 128), 128, 2, 0, 168), "ws_m128n64s3pp": (("ws", 128), 64, 3, 2, 168),
}


def bench(fn, reps=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def gathered(x, B, N, H, w, r):
    """(B, N, H, D) -> the lanes each head keeps, (B·N/w, H, L, D) contiguous."""
    L, D = w // r, x.shape[-1]
    x6 = x.view(B, N // w, L, r, H, D)
    heads = torch.arange(H, device=x.device)
    g = x6[:, :, :, heads % r, heads, :]                  # (B, N/w, L, H, D)
    return g.permute(0, 1, 3, 2, 4).reshape(B * N // w, H, L, D).contiguous()


def scatter_back(g, B, N, H, w, r):
    """Inverse of gathered for the kept rows: the (B, N/w, L, H, D) rows each head keeps."""
    L, D = w // r, g.shape[-1]
    return g.view(B, N // w, H, L, D).permute(0, 1, 3, 2, 4)


def run_gluon(q, k, v, out, lse, B, N, H, D, w, r, var):
    BM, BN, STAGES, PIPE, nw = var
    ws = isinstance(BM, tuple)
    if ws:
        BM = BM[1]         # rows per consumer warpgroup; the CTA takes two tiles
    views = [t.view(B * N // r, r * H, D) for t in (q, k, v, out)]
    descs = []
    for t, blk in zip(views, (BM, BN, BN, BM)):
        lay = gl.NVMMASharedLayout.get_default_for([blk, 1, D], gl.bfloat16)
        descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), [blk, 1, D], lay))
    grid = ((w // r) // (2 * BM if ws else BM), B * N // w, H)
    scale = LOG2E / math.sqrt(D)
    if ws:     # nw: maxnreg; the consumers get 240 registers, the producer 24
        return lambda: lane_fwd_ws[grid](*descs, lse, scale, N, H, r, w, BN, D, STAGES, PIPE, 240,
                                         num_warps=4, maxnreg=nw)
    return lambda: lane_fwd[grid](*descs, lse, scale, N, H, r, w, BM, BN, D, STAGES, PIPE, num_warps=nw)


def one_branch(name, quick, log):
    B, H, N, D, w, r = BRANCHES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    L = w // r
    flops = 4 * B * H * (N / w) * L * L * D
    row = {"branch": name, "shape": dict(B=B, H=H, N=N, D=D, w=w, r=r), "useful_gflop": flops / 1e9, "variants": {}}
    qg, kg, vg = (gathered(t, B, N, H, w, r) for t in (q, k, v))
    ref32 = F.scaled_dot_product_attention(qg.float(), kg.float(), vg.float())
    ref32_rows = scatter_back(ref32, B, N, H, w, r)
    lanes = [0, qg.shape[0] - 1]
    ref64 = F.scaled_dot_product_attention(qg[lanes].double(), kg[lanes].double(), vg[lanes].double())
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["cudnn_gathered_ms"] = bench(lambda: F.scaled_dot_product_attention(qg, kg, vg))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        row["flash2_gathered_ms"] = bench(lambda: F.scaled_dot_product_attention(qg, kg, vg))
    spec = dilgen.Spec(name=f"probe_{name.lower()}", num_heads=H, head_dim=D, segment_lengths=[w],
                       dilation_rates=[r], dtype="bfloat16")
    kern = dilgen.compile(spec)
    row["dilgen_tl_ms"] = bench(lambda: kern(q, k, v))
    for vname, var in VARIANTS.items():
        if quick and vname not in ("m128n128s2", "ws_n128s3pp"):
            continue
        bm = 2 * var[0][1] if isinstance(var[0], tuple) else var[0]
        if var[1] > L or L % bm or L % var[1]:
            continue
        stages_bytes = var[2] * 2 * var[1] * D * 2 + bm * D * 2
        if stages_bytes > 227 * 1024:
            row["variants"][vname] = {"skipped": f"{stages_bytes} B of shared memory"}
            continue
        out = torch.full_like(q, float("nan"))
        lse = torch.full((B, H, N), float("nan"), device="cuda", dtype=torch.float32)
        try:
            fn = run_gluon(q, k, v, out, lse, B, N, H, D, w, r, var)
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            got = scatter_back(gathered(out, B, N, H, w, r), B, N, H, w, r)
            err32 = ((got.float() - ref32_rows).abs().max()).item()
            got64 = gathered(out, B, N, H, w, r)[lanes].double()
            rel64 = ((got64 - ref64).norm() / ref64.norm()).item()
            kept_lse = gathered(lse.permute(0, 2, 1).unsqueeze(-1), B, N, H, w, r)
            lse_ref = torch.logsumexp((qg.float() @ kg.float().transpose(-1, -2)) / math.sqrt(D), dim=-1)
            lse_err = (kept_lse.squeeze(-1) - lse_ref).abs().max().item()
            nan = bool(torch.isnan(got).any())
            ms = bench(fn)
            row["variants"][vname] = dict(ms=ms, tflops=round(flops / ms / 1e9, 1), max_abs_err_vs_fp32=err32,
                                          rel_err_vs_fp64=rel64, lse_max_abs_err=lse_err, nan_in_kept_rows=nan,
                                          compile_s=round(compile_s, 2))
        except Exception as exc:  # noqa: BLE001 - recorded
            row["variants"][vname] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
        log(f"{name} {vname} {row['variants'][vname]}")
    log(f"{name}: cudnn {row['cudnn_gathered_ms']:.3f} fa2 {row['flash2_gathered_ms']:.3f} dilgen tl {row['dilgen_tl_ms']:.3f}")
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--branches", default=",".join(BRANCHES))
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    res = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, triton=triton.__version__,
               device=torch.cuda.get_device_name(), rows=[])
    path = os.path.join(args.out, "gluon_lane_probe.json")
    for name in args.branches.split(","):
        res["rows"].append(one_branch(name, args.quick, lambda m: print(m, flush=True)))
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
