#!/usr/bin/env python3
"""Decode benchmark (issue 15): one new token per item against a KV cache, bf16, one GPU;
LongNet's five branches (w 2K .. 32K, r 1 .. 16), causal, H 32, H_kv 8, D 128; batch 1, 8,
16, 64 x context 16K, 128K, 1M. Methods: dilgen (kernel.decode; dilgen_graph: replayed from a
CUDA graph), dense (SDPA over the whole cache: the cost of reading it, not the same math),
gather_sdpa (the exact peer: the kept keys gathered, SDPA with a validity mask). us_per_step
(CUDA-event median) and GB_per_s of the kept K, V rows beside the device's copy rate. Checked
first: dilgen against the float64 reference (a scaled-down spec) and gather_sdpa at full size.

  python bench/bench_decode.py                      # the grid above, JSON + PNG in bench/results
"""
from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402

METHODS = ("dilgen", "dense", "gather_sdpa")
SHOWN = METHODS + ("dilgen_graph",)          # dilgen_graph: beside METHODS on a GPU
GPU = dict(H=32, Hkv=8, D=128, ws=[2048, 4096, 8192, 16384, 32768], rs=[1, 2, 4, 8, 16],
           batches=[1, 8, 16, 64], contexts=[16384, 131072, 1048576], dtype="bfloat16")
DRY = dict(H=4, Hkv=2, D=16, ws=[16, 32, 64, 128, 256], rs=[1, 2, 4, 8, 16], batches=[1, 2], contexts=[64, 512],
           dtype="float32")
TOL = {"bfloat16": 2e-2, "float32": 1e-4}


def parse_args(argv=None):
    ap = tk.parser(__doc__, "warmup", "reps", "out", "seed", "no_plot", "dry_run_cpu", methods=METHODS,
                   warmup=dict(default=20, help="warm-up calls (default 20)"),
                   reps=dict(default=50, help="timed calls, median taken (default 50)"))
    add = ap.add_argument
    add("--batches", default=None, help="comma list (default 1,8,16,64: 16 is the largest batch whose 1M cache "
        "fits an H200)")
    add("--contexts", default=None, help="comma list (default 16384,131072,1048576)")
    add("--mem-frac", type=float, default=0.85,
        help="skip a (batch, context, method) whose tensors exceed this fraction of GPU memory")
    add("--split", type=int, default=None, help="force dilgen's split (default: the runtime's)")
    add("--tile", default=None, help="dilgen decode tile block,split,warps,stages (tuning)")
    a = ap.parse_args(argv)
    cfg = DRY if a.dry_run_cpu else GPU
    a.batches = [int(x) for x in a.batches.split(",")] if a.batches else cfg["batches"]
    a.contexts = [int(x) for x in a.contexts.split(",")] if a.contexts else cfg["contexts"]
    a.methods = tk.pick(a.methods, METHODS)
    a.tile = tuple(int(x) for x in a.tile.split(",")) if a.tile else None
    return a, cfg


class Bench:
    def __init__(self, a, cfg):
        import torch
        import dilgen
        import dilgen.compiler  # noqa: F401  (Kernel with a tuning)
        self.torch, self.dilgen, self.a, self.cfg, self.t0 = torch, dilgen, a, cfg, time.time()
        self.dev = torch.device("cpu" if a.dry_run_cpu else "cuda")
        self.dtype = getattr(torch, cfg["dtype"])
        self.spec = dilgen.Spec(name="bench_decode", num_heads=cfg["H"], num_kv_heads=cfg["Hkv"], head_dim=cfg["D"],
                                dtype=cfg["dtype"], segment_lengths=cfg["ws"], dilation_rates=cfg["rs"], causal=True)
        self.kernel = dilgen.compiler.Kernel(self.spec, tuning={"decode": a.tile} if a.tile else None)
        head = tk.header(self.dev, a.dry_run_cpu, {
            "bench": "bench/bench_decode.py", "args": sys.argv[1:], "spec": self.spec.to_json(),
            "definitions": {
                "us_per_step": "median CUDA-event time of one decode step (one new token per item), microseconds",
                "kept_bytes": "K and V bytes of the rows some query head of a kv group keeps for the new token, "
                              "summed over branches (a row kept by two counts twice): what dilgen reads; the same "
                              "figure for every method",
                "GB_per_s": "kept_bytes / time (1e9 bytes)",
                "copy_GB_per_s": "device-to-device copy of 4 GiB: (read + write bytes) / time",
                "dense": "SDPA of the new query against every valid cache row (the cost of reading the whole "
                         "cache; not the same math)",
                "gather_sdpa": "kept keys gathered per (item, head) with torch indexing, then SDPA with a "
                               "validity mask (exact)"}})
        self.res = tk.Results(tk.result_path(a.out, "decode", a.dry_run_cpu, tag=None if a.dry_run_cpu else
                                             tk.gpu_tag(head["device"])), head, key=("batch", "context", "method"))
        self.res.data.update(check=[], skipped=[])
        self.check_failed = False

    def cache(self, B, N, seed):
        torch, c = self.torch, self.cfg
        g = torch.Generator(device=self.dev).manual_seed(seed)
        k, v = (torch.empty((B, N, c["Hkv"], c["D"]), dtype=self.dtype, device=self.dev).normal_(generator=g)
                for _ in range(2))
        return torch.randn(B, 1, c["H"], c["D"], dtype=self.dtype, device=self.dev, generator=g), k, v

    def kept_bytes(self, lens) -> int:
        """K + V bytes of the kept rows per branch (rows some head of a kv group keeps)."""
        H, Hkv, D = self.cfg["H"], self.cfg["Hkv"], self.cfg["D"]
        G, rows = H // Hkv, 0
        for n in lens:
            for w, r in zip(self.cfg["ws"], self.cfg["rs"]):
                x_q = (n - 1) % w
                rows += sum(any((kvh * G + g) % r == x_q % r for g in range(G)) for kvh in range(Hkv)) * (x_q // r + 1)
        return rows * 2 * D * self.dtype.itemsize

    def fn(self, method, q, k, v, seqlens):
        torch, F = self.torch, self.torch.nn.functional
        if method == "dilgen":
            from dilgen.runtime.decode import decode
            att = self.kernel.compiled_for(q.device).attention
            return lambda: decode(att, q, k, v, seqlens, validate=False, split=self.a.split)
        if method == "dilgen_graph":          # without the host's launch work
            step = self.fn("dilgen", q, k, v, seqlens)
            for _ in range(3):
                step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):         # synchronises first
                step()
            return graph.replay
        (B, _, H, D), Hkv = q.shape, k.shape[2]
        if method == "dense":
            N = int(seqlens.max())
            qd, kd, vd = q.view(B, Hkv, H // Hkv, D), k[:, :N].transpose(1, 2), v[:, :N].transpose(1, 2)
            return lambda: F.scaled_dot_product_attention(qd, kd, vd).view(B, 1, H, D)
        heads = torch.arange(H, device=q.device)            # gather_sdpa
        kvh, items = (heads // (H // Hkv))[None, :, None], torch.arange(B, device=q.device)[:, None, None]
        lanes = [torch.arange(-(-w // r), device=q.device) for w, r in zip(self.cfg["ws"], self.cfg["rs"])]

        def step():
            P, idx, ok = (seqlens.long() - 1)[:, None, None], [], []
            for (w, r), j in zip(zip(self.cfg["ws"], self.cfg["rs"]), lanes):
                seg, res = (P // w) * w, P % w % r
                pos = seg + res + r * j[None, None, :]                # (B, 1, K_i)
                idx.append(pos.expand(B, H, -1))
                ok.append(((heads[None, :, None] % r) == res) & (pos <= P))
            idx, ok = torch.cat(idx, -1).clamp_max(k.shape[1] - 1), torch.cat(ok, -1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k[items, idx, kvh], v[items, idx, kvh],
                                                 attn_mask=ok[:, :, None, :])
            return torch.where(ok.any(-1)[:, :, None, None], out, 0.0).transpose(1, 2)   # no branch keeps: 0
        return step

    def check(self):
        """dilgen against the float64 reference (a scaled-down spec), then against gather_sdpa."""
        torch, dry = self.torch, self.a.dry_run_cpu
        from dilgen.reference import reference_attention
        tk.log("\n== correctness ==")
        ws = self.cfg["ws"] if dry else [max(8, w // 32) for w in self.cfg["ws"]]
        spec = self.spec.replace(name="bench_decode_small", segment_lengths=ws)
        lens = [200, 157] if dry else [min(1500, 2 * ws[-1]) - 37, min(1500, 2 * ws[-1])]
        q, k, v = self.cache(len(lens), max(lens), 123)
        full_q = torch.randn(len(lens), max(lens), self.cfg["H"], self.cfg["D"], dtype=self.dtype, device=self.dev)
        for b, n in enumerate(lens):
            full_q[b, n - 1] = q[b, 0]

        def against_reference():
            sl = torch.tensor(lens, dtype=torch.int32, device=self.dev)
            out, lse = self.dilgen.compiler.Kernel(spec).decode(q, k, v, sl, return_lse=True)
            errs = []
            for b, n in enumerate(lens):
                ref, ref_lse = reference_attention(*(t[b:b + 1, :n].cpu() for t in (full_q, k, v)), spec,
                                                   return_lse=True)
                d, pat = tk.lse_diff(lse[b, :, 0].cpu(), ref_lse[0, :, n - 1])
                errs += [tk.rel_err(out[b, 0].cpu(), ref[0, n - 1]), d if pat else math.inf]
            return {"max_err": max(errs)}
        self.record_check({"method": "dilgen", "against": "float64 reference", "segment_lengths": ws, "lens": lens},
                          against_reference)
        ctx = 300 if dry else 40000                 # full size: dilgen against the exact peer
        q, k, v = self.cache(2, ctx, 7)
        sl = torch.tensor([ctx - 43 if dry else ctx - 4321, ctx], dtype=torch.int32, device=self.dev)
        self.record_check({"method": "dilgen", "against": "gather_sdpa", "context": ctx, "lens": sl.tolist()},
                          lambda: {"rel_err": tk.rel_err(self.fn("dilgen", q, k, v, sl)().float(),
                                                         self.fn("gather_sdpa", q, k, v, sl)().float())})
        q = k = v = full_q = None
        tk.cleanup(self.dev)
        self.res.data["check_passed"] = not self.check_failed

    def record_check(self, rec, measure):
        """rec + measure()'s {name: error}, passed when each is under TOL (or the exception); logged."""
        with tk.failsoft(rec, passed=False), self.torch.no_grad():
            rec.update(errs := measure())
            rec["passed"] = max(errs.values()) < TOL[self.cfg["dtype"]]
        self.res.data["check"].append(rec)
        self.check_failed |= not rec["passed"]
        tk.log(f"  {'ok  ' if rec['passed'] else 'FAIL'} dilgen vs {rec['against']}: "
               + (rec.get("error") or f"{max(errs.values()):.2e}"))
        self.res.save()

    def copy_bandwidth(self):
        n = (64 << 20) if self.a.dry_run_cpu else (4 << 30)
        src, dst = (self.torch.empty(n, dtype=self.torch.uint8, device=self.dev) for _ in range(2))
        t = tk.time_ms(lambda: dst.copy_(src), 3, 10, self.dev)
        bw = self.res.data["copy_GB_per_s"] = 2 * n / (t["median"] * 1e-3) / 1e9
        self.res.data["copy_timing_ms"] = t
        tk.log(f"copy bandwidth: {bw:.0f} GB/s (read + write of {n >> 20} MiB, {t['median']:.3f} ms)")
        src = dst = None
        tk.cleanup(self.dev)

    def fits(self, nbytes):
        return self.dev.type != "cuda" or \
            nbytes <= self.a.mem_frac * self.torch.cuda.get_device_properties(self.dev).total_memory

    def skip(self, B, ctx, methods, msg):
        self.res.data["skipped"] += [{"batch": B, "context": ctx, "method": m, "reason": msg} for m in methods]
        tk.log(f"  B={B:3d} ctx={ctx:8d} {methods[0] + ': ' if len(methods) == 1 else ''}skipped: {msg}")
        self.res.save()

    def time_row(self, B, ctx, method, q, k, v, sl, kept):
        row = {"batch": B, "context": ctx, "method": method, "kept_bytes": kept}
        with tk.failsoft(row), self.torch.no_grad():
            fn = self.fn(method, q, k, v, sl)
            fn()
            t = tk.time_ms(fn, self.a.warmup, self.a.reps, self.dev)
            row.update(us_per_step=1e3 * t["median"], GB_per_s=kept / (t["median"] * 1e-3) / 1e9, timing_ms=t)
            if method.startswith("dilgen"):
                from dilgen.runtime.decode import choose_split
                att = self.kernel.compiled_for(q.device).attention
                row["split"] = self.a.split or choose_split(
                    att.decode_kernels["config"], B * self.cfg["Hkv"], q.device)
                row["tile"] = att.plan["config"]["decode"]
            if self.res.data.get("copy_GB_per_s"):
                row["fraction_of_copy_bw"] = row["GB_per_s"] / self.res.data["copy_GB_per_s"]
        if "error" in row:
            tk.cleanup(self.dev)
        self.res.add(row)
        tk.log(f"  B={B:3d} ctx={ctx:8d} {method:28s} " + (f"{row['us_per_step']:9.1f} us  {row['GB_per_s']:7.0f} GB/s"
                                                            if "us_per_step" in row else row.get("error", "")))

    def timing(self):
        a, c, item = self.a, self.cfg, self.dtype.itemsize
        tk.log("\n== timing ==")
        for ctx in a.contexts:
            for B in a.batches:
                cache_bytes = 2 * B * ctx * c["Hkv"] * c["D"] * item
                if not self.fits(cache_bytes):
                    self.skip(B, ctx, a.methods, f"cache does not fit: B={B} x {ctx} tokens x K,V = "
                              f"{cache_bytes / 2**30:.0f} GiB (> {a.mem_frac:.0%} of GPU memory)")
                    continue
                q, k, v = self.cache(B, ctx, a.seed + B + ctx)
                sl = self.torch.full((B,), ctx, dtype=self.torch.int32, device=self.dev)
                kept, K = self.kept_bytes([ctx] * B), sum(-(-w // r) for w, r in zip(c["ws"], c["rs"]))
                for m in a.methods:
                    extra = {"gather_sdpa": 3 * B * c["H"] * K * c["D"] * item + B * c["H"] * K * 9,
                             "dense": B * c["H"] * c["D"] * 4}.get(m, 0)
                    if not self.fits(cache_bytes + extra):
                        self.skip(B, ctx, [m], f"{m} needs {(cache_bytes + extra) / 2**30:.0f} GiB with the cache")
                    else:
                        self.time_row(B, ctx, m, q, k, v, sl, kept)
                if "dilgen" in a.methods and self.dev.type == "cuda":
                    self.time_row(B, ctx, "dilgen_graph", q, k, v, sl, kept)
                del q, k, v
                tk.cleanup(self.dev)


def report(res, a):
    rows = [r for r in res.all_rows() if r["method"] in SHOWN and "us_per_step" in r]
    by = {(r["batch"], r["context"], r["method"]): r for r in rows}
    get = lambda B, c, m, f="us_per_step", s=".1f": tk.fmt((by.get((B, c, m)) or {}).get(f), s)  # noqa: E731
    ratio = lambda B, c: (by[(B, c, "dense")]["us_per_step"] / by[(B, c, "dilgen")]["us_per_step"]  # noqa: E731
                          if (B, c, "dense") in by and (B, c, "dilgen") in by else None)
    tk.log(f"\n== decode, us per step ({res.data['device']}) ==")
    tk.log(tk.markdown_table(["batch", "context", "dilgen us", "dilgen (CUDA graph) us", "dense us", "gather_sdpa us",
                              "dilgen GB/s", "graph GB/s", "graph / copy BW", "dense / dilgen"],
                             [[B, c, *(get(B, c, m) for m in ("dilgen", "dilgen_graph", "dense", "gather_sdpa")),
                               get(B, c, "dilgen", "GB_per_s", ".0f"), get(B, c, "dilgen_graph", "GB_per_s", ".0f"),
                               get(B, c, "dilgen_graph", "fraction_of_copy_bw", ".2f"), tk.fmt(ratio(B, c), ".1f")]
                              for B in a.batches for c in a.contexts]))
    series = {(m, B): sorted((r["context"], r["us_per_step"]) for r in rows if r["method"] == m and r["batch"] == B)
              for m in SHOWN for B in a.batches}         # us per step against the context
    top = max(a.contexts)
    summary = {f"{m}_batch{B}_us_{pts[-1][0]}_over_{pts[0][0]}": pts[-1][1] / pts[0][1]
               for (m, B), pts in series.items() if m.startswith("dilgen") and len(pts) > 1}
    summary.update({f"dense_over_dilgen_batch{B}_{top}": ratio(B, top) for B in a.batches if ratio(B, top)})
    res.data["summary"] = summary
    res.save()
    tk.log(f"summary: {summary}")
    styles = {"dilgen": ("#d62728", "o"), "dilgen_graph": ("#ff7f0e", "^"), "dense": ("#7f7f7f", "x"),
              "gather_sdpa": ("#1f77b4", "s")}

    def draw(ax):
        for (m, B), pts in series.items():
            if pts:
                ax.plot(*zip(*pts), color=styles[m][0], marker=styles[m][1], label=f"{m}, batch {B}",
                        linestyle=("-", "--", ":", "-.")[a.batches.index(B) % 4])
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="context (tokens in the cache)", ylabel="us per decode step (log)")
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=3)
    d = res.data
    if rows and not a.no_plot:
        tk.figure(res.path.with_suffix(".png"), f"decode latency vs context, bf16 H32/8 D128, w 2K..32K r 1..16\n"
                  f"{d['device']}, torch {d['torch']}, triton {d['triton']}, {d['date']}", draw)


def main(argv=None):
    a, cfg = parse_args(argv)
    warnings.filterwarnings("ignore")
    if tk.no_gpu(a.dry_run_cpu, "bench_decode.py"):
        return 2
    b = Bench(a, cfg)
    b.check()
    b.copy_bandwidth()
    b.timing()
    report(b.res, a)
    tk.log(f"json: {b.res.path}   total {time.time() - b.t0:.0f} s")
    return 1 if b.check_failed else 0


if __name__ == "__main__":
    sys.exit(main())
