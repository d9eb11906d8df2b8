"""Issue 16 on the GPU: (a) padded head dims, head_offsets "block" and short_segments
"zero_pad" against the float64 reference (small N, bf16, forward and gradients);
(b) speed: head_dim 48 against 64 on the same spec (H = 16, N = 32768, GigaPath's branches).
Writes JSON to --out (default bench/results)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dilgen import compiler  # noqa: E402
from dilgen.reference import differentiable_reference  # noqa: E402
from dilgen.spec import Spec  # noqa: E402

GIGAPATH = ([1024, 2048, 4096, 8192, 16384], [1, 2, 4, 8, 16])


def spec(H, Hkv, D, ws, rs, causal=False, dtype="bfloat16", **kw):
    return Spec(name=f"i16_d{D}_{'c' if causal else 'n'}_{kw.get('head_offsets', 'mod')}_{kw.get('short_segments', 'exact')}",
                num_heads=H, num_kv_heads=Hkv, head_dim=D, segment_lengths=list(ws),
                dilation_rates=list(rs), causal=causal, dtype=dtype, **kw)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(s, N):
    kern = compiler.compile(s)
    g = torch.Generator(device="cpu").manual_seed(0)
    H, Hkv, D = s.num_heads, s.num_kv_heads, s.head_dim
    mk = lambda h: torch.randn(1, N, h, D, generator=g).cuda().bfloat16().requires_grad_()
    q, k, v = mk(H), mk(Hkv), mk(Hkv)
    out = kern(q, k, v)
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    ref = differentiable_reference(q64, k64, v64, s)[0]
    do = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (out * do.cuda().bfloat16()).sum().backward()
    (ref * do).sum().backward()
    r = {"spec": s.name, "N": N, "out": rel(out.cpu(), ref), "dq": rel(q.grad.cpu(), q64.grad),
         "dk": rel(k.grad.cpu(), k64.grad), "dv": rel(v.grad.cpu(), v64.grad)}
    r["ok"] = all(r[x] < 3e-2 for x in ("out", "dq", "dk", "dv"))
    print(json.dumps(r), flush=True)
    return r


def speed(D, N=32768, H=16, **kw):
    s = spec(H, H, D, *GIGAPATH, **kw)
    kern = compiler.compile(s)
    q = torch.randn(1, N, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    fwd = triton.testing.do_bench(lambda: kern(q, k, v), warmup=50, rep=300)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)

    def fb():
        kern(qg, kg, vg).backward(do)
    fwdbwd = triton.testing.do_bench(fb, warmup=10, rep=200, grad_to_none=[qg, kg, vg])
    r = {"D": D, "N": N, "H": H, **kw, "fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(fwdbwd, 4)}
    print(json.dumps(r), flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "checks": [], "speed": []}
    small = ([64, 128, 256], [1, 2, 4])
    for s, N in [(spec(16, 16, 48, *small), 700), (spec(8, 2, 48, *small, causal=True), 700),
                 (spec(16, 16, 48, *small, head_offsets="block", short_segments="zero_pad"), 700),
                 (spec(5, 5, 48, *small, causal=True, head_offsets="block"), 700)]:
        res["checks"].append(check(s, N))
    for D in (48, 64):
        res["speed"].append(speed(D, head_offsets="block", short_segments="zero_pad"))
    res["seconds"] = round(time.time() - t0, 1)
    out = Path(a.out) / f"issue16_gpu_check-{time.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
