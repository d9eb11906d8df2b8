"""One-off device probe of the lane kernels (issue 12): for configs A, B, E, F (causal and not)
and tuning variants, the relative error of out/dq/dk/dv against float64 at N = 4096, then the
median ms of forward and forward+backward (triton.testing.do_bench; grads accumulate).

  CONFIGS=A,B VARIANTS=auto TUNE_CONFIGS=AB \
  TUNINGS='{"all": {"lanes": "all"}, "c_tma": {"lanes": "all", "lane_tma": true}}' \
  python bench/tools/lanes_probe.py        # rows to $OUT/probe.json

Tuning names starting with c_ run only causal, nc_ only non-causal. CAUSAL=1 (or 0) runs
only causal (non-causal) rows; SKIP_CHECK=1 skips the float64 check (tile-only sweeps of
kernels the tests cover); FWD_ONLY=1 checks and times the forward only; PROFILE=D,C adds each row's CUDA time per kernel (fwd+bwd). Results of the
2026-11-23 session: bench/results/lanes_probe-2026-11-23-h200.json."""
import os, sys, json, math, time, torch, triton
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import toolkit as tk  # noqa: E402
import dilgen
from dilgen.compiler import Kernel
from dilgen.reference import reference_attention
OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
CFG = {
 "A": dict(B=1,H=16,N=32768,D=128, ws=[2048,4096,8192], rs=[1,2,4]),
 "B": dict(B=1,H=16,N=131072,D=128, ws=[2048,4096,8192,16384,32768], rs=[1,2,4,8,16]),
 "E": dict(B=1,H=16,N=131072,D=128, ws=[2048,4096,8192,16384,32768], rs=[1,2,4,6,12]),
 "F": dict(B=1,H=16,N=32768,D=128, ws=[2048,4096,8192], rs=[1,2,4], hil=True),
 "C": dict(B=2,H=32,N=16384,D=64, ws=[1024,2048,4096], rs=[1,2,4]),
 "D": dict(B=1,H=16,N=65536,D=128, ws=[4096,16384], rs=[4,16]),
}
def spec_of(name, c, causal):
    kw = dict(name=f"p_{name.lower()}{'_c' if causal else ''}", num_heads=c["H"], head_dim=c["D"], dtype="bfloat16",
              segment_lengths=c["ws"], dilation_rates=c["rs"], causal=causal)
    if c.get("hil"): kw["hilbert"] = {"scope": "segment"}
    return dilgen.Spec(**kw)
def flops(c, causal):
    f = sum(4*c["B"]*c["H"]*(c["N"]/w)*(w/r)**2*c["D"] for w, r in zip(c["ws"], c["rs"]))
    return f/2 if causal else f
def bench(fn, rep_ms=200):
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
def rel(a, b): return ((a.double()-b.double()).norm()/b.double().norm()).item()
def check(kern, c, spec, Nc=4096):
    """Relative errors of out, dq, dk, dv against the float64 reference at N = Nc."""
    from dilgen.reference import differentiable_reference
    q = torch.randn(1, Nc, c["H"], c["D"], device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True); v = torch.randn_like(q, requires_grad=True)
    if FWD_ONLY:
        with torch.no_grad():
            o = kern(q, k, v)
        ro, _ = differentiable_reference(*[t.detach().cpu().double() for t in (q, k, v)], spec)
        return dict(out=rel(o.cpu(), ro))
    o = kern(q, k, v); go = torch.randn_like(o); o.backward(go)
    qd, kd, vd = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ro, _ = differentiable_reference(qd, kd, vd, spec)
    (ro * go.cpu().double()).sum().backward()
    return dict(out=rel(o.detach().cpu(), ro.detach()), dq=rel(q.grad.cpu(), qd.grad),
                dk=rel(k.grad.cpu(), kd.grad), dv=rel(v.grad.cpu(), vd.grad))
FWD_ONLY = os.environ.get("FWD_ONLY") == "1"
rows = []
variants = os.environ.get("VARIANTS", "auto,all").split(",")
configs = os.environ.get("CONFIGS", "A,E,F,B").split(",")
tunings = json.loads(os.environ.get("TUNINGS", "{}"))   # extra named tunings
for cname in configs:
    c = CFG[cname]
    for causal in {"1": (True,), "0": (False,)}.get(os.environ.get("CAUSAL", ""), (False, True)):
        for var in dict.fromkeys(variants + list(tunings)):
            if var == "all" and not causal and cname not in os.environ.get("ALL_NONCAUSAL", ""): continue
            if var in tunings and cname not in os.environ.get("TUNE_CONFIGS", "A"): continue
            if var in tunings and causal and var.startswith("nc_"): continue
            if var in tunings and not causal and var.startswith("c_"): continue
            spec = spec_of(cname, c, causal)
            tuning = None if var == "auto" else {"lanes": "all"} if var == "all" else tunings[var]
            try:
                kern = Kernel(spec, None, tuning)
                torch.manual_seed(1)
                err = None if os.environ.get("SKIP_CHECK") == "1" else check(kern, c, spec)
                B, N, H, D = c["B"], c["N"], c["H"], c["D"]
                q = torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn_like(q, requires_grad=True); v = torch.randn_like(q, requires_grad=True)
                g = torch.randn_like(q)
                with torch.no_grad():
                    t_f = bench(lambda: kern(q, k, v))
                def fb():
                    o = kern(q, k, v); o.backward(g)
                t_fb = float("nan") if FWD_ONLY else bench(fb, 400)
                fl = flops(c, causal)
                row = dict(config=cname, causal=causal, variant=var, fwd_ms=t_f, fwdbwd_ms=t_fb,
                           fwd_tflops=fl/t_f/1e9, fb_tflops=3.5*fl/t_fb/1e9, err=err, tuning=tuning)
                if cname in os.environ.get("PROFILE", "").split(","):
                    row["kernels_fwd_bwd_ms"] = tk.kernel_times(fb, warmup=1, reps=3, top=12)  # [ms, launches]
            except Exception as e:
                import traceback; traceback.print_exc()
                row = dict(config=cname, causal=causal, variant=var, error=repr(e)[:300])
            rows.append(row); print(json.dumps(row), flush=True)
            json.dump(rows, open(f"{OUT}/probe.json", "w"), indent=1)
            torch.cuda.empty_cache()
print()
print(f"{'cfg':4s} {'causal':6s} {'var':8s} {'fwd ms':>8s} {'TF/s':>6s} {'f+b ms':>8s} {'TF/s':>6s} max_err")
for r in rows:
    if "error" in r: print(r["config"], r["causal"], r["variant"], "ERROR", r["error"][:100]); continue
    print(f"{r['config']:4s} {str(r['causal']):6s} {r['variant']:8s} {r['fwd_ms']:8.3f} {r['fwd_tflops']:6.0f} {r['fwdbwd_ms']:8.3f} {r['fb_tflops']:6.0f} {max(r['err'].values()) if r['err'] else float('nan'):.1e}")
