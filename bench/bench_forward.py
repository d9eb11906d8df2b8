#!/usr/bin/env python3
"""Forward benchmark: dilgen against its peers on the same dilated attention (SPEC.md §2),
bf16, one GPU, one process. Configs A-F (bench/toolkit.py), each non-causal and causal:

  A  B1 H16 N32768  D128  w [2048, 4096, 8192]                r [1, 2, 4]
  B  B1 H16 N131072 D128  w [2048, 4096, 8192, 16384, 32768]  r [1, 2, 4, 8, 16]
  C  B2 H32 N16384  D64   w [1024, 2048, 4096]                r [1, 2, 4]
  D  B1 H16 N65536  D128  w [4096, 16384]                     r [4, 16]
  E  B with r [1, 2, 4, 6, 12] (6 and 12 do not divide w)
  F  A with "hilbert": {"scope": "segment"}

Methods: dilgen; gather_cudnn, gather_flash, flex (the exact peers of bench/peers.py);
dense (plain dense SDPA: a REFERENCE POINT only, not the same math).

  1. correctness at N = --check-n (B=1): dilgen, gather_cudnn, gather_flash against the
     float64 reference (dilgen.reference); flex's analytic block masks against
     create_block_mask (raster configs);
  2. timing of dilgen, gather_cudnn, gather_flash, dense per (config, causal): fresh random
     inputs, CUDA events, median of --reps after --warmup warm-ups, peak extra memory, the
     exact peers' outputs compared with dilgen's at full size;
  3. the matmul ceiling: one bf16 --matmul-n cubed matmul on random data;
  4. flex per (config, causal) (torch.compile; skipped once --budget-s is spent).
Results: a markdown table, <out>/forward-<date>.json (rewritten after every row),
forward-<date>.png (ms) and roofline-<date>.png (useful TFLOP/s against the matmul
ceiling). Exit status 1 if dilgen failed the correctness check.

  python bench/bench_forward.py                          # A-F, both causal flags
  python bench/bench_forward.py --configs A,F --no-causal --quick
  python bench/bench_forward.py --dry-run-cpu --quick --out /tmp/x   # toy sizes on the CPU
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
# length of the correctness check: the float64 reference costs ~N² per head on the CPU
CHECK_N = {"A": 4096, "B": 2048, "C": 4096, "D": 2048, "E": 2048, "F": 4096}
TOL = 2e-2               # SPEC §2, bf16: relative error of out
LSE_TOL = 2e-2           # max |lse - lse_ref| over the queries some branch keeps


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(tk.CONFIGS), help="subset of A-F (default: all)")
    ap.add_argument("--no-causal", action="store_true", help="only the non-causal variants")
    ap.add_argument("--causal-only", action="store_true", help="only the causal variants")
    ap.add_argument("--quick", action="store_true", help="1 warm-up, 5 timed calls, --check-n 2048")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 3)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls, median taken (default 10)")
    ap.add_argument("--out", default=str(tk.RESULTS), help="output folder (default bench/results)")
    ap.add_argument("--append", nargs="?", const=True, default=False, metavar="FILE",
                    help="keep the rows of an earlier run that this run does not redo: of today's "
                         "forward-<date>.json in --out, or of FILE")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--check-n", type=int, default=None, help="N of the correctness check (default per config)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--dense-max-n", type=int, default=65536, help="no dense above this N (default: not B, E)")
    ap.add_argument("--flex-max-n", type=int, default=1 << 30, help="no flex above this N")
    ap.add_argument("--flex-mask", choices=("analytic", "create"), default="analytic",
                    help="flex BlockMask from the segment structure (default; checked equal to "
                         "create_block_mask's) or create_block_mask; Hilbert configs always 'create'")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip flex rows after this many seconds")
    ap.add_argument("--matmul-n", type=int, default=8192, help="size of the matmul ceiling (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="the whole flow at toy sizes on the CPU (numbers meaningless; files *-cpu-dryrun.*)")
    a = ap.parse_args(argv)
    configs = tk.DRY_CONFIGS if a.dry_run_cpu else tk.CONFIGS
    try:
        a.configs = tk.parse_configs(a.configs, configs)
        a.causals = tk.causal_flags(a.no_causal, a.causal_only)
    except ValueError as e:
        ap.error(str(e))
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if [m for m in a.methods if m not in METHODS]:
        ap.error(f"--methods: choose from {','.join(METHODS)}")
    a.warmup = a.warmup if a.warmup is not None else (0 if a.dry_run_cpu else 1 if a.quick else 3)
    a.reps = a.reps if a.reps is not None else (1 if a.dry_run_cpu else 5 if a.quick else 10)
    if a.check_n is None and a.quick:
        a.check_n = 2048
    if a.reps < 1 or a.warmup < 0 or (a.check_n is not None and a.check_n < 1):
        ap.error("--reps >= 1, --warmup >= 0, --check-n >= 1")
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
        peers.FLEX_MASK_METHOD = args.flex_mask
        self.variants = [(c, causal) for c in args.configs for causal in args.causals]
        head = tk.header(self.dev, self.dry, {
            "args": vars(args), "configs": {c: self.configs[c] for c in args.configs},
            "timing": f"{'wall clock' if self.dry else 'CUDA events'}, median of {args.reps} after "
                      f"{args.warmup} warm-ups, synchronised per call",
            "notes": ["useful_gflop: Σ_i 4·B·H·(N/w_i)·(w_i/r_i)²·D, halved when causal (dilgen.stats)",
                      "useful_tflops: dilgen's; useful_tflops_by_method: the same work / each method's time",
                      "dense: plain dense SDPA, a REFERENCE POINT only (not the same math)",
                      "speedup_vs_X = X_ms / dilgen_ms",
                      "X_peak_extra_gib: max_memory_allocated during one call minus what was allocated "
                      "before it minus its outputs"],
            "check": []})
        self.res = tk.Results(tk.result_path(args.out, "forward", self.dry), head, append=args.append)
        self.rows = {}

    def elapsed(self):
        return time.time() - self.t0

    def spec(self, cname, causal):
        return tk.make_spec(cname, self.configs[cname], causal)

    def inputs(self, cfg, seed, n=None, b=None):
        g = self.torch.Generator(device=self.dev).manual_seed(seed)
        shape = (b or cfg["B"], n or cfg["N"], cfg["H"], cfg["D"])
        return tuple(self.torch.randn(shape, device=self.dev, dtype=self.torch.bfloat16, generator=g)
                     for _ in range(3))

    def fn(self, method, spec, q, k, v):
        if method == "dilgen":
            kern = self.kernels.get(spec.name) or self.kernels.setdefault(spec.name, self.dilgen.compile(spec))
            return lambda: kern(q, k, v, return_lse=True)
        if method == "dense":
            return lambda: self.peers.dense_sdpa(q, k, v, spec)
        return lambda: self.peers.PEERS[method](q, k, v, spec)

    # ------------------------------------------------------------------ 1. correctness
    def check(self):
        from dilgen.reference import reference_attention
        methods = [m for m in ("dilgen", "gather_cudnn", "gather_flash") if m in self.args.methods]
        log("== correctness (B=1, bf16) against the float64 reference (dilgen.reference) ==")
        for i, (cname, causal) in enumerate(self.variants):
            cfg, spec = self.configs[cname], self.spec(cname, causal)
            n = min(self.args.check_n or CHECK_N[cname], cfg["N"])
            q, k, v = self.inputs(cfg, self.args.seed + 1000 + i, n=n, b=1)
            recs = []
            try:
                ref_out, ref_lse = reference_attention(q, k, v, spec, return_lse=True)
            except Exception as e:  # noqa: BLE001
                recs.append({"method": "reference", "error": tk.short_err(e), "passed": False})
                ref_out = None
            for m in methods if ref_out is not None else []:
                rec = {"method": m}
                try:
                    out, lse = self.fn(m, spec, q, k, v)()
                    rec["rel_err_vs_ref"] = tk.rel_err(out.cpu(), ref_out)
                    rec["max_abs_lse_err"], rec["lse_inf_pattern_ok"] = tk.lse_diff(lse.cpu(), ref_lse)
                    rec["passed"] = bool(rec["rel_err_vs_ref"] < TOL and rec["max_abs_lse_err"] < LSE_TOL
                                         and rec["lse_inf_pattern_ok"])
                except Exception as e:  # noqa: BLE001
                    rec.update(error=tk.short_err(e), passed=False)
                recs.append(rec)
            if "flex" in self.args.methods and self.args.flex_mask == "analytic" and not cfg.get("hilbert"):
                recs.append(self.check_block_mask(spec, n))
            for rec in recs:
                rec.update(config=cname, causal=causal, N=n)
                self.res.data["check"].append(rec)
                detail = rec.get("error") or rec.get("detail") or (
                    f"rel_err {rec['rel_err_vs_ref']:.2e}  max|dlse| {rec['max_abs_lse_err']:.2e}  "
                    f"-inf pattern ok {rec['lse_inf_pattern_ok']}")
                log(f"  {'ok  ' if rec['passed'] else 'FAIL'} {cname} causal={causal!s:5s} N={n} "
                    f"{rec['method']:15s} {detail}")
                if rec["method"] in ("dilgen", "reference") and not rec["passed"]:
                    self.check_failed = True
            self.peers.clear_caches()
            tk.cleanup(self.dev)
        if any(r["method"] == "flex_block_mask" and not r["passed"] for r in self.res.data["check"]):
            log("  !! analytic flex block mask differs from create_block_mask's: flex uses --flex-mask create")
            self.args.flex_mask = self.peers.FLEX_MASK_METHOD = "create"
        if self.check_failed:
            log("  !! dilgen FAILED the correctness check: its timings are not meaningful")
        self.res.data["check_passed"] = not self.check_failed
        self.res.save()

    def check_block_mask(self, spec, n):
        from torch.nn.attention.flex_attention import create_block_mask
        rec = {"method": "flex_block_mask"}
        try:
            bm_a, mask_mod, _, _ = self.peers.flex_block_mask(spec, n, self.dev, "analytic")
            bm_c = create_block_mask(mask_mod, B=None, H=spec.num_heads, Q_LEN=n, KV_LEN=n, device=self.dev)
            (a_ne, a_full), (c_ne, c_full) = self.peers.block_sets_of(bm_a), self.peers.block_sets_of(bm_c)
            rec["nonempty_equal"] = bool(self.torch.equal(a_ne, c_ne))
            rec["full_equal"] = bool(self.torch.equal(a_full, c_full))
            rec["passed"] = rec["nonempty_equal"] and rec["full_equal"]
            rec["detail"] = f"analytic == create_block_mask: nonempty {rec['nonempty_equal']}, full {rec['full_equal']}"
        except Exception as e:  # noqa: BLE001
            rec.update(error=tk.short_err(e), passed=False)
        return rec

    # ------------------------------------------------------------------ 2.-4. timing
    def new_row(self, cname, causal):
        cfg = self.configs[cname]
        row = {"config": cname, "causal": causal, "B": cfg["B"], "H": cfg["H"], "N": cfg["N"], "D": cfg["D"],
               "segment_lengths": cfg["ws"], "dilation_rates": cfg["rs"], "hilbert": cfg.get("hilbert"),
               "useful_gflop": tk.useful_flops(cfg, causal) / 1e9,
               "dense_gflop": 4 * cfg["B"] * cfg["H"] * cfg["N"] ** 2 * cfg["D"] / (2 if causal else 1) / 1e9,
               "useful_tflops": None, "useful_tflops_by_method": {}, "timing_ms": {}, "errors": {},
               "rel_err_vs_dilgen": {}, "lse_max_abs_diff_vs_dilgen": {}, "lse_inf_pattern_equal_vs_dilgen": {},
               "dense_note": "reference point: dense attention over the whole sequence, not the same math"}
        row.update({f"{m}_ms": None for m in METHODS})
        return row

    def skip_reason(self, method, cfg):
        a = self.args
        if method not in a.methods:
            return "not selected (--methods)"
        if method == "dense" and cfg["N"] > a.dense_max_n:
            return f"skipped: N={cfg['N']} > --dense-max-n={a.dense_max_n} (reference point only)"
        if method == "flex" and cfg["N"] > a.flex_max_n:
            return f"skipped: N={cfg['N']} > --flex-max-n={a.flex_max_n}"
        if method == "flex" and self.elapsed() > a.budget_s:
            return f"skipped: time budget --budget-s={a.budget_s:.0f} spent ({self.elapsed():.0f} s)"
        return None

    def run_method(self, row, method, spec, q, k, v, base, say, against="dilgen"):
        torch, a = self.torch, self.args
        reason = self.skip_reason(method, self.configs[row["config"]])
        if reason:
            row["errors"][method] = reason
            say(f"    {method:12s} {reason}")
            return None
        fn, kept = self.fn(method, spec, q, k, v), None
        try:
            if method == "flex":
                info = self.peers.flex_block_mask(spec, row["N"], self.dev, a.flex_mask)[3]
                row["flex_mask_method"], row["flex_mask_build_s"] = info["method"], round(info["build_s"], 3)
            first, res = tk.first_call_s(fn, self.dev)
            row[f"{method}_first_call_s"] = round(first, 3)
            if method in EXACT and base is not None:
                errs = row.setdefault(f"rel_err_vs_{against}", {})
                errs[method] = tk.rel_err(res[0], base[0])
                d, pat = tk.lse_diff(res[1], base[1])
                row.setdefault(f"lse_max_abs_diff_vs_{against}", {})[method] = d
                row.setdefault(f"lse_inf_pattern_equal_vs_{against}", {})[method] = pat
                sfx = f"  vs {against}: rel_err {errs[method]:.1e}, max|dlse| {d:.1e}" + ("" if pat else " (-inf differ!)")
            else:
                sfx = ""
            if method == "dilgen":
                kept = (res[0], res[1])
            del res
            pk = tk.peak_extra_gib(fn, self.dev)
            row[f"{method}_peak_extra_gib"] = None if pk is None else round(pk, 4)
            t = tk.time_ms(fn, a.warmup, a.reps, self.dev)
            row[f"{method}_ms"], row["timing_ms"][method] = t["median"], t
            row["useful_tflops_by_method"][method] = row["useful_gflop"] / t["median"]
            if method == "dense":
                row["dense_tflops"] = row["dense_gflop"] / t["median"]
            say(f"    {method:12s} {t['median']:9.3f} ms {row['useful_gflop'] / t['median']:7.1f} useful TFLOP/s  "
                f"peak +{tk.fmt(pk)} GiB  first call {first:.1f} s{sfx}")
        except Exception as e:  # noqa: BLE001 - fail soft: record, go on
            oom = isinstance(e, torch.OutOfMemoryError)
            row["errors"][method] = ("OOM: " if oom else "") + tk.short_err(e, 200 if oom else 400)
            say(f"    {method:12s} {'OOM' if oom else 'ERROR'} {tk.short_err(e, 300)}")
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
        finally:
            fn = None
            tk.cleanup(self.dev)
        return kept

    def finish(self, row):
        d = row.get("dilgen_ms")
        row["useful_tflops"] = row["useful_gflop"] / d if d else None
        for m in METHODS[1:]:
            pm = row.get(f"{m}_ms")
            row[f"speedup_vs_{m}"] = pm / d if (pm and d) else None
        self.res.save()

    def timing(self):
        a = self.args
        log(f"\n== timing: dilgen, gather_cudnn, gather_flash, dense (median of {a.reps} after {a.warmup}) ==")
        prog = tk.Progress(len(self.variants), "forward")
        for i, (cname, causal) in enumerate(self.variants):
            cfg, spec = self.configs[cname], self.spec(cname, causal)
            row = self.rows[(cname, causal)] = self.res.add(self.new_row(cname, causal))
            prog.write(f"{prog.tag()} {tk.config_text(cname, cfg)} causal={causal}: "
                       f"{row['useful_gflop']:.1f} useful GFLOP")
            q, k, v = self.inputs(cfg, a.seed + i)
            base = self.run_method(row, "dilgen", spec, q, k, v, None, prog.write)
            for m in ("gather_cudnn", "gather_flash", "dense"):
                self.run_method(row, m, spec, q, k, v, base, prog.write)
            del q, k, v, base
            tk.cleanup(self.dev)
            self.finish(row)
            prog.step(f"{cname} causal={causal}: dilgen {tk.fmt(row['dilgen_ms'], '.3f')} ms")
        prog.close()
        if a.matmul_n:
            mm = tk.matmul_ceiling(self.dev, a.matmul_n, warmup=a.warmup, reps=a.reps)
            self.res.data["matmul_ceiling"] = mm
            self.res.save()
            log(f"\n== matmul ceiling: bf16 {mm['n']}^3: {mm['ms']:.3f} ms = {mm['tflops']:.0f} TFLOP/s ==")
        if "flex" not in a.methods:
            for row in self.rows.values():
                row["errors"]["flex"] = "not selected (--methods)"
            return
        log(f"\n== timing: flex (torch.compile; skipped after {a.budget_s:.0f} s) ==")
        prog = tk.Progress(len(self.variants), "flex")
        for i, (cname, causal) in enumerate(self.variants):
            cfg, spec, row = self.configs[cname], self.spec(cname, causal), self.rows[(cname, causal)]
            q = k = v = base = None
            against = "dilgen"
            if not self.skip_reason("flex", cfg):
                q, k, v = self.inputs(cfg, a.seed + 100 + i)
                for against in ("dilgen", "gather_cudnn"):     # flex is checked against this one
                    if row.get(f"{against}_ms") is not None:
                        try:
                            base = tuple(self.fn(against, spec, q, k, v)())
                            break
                        except Exception:  # noqa: BLE001
                            tk.cleanup(self.dev)
            row["flex_checked_against"] = against if base is not None else None
            self.run_method(row, "flex", spec, q, k, v, base, prog.write, against)
            del q, k, v, base
            self.peers.clear_caches()
            tk.cleanup(self.dev)
            self.finish(row)
            prog.step(f"{cname} causal={causal}: flex {tk.fmt(row['flex_ms'], '.3f')} ms")
        prog.close()

    # ------------------------------------------------------------------ output
    def report(self):
        rows = self.res.all_rows()
        names = {"gather_cudnn": "gather+cuDNN", "gather_flash": "gather+flash", "flex": "FlexAttention",
                 "dense": "dense SDPA"}

        def cell(r, m):
            ms = r.get(f"{m}_ms")
            if ms is not None:
                return f"**{ms:.2f}**" if m == "dilgen" else f"{ms:.2f}"
            e = (r.get("errors") or {}).get(m, "")
            return "—" if e.startswith(("skipped", "not selected")) or not e else ("OOM" if e.startswith("OOM") else "err")
        log(f"\n== forward, median ms ({self.res.data['device']}) ==")
        log(tk.markdown_table(
            ["config", "causal", "dilgen ms", "useful TFLOP/s"] + [names[m] for m in METHODS[1:]],
            [[r["config"], "yes" if r["causal"] else "no", cell(r, "dilgen"), tk.fmt(r.get("useful_tflops"), ".0f")]
             + [cell(r, m) for m in METHODS[1:]] for r in rows]))
        mm = self.res.data.get("matmul_ceiling")
        if mm:
            log(f"matmul ceiling (bf16 {mm['n']}^3): {mm['tflops']:.0f} TFLOP/s")
        log("\nexact peers against dilgen at full size (relative error of out):")
        for r in rows:
            parts = [f"{m} {e:.1e}" for m, e in (r.get("rel_err_vs_dilgen") or {}).items() if e is not None]
            parts += [f"{m} {e:.1e} (vs gather_cudnn)" for m, e in (r.get("rel_err_vs_gather_cudnn") or {}).items()]
            log(f"  {r['config']} causal={r['causal']!s:5s} " + (", ".join(parts) or "-"))
        for r in rows:
            for m, e in (r.get("errors") or {}).items():
                if not e.startswith("not selected"):
                    log(f"  {r['config']} causal={r['causal']} {m}: {e}")
        log("dense = plain dense SDPA over the whole sequence: a reference point, NOT the same math.")
        if not self.args.no_plot:
            draw_plots(self.res.data, rows, tk.result_path(self.args.out, "forward", self.dry))


def draw_plots(data: dict, rows: list, json_path: Path) -> None:
    """forward-<date>.png (ms per method) and roofline-<date>.png (useful TFLOP/s against
    the matmul ceiling) beside the result file json_path."""
    title = f"{data['device']}, torch {data['torch']}, triton {data.get('triton')}, {data['date']}"
    tk.plot_bars(rows, METHODS, json_path.with_suffix(".png"),
                 "forward time, ms (log scale; lower is better)", f"dilated attention forward, bf16 — {title}")
    tk.plot_roofline(rows, EXACT, (data.get("matmul_ceiling") or {}).get("tflops"),
                     json_path.with_name(json_path.name.replace("forward", "roofline", 1)).with_suffix(".png"),
                     f"useful TFLOP/s of the exact methods, bf16 forward — {title}")


def main(argv=None):
    args = parse_args(argv)
    tk.setup_paths()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    import torch
    if not torch.cuda.is_available() and not args.dry_run_cpu:
        log("bench_forward.py needs a CUDA GPU; --dry-run-cpu runs the flow on the CPU at toy sizes.")
        return 2
    b = Bench(args)
    d = b.res.data
    log(f"device {d['device']}  torch {d['torch']}  triton {d['triton']}  python {d['python']}  date {d['date']}")
    log(f"variants {len(b.variants)}  methods {args.methods}  warmup {args.warmup} reps {args.reps}  json {b.res.path}")
    if not args.no_check:
        b.check()
    b.timing()
    b.res.save()
    b.report()
    log(f"json: {b.res.path}   total {b.elapsed():.0f} s")
    return 1 if b.check_failed else 0


if __name__ == "__main__":
    sys.exit(main())
