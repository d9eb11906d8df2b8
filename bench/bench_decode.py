#!/usr/bin/env python3
"""Decode benchmark (issue 15): one new token per item against a KV cache, dilgen's
kernel.decode against its peers on the same inputs, bf16, one GPU, one process.

Spec: LongNet's five branches, causal, H 32, H_kv 8, D 128, w [2048, 4096, 8192, 16384,
32768], r [1, 2, 4, 8, 16]. Grid: batch 1, 8, 64 x context 16K, 128K, 1M (the new token is
the context's last position; every item at the same length). Methods:

  dilgen       kernel.decode(q, k_cache, v_cache, cache_seqlens, validate=False): the split
               kernel over the kept rows + one combine (two launches), no host sync
  dense        dense decoding over the whole cache: scaled_dot_product_attention of the
               new query against every valid row (the G query heads of a kv head as G
               query rows, so the cache is read once); not the same math, the cost of
               reading everything
  gather_sdpa  the exact peer: build the kept set of every (item, head) from
               cache_seqlens (torch ops), gather those keys and values, then SDPA with a
               validity mask (heads that keep the query in no branch give 0)

us_per_step: median of CUDA-event times (toolkit.time_ms, back to back). GB_per_s: bytes of
the kept rows (the rows some head of a kv group keeps for the new token, K and V, per
branch: what an exact method must read) divided by the time, the same figure for every
method. The copy bandwidth of the GPU (device-to-device copy of 4 GiB, (read + write) /
time) is measured in the same run. Before timing: dilgen against the float64 reference
(a scaled-down spec with the same rates, items at different lengths) and against
gather_sdpa at full size.

Sweeps for tuning (--sweep): split (kept keys per program) and the decode tile (block,
warps, stages) at a few points; rows with method "dilgen_split=<s>" / "dilgen_tile=...".

  python bench/bench_decode.py                      # the grid above, JSON + PNG in bench/results
  python bench/bench_decode.py --sweep --out /tmp/x
  python bench/bench_decode.py --dry-run-cpu --out /tmp/x    # toy sizes, interpreter
"""
from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402
from toolkit import log  # noqa: E402

METHODS = ("dilgen", "dense", "gather_sdpa")
EXTRA = ("dilgen_graph",)          # measured beside METHODS on a GPU
GPU = dict(H=32, Hkv=8, D=128, ws=[2048, 4096, 8192, 16384, 32768], rs=[1, 2, 4, 8, 16],
           batches=[1, 8, 16, 64], contexts=[16384, 131072, 1048576], dtype="bfloat16")
DRY = dict(H=4, Hkv=2, D=16, ws=[16, 32, 64, 128, 256], rs=[1, 2, 4, 8, 16],
           batches=[1, 2], contexts=[64, 512], dtype="float32")
TOL = {"bfloat16": 2e-2, "float32": 1e-4}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,16,64: 16 is the largest batch whose 1M cache fits an H200)")
    ap.add_argument("--contexts", default=None, help="comma list (default 16384,131072,1048576)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--mem-frac", type=float, default=0.85,
                    help="skip a (batch, context, method) whose tensors exceed this fraction of GPU memory")
    ap.add_argument("--sweep", action="store_true", help="also sweep dilgen's split and tile")
    ap.add_argument("--split", type=int, default=None, help="force dilgen's split (default: the runtime's)")
    ap.add_argument("--tile", default=None, help="dilgen decode tile block,split,warps,stages (tuning)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop sweeps after this many seconds")
    ap.add_argument("--out", default=str(tk.RESULTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run-cpu", action="store_true")
    ap.add_argument("--report-from", metavar="JSON", help="only print the table and draw the plot of "
                                                          "an earlier run's JSON (no GPU needed)")
    a = ap.parse_args(argv)
    cfg = DRY if a.dry_run_cpu else GPU
    a.batches = [int(x) for x in a.batches.split(",")] if a.batches else cfg["batches"]
    a.contexts = [int(x) for x in a.contexts.split(",")] if a.contexts else cfg["contexts"]
    a.methods = [m for m in a.methods.split(",") if m]
    a.tile = tuple(int(x) for x in a.tile.split(",")) if a.tile else None
    return a, cfg


class Bench:
    def __init__(self, a, cfg):
        import torch
        import dilgen
        import dilgen.compiler  # noqa: F401  (Kernel with a tuning)
        self.torch, self.dilgen, self.a, self.cfg = torch, dilgen, a, cfg
        self.dev = torch.device("cpu" if a.dry_run_cpu else "cuda")
        self.dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg["dtype"]]
        self.t0 = time.time()
        self.spec = dilgen.Spec(name="bench_decode", num_heads=cfg["H"], num_kv_heads=cfg["Hkv"],
                                head_dim=cfg["D"], dtype=cfg["dtype"], segment_lengths=cfg["ws"],
                                dilation_rates=cfg["rs"], causal=True)
        tuning = {"decode": a.tile} if a.tile else None
        self.kernel = dilgen.compiler.Kernel(self.spec, tuning=tuning)
        head = tk.header(self.dev, a.dry_run_cpu, {
            "bench": "bench/bench_decode.py", "args": sys.argv[1:],
            "spec": self.spec.to_json(),
            "definitions": {
                "us_per_step": "median CUDA-event time of one decode step (one new token per item), "
                               "microseconds",
                "kept_bytes": "K and V bytes of the rows some query head of a kv group keeps for the "
                              "new token, summed over branches (a row kept by two branches counts "
                              "twice): what dilgen reads; the same figure for every method",
                "GB_per_s": "kept_bytes / time (1e9 bytes)",
                "copy_GB_per_s": "device-to-device copy of 4 GiB: (read + write bytes) / time",
                "dense": "SDPA of the new query against every valid cache row (the cost of reading "
                         "the whole cache; not the same math)",
                "gather_sdpa": "kept keys gathered per (item, head) with torch indexing, then SDPA "
                               "with a validity mask (exact)"}})
        name = f"decode-{datetime.date.today().isoformat()}-" + (
            "cpu-dryrun" if a.dry_run_cpu else ("h200" if "H200" in head.get("device", "") else "gpu"))
        self.res = tk.Results(Path(a.out) / f"{name}.json", head, key=("batch", "context", "method"))
        self.res.data["check"] = []
        self.res.data["skipped"] = []
        self.check_failed = False

    def elapsed(self):
        return time.time() - self.t0

    # ------------------------------------------------------------------ inputs
    def cache(self, B, N, seed):
        torch = self.torch
        g = torch.Generator(device=self.dev).manual_seed(seed)
        shape = (B, N, self.cfg["Hkv"], self.cfg["D"])
        k = torch.empty(shape, dtype=self.dtype, device=self.dev).normal_(generator=g)
        v = torch.empty(shape, dtype=self.dtype, device=self.dev).normal_(generator=g)
        q = torch.randn(B, 1, self.cfg["H"], self.cfg["D"], dtype=self.dtype, device=self.dev, generator=g)
        return q, k, v

    def kept_bytes(self, lens) -> int:
        """K + V bytes of the kept rows per branch (rows some head of a kv group keeps)."""
        H, Hkv, D = self.cfg["H"], self.cfg["Hkv"], self.cfg["D"]
        G = H // Hkv
        item = 2 if self.dtype == self.torch.bfloat16 else 4
        rows = 0
        for n in lens:
            P = n - 1
            for w, r in zip(self.cfg["ws"], self.cfg["rs"]):
                x_q = P - (P // w) * w
                kvs = sum(1 for kvh in range(Hkv) if any((kvh * G + g) % r == x_q % r for g in range(G)))
                rows += kvs * (x_q // r + 1)
        return rows * 2 * D * item

    # ------------------------------------------------------------------ methods
    def fn(self, method, q, k, v, seqlens, split=None, kernel=None):
        torch = self.torch
        F = torch.nn.functional
        kernel = kernel or self.kernel
        if method == "dilgen":
            att = kernel.compiled_for(q.device).attention
            from dilgen.runtime.decode import decode
            split = split or self.a.split
            return lambda: decode(att, q, k, v, seqlens, validate=False, split=split)
        if method == "dilgen_graph":
            # the same call captured in a CUDA graph and replayed: the device time of a step
            # without the host's launch work (how a serving loop runs decode)
            step = self.fn("dilgen", q, k, v, seqlens, split=split, kernel=kernel)
            torch = self.torch
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            return graph.replay
        if method == "dense":
            B, T, H, D = q.shape
            Hkv = k.shape[2]
            N = int(seqlens.max())
            qd = q.view(B, Hkv, H // Hkv, D)               # T = 1: the G heads of a kv head as query rows
            kd, vd = k[:, :N].transpose(1, 2), v[:, :N].transpose(1, 2)
            return lambda: F.scaled_dot_product_attention(qd, kd, vd).view(B, 1, H, D)
        if method == "gather_sdpa":
            return self.gather_fn(q, k, v, seqlens)
        raise ValueError(method)

    def gather_fn(self, q, k, v, seqlens):
        """Build the kept set of every (item, head) from cache_seqlens, gather, SDPA."""
        torch = self.torch
        F = torch.nn.functional
        B, T, H, D = q.shape
        Hkv = k.shape[2]
        G = H // Hkv
        dev = q.device
        heads = torch.arange(H, device=dev)
        kvh = (heads // G)[None, :, None]
        items = torch.arange(B, device=dev)[:, None, None]
        lanes = [torch.arange(-(-w // r), device=dev) for w, r in zip(self.cfg["ws"], self.cfg["rs"])]

        def step():
            P = (seqlens.long() - 1)[:, None, None]                   # (B, 1, 1)
            idx, ok = [], []
            for (w, r), j in zip(zip(self.cfg["ws"], self.cfg["rs"]), lanes):
                seg = (P // w) * w
                x_q = P - seg
                res = x_q % r
                keep = (heads[None, :, None] % r) == res              # (B, H, 1)
                pos = seg + res + r * j[None, None, :]                # (B, 1, K_i)
                idx.append(pos.expand(B, H, -1))
                ok.append(keep & (pos <= P))
            idx = torch.cat(idx, -1).clamp_max(k.shape[1] - 1)
            ok = torch.cat(ok, -1)                                    # (B, H, K)
            kg = k[items, idx, kvh]                                   # (B, H, K, D)
            vg = v[items, idx, kvh]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), kg, vg, attn_mask=ok[:, :, None, :])
            out = torch.where(ok.any(-1)[:, :, None, None], out, 0.0)   # heads no branch keeps: 0
            return out.transpose(1, 2)
        return step

    # ------------------------------------------------------------------ 1. checks
    def check(self):
        torch, dilgen = self.torch, self.dilgen
        from dilgen.reference import reference_attention
        log("\n== correctness ==")
        small = dict(self.cfg)
        ws = [max(8, w // 32) for w in self.cfg["ws"]] if not self.a.dry_run_cpu else self.cfg["ws"]
        spec = self.spec.replace(name="bench_decode_small", segment_lengths=ws)
        kernel = dilgen.compiler.Kernel(spec)
        lens = [min(1500, 2 * ws[-1]) - 37, min(1500, 2 * ws[-1])] if not self.a.dry_run_cpu else [200, 157]
        n_max = max(lens)
        q, k, v = self.cache(len(lens), n_max, 123)
        full_q = torch.randn(len(lens), n_max, small["H"], small["D"], dtype=self.dtype, device=self.dev)
        for b, n in enumerate(lens):
            full_q[b, n - 1] = q[b, 0]
        sl = torch.tensor(lens, dtype=torch.int32, device=self.dev)
        rec = {"method": "dilgen", "against": "float64 reference", "segment_lengths": ws, "lens": lens}
        try:
            with torch.no_grad():
                out, lse = kernel.decode(q, k, v, sl, return_lse=True)
            errs = []
            for b, n in enumerate(lens):
                ref, ref_lse = reference_attention(full_q[b:b + 1, :n].cpu(), k[b:b + 1, :n].cpu(),
                                                   v[b:b + 1, :n].cpu(), spec, return_lse=True)
                errs.append(tk.rel_err(out[b, 0].cpu(), ref[0, n - 1]))
                d, pat = tk.lse_diff(lse[b, :, 0].cpu(), ref_lse[0, :, n - 1])
                errs.append(d if pat else math.inf)
            rec["max_err"] = max(errs)
            rec["passed"] = rec["max_err"] < TOL[self.cfg["dtype"]]
        except Exception as e:  # noqa: BLE001
            rec.update(error=tk.short_err(e), passed=False)
        self.record_check(rec)
        # full size: dilgen against the exact peer
        ctx = 40000 if not self.a.dry_run_cpu else 300
        q, k, v = self.cache(2, ctx, 7)
        sl = torch.tensor([ctx - 4321 if ctx > 5000 else ctx - 43, ctx], dtype=torch.int32, device=self.dev)
        rec = {"method": "dilgen", "against": "gather_sdpa", "context": ctx, "lens": sl.tolist()}
        try:
            with torch.no_grad():
                a = self.fn("dilgen", q, k, v, sl)()
                b = self.fn("gather_sdpa", q, k, v, sl)()
            rec["rel_err"] = tk.rel_err(a.float(), b.float())
            rec["passed"] = rec["rel_err"] < TOL[self.cfg["dtype"]]
        except Exception as e:  # noqa: BLE001
            rec.update(error=tk.short_err(e), passed=False)
        self.record_check(rec)
        del q, k, v
        tk.cleanup(self.dev)
        self.res.data["check_passed"] = not self.check_failed

    def record_check(self, rec):
        self.res.data["check"].append(rec)
        if not rec["passed"]:
            self.check_failed = True
        log(f"  {'ok  ' if rec['passed'] else 'FAIL'} dilgen vs {rec['against']}: "
            + (rec.get("error") or f"{rec.get('max_err', rec.get('rel_err')):.2e}"))
        self.res.save()

    # ------------------------------------------------------------------ 2. copy bandwidth
    def copy_bandwidth(self):
        torch = self.torch
        n = (4 << 30) if not self.a.dry_run_cpu else (64 << 20)
        src = torch.empty(n, dtype=torch.uint8, device=self.dev)
        dst = torch.empty_like(src)
        t = tk.time_ms(lambda: dst.copy_(src), 3, 10, self.dev)
        bw = 2 * n / (t["median"] * 1e-3) / 1e9
        self.res.data["copy_GB_per_s"] = bw
        self.res.data["copy_timing_ms"] = t
        log(f"copy bandwidth: {bw:.0f} GB/s (read + write of {n >> 20} MiB, {t['median']:.3f} ms)")
        del src, dst
        tk.cleanup(self.dev)

    # ------------------------------------------------------------------ 3. timing
    def fits(self, nbytes):
        if self.dev.type != "cuda":
            return True
        return nbytes <= self.a.mem_frac * self.torch.cuda.get_device_properties(self.dev).total_memory

    def time_row(self, B, ctx, method, q, k, v, sl, kept, **kw):
        torch = self.torch
        row = {"batch": B, "context": ctx, "method": method, "kept_bytes": kept}
        try:
            with torch.no_grad():
                base = method.split("=")[0].replace("_split", "").replace("_tile", "")
                fn = self.fn(base, q, k, v, sl, **kw)
                fn()
                t = tk.time_ms(fn, self.a.warmup, self.a.reps, self.dev)
            row.update(us_per_step=1e3 * t["median"], GB_per_s=kept / (t["median"] * 1e-3) / 1e9,
                       timing_ms=t)
            if method.startswith("dilgen"):
                from dilgen.runtime.decode import choose_split
                att = (kw.get("kernel") or self.kernel).compiled_for(q.device).attention
                row["split"] = kw.get("split") or self.a.split or choose_split(
                    att.decode_kernels["config"], B * self.cfg["Hkv"], q.device)
                row["tile"] = att.plan["config"]["decode"]
            cb = self.res.data.get("copy_GB_per_s")
            if cb:
                row["fraction_of_copy_bw"] = row["GB_per_s"] / cb
        except Exception as e:  # noqa: BLE001
            row["error"] = tk.short_err(e)
            tk.cleanup(self.dev)
        self.res.add(row)
        log(f"  B={B:3d} ctx={ctx:8d} {method:28s} "
            + (f"{row['us_per_step']:9.1f} us  {row['GB_per_s']:7.0f} GB/s" if "us_per_step" in row
               else row.get("error", "")))
        return row

    def timing(self):
        torch = self.torch
        a = self.a
        H, Hkv, D = self.cfg["H"], self.cfg["Hkv"], self.cfg["D"]
        item = 2 if self.dtype == torch.bfloat16 else 4
        log("\n== timing ==")
        for ctx in a.contexts:
            for B in a.batches:
                cache_bytes = 2 * B * ctx * Hkv * D * item
                if not self.fits(cache_bytes):
                    msg = (f"cache does not fit: B={B} x {ctx} tokens x K,V = {cache_bytes / 2**30:.0f} GiB "
                           f"(> {a.mem_frac:.0%} of GPU memory)")
                    for m in a.methods:
                        self.res.data["skipped"].append({"batch": B, "context": ctx, "method": m, "reason": msg})
                    log(f"  B={B:3d} ctx={ctx:8d} skipped: {msg}")
                    self.res.save()
                    continue
                q, k, v = self.cache(B, ctx, a.seed + B + ctx)
                sl = torch.full((B,), ctx, dtype=torch.int32, device=self.dev)
                kept = self.kept_bytes([ctx] * B)
                for m in a.methods:
                    extra = 0
                    if m == "gather_sdpa":
                        K = sum(-(-w // r) for w, r in zip(self.cfg["ws"], self.cfg["rs"]))
                        extra = 3 * B * H * K * D * item + B * H * K * 9
                    if m == "dense":
                        extra = B * H * D * 4
                    if not self.fits(cache_bytes + extra):
                        msg = f"{m} needs {(cache_bytes + extra) / 2**30:.0f} GiB with the cache"
                        self.res.data["skipped"].append({"batch": B, "context": ctx, "method": m, "reason": msg})
                        log(f"  B={B:3d} ctx={ctx:8d} {m}: skipped: {msg}")
                        continue
                    self.time_row(B, ctx, m, q, k, v, sl, kept)
                if "dilgen" in a.methods and self.dev.type == "cuda":
                    self.time_row(B, ctx, "dilgen_graph", q, k, v, sl, kept)
                    if a.sweep and self.elapsed() < a.budget_s:
                        for split in (256, 512, 1024, 2048, 4096):
                            self.time_row(B, ctx, f"dilgen_graph_split={split}", q, k, v, sl, kept, split=split)
                if a.sweep and self.elapsed() < a.budget_s and "dilgen" in a.methods:
                    for split in (512, 2048):
                        self.time_row(B, ctx, f"dilgen_split={split}", q, k, v, sl, kept, split=split)
                    if (B, ctx) in ((64, 131072),):
                        for tile in ((64, 2048, 4, 3), (32, 2048, 4, 3), (32, 2048, 2, 3), (64, 2048, 4, 2)):
                            if self.elapsed() > a.budget_s:
                                break
                            kern = self.dilgen.compiler.Kernel(self.spec, tuning={"decode": tile})
                            self.time_row(B, ctx, f"dilgen_tile={','.join(map(str, tile))}", q, k, v, sl,
                                          kept, kernel=kern)
                del q, k, v
                tk.cleanup(self.dev)

    # ------------------------------------------------------------------ output
    def report(self):
        shown = METHODS + EXTRA
        rows = [r for r in self.res.all_rows() if r["method"] in shown and "us_per_step" in r]
        by = {(r["batch"], r["context"], r["method"]): r for r in rows}
        table = []
        for B in self.a.batches:
            for ctx in self.a.contexts:
                get = lambda m, f="us_per_step", spec=".1f": tk.fmt((by.get((B, ctx, m)) or {}).get(f), spec)  # noqa: E731
                d, dg, dn = (by.get((B, ctx, m)) for m in ("dilgen", "dilgen_graph", "dense"))
                table.append([B, ctx, get("dilgen"), get("dilgen_graph"), get("dense"), get("gather_sdpa"),
                              get("dilgen", "GB_per_s", ".0f"), get("dilgen_graph", "GB_per_s", ".0f"),
                              get("dilgen_graph", "fraction_of_copy_bw", ".2f"),
                              tk.fmt(dn["us_per_step"] / d["us_per_step"], ".1f") if d and dn else "—"])
        log(f"\n== decode, us per step ({self.res.data['device']}) ==")
        log(tk.markdown_table(["batch", "context", "dilgen us", "dilgen (CUDA graph) us", "dense us",
                               "gather_sdpa us", "dilgen GB/s", "graph GB/s", "graph / copy BW",
                               "dense / dilgen"], table))
        summary = {}
        for m in ("dilgen", "dilgen_graph"):
            for B in self.a.batches:
                pts = sorted((r["context"], r["us_per_step"]) for r in rows if r["method"] == m and r["batch"] == B)
                if len(pts) > 1:
                    summary[f"{m}_batch{B}_us_{pts[-1][0]}_over_{pts[0][0]}"] = pts[-1][1] / pts[0][1]
        for B in self.a.batches:
            d, dn = by.get((B, max(self.a.contexts), "dilgen")), by.get((B, max(self.a.contexts), "dense"))
            if d and dn:
                summary[f"dense_over_dilgen_batch{B}_{max(self.a.contexts)}"] = dn["us_per_step"] / d["us_per_step"]
        self.res.data["summary"] = summary
        self.res.save()
        log(f"summary: {summary}")
        if self.a.no_plot:
            return
        plt = tk.pyplot()
        if plt is None or not rows:
            return
        fig, ax = plt.subplots(figsize=(8, 5))
        styles = {"dilgen": ("#d62728", "o"), "dilgen_graph": ("#ff7f0e", "^"), "dense": ("#7f7f7f", "x"),
                  "gather_sdpa": ("#1f77b4", "s")}
        dashes = {b: ls for b, ls in zip(self.a.batches, ("-", "--", ":", "-."))}
        for m in shown:
            for B in self.a.batches:
                pts = sorted((r["context"], r["us_per_step"]) for r in rows if r["method"] == m and r["batch"] == B)
                if pts:
                    c, mk = styles[m]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c, marker=mk,
                            linestyle=dashes[B], label=f"{m}, batch {B}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens in the cache)")
        ax.set_ylabel("us per decode step (log)")
        d = self.res.data
        ax.set_title(f"decode latency vs context, bf16 H32/8 D128, w 2K..32K r 1..16\n{d['device']}, "
                     f"torch {d['torch']}, triton {d['triton']}, {d['date']}", fontsize=9)
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=3)
        fig.tight_layout()
        path = self.res.path.with_suffix(".png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        log(f"plot: {path}")


def main(argv=None):
    a, cfg = parse_args(argv)
    tk.setup_paths()
    warnings.filterwarnings("ignore")
    if a.report_from:
        import json
        b = Bench.__new__(Bench)
        b.a = a
        b.res = tk.Results(a.report_from, json.load(open(a.report_from)), key=("batch", "context", "method"),
                           append=True)
        a.batches = sorted({r["batch"] for r in b.res.all_rows()})
        a.contexts = sorted({r["context"] for r in b.res.all_rows()})
        b.report()
        return 0
    import torch
    if not torch.cuda.is_available() and not a.dry_run_cpu:
        log("bench_decode.py needs a CUDA GPU; --dry-run-cpu runs the flow on the CPU at toy sizes.")
        return 2
    b = Bench(a, cfg)
    d = b.res.data
    log(f"device {d['device']}  torch {d['torch']}  triton {d['triton']}  date {d['date']}  json {b.res.path}")
    b.check()
    b.copy_bandwidth()
    b.timing()
    b.report()
    log(f"json: {b.res.path}   total {b.elapsed():.0f} s")
    return 1 if b.check_failed else 0


if __name__ == "__main__":
    sys.exit(main())
