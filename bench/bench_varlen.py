"""Variable-length batches (issue 14): packed batches of many sequence lengths, forward and
fwd+bwd, config A's branches, bf16, one GPU. Methods on the same inputs: dilgen_varlen (the
packed call, cu_seqlens; always run), dilgen_one_sequence (one sequence of the total length:
the rate to reach), (a) dilgen_padded (kernel.padded, right-padded to the longest, in chunks
when too big), (b) dilgen_loop (a call per sequence), (c) flex_document (FlexAttention with a
document mask), gather_cudnn per sequence. Each method's first call is checked against
dilgen_varlen's out or dq, dk, dv (dilgen_loop's check is the packed call's; 2e-2 / 4e-2, fp32
dry run / 100). Useful FLOPs exact per sequence. Target: varlen >= 0.9x one sequence and >= 2x
the best of (a)-(c) (`summary`). Packings: docs64 (64 sequences, log-uniform 2K .. 64K, 1.3M
tokens: the issue's), docs (LM packing, 131,072 rows), slides (8 slides of 2K .. 32K tiles).

    python bench/bench_varlen.py --packings docs64 --no-causal
    python bench/bench_varlen.py --packings docs64 --causal-only --append
"""
from __future__ import annotations

import itertools
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402

SPEC = dict(H=16, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4])          # config A's branches
DRY = dict(H=2, D=16, ws=[8, 16], rs=[1, 2])
DOCS64, DRY_DOCS64 = dict(count=64, lo=2048, hi=65536, seed=5), dict(count=4, lo=8, hi=32, seed=5)
# run order: dilgen_varlen first (every check's reference), dilgen_padded last (drops the packed inputs)
METHODS = ("dilgen_varlen", "dilgen_one_sequence", "dilgen_loop", "gather_cudnn", "flex_document", "dilgen_padded")
SHOW = ("dilgen_varlen", "dilgen_one_sequence", "dilgen_padded", "dilgen_loop", "flex_document", "gather_cudnn")
TARGET_PEERS = ("dilgen_padded", "dilgen_loop", "flex_document")      # issue 14's (a)-(c)
TARGET_RATE, TARGET_SPEEDUP = 0.9, 2.0
PASSES = ("fwd", "fwd_bwd")
BOUND = {"fwd": 2e-2, "fwd_bwd": 4e-2}
CHUNK = 1 << 15                                        # rows per fp64 piece of a check
tk.NAMES.update(dilgen_varlen="dilgen varlen", dilgen_one_sequence="dilgen, one sequence of the total",
                dilgen_padded="(a) dilgen padded", dilgen_loop="(b) dilgen per sequence",
                flex_document="(c) FlexAttention document mask", gather_cudnn="gather+cuDNN per sequence")
tk.COLORS.update(dilgen_varlen="#d62728", dilgen_one_sequence="#ff9896", dilgen_padded="#9467bd",
                 dilgen_loop="#8c564b", flex_document="#2ca02c")


def log_uniform_lengths(count: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(round(2 ** rng.uniform(math.log2(lo), math.log2(hi)))) for _ in range(count)]


def packings(dry: bool) -> dict[str, list[int]]:
    if dry:
        return {"docs64": log_uniform_lengths(**DRY_DOCS64), "docs": [5, 17, 9, 24], "slides": [30, 11]}
    rng, docs, total = random.Random(0), [], 0
    while total < 131072:                  # LM packing: documents of 256 .. 16K tokens
        docs.append(min(int(2 ** rng.uniform(8, 14)), 131072 - total))
        total += docs[-1]
    return {"docs64": log_uniform_lengths(**DOCS64), "docs": docs,
            "slides": [rng.randint(2000, 32000) for _ in range(8)]}


def packing_flops(lengths, cfg: dict, causal: bool, fwd_bwd: bool) -> float:
    """Σ over sequences, branches and segments (the last one short) of 4·H·(len/r)²·D."""
    f = sum(4 * cfg["H"] * (min(w, n - a) / r) ** 2 * cfg["D"] for n in lengths
            for w, r in zip(cfg["ws"], cfg["rs"]) for a in range(0, n, w))
    return f / (2 if causal else 1) * (3.5 if fwd_bwd else 1.0)


def flex_head_group(H: int, rs, T: int, D: int):
    """Heads per FlexAttention call: the most (a divisor of H, a multiple of every r, or H) whose
    (1, heads, T, D) tensor stays under 2^31 elements (flex indexes in int32); None if none."""
    t = (-(-T // 128) + 1) * 128
    return next((g for g in range(H, 0, -1) if H % g == 0 and (g == H or g % math.lcm(*rs) == 0)
                 and g * t * D < 2 ** 31), None)


class Skip(Exception):
    pass


class Case:
    """One (packing, causal, pass): the packed inputs, and per method a builder of its call."""
    def __init__(self, b, pack: str, causal: bool, pas: str):
        import torch
        import dilgen
        self.b, self.pack, self.causal, self.pas, self.grad = b, pack, causal, pas, pas == "fwd_bwd"
        cfg, dev, self.lengths = b.cfg, b.dev, b.packs[pack]
        self.T, self.L = sum(self.lengths), max(self.lengths)
        self.spec = tk.make_spec("varlen", cfg, causal, dtype="float32" if b.dry else "bfloat16")   # bench_varlen_*
        self.kernel = dilgen.compile(self.spec)
        offs = [0, *itertools.accumulate(self.lengths)]
        self.bounds = list(zip(offs[:-1], offs[1:]))
        self.cu = torch.tensor(offs, dtype=torch.int32, device=dev)
        g = torch.Generator(device=dev).manual_seed(1)
        x = [torch.randn((self.T, cfg["H"], cfg["D"]), generator=g, device=dev, dtype=b.dtype)
             for _ in range(3 + self.grad)]
        self.q, self.k, self.v, self.do = x + [None] * (not self.grad)
        self.ref = None                # dilgen_varlen's out (fwd) or (dq, dk, dv) (fwd_bwd)
        self.flops, self.one_flops = (packing_flops(ls, cfg, causal, self.grad) for ls in (self.lengths, [self.T]))

    def leaves(self, *ts):
        return [t.detach().requires_grad_(self.grad) for t in ts]

    def finish(self, out, ins, do, sink, a, e, take=lambda t: t, heads=None):
        """Backward when fwd_bwd (gradients discarded); rows a:e (heads) of the result to sink."""
        import torch
        res = torch.autograd.grad(out, ins, do) if self.grad else (out,)
        if sink is not None:
            sink(a, e, [take(t) for t in res], heads)

    # each method: build() -> run(sink=None), one call of the method
    def dilgen_varlen(self):
        q, k, v = self.leaves(self.q, self.k, self.v)
        return lambda sink=None: self.finish(self.kernel(q, k, v, cu_seqlens=self.cu, max_seqlen=self.L),
                                             (q, k, v), self.do, sink, 0, self.T)

    def dilgen_one_sequence(self):                  # another function: not checked
        q, k, v = self.leaves(*(t.unsqueeze(0) for t in (self.q, self.k, self.v)))
        do = self.do.unsqueeze(0) if self.grad else None
        return lambda sink=None: self.finish(self.kernel(q, k, v), (q, k, v), do, None, 0, self.T)

    def _per_sequence(self, fn):
        seqs = [(a, e, *self.leaves(*(t[a:e].unsqueeze(0) for t in (self.q, self.k, self.v))),
                 self.do[a:e].unsqueeze(0) if self.grad else None) for a, e in self.bounds if e > a]

        def run(sink=None):
            for a, e, q, k, v, do in seqs:
                self.finish(fn(q, k, v), (q, k, v), do, sink, a, e, take=lambda t: t[0])
        return run

    def dilgen_loop(self):
        return self._per_sequence(lambda q, k, v: self.kernel(q, k, v))

    def gather_cudnn(self):
        import peers
        return self._per_sequence(lambda q, k, v: peers.gather_cudnn(q, k, v, self.spec)[0])

    def flex_document(self):
        import peers
        b, (H, D) = self.b, (self.b.cfg["H"], self.b.cfg["D"])
        if b.dev.type != "cuda" and self.grad:
            raise Skip("skipped: FlexAttention's backward needs torch.compile (GPU); the dry run "
                       "checks and times its forward only")
        if b.dev.type == "cuda" and time.time() - b.t0 > b.args.flex_budget_s:
            raise Skip(f"skipped: time budget --flex-budget-s={b.args.flex_budget_s:.0f} spent")
        if (hg := flex_head_group(H, b.cfg["rs"], self.T, D)) is None:
            raise Skip(f"skipped: one head of the packed row ({self.T} x {D}) is past int32 offsets")
        bm, _, score_mod, build_s = peers.document_block_mask(self.spec, self.lengths, b.dev)
        self.extra.update(flex_mask_build_s=round(build_s, 3), flex_head_groups=H // hg)
        fn, scale = peers.flex_fn(b.dev), self.spec.scale
        # flex's own layout, (1, heads, T, D) contiguous per head group, made before timing
        group = lambda t, h0: t[:, h0:h0 + hg].permute(1, 0, 2).unsqueeze(0).contiguous()  # noqa: E731
        groups = [(slice(h0, h0 + hg), *self.leaves(group(self.q, h0), group(self.k, h0), group(self.v, h0)),
                   group(self.do, h0) if self.grad else None) for h0 in range(0, H, hg)]

        def run(sink=None):
            for heads, q, k, v, do in groups:
                self.finish(fn(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale), (q, k, v), do, sink,
                            0, self.T, take=lambda t: t[0].transpose(0, 1), heads=heads)
        return run

    def dilgen_padded(self):
        """Right-padded to the longest, in chunks of whole items; drops the packed inputs."""
        import torch
        b, cfg, B, L = self.b, self.b.cfg, len(self.lengths), self.L
        item = L * cfg["H"] * cfg["D"] * self.q.element_size()      # bytes of one padded item
        n_in, per_item, chunks = 3 + self.grad, (10 if self.grad else 1) * item, 1
        if b.dev.type == "cuda":
            free = (torch.cuda.mem_get_info(b.dev)[0] + torch.cuda.memory_reserved(b.dev)
                    - torch.cuda.memory_allocated(b.dev))
            if n_in * B * item > 0.9 * free:
                raise Skip(f"skipped: out of memory: the padded inputs ({B} x {L} rows) need "
                           f"{n_in * B * item / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            free += sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.do) if t is not None)
            chunks = next((c for c in (1, 2, 4, 8, 16, 32, 64)
                           if per_item * -(-B // c) <= 0.85 * free - n_in * B * item), None)
            if chunks is None:
                raise Skip(f"skipped: out of memory: the padded batch ({B} x {L} rows) needs "
                           f"{(n_in * B * item + per_item) / 2**30:.1f} GiB at least, {free / 2**30:.1f} GiB free")
        per, pieces = -(-B // chunks), []
        for items in [list(range(i, min(i + per, B))) for i in range(0, B, per)]:
            def pad(t, items=items):
                x = t.new_zeros((len(items), L) + tuple(t.shape[1:]))
                for j, i in enumerate(items):
                    x[j, :self.bounds[i][1] - self.bounds[i][0]] = t[slice(*self.bounds[i])]
                return x
            mask = torch.arange(L, device=b.dev)[None, :] >= torch.tensor(
                [self.lengths[i] for i in items], device=b.dev)[:, None]      # True = padding
            pieces.append((items, *self.leaves(pad(self.q), pad(self.k), pad(self.v)), mask,
                           pad(self.do) if self.grad else None))
        self.q = self.k = self.v = self.do = None                   # the packed inputs go
        tk.cleanup(b.dev)
        self.extra.update(padded_chunks=len(pieces), padded_rows=B * L)

        def run(sink=None):
            for items, q, k, v, mask, do in pieces:
                out = self.kernel.padded(q, k, v, mask)
                res = torch.autograd.grad(out, (q, k, v), do) if self.grad else (out,)
                for j, i in enumerate(items if sink is not None else []):
                    a, e = self.bounds[i]
                    sink(a, e, [t[j, :e - a] for t in res], None)
                del out, res
        return run

    def measure(self, m: str) -> dict:
        """Build, check on the first call, time."""
        b, flops = self.b, self.one_flops if m == "dilgen_one_sequence" else self.flops
        row = {"packing": self.pack, "causal": self.causal, "method": m, "pass": self.pas, "ms": None,
               "useful_tflops": None, "sequences": len(self.lengths), "tokens": self.T, "longest": self.L,
               "useful_flops": flops}
        self.extra, run = {}, None
        try:
            run = getattr(self, m)()
            t0 = time.perf_counter()
            if m == "dilgen_varlen":
                pieces = []
                run(lambda a, e, ts, heads: pieces.append([t.detach() for t in ts]))
                self.ref = pieces[0]               # checked by dilgen_loop's check
            elif m != "dilgen_one_sequence" and self.ref is not None:
                sq = {}            # per output: [‖a − ref‖², ‖ref‖²] over the pieces, fp64, in row chunks

                def sink(a, e, ts, heads):
                    for i, (t, r) in enumerate(zip(ts, self.ref)):
                        r = r[a:e] if heads is None else r[a:e, heads]
                        for c in range(0, r.shape[0], CHUNK):
                            x, y = t[c:c + CHUNK].detach().double(), r[c:c + CHUNK].double()
                            acc = sq.setdefault(i, [0.0, 0.0])
                            acc[0], acc[1] = acc[0] + (x - y).pow(2).sum().item(), acc[1] + y.pow(2).sum().item()
                run(sink)
                bound = BOUND[self.pas] / (100 if b.dry else 1)
                errs = [math.sqrt(n / d) if d > 0 else (0.0 if n == 0 else math.inf) for n, d in sq.values()]
                row.update(rel_err=max(errs) if errs else None, check_against="dilgen_varlen", check_bound=bound)
                row["check_passed"] = row["rel_err"] is not None and row["rel_err"] < bound
            else:
                run()
            tk.sync(b.dev)
            first = time.perf_counter() - t0
            row["first_call_s"] = round(first, 3)
            t = ({"median": first * 1e3, "min": first * 1e3, "max": first * 1e3, "n": 1} if b.warmup == 0
                 else tk.time_ms(run, warmup=b.warmup - 1, reps=b.reps, device=b.dev))   # dry: the first call
            row.update(ms=round(t["median"], 4), useful_tflops=round(flops / t["median"] / 1e9, 9 if b.dry else 1),
                       ms_min=round(t["min"], 4), ms_max=round(t["max"], 4), reps=t["n"])
        except Skip as e:
            row["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - recorded in the row; the next method runs
            row["error"] = ("out of memory: " if "out of memory" in str(e).lower() else "") + tk.short_err(e)
        row.update(self.extra)
        del run
        tk.cleanup(b.dev)
        return row


class Bench:
    def __init__(self, args):
        import torch
        self.args, self.dry, self.t0, self.failed = args, args.dry_run_cpu, time.time(), False
        self.dev = torch.device("cpu" if self.dry else "cuda")
        self.cfg, self.dtype = (DRY, torch.float32) if self.dry else (SPEC, torch.bfloat16)
        self.reps = 1 if self.dry and args.reps is None else (args.reps or 10)
        self.warmup = 0 if self.dry and args.warmup is None else (3 if args.warmup is None else args.warmup)
        self.packs = packings(self.dry)
        self.names = tk.pick(args.packings or ("docs64,slides" if self.dry else ",".join(self.packs)), self.packs,
                             "--packings")
        chosen = tk.pick(args.methods, METHODS)
        self.methods = [m for m in METHODS if m in chosen or m == "dilgen_varlen"]   # varlen: the reference
        self.causals = tk.causal_flags(args.no_causal, args.causal_only)
        self.passes = ("fwd",) if args.no_bwd else PASSES
        pk = {name: {"sequences": len(ls), "total": sum(ls), "longest": max(ls), "shortest": min(ls), "lengths": ls}
              for name, ls in self.packs.items()}
        pk["docs64"]["drawn"] = dict(DRY_DOCS64 if self.dry else DOCS64,
                                     rng="random.Random(seed), round(2 ** uniform(log2 lo, log2 hi))")
        head = tk.header(self.dev, self.dry, {
            "spec": self.cfg, "dtype": str(self.dtype).replace("torch.", ""), "packings": pk,
            "targets": {"rate_vs_one_sequence": TARGET_RATE, "speedup_vs_best_peer": TARGET_SPEEDUP,
                        "peers": list(TARGET_PEERS)},
            "useful_flops": "exact: sum over sequences and segments of 4*H*(len/r)^2*D, /2 causal, x3.5 fwd_bwd",
            "args": dict(vars(args)), "summary": []})
        self.res = tk.Results(tk.result_path(args.out, "varlen", self.dry), head,
                              key=("packing", "causal", "method", "pass"), append=args.append, lists=())
        self.res.data["summary"] = summarize(self.res.all_rows())

    def run(self):
        todo = [(p, c, s) for p in self.names for c in self.causals for s in self.passes]
        prog = tk.Progress(len(todo) * len(self.methods))
        for pack, causal, pas in todo:
            case, rows = Case(self, pack, causal, pas), {}
            for m in self.methods:
                row = rows[m] = case.measure(m)
                if m == "dilgen_loop" and "rel_err" in row:         # the packed call's check
                    rows["dilgen_varlen"].update({k: row[k] for k in ("rel_err", "check_bound", "check_passed")},
                                                 check_against="dilgen_loop")
                    self.failed |= not row["check_passed"]
                self.res.add(row)
                self.res.data["summary"] = summarize(self.res.all_rows())
                self.res.save()
                prog.step(f"{pack} {'causal' if causal else 'full'} {pas} {m}: {tk.fmt(row['ms'], '.3f')} ms"
                          + (f", err {row['rel_err']:.1e}" if row.get("rel_err") is not None else "")
                          + (f"  [{row['error']}]" if row.get("error") else ""))
            self.failed |= bool(rows["dilgen_varlen"].get("error"))
            del case
            tk.cleanup(self.dev)

    def report(self):
        order, packs = {m: i for i, m in enumerate(SHOW)}, {p: i for i, p in enumerate(self.packs)}
        rows = sorted((r for r in self.res.all_rows() if r.get("method")), key=lambda r: (
            packs.get(r["packing"], 99), r["causal"], r["pass"], order.get(r["method"], 99)))
        spec, mask = (".3g" if self.dry else ".1f"), (lambda r: "causal" if r["causal"] else "full")
        print(tk.markdown_table(
            ["packing", "mask", "pass", "method", "ms", "useful TFLOP/s", "rel err", "check", "note"],
            [[r["packing"], mask(r), r["pass"], r["method"], tk.fmt(r.get("ms"), ".3f"),
              tk.fmt(r.get("useful_tflops"), spec), tk.fmt(r.get("rel_err"), ".1e"),
              {True: "ok", False: "FAIL", None: None}[r.get("check_passed")], (r.get("error") or "")[:60] or None]
             for r in rows]))
        summ = self.res.data["summary"]
        print("\n" + tk.markdown_table(
            ["packing", "mask", "pass", "varlen TFLOP/s", "one-sequence TFLOP/s", f"rate (>= {TARGET_RATE})",
             "best peer", f"speedup (>= {TARGET_SPEEDUP})", "vs gather+cuDNN", "targets met"],
            [[s["packing"], mask(s), s["pass"], tk.fmt(s["dilgen_varlen_tflops"], spec),
              tk.fmt(s["dilgen_one_sequence_tflops"], spec), tk.fmt(s["rate_vs_one_sequence"]), s["best_peer"],
              tk.fmt(s["speedup_vs_best_peer"]), tk.fmt(s["speedup_vs_gather_cudnn"]), {True: "yes", False: "no",
              None: "—"}[s["targets_met"]] + " (peers missing)" * (not s["peers_complete"])]
             for s in summ]))
        for r in [r for r in rows if r.get("check_passed") is False]:
            tk.log(f"!! check failed: {r}")
        d = self.res.data
        tk.plot_bars([dict({"config": f"{s['packing']} {s['pass']}", "causal": s["causal"]},
                           **{f"{m}_tflops": s.get(f"{m}_tflops") for m in SHOW}) for s in summ], list(SHOW),
                     tk.result_path(self.args.out, "varlen", self.dry, ext="png"), "useful TFLOP/s (higher is better)",
                     f"packed batches, config A's branches — {d['device']}\ntorch {d['torch']}, {d['date']}; target: "
                     f"varlen >= {TARGET_RATE}x one sequence, >= {TARGET_SPEEDUP}x the best of (a)-(c)",
                     field="{m}_tflops", log_scale=False)


def summarize(rows) -> list:
    """One entry per (packing, causal, pass): the rates and whether issue 14's targets are met."""
    groups: dict = {}
    for r in rows:
        if r.get("method"):
            groups.setdefault((r["packing"], r["causal"], r["pass"]), {})[r["method"]] = r
    out = []
    for (pack, causal, pas), by in groups.items():
        tf = {m: (by.get(m) or {}).get("useful_tflops") for m in SHOW}
        s = {"packing": pack, "causal": causal, "pass": pas, **{f"{m}_tflops": tf[m] for m in SHOW}}
        v, one = tf["dilgen_varlen"], tf["dilgen_one_sequence"]
        peers = {m: tf[m] for m in TARGET_PEERS if tf[m]}
        best = max(peers, key=peers.get) if peers else None
        s.update(rate_vs_one_sequence=round(v / one, 3) if v and one else None, best_peer=best,
                 peers_missing={m: (by.get(m) or {}).get("error") or "not run" for m in TARGET_PEERS if not tf[m]},
                 speedup_vs_best_peer=round(v / peers[best], 3) if v and best else None,
                 speedup_vs_gather_cudnn=round(v / tf["gather_cudnn"], 3) if v and tf["gather_cudnn"] else None)
        rate, speed = s["rate_vs_one_sequence"], s["speedup_vs_best_peer"]
        s.update(peers_complete=not s["peers_missing"], rate_target_met=None if rate is None else rate >= TARGET_RATE,
                 speedup_target_met=None if speed is None else speed >= TARGET_SPEEDUP,
                 targets_met=None if None in (rate, speed) else rate >= TARGET_RATE and speed >= TARGET_SPEEDUP,
                 checks_passed=all(r.get("check_passed") is not False for r in by.values()))
        out.append(s)
    order = {p: i for i, p in enumerate(("docs64", "docs", "slides"))}
    return sorted(out, key=lambda s: (order.get(s["packing"], 99), s["packing"], s["causal"], PASSES.index(s["pass"])))


def main(argv=None) -> int:
    ap = tk.parser(__doc__, "out", "no_causal", "causal_only", "reps", "warmup", "append", "dry_run_cpu",
                   methods=METHODS, warmup=dict(help="calls before timing, the checked first call included "
                                                     "(default 3); 0: the checked first call is the only timed one "
                                                     "(dry default)"))
    ap.add_argument("--packings", default=None, help="comma list of docs64,docs,slides (default: all)")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--flex-budget-s", type=float, default=480.0, help="skip flex_document after this many seconds")
    args = ap.parse_args(argv)
    tk.quiet()
    if tk.no_gpu(args.dry_run_cpu, "bench_varlen.py"):
        return 2
    b = Bench(args)
    tk.log(f"packings {b.names}  methods {b.methods}  json {b.res.path}")
    for p in b.names:
        i = b.res.data["packings"][p]
        tk.log(f"  {p}: {i['sequences']} sequences, {i['total']} rows, {i['shortest']} .. {i['longest']}")
    b.run()
    b.report()
    tk.log(f"wrote {b.res.save()}  ({time.time() - b.t0:.0f} s)")
    return 1 if b.failed else 0


if __name__ == "__main__":
    sys.exit(main())
