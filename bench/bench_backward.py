"""Forward+backward benchmark: dilgen against the gather peers (autograd through the cuDNN
and flash attention ops with the LSE merge; their LSE gets no gradient, so they are a
lower bound for an exact method), FlexAttention's backward and dense SDPA, on configs A
and C of the forward benchmark and causal A (bf16, one GPU, one process).

    python bench/bench_backward.py [--out bench/results] [--reps 10]

First checks dilgen's gradients against gather_cudnn's on a small input; then times
loss.backward() after the forward (median of --reps after warm-ups), prints a table and
writes <out>/backward-<date>.json and a PNG plot.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

import dilgen  # noqa: E402
from dilgen.stats import forward_flops  # noqa: E402

from probe_forward import CONFIGS as SHAPES  # noqa: E402  (one table of A-D)

CONFIGS = [("A", False, SHAPES["A"]), ("C", False, SHAPES["C"]), ("A", True, SHAPES["A"])]
METHODS = ("dilgen", "gather_cudnn", "gather_flash", "flex", "dense")


def _spec(name, causal, c):
    return dilgen.Spec(name=f"bwd_{name.lower()}{'_causal' if causal else ''}", num_heads=c["H"],
                       head_dim=c["D"], segment_lengths=c["w"], dilation_rates=c["r"], causal=causal)


def _fn(method, spec):
    kernel = dilgen.compile(spec)
    return {
        "dilgen": lambda q, k, v: kernel(q, k, v),
        "gather_cudnn": lambda q, k, v: peers.gather_cudnn(q, k, v, spec)[0],
        "gather_flash": lambda q, k, v: peers.gather_flash(q, k, v, spec)[0],
        "flex": lambda q, k, v: peers.flex(q, k, v, spec)[0],
        "dense": lambda q, k, v: peers.dense_sdpa(q, k, v, spec)[0],
    }[method]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(reps_note):
    """dilgen's gradients vs gather_cudnn's (non-causal A shape at N=4096: the gather
    peer's LSE gets no gradient, which does not matter for loss = <out, g>)."""
    c = dict(CONFIGS[0][2], N=4096)
    spec = _spec("check", False, c)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4096, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn_like(q)
    grads = {}
    for m in ("dilgen", "gather_cudnn"):
        q.grad = k.grad = v.grad = None
        _fn(m, spec)(q, k, v).backward(g)
        grads[m] = (q.grad.clone(), k.grad.clone(), v.grad.clone())
    errs = [_rel(a, b) for a, b in zip(grads["dilgen"], grads["gather_cudnn"])]
    print(f"check: dilgen vs gather_cudnn gradients rel err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}")
    return errs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_backward.py needs a CUDA GPU", file=sys.stderr)
        return 2
    errs = check(args.reps)
    rows = []
    for i, (name, causal, c) in enumerate(CONFIGS, 1):
        spec = _spec(name, causal, c)
        torch.manual_seed(i)
        q = torch.randn(c["B"], c["N"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn_like(q, requires_grad=True)
        v = torch.randn_like(q, requires_grad=True)
        g = torch.randn_like(q)
        row = {"config": name, "causal": causal, "B": c["B"], "H": c["H"], "N": c["N"], "D": c["D"],
               "segment_lengths": c["w"], "dilation_rates": c["r"], "errors": {}}
        for m in METHODS:
            fn = _fn(m, spec)

            def step():
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(g)
            try:
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                ms = triton.testing.do_bench(step, warmup=3 * 10, rep=args.reps * 10, return_mode="median")
                row[f"{m}_ms"] = ms
                row[f"{m}_first_call_s"] = first
            except Exception as exc:  # noqa: BLE001 - record, go on
                row[f"{m}_ms"] = None
                row["errors"][m] = f"{type(exc).__name__}: {str(exc)[:200]}"
            tag = f"{row[f'{m}_ms']:.3f} ms" if row[f"{m}_ms"] is not None else row["errors"][m]
            print(f"[{i}/{len(CONFIGS)}] {name}{' causal' if causal else ''} {m:<13} {tag}", flush=True)
            torch.cuda.empty_cache()
        fl = 3.5 * forward_flops(c["w"], c["r"], c["H"], c["D"], causal, c["N"], c["B"])
        row["useful_tflops"] = fl / row["dilgen_ms"] / 1e9 if row["dilgen_ms"] else None
        rows.append(row)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "date": dt.date.today().isoformat(),
              "flops_note": "useful FLOPs of forward+backward counted as 3.5x the forward formula",
              "gradient_check_rel_err_vs_gather_cudnn": errs, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"backward-{result['date']}.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print("\ncfg causal |   dilgen | gather_cudnn | gather_flash |     flex |    dense")
    for r in rows:
        cells = " | ".join(f"{r[f'{m}_ms']:8.2f}" if r[f"{m}_ms"] else "       —" for m in METHODS)
        print(f"{r['config']}   {str(r['causal']):<6} | {cells}")
    _plot(result, path.replace(".json", ".png"))
    print(f"json: {path}")
    return 0


def _plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.16
    for j, m in enumerate(METHODS):
        xs = [i + (j - 2) * width for i in range(len(rows))]
        ys = [r[f"{m}_ms"] or 0 for r in rows]
        ax.bar(xs, ys, width, label=m)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['config']}{' causal' if r['causal'] else ''}" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("forward+backward ms (log; lower is better)")
    ax.set_title(f"dilated attention fwd+bwd, bf16 — {result['device']}, {result['date']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
