#!/usr/bin/env python3
"""Forward+backward benchmark: dilgen against its peers, bf16, one GPU, one process, on the
configs A-F of bench/toolkit.py (see bench_forward.py), each non-causal and causal.

Methods: dilgen; gather_cudnn, gather_flash (autograd through the cuDNN / flash attention
ops and the LSE merge: their LSE gets no gradient, so they are a lower bound for an exact
method); flex (FlexAttention's backward, torch.compile'd); dense (plain dense SDPA, a
REFERENCE POINT only, not the same math).

  1. correctness at N = --check-n (B=1): out and dq, dk, dv of dilgen and gather_cudnn
     against autograd through the float64 reference (dilgen.reference), loss = <out, g>;
     SPEC bounds (bf16): 2e-2 for out, 4e-2 for gradients;
  2. timing per (config, causal): forward + backward(g) on fresh random inputs, CUDA
     events, median of --reps after --warmup warm-ups; each exact peer's gradients are
     compared with dilgen's on the same inputs at full size.
Useful FLOPs of forward+backward: 3.5 x the forward's (Σ_i 4·B·H·(N/w_i)·(w_i/r_i)²·D,
halved when causal). Results: a markdown table, <out>/backward-<date>.json (rewritten
after every row) and backward-<date>.png. Exit status 1 if dilgen failed the check.

  python bench/bench_backward.py                                 # A-F x {non-causal, causal}
  python bench/bench_backward.py --configs A,C --no-causal
  python bench/bench_backward.py --dry-run-cpu --out /tmp/x      # toy sizes on the CPU
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402
from toolkit import log  # noqa: E402

METHODS = ("dilgen", "gather_cudnn", "gather_flash", "flex", "dense")
EXACT = METHODS[:4]
BOUND_OUT, BOUND_GRAD = 2e-2, 4e-2      # SPEC §2 tolerance, bf16 (gradients: twice)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(tk.CONFIGS), help="subset of A-F (default: all)")
    ap.add_argument("--no-causal", action="store_true", help="only the non-causal variants")
    ap.add_argument("--causal-only", action="store_true", help="only the causal variants")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--quick", action="store_true", help="1 warm-up, 5 timed calls")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3)")
    ap.add_argument("--reps", type=int, default=None, help="timed steps, median taken (default 10)")
    ap.add_argument("--out", default=str(tk.RESULTS), help="output folder (default bench/results)")
    ap.add_argument("--append", nargs="?", const=True, default=False, metavar="FILE",
                    help="keep the rows of an earlier run that this run does not redo: of today's "
                         "backward-<date>.json in --out, or of FILE")
    ap.add_argument("--check-n", type=int, default=1024, help="N of the gradient check (default 1024)")
    ap.add_argument("--no-check", action="store_true", help="skip the gradient check")
    ap.add_argument("--dense-max-n", type=int, default=65536, help="no dense above this N (default: not B, E)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip flex rows after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="the whole flow at toy sizes on the CPU (numbers meaningless; files *-cpu-dryrun.*)")
    a = ap.parse_args(argv)
    try:
        a.configs = tk.parse_configs(a.configs, tk.DRY_CONFIGS if a.dry_run_cpu else tk.CONFIGS)
        a.causals = tk.causal_flags(a.no_causal, a.causal_only)
    except ValueError as e:
        ap.error(str(e))
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if [m for m in a.methods if m not in METHODS]:
        ap.error(f"--methods: choose from {','.join(METHODS)}")
    a.warmup = a.warmup if a.warmup is not None else (0 if a.dry_run_cpu else 1 if a.quick else 3)
    a.reps = a.reps if a.reps is not None else (1 if a.dry_run_cpu else 5 if a.quick else 10)
    return a


class Bench:
    def __init__(self, args):
        import torch
        import dilgen
        import peers
        self.torch, self.dilgen, self.peers, self.args = torch, dilgen, peers, args
        self.dry = args.dry_run_cpu
        self.configs = tk.DRY_CONFIGS if self.dry else tk.CONFIGS
        self.dev = torch.device("cpu" if self.dry else "cuda")
        self.t0 = time.time()
        self.kernels = {}
        self.check_failed = False
        self.variants = [(c, causal) for c in args.configs for causal in args.causals]
        head = tk.header(self.dev, self.dry, {
            "args": vars(args), "configs": {c: self.configs[c] for c in args.configs},
            "timing": f"{'wall clock' if self.dry else 'CUDA events'} around forward + backward(g), median of "
                      f"{args.reps} after {args.warmup} warm-ups, synchronised per step",
            "flops_note": "useful FLOPs of forward+backward counted as 3.5x the forward formula",
            "notes": ["the gather peers' LSE gets no gradient: a lower bound for an exact method",
                      "dense: plain dense SDPA, a REFERENCE POINT only (not the same math)",
                      "grad_rel_err_vs_dilgen: [dq, dk, dv] of each exact peer against dilgen's, same inputs"],
            "check": []})
        self.res = tk.Results(tk.result_path(args.out, "backward", self.dry), head, append=args.append)

    def spec(self, cname, causal):
        return tk.make_spec(cname, self.configs[cname], causal, prefix="bwd")

    def fn(self, method, spec):
        p = self.peers
        if method == "dilgen":
            kern = self.kernels.get(spec.name) or self.kernels.setdefault(spec.name, self.dilgen.compile(spec))
            return lambda q, k, v: kern(q, k, v)
        if method == "dense":
            return lambda q, k, v: p.dense_sdpa(q, k, v, spec)[0]
        return lambda q, k, v: p.PEERS[method](q, k, v, spec)[0]

    def leaves(self, cfg, seed, n=None, b=None):
        torch = self.torch
        g = torch.Generator(device=self.dev).manual_seed(seed)
        shape = (b or cfg["B"], n or cfg["N"], cfg["H"], cfg["D"])
        q, k, v, go = (torch.randn(shape, device=self.dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
        return [t.requires_grad_(True) for t in (q, k, v)], go

    @staticmethod
    def grads(fn, qkv, go):
        for t in qkv:
            t.grad = None
        out = fn(*qkv)
        out.backward(go)
        return out.detach(), [t.grad.detach().clone() for t in qkv]

    # ------------------------------------------------------------------ 1. correctness
    def check(self):
        from dilgen.reference import differentiable_reference
        n_req = self.args.check_n
        log("== gradient check (B=1, bf16) against autograd through the float64 reference ==")
        for i, (cname, causal) in enumerate(self.variants):
            cfg, spec = self.configs[cname], self.spec(cname, causal)
            n = min(n_req, cfg["N"])
            qkv, go = self.leaves(cfg, self.args.seed + 1000 + i, n=n, b=1)
            ref = [t.detach().cpu().double().requires_grad_(True) for t in qkv]
            ro, _ = differentiable_reference(*ref, spec)
            ro.backward(go.cpu().double())
            want = [ro.detach()] + [t.grad for t in ref]
            got_by = {}
            for m in [m for m in ("dilgen", "gather_cudnn") if m in self.args.methods]:
                rec = {"config": cname, "causal": causal, "N": n, "method": m}
                try:
                    out, gr = self.grads(self.fn(m, spec), qkv, go)
                    got_by[m] = gr
                    errs = [tk.rel_err(a.cpu(), b) for a, b in zip([out] + gr, want)]
                    rec["rel_err_out_dq_dk_dv"] = errs
                    rec["passed"] = bool(errs[0] < BOUND_OUT and max(errs[1:]) < BOUND_GRAD)
                    detail = "out/dq/dk/dv rel err " + " ".join(f"{e:.2e}" for e in errs)
                except Exception as e:  # noqa: BLE001
                    rec.update(error=tk.short_err(e), passed=False)
                    detail = rec["error"]
                self.res.data["check"].append(rec)
                log(f"  {'ok  ' if rec['passed'] else 'FAIL'} {cname} causal={causal!s:5s} N={n} {m:12s} {detail}")
                if m == "dilgen" and not rec["passed"]:
                    self.check_failed = True
            if len(got_by) == 2:
                errs = [tk.rel_err(a, b) for a, b in zip(got_by["dilgen"], got_by["gather_cudnn"])]
                self.res.data["check"].append({"config": cname, "causal": causal, "N": n,
                                               "method": "dilgen_vs_gather_cudnn", "rel_err_dq_dk_dv": errs})
            self.peers.clear_caches()
            tk.cleanup(self.dev)
        self.res.data["check_passed"] = not self.check_failed
        self.res.save()

    # ------------------------------------------------------------------ 2. timing
    def skip_reason(self, m, cfg):
        if m not in self.args.methods:
            return "not selected (--methods)"
        if m == "dense" and cfg["N"] > self.args.dense_max_n:
            return f"skipped: N={cfg['N']} > --dense-max-n={self.args.dense_max_n} (reference point only)"
        if m == "flex" and self.dev.type == "cpu":
            return "skipped: FlexAttention has no backward on the CPU (dry run)"
        if m == "flex" and time.time() - self.t0 > self.args.budget_s:
            return f"skipped: time budget --budget-s={self.args.budget_s:.0f} spent"
        return None

    def timing(self):
        a, torch = self.args, self.torch
        log(f"\n== timing: forward + backward (median of {a.reps} after {a.warmup} warm-ups) ==")
        prog = tk.Progress(len(self.variants), "backward")
        for i, (cname, causal) in enumerate(self.variants):
            cfg, spec = self.configs[cname], self.spec(cname, causal)
            row = self.res.add({
                "config": cname, "causal": causal, "B": cfg["B"], "H": cfg["H"], "N": cfg["N"], "D": cfg["D"],
                "segment_lengths": cfg["ws"], "dilation_rates": cfg["rs"], "hilbert": cfg.get("hilbert"),
                "useful_gflop": tk.useful_flops(cfg, causal, fwd_bwd=True) / 1e9, "useful_tflops": None,
                "useful_tflops_by_method": {}, "timing_ms": {}, "grad_rel_err_vs_dilgen": {}, "errors": {},
                **{f"{m}_ms": None for m in METHODS}})
            prog.write(f"{prog.tag()} {tk.config_text(cname, cfg)} causal={causal}: "
                       f"{row['useful_gflop']:.1f} useful GFLOP (fwd+bwd)")
            qkv, go = self.leaves(cfg, a.seed + i)
            base = None
            for m in METHODS:
                reason = self.skip_reason(m, cfg)
                if reason:
                    row["errors"][m] = reason
                    prog.write(f"    {m:12s} {reason}")
                    continue
                fn = self.fn(m, spec)
                try:
                    first, (_, gr) = tk.first_call_s(lambda: self.grads(fn, qkv, go), self.dev)
                    row[f"{m}_first_call_s"] = round(first, 3)
                    extra = ""
                    if m == "dilgen":
                        base = gr
                    elif m in EXACT and base is not None:
                        errs = [tk.rel_err(x, y) for x, y in zip(gr, base)]
                        row["grad_rel_err_vs_dilgen"][m] = errs
                        extra = "  grads vs dilgen " + "/".join(f"{e:.1e}" for e in errs)
                    del gr

                    def step():
                        for t in qkv:
                            t.grad = None
                        fn(*qkv).backward(go)
                    pk = tk.peak_extra_gib(step, self.dev)
                    row[f"{m}_peak_extra_gib"] = None if pk is None else round(pk, 4)
                    t = tk.time_ms(step, a.warmup, a.reps, self.dev)
                    row[f"{m}_ms"], row["timing_ms"][m] = t["median"], t
                    row["useful_tflops_by_method"][m] = row["useful_gflop"] / t["median"]
                    prog.write(f"    {m:12s} {t['median']:9.3f} ms {row['useful_gflop'] / t['median']:7.1f} useful "
                               f"TFLOP/s  first call {first:.1f} s{extra}")
                except Exception as e:  # noqa: BLE001 - fail soft
                    oom = isinstance(e, torch.OutOfMemoryError)
                    row["errors"][m] = ("OOM: " if oom else "") + tk.short_err(e)
                    prog.write(f"    {m:12s} {'OOM' if oom else 'ERROR'} {tk.short_err(e, 300)}")
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                finally:
                    for t_ in qkv:
                        t_.grad = None
                    fn = None
                    tk.cleanup(self.dev)
                self.res.save()
            del qkv, go, base
            self.peers.clear_caches()
            tk.cleanup(self.dev)
            d = row["dilgen_ms"]
            row["useful_tflops"] = row["useful_gflop"] / d if d else None
            for m in METHODS[1:]:
                row[f"speedup_vs_{m}"] = row[f"{m}_ms"] / d if (row[f"{m}_ms"] and d) else None
            self.res.save()
            prog.step(f"{cname} causal={causal}: dilgen {tk.fmt(d, '.3f')} ms")
        prog.close()

    def report(self):
        rows = self.res.all_rows()

        def cell(r, m):
            ms = r.get(f"{m}_ms")
            if ms is not None:
                return f"**{ms:.2f}**" if m == "dilgen" else f"{ms:.2f}"
            e = (r.get("errors") or {}).get(m, "")
            return "—" if not e or e.startswith(("skipped", "not selected")) else ("OOM" if e.startswith("OOM") else "err")
        log(f"\n== forward + backward, median ms ({self.res.data['device']}) ==")
        log(tk.markdown_table(
            ["config", "causal", "dilgen", "useful TFLOP/s", "gather+cuDNN", "gather+flash", "FlexAttention",
             "dense SDPA"],
            [[r["config"], "yes" if r["causal"] else "no", cell(r, "dilgen"), tk.fmt(r.get("useful_tflops"), ".0f")]
             + [cell(r, m) for m in METHODS[1:]] for r in rows]))
        log("\nexact peers' gradients against dilgen's at full size (rel. err. dq/dk/dv):")
        for r in rows:
            parts = [f"{m} " + "/".join(f"{e:.1e}" for e in errs) for m, errs in (r.get("grad_rel_err_vs_dilgen") or {}).items()]
            log(f"  {r['config']} causal={r['causal']!s:5s} " + (", ".join(parts) or "-"))
        for r in rows:
            for m, e in (r.get("errors") or {}).items():
                if not e.startswith("not selected"):
                    log(f"  {r['config']} causal={r['causal']} {m}: {e}")
        if not self.args.no_plot:
            draw_plots(self.res.data, rows, tk.result_path(self.args.out, "backward", self.dry))


def draw_plots(data: dict, rows: list, json_path: Path) -> None:
    """backward-<date>.png (fwd+bwd ms per method) beside the result file json_path."""
    tk.plot_bars(rows, METHODS, json_path.with_suffix(".png"), "forward+backward ms (log scale; lower is better)",
                 f"dilated attention fwd+bwd, bf16 — {data['device']}, torch {data['torch']}, {data['date']}")


def main(argv=None):
    args = parse_args(argv)
    tk.setup_paths()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    import torch
    if not torch.cuda.is_available() and not args.dry_run_cpu:
        log("bench_backward.py needs a CUDA GPU; --dry-run-cpu runs the flow on the CPU at toy sizes.")
        return 2
    b = Bench(args)
    d = b.res.data
    log(f"device {d['device']}  torch {d['torch']}  triton {d['triton']}  python {d['python']}  date {d['date']}")
    log(f"variants {len(b.variants)}  methods {args.methods}  warmup {args.warmup} reps {args.reps}  json {b.res.path}")
    if not args.no_check:
        b.check()
    b.timing()
    b.report()
    log(f"json: {b.res.path}   total {time.time() - b.t0:.0f} s")
    return 1 if b.check_failed else 0


if __name__ == "__main__":
    sys.exit(main())
