"""Probe (issue 33; leaves the tree after one run): products accumulated inside the dot
(tl.dot(a, b, acc): the wgmma adds into its accumulator) instead of `acc * alpha + tl.dot(a, b)`
and `dk += tl.dot(...)` in the forward and backward; and two chains on C causal."""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import toolkit as tk  # noqa: E402
from dilgen import codegen  # noqa: E402
from dilgen.compiler import Kernel  # noqa: E402

EDITS = {}
_emit = codegen.emit


def _patched(plan):
    src = _emit(plan)
    for old, new in EDITS.get(plan.spec["name"], []):
        assert old in src, old
        src = src.replace(old, new)
    return src


codegen.emit = _patched
FWD = [("acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)", "acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])")]
BWD = [("dv += tl.dot(pt.to(dout.dtype), dout)", "dv = tl.dot(pt.to(dout.dtype), dout, dv)"),
       ("dk += tl.dot(dst.to(q.dtype), q)", "dk = tl.dot(dst.to(q.dtype), q, dk)"),
       ("dq += tl.dot(ds.to(k.dtype), k)", "dq = tl.dot(ds.to(k.dtype), k, dq)")]
VARIANTS = {"base": ([], None), "acc_fwd": (FWD, None), "acc_bwd": (BWD, None), "acc_both": (FWD + BWD, None),
            "dual": ([], {"dual_chain": True}), "dual_acc_both": (FWD + BWD, {"dual_chain": True})}
CASES = [("A", False, ["base", "acc_fwd", "acc_bwd", "acc_both"]), ("C", False, ["base", "acc_fwd", "acc_both"]),
         ("A", True, ["base", "acc_fwd", "acc_both"]), ("C", True, ["base", "acc_both", "dual", "dual_acc_both"])]


def main():
    out = Path(os.environ.get("OUT", "/tmp"))
    res = tk.header("cuda", extra={"produced_by": f"scratch/probe_dot_acc.py@{tk.commit()}"})
    rows = res["rows"] = {}
    for name, causal, tags in CASES:
        cfg = tk.CONFIGS[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, go = (torch.randn(cfg["B"], cfg["N"], cfg["H"], cfg["D"], device="cuda", dtype=torch.bfloat16,
                                   generator=g) for _ in range(4))
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        base = None
        for tag in tags:
            edits, tuning = VARIANTS[tag]
            spec = tk.make_spec(name, cfg, causal, prefix=f"pda{tag}")
            EDITS[spec.name] = edits
            key = f"{name}{' causal' if causal else ''} {tag}"
            try:
                kern = Kernel(spec, None, tuning)
                with torch.no_grad():
                    o = kern(q, k, v)
                grads = torch.autograd.grad(kern(qs, ks, vs), (qs, ks, vs), go)
                torch.cuda.synchronize()
                row = {"tuning": tuning, "edits": [e[0][:24] for e in edits],
                       "fwd_ms": round(tk.time_ms(lambda: kern(q, k, v), warmup=5, reps=20)["median"], 4)}

                def fb():
                    torch.autograd.grad(kern(qs, ks, vs), (qs, ks, vs), go)
                row["fwd_bwd_ms"] = round(tk.time_ms(fb, warmup=3, reps=10)["median"], 4)
                if base is None:
                    base = (o, grads)
                else:
                    row["rel_err_vs_base"] = [tk.rel_err(o, base[0])] + [tk.rel_err(a, b) for a, b in zip(grads, base[1])]
                rows[key] = row
            except Exception as e:  # noqa: BLE001
                rows[key] = {"error": tk.short_err(e, 800)}
            tk.log(f"{key}: {rows[key]}")
            torch.cuda.empty_cache()
        tk.write_json_atomic(out / "dot_acc.json", tk.sanitize(res))


if __name__ == "__main__":
    main()
