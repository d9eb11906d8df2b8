"""GPU check (issue 42): dilgen with the Gluon forward (tuning {"gluon_fwd": true}) against
float64 and against the default `tl` plan, and both timed, one H200.

    python3 bench/tools/gluon_dilgen_check.py --out DIR

Per spec: the forward of both plans on the same inputs (float64 reference of LongNet eq. 10
on three heads; lse too), forward + backward gradients of the Gluon plan against the tl
plan's, whether the Gluon kernel ran, and times (CUDA events: 20 calls back to back, median
of 7; one call alone). Writes gluon_dilgen_check.json."""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import dilgen  # noqa: E402
from dilgen.runtime.gluon_launch import gluon_launch  # noqa: E402
from gluon_fused_probe import b2b, reference64  # noqa: E402

CASES = {
    "A": dict(B=1, H=16, Hkv=16, N=32768, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4]),
    "A_gqa4_b2": dict(B=2, H=16, Hkv=4, N=16384, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4]),
    "B": dict(B=1, H=16, Hkv=16, N=131072, D=128, ws=[2048, 4096, 8192, 16384, 32768], rs=[1, 2, 4, 8, 16]),
    "C": dict(B=2, H=32, Hkv=32, N=16384, D=64, ws=[1024, 2048, 4096], rs=[1, 2, 4]),
    "A_short_last": dict(B=1, H=16, Hkv=16, N=30720, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4]),
}


def one_call(fn):
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


def check(name, c, log):
    spec = dilgen.Spec(name=f"gluon_check_{name.lower()}", num_heads=c["H"], num_kv_heads=c["Hkv"], head_dim=c["D"],
                       segment_lengths=c["ws"], dilation_rates=c["rs"], dtype="bfloat16")
    kg = dilgen.Kernel(spec, None, {"gluon_fwd": True})
    kt = dilgen.compile(spec)
    gen = torch.Generator(device="cuda").manual_seed(7)
    B, N, H, Hkv, D = c["B"], c["N"], c["H"], c["Hkv"], c["D"]
    q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(B, N, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    row = {"case": name, "shape": c}
    attn = kg.compiled_for(q.device).attention
    out0 = torch.empty_like(q)
    lse0 = torch.empty(B, H, N, device="cuda")
    row["gluon_ran"] = gluon_launch(attn, q, k, v, out0, lse0, B, N) is not None
    with torch.no_grad():
        og, lg = kg(q, k, v, return_lse=True)
        ot, lt = kt(q, k, v, return_lse=True)
    row["nan"] = bool(torch.isnan(og).any() or torch.isnan(lg).any())
    if N % max(c["ws"]) == 0 and Hkv == H:
        heads = [0, 1, H - 1]
        ro, rl = reference64(q, k, v, dict(B=B, N=N, D=D, ws=c["ws"], rs=c["rs"]), heads)
        for tag, o, lse in (("gluon", og, lg), ("tl", ot, lt)):
            row[f"{tag}_rel_err_fp64"] = ((o[:, :, heads].double() - ro).norm() / ro.norm()).item()
            row[f"{tag}_lse_max_abs_err_fp64"] = (lse[:, heads].double() - rl).abs().max().item()
    row["out_max_abs_diff_vs_tl"] = (og.float() - ot.float()).abs().max().item()
    row["lse_max_abs_diff_vs_tl"] = (lg - lt).abs().max().item()
    gout = torch.randn_like(q)
    grads = {}
    for tag, kern in (("gluon", kg), ("tl", kt)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        kern(*leaves).backward(gout)
        grads[tag] = [t.grad for t in leaves]
    row["grad_rel_diff_vs_tl"] = [((a.float() - b.float()).norm() / b.float().norm()).item()
                                  for a, b in zip(grads["gluon"], grads["tl"])]
    with torch.no_grad():
        for tag, kern in (("gluon", kg), ("tl", kt)):
            row[f"{tag}_fwd_ms"] = b2b(lambda kern=kern: kern(q, k, v))
            row[f"{tag}_fwd_one_call_ms"] = one_call(lambda kern=kern: kern(q, k, v))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    for tag, kern in (("gluon", kg), ("tl", kt)):
        row[f"{tag}_fwd_bwd_ms"] = b2b(lambda kern=kern: kern(*leaves).backward(gout), calls=5, rounds=5)
    # a repeated call replays its recorded launches: on new inputs it still equals the tl plan
    q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
    with torch.no_grad():
        row["replayed_equal_tl"] = bool(torch.equal(kg(q2, k2, v2), kt(q2, k2, v2)))
    row["recipes"] = len(attn._replays)
    flops = sum(4 * B * H * (N / w) * (w / r) ** 2 * D for w, r in zip(c["ws"], c["rs"]))
    row["gluon_fwd_tflops"] = round(flops / row["gluon_fwd_ms"] / 1e9, 1)
    row["tl_fwd_tflops"] = round(flops / row["tl_fwd_ms"] / 1e9, 1)
    log(json.dumps(row))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    res = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, triton=__import__("triton").__version__,
               device=torch.cuda.get_device_name(), rows=[])
    for name in args.cases.split(","):
        try:
            res["rows"].append(check(name, CASES[name], lambda m: print(m, flush=True)))
        except Exception as exc:  # noqa: BLE001 - recorded
            res["rows"].append({"case": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(name, "ERROR", res["rows"][-1]["error"], flush=True)
        with open(os.path.join(args.out, "gluon_dilgen_check.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
