#!/usr/bin/env python3
"""Forward + backward(g) of dilgen and its peers, configs A-F x {non-causal, causal}, bf16, one
GPU, and the flow bench_forward.py shares (Bench, report, merge_rerun; bench/README.md has the
methods, options and fields). Before timing, out, dq, dk, dv of dilgen and gather_cudnn against
autograd through the float64 reference (2e-2, 4e-2); each exact peer's gradients against
dilgen's at full size. Writes backward-<date>.json and .png; exit status 1 if dilgen failed.

  python bench/bench_backward.py                                 # A-F x {non-causal, causal}
  python bench/bench_backward.py --configs A,F --causal-only --quick
  python bench/bench_backward.py --configs A --methods dilgen --tunings '{"kv": {"bwd_kv": [64, 32, 4, 3]}}'
  python bench/bench_backward.py --configs A,C --methods dilgen,gather_flash,gather_flash_dropout --no-check \
      --tunings '{"p01": {"dropout_p": 0.1}}'                   # attention dropout's cost, FA2's beside it
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402

BOUND_OUT, BOUND_GRAD = 2e-2, 4e-2      # SPEC §2 tolerance, bf16 (gradients: twice)
PLOTTED = ("dilgen", "gather_cudnn", "gather_flash", "flex", "dense", "cudnn_floor")     # table and plot order


class Bench:
    """One bench over configs x causal flags, every method through one timing/compare loop
    (run_method); bench_forward.Bench overrides the step (forward alone) and its checks."""
    kind, prefix, fwd_bwd = "backward", "bwd", True
    METHODS = ("dilgen", "gather_cudnn", "gather_flash", "dense", "cudnn_floor", "flex", "gather_flash_dropout")
    CHECKED = ("dilgen", "gather_cudnn")                      # against float64 before timing
    POINTS = ("dense", "cudnn_floor", "gather_flash_dropout")    # reference points (flex compiles)
    NOTES = ["useful FLOPs of forward+backward counted as 3.5x the forward formula",
             "the gather peers' LSE gets no gradient: a lower bound for an exact method",
             "dense, cudnn_floor: REFERENCE POINTS only (not the same math)",
             "grad_rel_err_vs_dilgen: [dq, dk, dv] of each exact peer against dilgen's, same inputs"]
    OPTIONS = ()                                              # bench_forward.py's own: (flag, add_argument keywords)

    @classmethod
    def parse(cls, argv=None):
        ap = tk.parser(sys.modules[cls.__module__].__doc__, "no_causal", "causal_only", "warmup", "reps", "out",
                       "append", "seed", "no_plot", "dry_run_cpu", methods=cls.METHODS)
        add = ap.add_argument
        add("--configs", default=",".join(tk.CONFIGS), help="subset of A-F (default: all)")
        add("--quick", action="store_true", help="1 warm-up, 5 timed calls")
        add("--check-n", type=int, default=None, help="N of the float64 check (default per config; backward 1024)")
        add("--no-check", action="store_true", help="skip the float64 check")
        add("--dense-max-n", type=int, default=65536, help="no dense above this N (default: not B, E)")
        add("--budget-s", type=float, default=480.0, help="skip flex rows after this many seconds")
        add("--tunings", default=None, metavar="JSON", help='dilgen variants (a tile sweep) timed and checked '
            'beside dilgen: {"name": tuning, ...}, e.g. {"kv64": {"bwd_kv": [64, 32, 4, 3]}}')
        add("--merge-into", metavar="FILE", help="fold this run's --methods into a committed result file")
        add("--report-from", metavar="FILE", help="only print the table of FILE and redraw its plots")
        for flag, kw in cls.OPTIONS:
            add(flag, **kw)
        a = ap.parse_args(argv)
        try:
            a.configs = tk.parse_configs(a.configs, tk.DRY_CONFIGS if a.dry_run_cpu else tk.CONFIGS)
            a.causals = tk.causal_flags(a.no_causal, a.causal_only)
            a.methods = tk.pick(a.methods, cls.METHODS)
            a.tunings = json.loads(a.tunings) if a.tunings else {}
        except ValueError as e:
            ap.error(f"{type(e).__name__}: {e}")
        a.warmup = a.warmup if a.warmup is not None else (0 if a.dry_run_cpu else 1 if a.quick else 3)
        a.reps = a.reps if a.reps is not None else (1 if a.dry_run_cpu else 5 if a.quick else 10)
        if a.reps < 1 or a.warmup < 0 or (a.check_n is not None and a.check_n < 1):
            ap.error("--reps >= 1, --warmup >= 0, --check-n >= 1")
        return a

    @staticmethod
    def draw(data, rows, path):
        """<kind>-<date>.png beside the result file: ms per method."""
        what = "forward" if Path(path).name.startswith("forward") else "fwd+bwd"
        tk.plot_bars(rows, PLOTTED, Path(path).with_suffix(".png"), f"{what} time, ms (log scale; lower is better)",
                     f"dilated attention {what}, bf16 — {data.get('device')}, torch {data.get('torch')}, "
                     f"triton {data.get('triton')}, {data.get('date')}")

    def __init__(self, args):
        import torch
        import dilgen
        import peers
        self.torch, self.dilgen, self.peers, self.a, self.dry = torch, dilgen, peers, args, args.dry_run_cpu
        self.configs = tk.DRY_CONFIGS if self.dry else tk.CONFIGS
        self.dev = torch.device("cpu" if self.dry else "cuda")
        self.t0, self.kernels, self.check_failed = time.time(), {}, False
        peers.FLEX_MASK_METHOD = getattr(args, "flex_mask", "analytic")
        self.methods = list(self.METHODS) + [f"dilgen:{n}" for n in args.tunings]
        self.variants = [(c, causal) for c in args.configs for causal in args.causals]
        head = tk.header(self.dev, self.dry, {
            "args": vars(args), "configs": {c: self.configs[c] for c in args.configs},
            "timing": f"{'wall clock' if self.dry else 'CUDA events'}{' around forward + backward(g)' * self.fwd_bwd}"
                      f", median of {args.reps} after {args.warmup} warm-ups", "notes": self.NOTES, "check": []})
        self.res = tk.Results(tk.result_path(args.out, self.kind, self.dry), head, append=args.append)

    def check_n(self, cname):
        return self.a.check_n or 1024

    def inputs(self, cfg, seed, n=None, b=None):
        """q, k, v (leaves when fwd_bwd) and the cotangent g (fwd_bwd)."""
        g = self.torch.Generator(device=self.dev).manual_seed(seed)
        x = [self.torch.randn(b or cfg["B"], n or cfg["N"], cfg["H"], cfg["D"], device=self.dev,
                              dtype=self.torch.bfloat16, generator=g) for _ in range(3 + self.fwd_bwd)]
        return tuple(t.requires_grad_(self.fwd_bwd) for t in x[:3]) + tuple(x[3:])

    def attend(self, m, spec, lse=False):
        """(q, k, v) -> out, or (out, lse), of dilgen, a variant dilgen:<name> or a peer."""
        if m.startswith("dilgen"):
            tuning = dict(self.a.tunings[m[7:]]) if m.startswith("dilgen:") else {}
            p = tuning.pop("dropout_p", 0.0)           # a variant's call argument, not a planner knob
            if (m, spec.name) not in self.kernels:     # a variant dilgen:<name> compiles with its --tunings entry
                from dilgen.compiler import Kernel
                self.kernels[(m, spec.name)] = Kernel(spec, None, tuning) if tuning else self.dilgen.compile(spec)
            kern = self.kernels[(m, spec.name)]
            return lambda q, k, v: kern(q, k, v, return_lse=lse, dropout_p=p)
        peer = self.peers.PEERS["dense_sdpa" if m == "dense" else m]
        return lambda q, k, v: peer(q, k, v, spec) if lse else peer(q, k, v, spec)[0]

    def callables(self, m, spec, x):
        """(forward + backward(g), its cloned dq, dk, dv)."""
        q, k, v, g = x
        if m == "cudnn_floor":
            return (self.peers.lane_floor(spec, q.shape[0], q.shape[1], self.dev, grad=True),) * 2
        attend = self.attend(m, spec)

        def step():
            for t in (q, k, v):
                t.grad = None
            attend(q, k, v).backward(g)

        def first():
            step()
            return [t.grad.detach().clone() for t in (q, k, v)]
        return step, first

    def compare(self, row, m, res, base, against):
        errs = row.setdefault(f"grad_rel_err_vs_{against}", {})[m] = [tk.rel_err(x, y) for x, y in zip(res, base)]
        return f"  grads vs {against} " + "/".join(f"{e:.1e}" for e in errs)

    def row_extra(self, cfg, causal):
        return {"grad_rel_err_vs_dilgen": {}}

    def skip_reason(self, m, cfg):
        a, took = self.a, time.time() - self.t0
        if not (m in a.methods or m.startswith("dilgen:")):
            return "not selected (--methods)"
        if m == "dense" and cfg["N"] > a.dense_max_n:
            return f"skipped: N={cfg['N']} > --dense-max-n={a.dense_max_n} (reference point only)"
        if m == "flex" and self.fwd_bwd and self.dev.type == "cpu":
            return "skipped: FlexAttention has no backward on the CPU (dry run)"
        if m == "flex" and cfg["N"] > getattr(a, "flex_max_n", cfg["N"]):
            return f"skipped: N={cfg['N']} > --flex-max-n={a.flex_max_n}"
        if m == "flex" and took > a.budget_s:
            return f"skipped: time budget --budget-s={a.budget_s:.0f} spent ({took:.0f} s)"

    def check_case(self, spec, x, methods, tol=None):
        """out, dq, dk, dv of `methods` against autograd through the float64 reference."""
        from dilgen.reference import differentiable_reference
        q, k, v, g = x
        ref = [t.detach().cpu().double().requires_grad_(True) for t in (q, k, v)]
        ro, _ = differentiable_reference(*ref, spec)
        ro.backward(g.cpu().double())
        want, recs, got = [ro.detach()] + [t.grad for t in ref], [], {}
        for m in methods:
            with tk.failsoft(rec := {"method": m}, passed=False):
                out = self.attend(m, spec)(q, k, v)
                got[m] = list(self.torch.autograd.grad(out, (q, k, v), g))
                errs = rec["rel_err_out_dq_dk_dv"] = [tk.rel_err(a.cpu(), b) for a, b in zip([out] + got[m], want)]
                rec["passed"] = bool(errs[0] < BOUND_OUT and max(errs[1:]) < BOUND_GRAD)
                rec["_detail"] = "out/dq/dk/dv rel err " + " ".join(f"{e:.2e}" for e in errs)
            recs.append(rec)
        if "dilgen" in got and "gather_cudnn" in got:
            errs = [tk.rel_err(a, b) for a, b in zip(got["dilgen"], got["gather_cudnn"])]
            recs.append({"method": "dilgen_vs_gather_cudnn", "passed": True, "rel_err_dq_dk_dv": errs,
                         "_detail": "dq/dk/dv rel err " + " ".join(f"{e:.2e}" for e in errs)})
        return recs

    def check(self):
        tk.log("== correctness (B=1, bf16) against the float64 reference (dilgen.reference) ==")
        checked = [m for m in self.methods if m in self.CHECKED and m in self.a.methods or m.startswith("dilgen:")]
        for i, (cname, causal) in enumerate(self.variants):
            cfg, spec = self.configs[cname], tk.make_spec(cname, self.configs[cname], causal, prefix=self.prefix)
            n = min(self.check_n(cname), cfg["N"])
            for rec in self.check_case(spec, self.inputs(cfg, self.a.seed + 1000 + i, n=n, b=1), checked):
                rec.update(config=cname, causal=causal, N=n)
                detail = rec.pop("_detail", None)
                self.res.data["check"].append(rec)
                tk.log(f"  {'ok  ' if rec['passed'] else 'FAIL'} {cname} causal={causal!s:5s} N={n} "
                       f"{rec['method']:15s} {rec.get('error') or rec.get('detail') or detail}")
                self.check_failed |= rec["method"] in ("dilgen", "reference") and not rec["passed"]
            self.peers.clear_caches()
            tk.cleanup(self.dev)
        if any(r["method"] == "flex_block_mask" and not r["passed"] for r in self.res.data["check"]):
            tk.log("  !! analytic flex block mask differs from create_block_mask's: flex uses --flex-mask create")
            self.peers.FLEX_MASK_METHOD = "create"
        if self.check_failed:
            tk.log("  !! dilgen FAILED the correctness check: its timings are not meaningful")
        self.res.data["check_passed"] = not self.check_failed
        self.res.save()

    def run_method(self, row, m, spec, x, base, say, against="dilgen"):
        """Time one method on inputs x, fail soft; its first call compared with base; returns
        the first call's result for dilgen (the base of the others)."""
        if reason := self.skip_reason(m, self.configs[row["config"]]):
            row["errors"][m] = reason
            return say(f"    {m:12s} {reason}")
        try:
            fn, first = self.callables(m, spec, x)
            if m == "flex":
                info = self.peers.flex_block_mask(spec, row["N"], self.dev, self.peers.FLEX_MASK_METHOD)[3]
                row["flex_mask_method"], row["flex_mask_build_s"] = info["method"], round(info["build_s"], 3)
            t1, res = tk.first_call_s(first, self.dev)
            row[f"{m}_first_call_s"] = round(t1, 3)
            note = "" if base is None or m in self.POINTS else self.compare(row, m, res, base, against)
            kept = res if m in ("dilgen", "gather_cudnn") else None
            del res
            pk = tk.peak_extra_gib(fn, self.dev)
            row[f"{m}_peak_extra_gib"] = None if pk is None else round(pk, 4)
            t = tk.time_ms(fn, self.a.warmup, self.a.reps, self.dev)
            row[f"{m}_ms"], row["timing_ms"][m] = t["median"], t
            row["useful_tflops_by_method"][m] = row["useful_gflop"] / t["median"]
            say(f"    {m:12s} {t['median']:9.3f} ms {row['useful_gflop'] / t['median']:7.1f} useful TFLOP/s  "
                f"peak +{tk.fmt(pk)} GiB  first call {t1:.1f} s{note}")
            return kept
        except Exception as e:  # noqa: BLE001 - fail soft: record, go on
            oom = isinstance(e, self.torch.OutOfMemoryError)
            row["errors"][m] = ("OOM: " if oom else "") + tk.short_err(e, 200 if oom else 400)
            say(f"    {m:12s} {'OOM' if oom else 'ERROR'} {tk.short_err(e, 300)}")
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
        finally:
            fn = first = None
            for t_ in x:
                t_.grad = None
            tk.cleanup(self.dev)

    def timing(self):
        a = self.a
        tk.log(f"\n== timing (median of {a.reps} after {a.warmup} warm-ups; flex skipped after {a.budget_s:.0f} s) ==")
        prog = tk.Progress(len(self.variants))
        for i, (cname, causal) in enumerate(self.variants):
            cfg, spec = self.configs[cname], tk.make_spec(cname, self.configs[cname], causal, prefix=self.prefix)
            row = self.res.add({
                "config": cname, "causal": causal, "B": cfg["B"], "H": cfg["H"], "N": cfg["N"], "D": cfg["D"],
                "segment_lengths": cfg["ws"], "dilation_rates": cfg["rs"], "hilbert": cfg.get("hilbert"),
                "useful_gflop": tk.useful_flops(cfg, causal, self.fwd_bwd) / 1e9, "useful_tflops": None,
                "useful_tflops_by_method": {}, "timing_ms": {}, "errors": {}, **self.row_extra(cfg, causal),
                **{f"{m}_ms": None for m in self.methods}})
            hil = f" hilbert {json.dumps(cfg['hilbert'])}" if cfg.get("hilbert") else ""
            tk.log(f"[{i + 1}/{len(self.variants)}] {cname}: B{cfg['B']} H{cfg['H']} N{cfg['N']} D{cfg['D']} "
                   f"w {cfg['ws']} r {cfg['rs']}{hil} causal={causal}: {row['useful_gflop']:.1f} GFLOP")
            x, base, against = self.inputs(cfg, a.seed + i), None, None
            for m in self.methods:            # the first of dilgen, gather_cudnn to run is the others' base
                if m == "flex":
                    row["flex_checked_against"] = against
                kept = self.run_method(row, m, spec, x, base, tk.log, against)
                if base is None and kept is not None:
                    base, against = kept, m
            del x, base
            self.peers.clear_caches()
            d = row.get("dilgen_ms")
            row["useful_tflops"] = row["useful_gflop"] / d if d else None
            for m in self.methods[1:]:
                row[f"speedup_vs_{m}"] = row[f"{m}_ms"] / d if (row.get(f"{m}_ms") and d) else None
            if row.get("dense_ms") and "dense_gflop" in row:
                row["dense_tflops"] = row["dense_gflop"] / row["dense_ms"]
            self.res.save()
            prog.step(f"{cname} causal={causal}: dilgen {tk.fmt(row['dilgen_ms'], '.3f')} ms")


def report(data: dict, rows: list, path, draw=None) -> None:
    """README's table (ms, dilgen's TFLOP/s, each method, dilgen causal / non-causal), the
    exact peers and variants against dilgen, the errors, the plots."""
    shown = [m for m in PLOTTED[1:] if any(r.get(f"{m}_ms") for r in rows)]
    shown += sorted({k[:-3] for r in rows for k in r if k.startswith("dilgen:") and k.endswith("_ms")})
    nc = {r["config"]: r.get("dilgen_ms") for r in rows if not r["causal"]}

    def cell(r, m):
        if r.get(f"{m}_ms") is not None:
            return f"**{r[f'{m}_ms']:.2f}**" if m == "dilgen" else f"{r[f'{m}_ms']:.2f}"
        e = (r.get("errors") or {}).get(m, "")
        return "—" if not e or e.startswith(("skipped", "not selected")) else "OOM" if e.startswith("OOM") else "err"
    tk.log(f"\n== {Path(path).name.split('-')[0]}, median ms ({data.get('device')}) ==")
    tk.log(tk.markdown_table(
        ["config", "causal", "dilgen ms", "useful TFLOP/s"] + [tk.NAMES.get(m, m) for m in shown] + ["causal / full"],
        [[r["config"], "yes" if r["causal"] else "no", cell(r, "dilgen"), tk.fmt(r.get("useful_tflops"), ".0f")]
         + [cell(r, m) for m in shown] + [tk.fmt(r["dilgen_ms"] / nc[r["config"]]) if r["causal"] and
                                         r.get("dilgen_ms") and nc.get(r["config"]) else ""]
         for r in sorted(rows, key=lambda r: (r["config"], r["causal"]))]))
    if data.get("matmul_ceiling"):
        tk.log(f"matmul ceiling (bf16 {data['matmul_ceiling']['n']}^3): {data['matmul_ceiling']['tflops']:.0f} TFLOP/s")
    tk.log("\nexact peers and variants against dilgen at full size (relative error of out; fwd+bwd: dq/dk/dv):")
    for r in rows:
        parts = [f"{m} " + ("/".join(f"{x:.1e}" for x in e) if isinstance(e, list) else f"{e:.1e}")
                 + ("" if k.endswith("_vs_dilgen") else " (vs gather_cudnn)")
                 for k in (f"{g}rel_err_vs_{p}" for g in ("", "grad_") for p in ("dilgen", "gather_cudnn"))
                 for m, e in (r.get(k) or {}).items() if e is not None]
        tk.log(f"  {r['config']} causal={r['causal']!s:5s} " + (", ".join(parts) or "-"))
        for m, e in (r.get("errors") or {}).items():
            if not e.startswith("not selected"):
                tk.log(f"  {r['config']} causal={r['causal']} {m}: {e}")
    tk.log("dense and cudnn_floor are reference points, NOT the same math.")
    if draw:
        draw(data, rows, path)


def merge_rerun(committed, rerun, methods=("dilgen",), draw=None) -> list:
    """--merge-into: fold a re-run of some methods (a bench_forward / bench_backward file or its data)
    into a committed file of the same GPU. In each row of both (config, causal) the methods' fields
    (<m>_ms, _first_call_s, _peak_extra_gib, timing_ms, useful_tflops_by_method, errors; dilgen's
    useful_tflops) are replaced, the speed-ups recomputed, the peers' kept; rows get `merged_from`,
    their checks come from the re-run, `earlier_runs` lists the merge; draw(data, rows, path)
    redraws the plots. Returns the merged keys."""
    old = json.loads(Path(committed).read_text())
    new = rerun if isinstance(rerun, dict) else json.loads(Path(rerun).read_text())
    if old.get("device") != new.get("device"):
        raise ValueError(f"device differs: {old.get('device')!r} vs {new.get('device')!r}")
    key = lambda r: (r.get("config"), bool(r.get("causal")))  # noqa: E731
    by_key, merged = {key(r): r for r in old["rows"]}, [key(r) for r in new["rows"]]
    stamp = {k: new.get(k) for k in ("time", "device", "torch", "triton", "commit")} | {"methods": list(methods)}
    for row in new["rows"]:
        if (target := by_key.get(key(row))) is None:
            old["rows"].append(row)
            continue
        for m in methods:
            target.update({m + x: row[m + x] for x in ("_ms", "_first_call_s", "_peak_extra_gib") if m + x in row})
            for field in ("timing_ms", "useful_tflops_by_method"):
                if m in row.get(field, {}):
                    target.setdefault(field, {})[m] = row[field][m]
        if "dilgen" in methods:
            target["useful_tflops"] = row.get("useful_tflops", target.get("useful_tflops"))
        dg = target.get("dilgen_ms")
        for k in [k for k in target if k.startswith("speedup_vs_")]:
            peer = target.get(k[len("speedup_vs_"):] + "_ms")
            target[k] = peer / dg if peer and dg else None
        target["errors"] = ({m: e for m, e in (target.get("errors") or {}).items() if m not in methods}
                            | {m: e for m, e in (row.get("errors") or {}).items() if m in methods})
        target["merged_from"] = stamp
    old["check"] = ([c for c in old.get("check", []) if key(c) not in merged]
                    + [c for c in new.get("check", []) if key(c) in merged])
    old.setdefault("earlier_runs", []).append(stamp | {"merged_rows": [list(k) for k in merged]})
    if "check_passed" in new:
        old["check_passed"] = bool(old.get("check_passed", True)) and bool(new["check_passed"])
    tk.write_json_atomic(committed, old)
    tk.log(f"merged {len(merged)} row(s) into {committed}: {merged}")
    if draw:
        draw(old, old["rows"], committed)
    return merged


def main(argv=None, cls=Bench):
    a = cls.parse(argv)
    tk.quiet()
    if a.report_from:
        data = json.loads(Path(a.report_from).read_text())
        report(data, data["rows"], a.report_from, None if a.no_plot else cls.draw)
        return 0
    if tk.no_gpu(a.dry_run_cpu, f"bench_{cls.kind}.py"):
        return 2
    b = cls(a)
    tk.log(f"variants {len(b.variants)}  methods {a.methods}  tunings {list(a.tunings)}  warmup {a.warmup} "
           f"reps {a.reps}  json {b.res.path}")
    if not a.no_check:
        b.check()
    b.timing()
    report(b.res.data, b.res.all_rows(), b.res.path, None if a.no_plot else cls.draw)
    if a.merge_into:
        merge_rerun(a.merge_into, json.loads(b.res.path.read_text()), a.methods, None if a.no_plot else cls.draw)
    tk.log(f"json: {b.res.path}   total {time.time() - b.t0:.0f} s")
    return 1 if b.check_failed else 0


if __name__ == "__main__":
    sys.exit(main())
