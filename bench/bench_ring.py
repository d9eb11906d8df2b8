#!/usr/bin/env python3
"""Weak and strong scaling of dilgen's ring over P GPUs (a process per GPU, NCCL; gloo with
--dry-run-cpu), raster and Hilbert orders, forward and fwd+bwd, every rank's rows checked against
one GPU; spec H16 D128 bf16, w 2K .. 1M, r 1 .. 32. bench/README.md says what a run does.

  python bench/bench_ring.py --gpus 1 2                       # raster, segment, sequence
  python bench/bench_ring.py --gpus 1 2 --specs bench/specs/ring_users.json --transports auto
  python bench/bench_ring.py --plot bench/results/ring-DATE.json     # redraw the plot
"""
from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

for _var, _off in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _off)                   # device README: no NVLink multicast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402

GPU = dict(ws=[2048, 8192, 32768, 131072, 524288, 1048576], rs=[1, 2, 4, 8, 16, 32], H=16, D=128,
           tokens=262144, small=(8192, 2, 64))          # small: (N, H, D) of the fp64 check
DRY = dict(ws=[8, 32, 128], rs=[1, 2, 4], H=2, D=16, tokens=64, small=(128, 2, 16))
# causal_gqa: H_kv = H/4, causal, zigzag chunks; local: Hilbert segment tiles that all lie inside a rank
ORDERS = ("raster", "segment", "sequence", "causal_gqa", "local")
USER = {}            # --specs: name -> a spec's fields and its tokens_per_gpu, run as an "order" each
TRANSPORTS = ("auto", "ring", "allgather", "heads", "recut", "hybrid")   # DILGEN_RING_TRANSPORT per row (auto: model's)
BOUND_OUT, BOUND_GRAD = 2e-2, 4e-2
chunks = lambda spec: "zigzag" if spec.causal and spec.ring_size > 1 else "contiguous"  # noqa: E731 - causal: balanced


def hilbert_for(order: str, n: int):
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)     # as square as possible
    scope = (USER[order].get("hilbert") or {}).get("scope") if order in USER else \
        None if order in ("raster", "causal_gqa") else "segment" if order in ("segment", "local") else "sequence"
    return scope and {"scope": scope} | ({"grid": [rows, n // rows]} if scope == "sequence" else {})


def make_spec(geo, order: str, n: int, P: int, H=None, D=None, name=None):
    import dilgen
    if order in USER:                  # H scaled down for the fp64 check keeps the GQA ratio
        u = {k: v for k, v in USER[order].items() if k not in ("name", "tokens_per_gpu")}
        h = H or u["num_heads"]
        return dilgen.Spec(**u | dict(name=name or f"ring_{order}_p{P}", num_heads=h, dtype="bfloat16", ring_size=P,
                                      num_kv_heads=max(h * u["num_kv_heads"] // u["num_heads"], 1),
                                      head_dim=D or u["head_dim"], hilbert=hilbert_for(order, n)))
    H, gqa, k = H or geo["H"], order == "causal_gqa", 4 if order == "local" else len(geo["ws"])
    return dilgen.Spec(name=name or f"ring_{order}_p{P}", num_heads=H, num_kv_heads=max(H // 4, 1) if gqa else H,
                       head_dim=D or geo["D"], dtype="bfloat16", segment_lengths=geo["ws"][:k], causal=gqa,
                       dilation_rates=geo["rs"][:k], ring_size=P, hilbert=hilbert_for(order, n))


def my_rows(x, P, rank, spec, dim=1):
    """Rank `rank`'s rows of a full tensor (Hilbert sequence scope: its run of the curve)."""
    from dilgen.runtime.ring import shard
    return x if P == 1 else shard(x, P, rank, chunks(spec), spec=spec, dim=dim)


class Rank:
    """One process of the ring: its device, its rows, its share of every measurement."""
    def __init__(self, rank, P, args, dist, dev):
        import torch
        self.torch, self.rank, self.P, self.args, self.dist, self.dev = torch, rank, P, args, dist, dev
        self.geo = args.geo

    def reduce(self, vals, op=None):
        self.dist.all_reduce(t := self.torch.tensor(vals, device=self.dev).double(), **({"op": op} if op else {}))
        return t.tolist()

    def wall_ms(self, fn, reps, barrier=True):
        """ms per call: reps calls or as many as fill 0.3 s (<= 50) after a warm-up; barrier: the slowest rank's."""
        def now():
            tk.sync(self.dev)
            self.dist.barrier() if barrier else None
            return time.perf_counter()
        t0, _ = now(), fn()
        first = self.reduce([now() - t0], self.dist.ReduceOp.MAX)[0] if barrier else now() - t0
        reps = max(reps, min(50, math.ceil(0.3 / max(first, 1e-6))))
        t0 = now()
        for _ in range(reps):
            fn()
        ms = (now() - t0) / reps * 1e3
        return self.reduce([ms], self.dist.ReduceOp.MAX)[0] if barrier else ms

    def bf16_error(self, order) -> float:
        """bf16 ring vs the float64 reference on a small N (every rank's rows)."""
        import dilgen
        from dilgen.reference import reference_attention
        torch, P, (n, h, d) = self.torch, self.P, self.geo["small"]
        spec = make_spec(self.geo, order, n, P, H=h, D=d, name=f"ring_err_{order}_p{P}")
        gen = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, n, x, d, generator=gen) for x in (h, spec.num_kv_heads, spec.num_kv_heads))
        with torch.no_grad():
            out = dilgen.compile(spec)(*[my_rows(t, P, self.rank, spec).to(torch.bfloat16).to(self.dev)
                                         for t in (q, k, v)], chunk_order=chunks(spec))
        ref = my_rows(reference_attention(q, k, v, spec), P, self.rank, spec)
        num, den = self.reduce([(out.double().cpu() - ref).norm().item() ** 2, ref.norm().item() ** 2])
        return math.sqrt(num / den)

    def steps(self, kernel, q, k, v, g):
        """(forward, forward + backward) callables on fresh leaves."""
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

        def fwd_bwd():
            for t in leaves:
                t.grad = None
            kernel(*leaves, chunk_order=chunks(kernel.spec)).backward(g)
        return self.torch.no_grad()(lambda: kernel(q, k, v, chunk_order=chunks(kernel.spec))), fwd_bwd, leaves

    def run(self, order) -> dict:
        import dilgen
        from dilgen.runtime.ring.costs import predicted_ms      # the cost model's ms, beside each row
        torch, P, rank, a, geo = self.torch, self.P, self.rank, self.args, self.geo
        N = (T := a.tokens_per_gpu or USER.get(order, geo)["tokens_per_gpu" if order in USER else "tokens"]) * P
        row = {"gpus": P, "tokens_per_gpu": T, "N": N, "hilbert": hilbert_for(order, N) and order,
               "hilbert_spec": hilbert_for(order, N), "order": order, "user_spec": USER.get(order),
               "bf16_rel_error_vs_fp64": self.bf16_error(order)}
        spec, one = make_spec(geo, order, N, P), make_spec(geo, order, N, 1, name=f"ring_{order}_one")
        # the single-device kernel on the full N (the same tensors on every rank): its rows, T_1(N)
        g = torch.Generator(device=self.dev).manual_seed(1234)
        full = [torch.randn(1, N, h, spec.head_dim, device=self.dev, dtype=torch.bfloat16, generator=g)
                for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads, spec.num_heads)]
        ref = None
        if P > 1:
            single = dilgen.compile(one)
            s_fwd, s_fwd_bwd, leaves = self.steps(single, *full)
            s_fwd_bwd()
            ref = [my_rows(t, P, rank, spec).clone() for t in [single(*full[:3])] + [t.grad for t in leaves]]
            if a.calibrate_specs:       # the spec's own single-device rate on a rank's rows (dilgen calibrate --spec)
                from dilgen.calibrate import calibrate_specs
                calibrate_specs([spec], N, None, self.dev)
            if rank == 0:
                row.update({k.replace("predicted_", "predicted_single_"): v for k, v in predicted_ms(
                    single.compiled_for(self.dev).attention, N, "single").items() if k.endswith("_ms")})
                row["single_device_fwd_ms"] = self.wall_ms(s_fwd, a.reps, barrier=False)
                row["single_device_fwd_bwd_ms"] = self.wall_ms(s_fwd_bwd, max(1, a.reps // 2), barrier=False)
            del leaves, s_fwd, s_fwd_bwd
            self.dist.barrier()
        mine = [my_rows(t, P, rank, spec).clone() for t in full]
        del full
        tk.cleanup(self.dev)
        kernel, rows = dilgen.compile(spec), []
        for tr in self.transports(spec, N):    # the ring on this rank's rows, by each transport
            os.environ["DILGEN_RING_TRANSPORT"] = tr
            r = dict(row, forced_transport=tr)
            fwd, fwd_bwd, leaves = self.steps(kernel, *mine)
            fwd_bwd()
            attn = kernel.compiled_for(self.dev).attention
            r["transport"] = attn.last_ring_transport if P > 1 else "single"
            if r["transport"] == "heads":
                from dilgen.runtime.ring.heads import chunks_for
                r["head_chunks"] = chunks_for(spec.num_kv_heads // P)
            if any(x["transport"] == r["transport"] for x in rows):
                continue                        # "auto" already ran this one
            if ref is not None:
                self.check(r, fwd, leaves, ref)
            cuda = self.dev.type == "cuda" and torch.cuda.reset_peak_memory_stats(self.dev) is None
            r["fwd_ms"], r["fwd_bwd_ms"] = self.wall_ms(fwd, a.reps), self.wall_ms(fwd_bwd, max(1, a.reps // 2))
            r["peak_gib"] = torch.cuda.max_memory_allocated(self.dev) / 2**30 if cuda else None
            r.update(predicted_ms(attn, N, r["transport"], chunks(spec)))
            if P == 1:
                r["single_device_fwd_ms"], r["single_device_fwd_bwd_ms"] = r["fwd_ms"], r["fwd_bwd_ms"]
            del leaves, fwd, fwd_bwd
            rows.append(r)
        os.environ["DILGEN_RING_TRANSPORT"] = "auto"
        del mine; tk.cleanup(self.dev)    # noqa: E702
        return rows

    def transports(self, spec, N: int) -> list[str]:
        """--transports that run the spec at this P (allgather: raster; recut: a border in N; hybrid: mixed)."""
        P, H, Hk = self.P, spec.num_heads, spec.num_kv_heads
        return ["auto"] if P == 1 else [t for t in self.args.transports
                                        if (t != "heads" or not (H % P or Hk % P))
                                        and (t != "allgather" or not (spec.causal or spec.hilbert))
                                        and (t != "recut" or math.lcm(*spec.segment_lengths) < N)
                                        and (t != "hybrid" or 0 < sum(N // P // (1 + spec.causal) % w == 0
                                                                      for w in spec.segment_lengths) < spec.num_branches)]

    def check(self, r, fwd, leaves, ref):
        """Every rank's rows of out, dq, dk, dv against the single-device kernel's same rows."""
        sq = [v for x, y in zip([fwd()] + [t.grad for t in leaves], ref)
              for v in ((x.double() - y.double()).norm().item() ** 2, y.double().norm().item() ** 2)]
        rel = lambda s: [math.sqrt(s[i] / max(s[i + 1], 1e-300)) for i in range(0, 8, 2)]  # noqa: E731
        worst, names = self.reduce(rel(sq), self.dist.ReduceOp.MAX), ("out", "dq", "dk", "dv")
        r["check_rel_err_vs_single_device"] = dict(zip(names, rel(self.reduce(sq))))
        r["check_worst_rank_rel_err"] = dict(zip(names, worst))
        r["check_passed"] = bool(worst[0] < BOUND_OUT and max(worst[1:]) < BOUND_GRAD)


def worker(rank, P, port, args, out_path):
    import warnings
    import torch
    import torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dry, dev = args.dry_run_cpu, torch.device("cpu") if args.dry_run_cpu else torch.device("cuda", rank)
    if dry:
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")   # masked interpreter lanes
    else:
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo" if dry else "nccl", rank=rank, world_size=P,
                            timeout=timedelta(seconds=600 if dry else 300), **({} if dry else {"device_id": dev}))
    USER.update((u["name"], u) for u in json.loads(Path(args.specs).read_text())) if args.specs else None
    me, rows = Rank(rank, P, args, dist, dev), []
    for order in args.orders:
        t0 = time.time()
        try:
            got = me.run(order)
        except Exception as e:  # noqa: BLE001 - record, go on with the next order
            got = [{"gpus": P, "tokens_per_gpu": args.tokens_per_gpu or me.geo["tokens"], "order": order,
                    "hilbert": hilbert_for(order, 4) and order, "error": tk.short_err(e, 600)}]
            if os.environ.get("BENCH_TRACEBACK") or rank == 0:
                got[0]["traceback"] = traceback.format_exc()[-3000:]
            tk.cleanup(dev)
        for row in got:
            row["wall_s"] = round(time.time() - t0, 1)
            rows.append(row)
            if rank == 0:
                eff = row.get("single_device_fwd_bwd_ms", 0) / P / row.get("fwd_bwd_ms", 1)    # strong scaling
                tk.log(f"    P={P} {order:10s} {row.get('transport', '?'):9s} " + (row.get("error") or
                       f"fwd {row['fwd_ms']:.1f} ms, fwd+bwd {row['fwd_bwd_ms']:.1f} ms (model "
                       f"{row.get('predicted_fwd_bwd_ms', 0):.1f}), strong eff {eff:.2f}, check "
                       f"{ {True: 'ok', False: 'FAILED'}.get(row.get('check_passed'), '-')}") + f"  ({row['wall_s']:.0f} s)")
        if rank == 0:
            tk.write_json_atomic(out_path, rows)
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001
            break
    dist.destroy_process_group()


def finish(rows, geo):
    """Useful TFLOP/s per GPU, strong scaling (T_1(N) / (P T_P(N))), weak-scaling efficiency against the
    1-GPU row of the same order."""
    for r, kind in ((r, kind) for r in rows if "fwd_bwd_ms" in r for kind in ("fwd", "fwd_bwd")):
        k, u = 4 if r.get("order") == "local" else len(geo["ws"]), USER.get(r.get("order"))
        cfg = dict(geo, ws=geo["ws"][:k], rs=geo["rs"][:k]) if u is None else dict(
            ws=u["segment_lengths"], rs=u["dilation_rates"], H=u["num_heads"], D=u["head_dim"])
        causal = r.get("order") == "causal_gqa" or bool(u and u.get("causal"))
        r[f"useful_tflops_per_gpu_{kind}"] = tk.useful_flops(dict(cfg, B=1, N=r["N"]), causal, kind == "fwd_bwd") \
            / r["gpus"] / r[f"{kind}_ms"] / 1e9
        for m, p, t in (("fwd_bwd", "fwd_bwd", "fwd_bwd"), ("single", "single_fwd_bwd", "single_device_fwd_bwd")):
            if r.get(f"predicted_{p}_ms") and r.get(f"{t}_ms"):
                r[f"model_error_{m}"] = r[f"predicted_{p}_ms"] / r[f"{t}_ms"] - 1
        s = r.get(f"single_device_{kind}_ms")       # strong_scaling_eff: fwd+bwd's (the last kind)
        r[f"strong_scaling_eff_{kind}"] = r["strong_scaling_eff"] = s / (r["gpus"] * r[f"{kind}_ms"]) if s else None
    for r in rows:
        base = next((b for b in rows if b["gpus"] == 1 and b.get("order") == r.get("order") and "useful_tflops_per_gpu_fwd" in b
                     and b.get("tokens_per_gpu") == r.get("tokens_per_gpu")), None)
        for kind in ("fwd", "fwd_bwd"):
            if base and "fwd_bwd_ms" in r:
                r[f"efficiency_{kind}"] = r[f"useful_tflops_per_gpu_{kind}"] / base[f"useful_tflops_per_gpu_{kind}"]


def report(rows):
    k = lambda x: f"{x // 1024}K" if x % 1024 == 0 else str(x)  # noqa: E731
    body = []
    rank = {o: i for i, o in enumerate(ORDERS + tuple(USER))}
    for r in sorted(rows, key=lambda r: (r["tokens_per_gpu"], rank.get(r.get("order"), 0), r["gpus"])):
        chk = r.get("check_worst_rank_rel_err")
        body.append([r["gpus"], r.get("order"), k(r["tokens_per_gpu"]), "—", "failed: " + r.get("error", "?")[:200]]
                    + [""] * 9 if "fwd_bwd_ms" not in r else
                    [r["gpus"], r["order"], f"{r.get('transport')}{' (auto)' * (r.get('forced_transport') == 'auto')}",
                     k(r["tokens_per_gpu"]), k(r["N"]), f"{r['fwd_ms']:.1f}", f"{r['fwd_bwd_ms']:.1f}",
                     tk.fmt(r.get("predicted_fwd_bwd_ms"), ".1f"), tk.fmt(r.get("single_device_fwd_bwd_ms"), ".1f"),
                     f"{r['useful_tflops_per_gpu_fwd_bwd']:.0f}", tk.fmt(r.get("efficiency_fwd_bwd"), ".0%"),
                     tk.fmt(r.get("strong_scaling_eff"), ".0%"),
                     "—" if not chk else "/".join(f"{chk[x]:.1e}" for x in ("out", "dq", "dk", "dv")),
                     tk.fmt(r.get("bf16_rel_error_vs_fp64"), ".1e"),
                     tk.fmt(r.get("peak_gib", r.get("memory_per_gpu_gib")), ".1f")])
    tk.log(tk.markdown_table(["GPUs", "order", "transport", "tokens/GPU", "N", "fwd ms", "fwd+bwd ms", "model fwd+bwd ms",
                              "1-GPU fwd+bwd ms (same N)", "TFLOP/s per GPU", "weak eff", "strong eff",
                              "rows vs 1 GPU out/dq/dk/dv", "bf16 vs fp64", "GiB per GPU"], body))


def plot(result, path):
    """TFLOP/s per GPU (weak scaling) and strong-scaling efficiency against P, per order."""
    rows = [r for r in result["rows"] if "fwd_bwd_ms" in r and r.get("forced_transport", "auto") == "auto"]
    style = dict(raster="o-", segment="s--", sequence="^:", causal_gqa="d-.", local="v-")
    gpus = sorted({r["gpus"] for r in rows})

    def draw(ax):
        for order in ORDERS:
            rs = sorted((r for r in rows if r.get("order") == order), key=lambda r: r["gpus"])
            label = dict(raster="raster", causal_gqa="causal GQA, zigzag", local="Hilbert, in a rank").get(order, order)
            for a_, xy in zip(ax, ([(r["gpus"], r[f]) for r in rs if r.get(f)]
                                   for f in ("useful_tflops_per_gpu_fwd_bwd", "strong_scaling_eff"))):
                a_.plot(*zip(*xy), style[order], label=label) if xy else None
        t = rows[0]["tokens_per_gpu"]
        ax[0].set(xlabel="GPUs", ylabel="useful TFLOP/s per GPU (fwd+bwd)", xticks=gpus, ylim=(0, None),
                  title=f"weak scaling, {f'{t // 1024}K' if t >= 1024 else t} tokens per GPU")
        ax[1].axhline(1.0, color="black", linewidth=0.8)
        ax[1].set(xlabel="GPUs", ylabel="T_1(N) / (P · T_P(N))", xticks=gpus, ylim=(0, 1.15),
                  title="strong scaling efficiency (fwd+bwd), N = tokens/GPU x P")
        for a_ in ax:
            a_.legend(fontsize=8)
            a_.grid(alpha=0.3)
    return tk.figure(path, f"dilgen ring, bf16 — {result['device']}, {result['date']}", draw, (11, 4.2), 2,
                     dpi=110) if rows else None


def parse_args(argv=None):
    ap = tk.parser(__doc__, "reps", "out", "append", "no_plot", "dry_run_cpu",
                   reps=dict(help="timed calls (fwd+bwd: half) (default 4; dry run 1)"),
                   dry_run_cpu=dict(help="gloo on the CPU at toy sizes (numbers meaningless)"))
    add = ap.add_argument
    add("--gpus", type=int, nargs="+", default=[1, 2, 4], help="GPU counts (default 1 2 4)")
    add("--tokens-per-gpu", type=int, default=None, help="default 262144 (dry run: 64)")
    add("--orders", default=",".join(ORDERS[:3]), help="subset of " + ",".join(ORDERS))
    add("--transports", default=",".join(TRANSPORTS), help="DILGEN_RING_TRANSPORT values, a row each (P > 1; "
        "all-gather: raster only)")
    add("--plot", dest="replot", metavar="JSON", help="only redraw the plot of a result file")
    add("--specs", metavar="JSON", help="run these specs (a list of spec fields + tokens_per_gpu) instead of --orders")
    add("--calibrate-specs", action="store_true", help="measure each spec's own rate first (dilgen calibrate --spec)")
    a = ap.parse_args(argv)
    USER.update((u["name"], u) for u in json.loads(Path(a.specs).read_text())) if a.specs else None
    a.orders = list(USER) if a.specs else tk.pick(a.orders, ORDERS, "--orders")
    a.reps = a.reps or (1 if a.dry_run_cpu else 4)
    a.transports = tk.pick(a.transports, TRANSPORTS, "--transports")
    a.geo = DRY if a.dry_run_cpu else GPU
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    import torch
    import torch.multiprocessing as mp
    dry, geo, gpus = args.dry_run_cpu, args.geo, args.gpus
    if tk.no_gpu(dry, "bench_ring.py", "--dry-run-cpu (gloo)"):
        return 2
    if not dry and [p for p in gpus if p > torch.cuda.device_count()]:
        gpus = [p for p in gpus if p <= torch.cuda.device_count()]
        tk.log(f"only {torch.cuda.device_count()} GPU(s): running --gpus {gpus}")
    head = tk.header("cpu" if dry else "cuda", dry, {
        "args": vars(args), "spec": {"segment_lengths": geo["ws"], "dilation_rates": geo["rs"], "num_heads": geo["H"],
                                     "head_dim": geo["D"], "dtype": "bfloat16", "batch": 1},
        "notes": ["strong_scaling_eff = T_1(N) / (P * T_P(N)), N = tokens_per_gpu * P, T_1 the single-device "
                  "kernel (ring_size 1) on the full N (fwd+bwd; _fwd: forward only)",
                  "efficiency_*: weak scaling, useful TFLOP/s per GPU against the 1-GPU row of the same order",
                  "check_*: every rank's rows of out, dq, dk, dv against the single-device kernel's same rows",
                  "useful FLOPs: sum_i 4*B*H*(N/w_i)*(w_i/r_i)^2*D (w_i capped at N), x3.5 fwd+bwd, / P per GPU"]})
    if not dry:
        head["device"] = f"{len(gpus) and max(gpus)} x {head['device']}"
    res = tk.Results(tk.result_path(args.out, "ring", dry), head,
                     key=("gpus", "order", "tokens_per_gpu", "forced_transport"), append=args.append, lists=())
    failed = False
    for i, P in enumerate(gpus):
        tk.log(f"[{i + 1}/{len(gpus)}] {P} {'process' if dry else 'GPU'}(s), "
               f"{args.tokens_per_gpu or geo['tokens']} tokens each, orders {args.orders} ...")
        path, t0 = Path(args.out) / f"ring_{P}.partial.json", time.time()    # kept if the run is cut short
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            mp.start_processes(worker, args=(P, port, args, str(path)), nprocs=P, join=True, start_method="spawn")
        except Exception as e:  # noqa: BLE001 - a crashed rank: keep what rank 0 wrote
            tk.log(f"  P={P}: {tk.short_err(e, 300)}")
            failed = True
        for r in json.loads(path.read_text()) if path.exists() else [{"gpus": P, "error": "no result"}]:
            r.setdefault("tokens_per_gpu", args.tokens_per_gpu or geo["tokens"])
            res.add(r)
            failed |= "error" in r or r.get("check_passed") is False
        path.unlink(missing_ok=True)
        tk.log(f"  {P}: {time.time() - t0:.0f} s")
    rows = res.all_rows()
    finish(rows, geo)
    res.save()
    report(rows)
    if not args.no_plot:
        plot({**res.data, "rows": rows}, tk.result_path(args.out, "ring", dry, ext="png"))
    tk.log(f"json: {res.path}")
    bad = [f"P={r['gpus']} {r.get('order')}: {r.get('error', 'check failed')[:160]}" for r in res.rows
           if "error" in r or r.get("check_passed") is False]
    if bad or failed:
        tk.log(f"{len(bad)} row(s) failed (exit status 1):\n  " + "\n  ".join(bad))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
