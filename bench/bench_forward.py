#!/usr/bin/env python3
"""Forward benchmark: dilgen against its peers on the same dilated attention (SPEC.md §2).

Configs (bf16; each non-causal and causal):
  A  B1 H16 N32768  D128  w [2048, 4096, 8192]                r [1, 2, 4]
  B  B1 H16 N131072 D128  w [2048, 4096, 8192, 16384, 32768]  r [1, 2, 4, 8, 16]
  C  B2 H32 N16384  D64   w [1024, 2048, 4096]                r [1, 2, 4]
  D  B1 H16 N65536  D128  w [4096, 16384]                     r [4, 16]

Methods: dilgen; gather_cudnn, gather_flash, flex (the exact peers of bench/peers.py);
dense (plain dense SDPA: a REFERENCE POINT only, not the same math).

One process, in this order:
  1. correctness at N = --check-n (B=1): dilgen, gather_cudnn and gather_flash against the
     float64 dense reference (dilgen.reference), dilgen against gather_cudnn, and the flex
     block masks against torch's create_block_mask;
  2. timing of dilgen, gather_cudnn, gather_flash and dense for every (config, causal):
     fresh random inputs, CUDA events, median of --reps after --warmup warm-ups, peak extra
     memory (max_memory_allocated above the inputs, minus the outputs), the exact peers'
     outputs compared with dilgen's at full size;
  3. timing of flex for every (config, causal) (compiles; skipped once --budget-s is spent).
Results: a table on stdout, <out>/forward-<date>.json (written after every row) and
<out>/forward-<date>.png. Every method fails soft: its error string is recorded, the
run goes on. Exit status 1 if the dilgen correctness check failed, else 0.

  python bench/bench_forward.py                    # everything (about 4-6 minutes on an H200)
  python bench/bench_forward.py --configs A,C --no-causal --quick
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

CONFIGS = {
    "A": dict(B=1, H=16, N=32768, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4]),
    "B": dict(B=1, H=16, N=131072, D=128, ws=[2048, 4096, 8192, 16384, 32768], rs=[1, 2, 4, 8, 16]),
    "C": dict(B=2, H=32, N=16384, D=64, ws=[1024, 2048, 4096], rs=[1, 2, 4]),
    "D": dict(B=1, H=16, N=65536, D=128, ws=[4096, 16384], rs=[4, 16]),
}
# --dry-run-cpu: the same flow at toy sizes on the CPU (dilgen in Triton's interpreter, the
# peers' math fallbacks, eager flex), to exercise this script without a GPU. Same r, small N, w.
DRY_CONFIGS = {
    "A": dict(B=1, H=4, N=512, D=16, ws=[32, 64, 128], rs=[1, 2, 4]),
    "B": dict(B=1, H=4, N=1024, D=16, ws=[32, 64, 128, 256, 512], rs=[1, 2, 4, 8, 16]),
    "C": dict(B=2, H=8, N=256, D=16, ws=[16, 32, 64], rs=[1, 2, 4]),
    "D": dict(B=1, H=4, N=512, D=16, ws=[64, 256], rs=[4, 16]),
}
# default length of the correctness check: the float64 reference runs on the CPU and costs
# ~N² per distinct head pattern (lcm of the rates: 4 for A and C, 16 for B and D)
CHECK_N = {"A": 4096, "B": 2048, "C": 4096, "D": 2048}
METHODS = ("dilgen", "gather_cudnn", "gather_flash", "flex", "dense")
EXACT = ("dilgen", "gather_cudnn", "gather_flash", "flex")
TOL_BF16 = 2e-2          # SPEC §2 tolerance for bf16 (relative error of out)
LSE_TOL = 2e-2           # max |lse - lse_ref| over the queries some branch keeps


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="A,B,C,D", help="comma-separated subset of A,B,C,D (default: all)")
    ap.add_argument("--no-causal", action="store_true", help="only the non-causal variants")
    ap.add_argument("--causal-only", action="store_true", help="only the causal variants")
    ap.add_argument("--quick", action="store_true",
                    help="fewer repetitions (1 warm-up, 5 timed) and --check-n 2048")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls per method (default 3)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per method, median taken (default 10)")
    ap.add_argument("--out", default=str(HERE / "results"), help="output folder (default bench/results)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    ap.add_argument("--check-n", type=int, default=None,
                    help="sequence length of the correctness check (default: 4096 for A and C, 2048 for B "
                         "and D, whose 16 head patterns make the CPU float64 reference 4x dearer; 2048 with --quick)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--dense-max-n", type=int, default=65536,
                    help="skip the dense reference point above this N (default 65536: not config B)")
    ap.add_argument("--flex-max-n", type=int, default=1 << 30, help="skip flex above this N (default: never)")
    ap.add_argument("--flex-mask", choices=("analytic", "create"), default="analytic",
                    help="how flex's BlockMask is built: 'analytic' (from the segment structure, checked "
                         "equal to create_block_mask's; default) or 'create' (create_block_mask(_compile=True): "
                         "about 2 minutes per mask at N=131072)")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="wall-clock seconds after which the remaining flex rows are skipped (default 360)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="exercise the whole flow on the CPU at toy sizes (no GPU needed; numbers meaningless; "
                         "writes forward-<date>-cpu-dryrun.json/png)")
    args = ap.parse_args(argv)
    args.configs = [c.strip().upper() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown config(s) {bad}; choose from {sorted(CONFIGS)}")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown method(s) {bad}; choose from {list(METHODS)}")
    if args.no_causal and args.causal_only:
        ap.error("--no-causal and --causal-only exclude each other")
    if args.warmup is None:
        args.warmup = 0 if args.dry_run_cpu else (1 if args.quick else 3)
    if args.reps is None:
        args.reps = 1 if args.dry_run_cpu else (5 if args.quick else 10)
    if args.check_n is None and args.quick:
        args.check_n = 2048
    if args.reps < 1 or args.warmup < 0 or (args.check_n is not None and args.check_n < 1):
        ap.error("--reps >= 1, --warmup >= 0, --check-n >= 1")
    return args


# --------------------------------------------------------------------------- helpers

def log(msg=""):
    print(msg, flush=True)


def short_err(e: BaseException, limit: int = 400) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s if len(s) <= limit else s[:limit - 3] + "..."


def finite_or_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def sanitize(obj):
    """JSON without NaN/inf (they become null)."""
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, float):
        return finite_or_none(obj)
    return obj


def make_spec(dilgen, cname: str, causal: bool, configs=CONFIGS):
    c = configs[cname]
    return dilgen.Spec(name=f"bench_{cname.lower()}_{'causal' if causal else 'full'}", num_heads=c["H"],
                       num_kv_heads=c["H"], head_dim=c["D"], segment_lengths=list(c["ws"]),
                       dilation_rates=list(c["rs"]), causal=causal, dtype="bfloat16")


def rand_inputs(torch, B, N, H, D, seed, device):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return tuple(torch.randn(B, N, H, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))


def rel_err(torch, a, b) -> float:
    a32, b32 = a.float(), b.float()
    return ((a32 - b32).norm() / b32.norm().clamp_min(1e-30)).item()


def lse_diff(torch, lse, ref):
    """(max |lse - ref| where ref is finite, True if both are -inf at the same places)."""
    lse = lse.to(ref.device, torch.float64)
    fin = torch.isfinite(ref)
    pattern = bool(torch.equal(torch.isfinite(lse), fin)) and not bool(torch.isnan(lse).any())
    d = (lse[fin] - ref[fin]).abs().max().item() if bool(fin.any()) else 0.0
    return d, pattern


def out_bytes(res) -> int:
    n = 0
    for t in (res if isinstance(res, (tuple, list)) else (res,)):
        if t is not None and hasattr(t, "untyped_storage"):
            n += t.untyped_storage().nbytes()
    return n


def time_ms(torch, fn, warmup: int, reps: int):
    """CUDA-event times (ms) of `reps` calls after `warmup` calls; synchronised per call.
    (Without CUDA, for --dry-run-cpu: wall-clock times.)"""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return times


def peak_extra_gib(torch, fn) -> float:
    """Peak memory of one call above what was allocated before it (inputs, caches),
    minus the outputs it returns, in GiB (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    extra = peak - base - out_bytes(res)
    del res
    return max(extra, 0) / 2**30


# --------------------------------------------------------------------------- the run

class Bench:
    def __init__(self, args):
        import torch
        import dilgen
        import dilgen.stats
        import peers
        self.torch, self.dilgen, self.peers = torch, dilgen, peers
        self.args = args
        self.dry = bool(args.dry_run_cpu)
        self.configs = DRY_CONFIGS if self.dry else CONFIGS
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.t0 = time.time()
        self.kernels = {}
        self.date = datetime.date.today().isoformat()
        self.out_dir = Path(args.out)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"forward-{self.date}" + ("-cpu-dryrun" if self.dry else "")
        self.json_path = self.out_dir / f"{stem}.json"
        self.png_path = self.out_dir / f"{stem}.png"
        peers.FLEX_MASK_METHOD = args.flex_mask
        try:
            import triton
            triton_version = triton.__version__
        except Exception as e:  # noqa: BLE001
            triton_version = f"unavailable ({short_err(e, 80)})"
        if self.dry:
            import platform
            dev_name, cap, sms = f"CPU dry run ({platform.machine()}): numbers meaningless", None, None
        else:
            dev_name = torch.cuda.get_device_name(0)
            cap = list(torch.cuda.get_device_capability(0))
            sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.result = {
            "device": dev_name,
            "torch": torch.__version__,
            "triton": triton_version,
            "date": self.date,
            "dilgen": getattr(dilgen, "__version__", None),
            "python": sys.version.split()[0],
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "capability": cap,
            "sm_count": sms,
            "dry_run_cpu": self.dry,
            "configs": {c: self.configs[c] for c in args.configs},
            "args": {k: v for k, v in vars(args).items()},
            "timing": (f"{'wall clock (CPU dry run)' if self.dry else 'CUDA events'}, median of {args.reps} "
                       f"after {args.warmup} warm-ups, synchronised per call"),
            "notes": [
                "useful_tflops: dilgen's useful FLOP/s (dilgen.stats.forward_flops, halved when causal); "
                "useful_tflops_by_method: the same work divided by each method's time",
                "dense_ms: plain dense SDPA, a REFERENCE POINT only (not the same math)",
                "speedup_vs_X = X_ms / dilgen_ms",
                "X_peak_extra_gib: torch.cuda.max_memory_allocated during one call minus what was "
                "allocated before it (inputs, caches such as flex's block mask) minus its outputs",
                f"flex block mask: {args.flex_mask} (build time in flex_mask_build_s, not in flex_ms)",
            ],
            "check": [],
            "rows": [],
        }
        self.check_failed = False

    # ---- bookkeeping
    def elapsed(self) -> float:
        return time.time() - self.t0

    def variants(self):
        causals = [False, True]
        if self.args.no_causal:
            causals = [False]
        if self.args.causal_only:
            causals = [True]
        return [(c, causal) for c in self.args.configs for causal in causals]

    def kernel(self, spec):
        k = self.kernels.get(spec.name)
        if k is None:
            k = self.kernels[spec.name] = self.dilgen.compile(spec)
        return k

    def fn_for(self, method, spec, q, k, v):
        p = self.peers
        if method == "dilgen":
            kern = self.kernel(spec)
            return lambda: kern(q, k, v, return_lse=True)
        if method == "dense":
            return lambda: p.dense_sdpa(q, k, v, spec)
        return lambda: p.PEERS[method](q, k, v, spec)

    def save(self):
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(sanitize(self.result), indent=1) + "\n")
        os.replace(tmp, self.json_path)

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def cleanup(self):
        gc.collect()
        if self.device.type != "cuda":
            return
        try:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a broken context: the next method records it
            pass

    # ---- phase 1: correctness
    def check(self):
        torch, peers = self.torch, self.peers
        from dilgen.reference import reference_attention
        methods = [m for m in ("dilgen", "gather_cudnn", "gather_flash") if m in self.args.methods]
        log("== correctness (B=1, bf16, small N) against the float64 reference (dilgen.reference) ==")
        for i, (cname, causal) in enumerate(self.variants()):
            cfg = self.configs[cname]
            spec = make_spec(self.dilgen, cname, causal, self.configs)
            n = min(self.args.check_n or CHECK_N[cname], cfg["N"])
            q, k, v = rand_inputs(torch, 1, n, cfg["H"], cfg["D"], self.args.seed + 1000 + i, self.device)
            t = time.time()
            try:
                ref_out, ref_lse = reference_attention(q, k, v, spec, return_lse=True)
            except Exception as e:  # noqa: BLE001
                self.result["check"].append({"config": cname, "causal": causal, "N": n, "method": "reference",
                                             "error": short_err(e), "passed": False})
                log(f"  FAIL {cname} causal={causal!s:5s} reference: {short_err(e)}")
                self.check_failed = True
                continue
            ref_s = time.time() - t
            outs = {}
            for m in methods:
                rec = {"config": cname, "causal": causal, "N": n, "method": m, "reference_s": round(ref_s, 2)}
                try:
                    out, lse = self.fn_for(m, spec, q, k, v)()
                    self.sync()
                    outs[m] = out
                    ref_dev = ref_out.to(self.device)
                    rec["rel_err_vs_ref"] = rel_err(torch, out.double(), ref_dev)
                    del ref_dev
                    d, pat = lse_diff(torch, lse, ref_lse)
                    rec["max_abs_lse_err"] = d
                    rec["lse_inf_pattern_ok"] = pat
                    rec["passed"] = bool(rec["rel_err_vs_ref"] < TOL_BF16 and d < LSE_TOL and pat)
                except Exception as e:  # noqa: BLE001
                    rec["error"] = short_err(e)
                    rec["passed"] = False
                self.result["check"].append(rec)
            if "dilgen" in outs and "gather_cudnn" in outs:
                r = rel_err(torch, outs["dilgen"], outs["gather_cudnn"])
                for rec in self.result["check"]:
                    if rec["config"] == cname and rec["causal"] == causal and rec["method"] == "dilgen":
                        rec["rel_err_vs_gather_cudnn"] = r
            for rec in [r for r in self.result["check"] if r["config"] == cname and r["causal"] == causal]:
                status = "ok  " if rec["passed"] else "FAIL"
                if "error" in rec:
                    detail = rec["error"]
                else:
                    detail = (f"rel_err={rec['rel_err_vs_ref']:.2e} max|dlse|={rec['max_abs_lse_err']:.2e} "
                              f"-inf pattern ok={rec['lse_inf_pattern_ok']}")
                    if "rel_err_vs_gather_cudnn" in rec:
                        detail += f"  vs gather_cudnn rel_err={rec['rel_err_vs_gather_cudnn']:.2e}"
                log(f"  {status} {cname} causal={causal!s:5s} N={n} {rec['method']:12s} {detail}")
                if rec["method"] == "dilgen" and not rec["passed"]:
                    self.check_failed = True
            if "flex" in self.args.methods and self.args.flex_mask == "analytic":
                self.check_block_mask(cname, causal, spec, n)
            del q, k, v, outs, ref_out, ref_lse
            self.cleanup()
            log(f"  ({self.elapsed():.0f} s elapsed; reference took {ref_s:.1f} s)")
        self.result["check_passed"] = not self.check_failed
        bad_masks = [r for r in self.result["check"] if r["method"] == "flex_block_mask" and not r["passed"]]
        if bad_masks and self.args.flex_mask == "analytic":
            log("  !! the analytic flex block mask differs from create_block_mask's: flex is timed with "
                "--flex-mask create instead")
            self.args.flex_mask = peers.FLEX_MASK_METHOD = "create"
            self.result["notes"].append("flex block mask switched to 'create' after a failed analytic check")
        if self.check_failed:
            log("  !! dilgen FAILED the correctness check: its timings below are not meaningful")
        self.save()

    def check_block_mask(self, cname, causal, spec, n):
        """flex's analytic block mask == create_block_mask's (eager) at length n."""
        torch, peers = self.torch, self.peers
        from torch.nn.attention.flex_attention import create_block_mask
        rec = {"config": cname, "causal": causal, "N": n, "method": "flex_block_mask"}
        try:
            bm_a, mask_mod, _, _ = peers.flex_block_mask(spec, n, self.device, "analytic")
            bm_c = create_block_mask(mask_mod, B=None, H=spec.num_heads, Q_LEN=n, KV_LEN=n, device=self.device)
            a_ne, a_full = peers.block_sets_of(bm_a)
            c_ne, c_full = peers.block_sets_of(bm_c)
            rec["nonempty_equal"] = bool(torch.equal(a_ne, c_ne))
            rec["full_equal"] = bool(torch.equal(a_full, c_full))
            rec["passed"] = rec["nonempty_equal"] and rec["full_equal"]
            detail = f"analytic == create_block_mask: nonempty {rec['nonempty_equal']}, full {rec['full_equal']}"
        except Exception as e:  # noqa: BLE001
            rec["error"] = short_err(e)
            rec["passed"] = False
            detail = rec["error"]
        peers.clear_caches()
        self.result["check"].append(rec)
        log(f"  {'ok  ' if rec['passed'] else 'FAIL'} {cname} causal={causal!s:5s} flex block mask {detail}")

    # ---- phases 2 and 3: timing
    def new_row(self, cname, causal):
        cfg = self.configs[cname]
        uf = self.dilgen.stats.forward_flops(cfg["ws"], cfg["rs"], cfg["H"], cfg["D"], causal, cfg["N"], cfg["B"])
        row = {"config": cname, "causal": causal, "B": cfg["B"], "H": cfg["H"], "N": cfg["N"], "D": cfg["D"],
               "segment_lengths": cfg["ws"], "dilation_rates": cfg["rs"], "useful_gflop": uf / 1e9,
               "dense_gflop": 4 * cfg["B"] * cfg["H"] * cfg["N"] ** 2 * cfg["D"] / (2 if causal else 1) / 1e9,
               "useful_tflops": None, "useful_tflops_by_method": {}, "timing_ms": {}, "errors": {},
               "rel_err_vs_dilgen": {}, "lse_max_abs_diff_vs_dilgen": {}, "lse_inf_pattern_equal_vs_dilgen": {}}
        for m in METHODS:
            row[f"{m}_ms"] = None
        row["dense_note"] = "reference point: dense attention over the whole sequence, not the same math"
        return row

    def skip_reason(self, method, cfg):
        if method not in self.args.methods:
            return "not selected (--methods)"
        if method == "dense" and cfg["N"] > self.args.dense_max_n:
            return f"skipped: N={cfg['N']} > --dense-max-n={self.args.dense_max_n} (reference point only)"
        if method == "flex" and cfg["N"] > self.args.flex_max_n:
            return f"skipped: N={cfg['N']} > --flex-max-n={self.args.flex_max_n}"
        if method == "flex" and self.elapsed() > self.args.budget_s:
            return f"skipped: time budget --budget-s={self.args.budget_s:.0f} spent ({self.elapsed():.0f} s)"
        return None

    def run_method(self, row, method, spec, q, k, v, baseline, tag, reason="check"):
        torch = self.torch
        if reason == "check":
            reason = self.skip_reason(method, self.configs[row["config"]])
        if reason:
            row["errors"][method] = reason
            log(f"{tag} {method:12s} {reason}")
            return None
        fn = self.fn_for(method, spec, q, k, v)
        kept = None
        try:
            if method == "flex":
                _, _, _, info = self.peers.flex_block_mask(spec, row["N"], q.device, self.args.flex_mask)
                row["flex_mask_method"] = info["method"]
                row["flex_mask_build_s"] = round(info["build_s"], 3)
            t = time.time()
            res = fn()
            self.sync()
            row[f"{method}_first_call_s"] = round(time.time() - t, 3)
            if method in EXACT and baseline is not None:
                out, lse = res
                row["rel_err_vs_dilgen"][method] = rel_err(torch, out, baseline[0])
                d, pat = lse_diff(torch, lse, baseline[1].double())
                row["lse_max_abs_diff_vs_dilgen"][method] = d
                row["lse_inf_pattern_equal_vs_dilgen"][method] = pat
            if method == "dilgen":
                kept = (res[0], res[1])
            del res
            pk = peak_extra_gib(torch, fn)
            row[f"{method}_peak_extra_gib"] = None if pk is None else round(pk, 4)
            times = time_ms(torch, fn, self.args.warmup, self.args.reps)
            ms = statistics.median(times)
            row[f"{method}_ms"] = ms
            row["timing_ms"][method] = {"median": ms, "min": min(times), "max": max(times), "n": len(times)}
            row["useful_tflops_by_method"][method] = row["useful_gflop"] / ms
            if method == "dense":
                row["dense_tflops"] = row["dense_gflop"] / ms
            extra = ""
            if method in row["rel_err_vs_dilgen"]:
                against = row.get("flex_checked_against", "dilgen") if method == "flex" else "dilgen"
                extra = (f"  vs {against}: rel_err {row['rel_err_vs_dilgen'][method]:.1e}, "
                         f"max|dlse| {row['lse_max_abs_diff_vs_dilgen'][method]:.1e}"
                         f"{'' if row['lse_inf_pattern_equal_vs_dilgen'][method] else ' (-inf rows differ!)'}")
            log(f"{tag} {method:12s} {ms:9.3f} ms  {row['useful_gflop'] / ms:7.1f} useful TFLOP/s  "
                f"peak +{pk if pk is None else round(pk, 2)} GiB  first call "
                f"{row[f'{method}_first_call_s']:.1f} s{extra}  [{self.elapsed():.0f} s]")
        except torch.OutOfMemoryError as e:
            row["errors"][method] = "OOM: " + short_err(e, 200)
            row[f"{method}_ms"] = None
            log(f"{tag} {method:12s} OOM ({short_err(e, 120)})")
        except Exception as e:  # noqa: BLE001
            row["errors"][method] = short_err(e)
            row[f"{method}_ms"] = None
            log(f"{tag} {method:12s} ERROR {short_err(e, 300)}")
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
        finally:
            fn = None
            self.cleanup()
        return kept

    def finish_row(self, row):
        d = row.get("dilgen_ms")
        row["useful_tflops"] = row["useful_gflop"] / d if d else None
        for m in METHODS[1:]:
            pm = row.get(f"{m}_ms")
            row[f"speedup_vs_{m}"] = (pm / d) if (pm and d) else None

    def timing(self):
        torch = self.torch
        variants = self.variants()
        rows = {}
        log(f"\n== timing: dilgen, gather_cudnn, gather_flash, dense "
            f"(median of {self.args.reps} after {self.args.warmup} warm-ups) ==")
        for i, (cname, causal) in enumerate(variants):
            cfg = self.configs[cname]
            spec = make_spec(self.dilgen, cname, causal, self.configs)
            row = rows[(cname, causal)] = self.new_row(cname, causal)
            self.result["rows"].append(row)
            tag = f"[{i + 1}/{len(variants)}] {cname} {'causal' if causal else 'full  '}"
            log(f"{tag} B={cfg['B']} H={cfg['H']} N={cfg['N']} D={cfg['D']} w={cfg['ws']} r={cfg['rs']} "
                f"useful {row['useful_gflop']:.1f} GFLOP")
            q, k, v = rand_inputs(torch, cfg["B"], cfg["N"], cfg["H"], cfg["D"], self.args.seed + i, self.device)
            base = self.run_method(row, "dilgen", spec, q, k, v, None, tag)
            for m in ("gather_cudnn", "gather_flash", "dense"):
                self.run_method(row, m, spec, q, k, v, base, tag)
            del q, k, v, base
            self.cleanup()
            self.finish_row(row)
            self.save()
        if "flex" in self.args.methods:
            log(f"\n== timing: flex (torch.compile; block mask '{self.args.flex_mask}'; "
                f"skipped after {self.args.budget_s:.0f} s) ==")
            for i, (cname, causal) in enumerate(variants):
                cfg = self.configs[cname]
                spec = make_spec(self.dilgen, cname, causal, self.configs)
                row = rows[(cname, causal)]
                tag = f"[{i + 1}/{len(variants)}] {cname} {'causal' if causal else 'full  '}"
                reason = self.skip_reason("flex", cfg)
                if reason:
                    self.run_method(row, "flex", spec, None, None, None, None, tag, reason)
                    self.finish_row(row)
                    self.save()
                    continue
                q, k, v = rand_inputs(torch, cfg["B"], cfg["N"], cfg["H"], cfg["D"], self.args.seed + 100 + i,
                                      self.device)
                base = None
                # the flex output is checked against dilgen's (else gather_cudnn's) on the same inputs
                for ref_m in ("dilgen", "gather_cudnn"):
                    if row.get(f"{ref_m}_ms") is None:
                        continue
                    try:
                        base = tuple(self.fn_for(ref_m, spec, q, k, v)())
                        row["flex_checked_against"] = ref_m
                        break
                    except Exception:  # noqa: BLE001
                        self.cleanup()
                self.run_method(row, "flex", spec, q, k, v, base, tag, None)
                if base is not None and row.get("flex_checked_against") == "gather_cudnn" \
                        and "flex" in row["rel_err_vs_dilgen"]:
                    row.setdefault("rel_err_vs_gather_cudnn", {})["flex"] = row["rel_err_vs_dilgen"].pop("flex")
                    row.setdefault("lse_max_abs_diff_vs_gather_cudnn", {})["flex"] = \
                        row["lse_max_abs_diff_vs_dilgen"].pop("flex", None)
                    row.setdefault("lse_inf_pattern_equal_vs_gather_cudnn", {})["flex"] = \
                        row["lse_inf_pattern_equal_vs_dilgen"].pop("flex", None)
                del q, k, v, base
                self.peers.clear_caches()
                self.cleanup()
                self.finish_row(row)
                self.save()
        else:
            for row in rows.values():
                row["errors"]["flex"] = "not selected (--methods)"

    # ---- output
    def table(self):
        rows = self.result["rows"]
        hdr = (f"{'cfg':3s} {'causal':6s} {'useful':>8s} | {'dilgen':>17s} | {'gather_cudnn':>17s} | "
               f"{'gather_flash':>17s} | {'flex':>17s} | {'dense (ref pt)':>17s} | peak extra GiB "
               f"(dil/cud/fla/flex/dense)")
        log("\n== results: ms (dilgen: useful TFLOP/s; peers: dilgen speedup = peer_ms / dilgen_ms) ==")
        log(hdr)
        log("-" * len(hdr))
        for r in rows:
            def cell(m):
                ms = r.get(f"{m}_ms")
                if ms is None:
                    err = r["errors"].get(m, "")
                    word = "skip" if err.startswith(("skipped", "not selected")) else ("OOM" if err.startswith("OOM") else "err")
                    return f"{word:>17s}"
                if m == "dilgen":
                    return f"{ms:8.3f} ({r['useful_gflop'] / ms:4.0f}TF)".rjust(17)
                sp = r.get(f"speedup_vs_{m}")
                return f"{ms:8.3f} ({sp:5.2f}x)".rjust(17) if sp else f"{ms:8.3f}".rjust(17)
            mem = "/".join(f"{r[f'{m}_peak_extra_gib']:.2f}" if r.get(f"{m}_peak_extra_gib") is not None else "-"
                           for m in METHODS)
            log(f"{r['config']:3s} {str(r['causal']):6s} {r['useful_gflop']:6.0f}GF | {cell('dilgen')} | "
                f"{cell('gather_cudnn')} | {cell('gather_flash')} | {cell('flex')} | {cell('dense')} | {mem}")
        log("\nfull-size cross-check of the exact peers against dilgen (relative error of out):")
        for r in rows:
            parts = [f"{m} {e:.1e}" for m, e in r["rel_err_vs_dilgen"].items() if e is not None]
            parts += [f"flex {e:.1e} (vs gather_cudnn)" for e in r.get("rel_err_vs_gather_cudnn", {}).values()]
            log(f"  {r['config']} causal={str(r['causal']):5s} " + (", ".join(parts) if parts else "-"))
        errs = [(r["config"], r["causal"], m, e) for r in rows for m, e in r["errors"].items()
                if not e.startswith(("skipped", "not selected"))]
        if errs:
            log("\nerrors:")
            for c, causal, m, e in errs:
                log(f"  {c} causal={causal} {m}: {e}")
        skipped = [(r["config"], r["causal"], m, e) for r in rows for m, e in r["errors"].items()
                   if e.startswith("skipped")]
        for c, causal, m, e in skipped:
            log(f"  {c} causal={causal} {m}: {e}")
        log("dense = plain dense SDPA over the whole sequence: a reference point, NOT the same math.")

    def plot(self):
        if self.args.no_plot:
            return
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as e:  # noqa: BLE001
            log(f"matplotlib unavailable ({short_err(e, 80)}): no plot written")
            return
        try:
            rows = self.result["rows"]
            labels = [f"{r['config']}{' causal' if r['causal'] else ''}" for r in rows]
            names = {"dilgen": "dilgen", "gather_cudnn": "gather+cuDNN", "gather_flash": "gather+FA2",
                     "flex": "FlexAttention", "dense": "dense SDPA (reference point)"}
            colors = {"dilgen": "#d62728", "gather_cudnn": "#1f77b4", "gather_flash": "#17becf",
                      "flex": "#2ca02c", "dense": "#7f7f7f"}
            fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(rows) + 3), 5))
            width = 0.8 / len(METHODS)
            for j, m in enumerate(METHODS):
                xs, ys = [], []
                for i, r in enumerate(rows):
                    if r.get(f"{m}_ms"):
                        xs.append(i + (j - (len(METHODS) - 1) / 2) * width)
                        ys.append(r[f"{m}_ms"])
                if xs:
                    ax.bar(xs, ys, width, label=names[m], color=colors[m],
                           hatch="//" if m == "dense" else None, edgecolor="white" if m != "dense" else "black")
            ax.set_yscale("log")
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(labels)
            ax.set_ylabel("forward time, ms (log scale; lower is better)")
            ax.set_title(f"dilated attention forward, bf16 — {self.result['device']}, torch {self.result['torch']}, "
                         f"{self.date}", fontsize=10)
            ax.legend(fontsize=8)
            ax.grid(axis="y", which="both", alpha=0.3)
            fig.tight_layout()
            fig.savefig(self.png_path, dpi=120)
            plt.close(fig)
            log(f"plot: {self.png_path}")
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {short_err(e)}")


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO))
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    if not torch.cuda.is_available() and not args.dry_run_cpu:
        log("bench_forward.py needs a CUDA GPU (torch.cuda.is_available() is False); "
            "--dry-run-cpu exercises the flow on the CPU at toy sizes.")
        return 2
    bench = Bench(args)
    r = bench.result
    log(f"device {r['device']}  torch {r['torch']}  triton {r['triton']}  cuDNN {r['cudnn']}  "
        f"python {r['python']}  date {r['date']}")
    log(f"configs {args.configs}  variants {len(bench.variants())}  methods {args.methods}  "
        f"warmup {args.warmup} reps {args.reps}  out {bench.out_dir}")
    if not args.no_check:
        bench.check()
    bench.timing()
    bench.result["check_passed"] = not bench.check_failed if not args.no_check else None
    bench.save()
    bench.table()
    bench.plot()
    log(f"json: {bench.json_path}   total {bench.elapsed():.0f} s")
    return 1 if bench.check_failed else 0


if __name__ == "__main__":
    sys.exit(main())
