#!/usr/bin/env python3
"""Ring benchmark: weak and strong scaling of dilgen's ring over P GPUs (one process per
GPU, torch.multiprocessing + NCCL), raster order and Hilbert orderings, forward and
forward+backward, with every rank's rows checked against the single-device kernel.

Spec (the same for every P): H16 D128 bf16, w = [2048, 8192, 32768, 131072, 524288,
1048576], r = [1, 2, 4, 8, 16, 32]; a segment longer than N is one short segment (SPEC §2).
Orders (--orders): raster (hilbert null); segment ({"scope": "segment"}); sequence
({"scope": "sequence", "grid": [rows, cols]}, rows·cols = N: the sequence is one image,
a rank holds a run of the curve).

For each P of --gpus and each order, at N = --tokens-per-gpu x P:
  1. bf16 ring against the float64 reference on a small N (H2 D64; the error must not grow with P);
  2. the single-device kernel (ring_size 1) on the full N: out and dq, dk, dv (each rank
     keeps its rows: dilgen.runtime.ring.shard(x, P, rank, spec=spec)), and its time T_1(N)
     (rank 0; for P = 1 it is the ring time itself);
  3. the ring: every rank's rows of out, dq, dk, dv against the single-device rows
     (SPEC bounds: 2e-2 out, 4e-2 gradients), then its time T_P(N), the slowest rank's;
  4. raster only: LongNet's all-gather transport on the same kernels (P > 1), a dense
     ring of flash attention (P x one measured flash step, P = 1), and the longest
     sequence that runs forward+backward (--max-tokens).
Efficiencies: weak = useful TFLOP/s per GPU at P / at 1 GPU (same order);
strong = T_1(N) / (P · T_P(N)) with the same N = tokens_per_gpu · P.
Useful FLOPs: Σ_i 4·B·H·(N/w_i)·(w_i/r_i)²·D (w_i capped at N), x3.5 for fwd+bwd, / P per GPU.
Time per call: wall clock of --reps back-to-back calls after one warm-up, synchronised,
barriers around the loop, the slowest rank's.

  python bench/bench_ring.py --gpus 1 2                       # raster, segment, sequence
  python bench/bench_ring.py --gpus 1 2 4 --orders raster --max-tokens
  python bench/bench_ring.py --dry-run-cpu --gpus 1 2 --out /tmp/x   # gloo on the CPU, toy sizes
  python bench/bench_ring.py --plot bench/results/ring-DATE.json     # redraw the plot
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # device README: no NVLink multicast
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402
from toolkit import log  # noqa: E402

tk.setup_paths()

GPU = dict(ws=[2048, 8192, 32768, 131072, 524288, 1048576], rs=[1, 2, 4, 8, 16, 32], H=16, D=128,
           tokens=262144, small=(8192, 2, 64))          # small: (N, H, D) of the fp64 check
DRY = dict(ws=[8, 32, 128], rs=[1, 2, 4], H=2, D=16, tokens=64, small=(128, 2, 16))
ORDERS = ("raster", "segment", "sequence")
BOUND_OUT, BOUND_GRAD = 2e-2, 4e-2


def grid_for(n: int) -> list[int]:
    """rows x cols = n, as square as possible (n = 2^k: rows = 2^floor(k/2))."""
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return [rows, n // rows]


def hilbert_for(order: str, n: int):
    return None if order == "raster" else {"scope": "segment"} if order == "segment" else \
        {"scope": "sequence", "grid": grid_for(n)}


def make_spec(geo, order: str, n: int, P: int, H=None, D=None, name=None):
    import dilgen
    return dilgen.Spec(name=name or f"ring_{order}_p{P}", num_heads=H or geo["H"], head_dim=D or geo["D"],
                       dtype="bfloat16", segment_lengths=geo["ws"], dilation_rates=geo["rs"], ring_size=P,
                       hilbert=hilbert_for(order, n))


def useful_flops_per_gpu(geo, N: int, P: int, fwd_bwd: bool) -> float:
    cfg = dict(B=1, H=geo["H"], D=geo["D"], N=N, ws=geo["ws"], rs=geo["rs"])
    return tk.useful_flops(cfg, False, fwd_bwd) / P


def shard_takes_spec() -> bool:
    from dilgen.runtime import ring
    try:
        return "spec" in inspect.signature(ring.shard).parameters
    except (TypeError, ValueError):
        return False


def my_rows(x, P, rank, spec, dim=1):
    """Rank `rank`'s rows of a full tensor: shard(..., spec=spec) (Hilbert sequence scope:
    its run of the curve, in curve order). One rank (no ring): the whole tensor, in raster order."""
    from dilgen.runtime.ring import shard
    if P == 1:
        return x
    if shard_takes_spec():
        return shard(x, P, rank, spec=spec, dim=dim)
    if spec.hilbert is not None and spec.hilbert.scope == "sequence":
        raise RuntimeError("the installed dilgen's ring.shard() does not accept spec= yet, so a rank's rows "
                           "under Hilbert sequence scope cannot be taken: update dilgen (SPEC §2 Ring)")
    return shard(x, P, rank, dim=dim)


# --------------------------------------------------------------------------- one rank

class Rank:
    def __init__(self, rank, P, args, dist, dev):
        import torch
        self.torch, self.rank, self.P, self.args, self.dist, self.dev = torch, rank, P, args, dist, dev
        self.geo = DRY if args.dry_run_cpu else GPU

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def wall_ms(self, fn, reps, barrier=True):
        """ms per call: one warm-up, then reps calls back to back; the slowest rank's."""
        fn()
        self.sync()
        if barrier:
            self.dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        self.sync()
        if barrier:
            self.dist.barrier()
        ms = (time.perf_counter() - t0) / reps * 1e3
        if not barrier:
            return ms
        t = self.torch.tensor([ms], device=self.dev, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.item()

    def allsum(self, vals):
        t = self.torch.tensor(vals, device=self.dev, dtype=self.torch.float64)
        self.dist.all_reduce(t)
        return t.tolist()

    def bf16_error(self, order) -> float:
        """bf16 ring vs the float64 reference on a small N (every rank's rows)."""
        import dilgen
        from dilgen.reference import reference_attention
        torch, P = self.torch, self.P
        n, h, d = self.geo["small"]
        spec = make_spec(self.geo, order, n, P, H=h, D=d, name=f"ring_err_{order}_p{P}")
        gen = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, n, h, d, generator=gen) for _ in range(3))
        mine = [my_rows(t, P, self.rank, spec).to(torch.bfloat16).to(self.dev) for t in (q, k, v)]
        with torch.no_grad():
            out = dilgen.compile(spec)(*mine)
        ref = my_rows(reference_attention(q, k, v, spec), P, self.rank, spec)
        num, den = self.allsum([(out.double().cpu() - ref).norm().item() ** 2, ref.norm().item() ** 2])
        return math.sqrt(num / den)

    def run(self, order) -> dict:
        import dilgen
        torch, P, rank, a, geo = self.torch, self.P, self.rank, self.args, self.geo
        T = a.tokens_per_gpu or geo["tokens"]
        N = T * P
        row = {"gpus": P, "tokens_per_gpu": T, "N": N, "hilbert": None if order == "raster" else order,
               "hilbert_spec": hilbert_for(order, N), "order": order}
        spec = make_spec(geo, order, N, P)
        one = make_spec(geo, order, N, 1, name=f"ring_{order}_one")
        row["bf16_rel_error_vs_fp64"] = self.bf16_error(order)
        # -- the single-device kernel on the full N: reference rows and T_1(N)
        g = torch.Generator(device=self.dev).manual_seed(1234)       # the same tensors on every rank
        full = [torch.randn(1, N, geo["H"], geo["D"], device=self.dev, dtype=torch.bfloat16, generator=g)
                for _ in range(4)]
        q, k, v, gout = full
        single = dilgen.compile(one) if P > 1 else None
        ref = None
        if P > 1:
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = single(*leaves)
            out.backward(gout)
            ref = [my_rows(t, P, rank, spec).clone() for t in [out.detach()] + [t.grad for t in leaves]]
            del out, leaves
            tk.cleanup(self.dev)
        mine = [my_rows(t, P, rank, spec).clone() for t in full]
        if P > 1:
            if rank == 0:
                def s_fwd():
                    with torch.no_grad():
                        single(q, k, v)
                s_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

                def s_fwd_bwd():
                    for t in s_leaves:
                        t.grad = None
                    single(*s_leaves).backward(gout)
                row["single_device_fwd_ms"] = self.wall_ms(s_fwd, a.reps, barrier=False)
                row["single_device_fwd_bwd_ms"] = self.wall_ms(s_fwd_bwd, max(1, a.reps // 2), barrier=False)
                del s_leaves
            self.dist.barrier()
        del q, k, v, gout, full
        tk.cleanup(self.dev)
        # -- the ring on this rank's rows
        kernel = dilgen.compile(spec)
        lq, lk, lv, lg = mine
        leaves = [t.clone().requires_grad_(True) for t in (lq, lk, lv)]
        out = kernel(*leaves)
        out.backward(lg)
        if ref is not None:
            got = [out.detach()] + [t.grad for t in leaves]
            sq = []
            for x, y in zip(got, ref):
                sq += [(x.double() - y.double()).norm().item() ** 2, y.double().norm().item() ** 2]
            worst = [math.sqrt(sq[2 * i] / max(sq[2 * i + 1], 1e-300)) for i in range(4)]
            tot = self.allsum(sq)
            errs = [math.sqrt(tot[2 * i] / max(tot[2 * i + 1], 1e-300)) for i in range(4)]
            mx = torch.tensor(worst, device=self.dev, dtype=torch.float64)
            self.dist.all_reduce(mx, op=self.dist.ReduceOp.MAX)
            row["check_rel_err_vs_single_device"] = dict(zip(("out", "dq", "dk", "dv"), errs))
            row["check_worst_rank_rel_err"] = dict(zip(("out", "dq", "dk", "dv"), mx.tolist()))
            row["check_passed"] = bool(max(mx.tolist()[:1]) < BOUND_OUT and max(mx.tolist()[1:]) < BOUND_GRAD)
            del got, ref
        del out

        def fwd():
            with torch.no_grad():
                kernel(lq, lk, lv)

        def fwd_bwd():
            for t in leaves:
                t.grad = None
            kernel(*leaves).backward(lg)
        transports = ["ring"] + (["allgather"] if P > 1 and order == "raster" and not a.no_allgather else [])
        for tr in transports:
            os.environ["DILGEN_RING_TRANSPORT"] = tr
            key = "" if tr == "ring" else "allgather_"
            if self.dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.dev)
            row[f"{key}fwd_ms"] = self.wall_ms(fwd, a.reps)
            row[f"{key}fwd_bwd_ms"] = self.wall_ms(fwd_bwd, max(1, a.reps // 2))
            if self.dev.type == "cuda":
                row[f"{key}peak_gib"] = torch.cuda.max_memory_allocated(self.dev) / 2**30
        os.environ["DILGEN_RING_TRANSPORT"] = "auto"
        if P == 1:
            row["single_device_fwd_ms"], row["single_device_fwd_bwd_ms"] = row["fwd_ms"], row["fwd_bwd_ms"]
        else:
            try:
                from dilgen.ir import ring_schedule
                sched = ring_schedule(kernel.compiled_for(lq.device).attention.plan["ring"], N)
                row["remote_steps"], row["bytes_fraction"] = len(sched["steps"]) - 1, sched["bytes_fraction"]
            except Exception as e:  # noqa: BLE001 - informational only
                row["schedule_error"] = tk.short_err(e, 200)
        for kind, fb in (("fwd", False), ("fwd_bwd", True)):
            fl = useful_flops_per_gpu(geo, N, P, fb)
            row[f"useful_tflops_per_gpu_{kind}"] = fl / row[f"{kind}_ms"] / 1e9
            s = row.get(f"single_device_{kind}_ms")
            row[f"strong_scaling_eff_{kind}"] = s / (P * row[f"{kind}_ms"]) if s else None
        row["strong_scaling_eff"] = row["strong_scaling_eff_fwd_bwd"]
        del leaves, mine, lq, lk, lv, lg
        tk.cleanup(self.dev)
        if order == "raster" and self.dev.type == "cuda":
            if P == 1 and not a.no_flash:
                self.flash_step(row, T)
            if a.max_tokens:
                self.longest(row, kernel, T)
        return row

    def flash_step(self, row, T):
        """Dense ring of flash attention: one step = flash over T queries against T keys."""
        torch, geo = self.torch, self.geo
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional
        qd, kd, vd, gd = (torch.randn(1, geo["H"], T, geo["D"], device=self.dev, dtype=torch.bfloat16)
                          for _ in range(4))
        sd = [t.clone().requires_grad_(True) for t in (qd, kd, vd)]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            def f():
                with torch.no_grad():
                    F.scaled_dot_product_attention(qd, kd, vd)

            def fb():
                F.scaled_dot_product_attention(*sd).backward(gd)
            row["flash_step_fwd_ms"] = self.wall_ms(f, 2)
            row["flash_step_fwd_bwd_ms"] = self.wall_ms(fb, 1)

    def longest(self, row, kernel, T):
        """Grow tokens per GPU while the measured peak, scaled, fits; every rank agrees first."""
        torch, geo = self.torch, self.geo
        per_token = row["peak_gib"] * 2**30 / T
        free = torch.cuda.mem_get_info(self.dev)[1] * 0.92
        best = T
        for t_try in self.args.max_tokens:
            fits = torch.tensor([1 if per_token * t_try * 1.1 < free else 0], device=self.dev)
            self.dist.all_reduce(fits, op=self.dist.ReduceOp.MIN)
            if not fits.item():
                break
            ok = torch.tensor([1], device=self.dev)
            try:
                big = [torch.randn(1, t_try, geo["H"], geo["D"], device=self.dev, dtype=torch.bfloat16)
                       .requires_grad_(True) for _ in range(3)]
                t0 = time.perf_counter()
                kernel(*big).backward(torch.randn_like(big[0]))
                self.sync()
                row[f"fwd_bwd_ms_at_{t_try}"] = (time.perf_counter() - t0) * 1e3
                del big
            except torch.OutOfMemoryError:
                ok[0] = 0
            tk.cleanup(self.dev)
            self.dist.all_reduce(ok, op=self.dist.ReduceOp.MIN)
            if not ok.item():
                break
            best = t_try
        row["max_tokens_per_gpu_fwd_bwd"] = best


def worker(rank, P, port, args, out_path):
    import warnings
    import torch
    import torch.distributed as dist
    if args.dry_run_cpu:   # masked lanes of the interpreter's numpy arithmetic
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if args.dry_run_cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=P, timeout=timedelta(seconds=600))
    else:
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=P, timeout=timedelta(seconds=300), device_id=dev)
    me = Rank(rank, P, args, dist, dev)
    rows = []
    for order in args.orders:
        t0 = time.time()
        try:
            row = me.run(order)
        except Exception as e:  # noqa: BLE001 - record, go on with the next order
            row = {"gpus": P, "tokens_per_gpu": args.tokens_per_gpu or me.geo["tokens"],
                   "hilbert": None if order == "raster" else order, "order": order, "error": tk.short_err(e, 600)}
            if os.environ.get("BENCH_TRACEBACK") or rank == 0:
                row["traceback"] = traceback.format_exc()[-3000:]
            tk.cleanup(dev)
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        if rank == 0:
            tk.write_json_atomic(out_path, rows)
            state = row.get("error") or (f"fwd {row['fwd_ms']:.1f} ms, fwd+bwd {row['fwd_bwd_ms']:.1f} ms, strong "
                                         f"eff {tk.fmt(row.get('strong_scaling_eff'), '.2f')}")
            log(f"    P={P} {order:8s} {state}  ({row['wall_s']:.0f} s)")
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001
            break
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- parent

def finish(rows):
    """Weak-scaling efficiency against the 1-GPU row of the same order; modelled dense flash ring."""
    for r in rows:
        base = next((b for b in rows if b["gpus"] == 1 and b.get("order") == r.get("order") and "fwd_bwd_ms" in b
                     and b.get("tokens_per_gpu") == r.get("tokens_per_gpu")), None)
        if base and "fwd_bwd_ms" in r:
            for kind in ("fwd", "fwd_bwd"):
                r[f"efficiency_{kind}"] = r[f"useful_tflops_per_gpu_{kind}"] / base[f"useful_tflops_per_gpu_{kind}"]
        flash = next((b for b in rows if b["gpus"] == 1 and "flash_step_fwd_ms" in b), None)
        if flash and r.get("order") == "raster":
            r["dense_ring_flash_fwd_ms_modelled"] = flash["flash_step_fwd_ms"] * r["gpus"]
            r["dense_ring_flash_fwd_bwd_ms_modelled"] = flash["flash_step_fwd_bwd_ms"] * r["gpus"]


def report(rows):
    def k(x):
        return f"{x // 1024}K" if x % 1024 == 0 else str(x)
    body = []
    for r in sorted(rows, key=lambda r: (ORDERS.index(r.get("order", "raster")), r["gpus"])):
        if "fwd_bwd_ms" not in r:
            body.append([r["gpus"], r.get("order"), k(r["tokens_per_gpu"]), "—",
                         "failed: " + r.get("error", "?")[:200]] + [""] * 8)
            continue
        chk = r.get("check_worst_rank_rel_err")
        body.append([r["gpus"], r["order"], k(r["tokens_per_gpu"]), k(r["N"]), f"{r['fwd_ms']:.1f}",
                     f"{r['fwd_bwd_ms']:.1f}", tk.fmt(r.get("single_device_fwd_bwd_ms"), ".1f"),
                     f"{r['useful_tflops_per_gpu_fwd_bwd']:.0f}", tk.fmt(r.get("efficiency_fwd_bwd"), ".0%"),
                     tk.fmt(r.get("strong_scaling_eff"), ".0%"), tk.fmt(r.get("allgather_fwd_bwd_ms"), ".1f"),
                     "—" if not chk else "/".join(f"{chk[x]:.1e}" for x in ("out", "dq", "dk", "dv")),
                     f"{r['bf16_rel_error_vs_fp64']:.1e}"])
    log(tk.markdown_table(["GPUs", "order", "tokens/GPU", "N", "fwd ms", "fwd+bwd ms", "1-GPU fwd+bwd ms (same N)",
                           "TFLOP/s per GPU", "weak eff", "strong eff", "all-gather fwd+bwd ms",
                           "rows vs 1 GPU out/dq/dk/dv", "bf16 vs fp64"], body))


def plot(result, path):
    plt = tk.pyplot()
    rows = [r for r in result["rows"] if "fwd_bwd_ms" in r]
    if plt is None or not rows:
        return
    try:
        fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
        style = {"raster": "o-", "segment": "s--", "sequence": "^:"}
        gpus = sorted({r["gpus"] for r in rows})
        for order in ORDERS:
            rs = sorted((r for r in rows if r.get("order") == order), key=lambda r: r["gpus"])
            if not rs:
                continue
            g = [r["gpus"] for r in rs]
            label = "raster" if order == "raster" else f"Hilbert {order}"
            ax[0].plot(g, [r["useful_tflops_per_gpu_fwd_bwd"] for r in rs], style[order], label=label)
            se = [(r["gpus"], r["strong_scaling_eff"]) for r in rs if r.get("strong_scaling_eff")]
            ax[1].plot([x for x, _ in se], [y for _, y in se], style[order], label=label)
        ag = sorted((r for r in rows if r.get("allgather_fwd_bwd_ms")), key=lambda r: r["gpus"])
        if ag:
            geo = dict(H=result["spec"]["num_heads"], D=result["spec"]["head_dim"],
                       ws=result["spec"]["segment_lengths"], rs=result["spec"]["dilation_rates"])
            ax[0].plot([r["gpus"] for r in ag], [useful_flops_per_gpu(geo, r["N"], r["gpus"], True)
                                                 / r["allgather_fwd_bwd_ms"] / 1e9 for r in ag],
                       "x-.", color="gray", label="raster, all-gather (LongNet)")
        t = rows[0]["tokens_per_gpu"]
        ax[0].set(xlabel="GPUs", ylabel="useful TFLOP/s per GPU (fwd+bwd)", xticks=gpus,
                  title=f"weak scaling, {t // 1024 if t >= 1024 else t}{'K' if t >= 1024 else ''} tokens per GPU")
        ax[0].set_ylim(bottom=0)
        ax[1].axhline(1.0, color="black", linewidth=0.8)
        ax[1].set(xlabel="GPUs", ylabel="T_1(N) / (P · T_P(N))", xticks=gpus, ylim=(0, 1.15),
                  title="strong scaling efficiency (fwd+bwd), N = tokens/GPU x P")
        for a_ in ax:
            a_.legend(fontsize=8)
            a_.grid(alpha=0.3)
        fig.suptitle(f"dilgen ring, bf16 — {result['device']}, {result['date']}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        log(f"plot: {path}")
    except Exception as e:  # noqa: BLE001
        log(f"plot failed: {tk.short_err(e)}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4], help="GPU counts (default 1 2 4)")
    ap.add_argument("--tokens-per-gpu", type=int, default=None, help="default 262144 (dry run: 64)")
    ap.add_argument("--orders", default=",".join(ORDERS), help="subset of raster,segment,sequence")
    ap.add_argument("--reps", type=int, default=None, help="timed calls (fwd+bwd: half) (default 4; dry run 1)")
    ap.add_argument("--max-tokens", type=int, nargs="*", default=None,
                    help="tokens per GPU to try for the longest fwd+bwd sequence (raster); bare flag: "
                         "1M 1.5M 2M; default: not measured")
    ap.add_argument("--no-allgather", action="store_true", help="skip LongNet's all-gather transport")
    ap.add_argument("--no-flash", action="store_true", help="skip the dense flash ring model")
    ap.add_argument("--out", default=str(tk.RESULTS))
    ap.add_argument("--append", nargs="?", const=True, default=False, metavar="FILE",
                    help="keep the rows of an earlier run not redone: of today's ring-<date>.json in --out, or of FILE")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run-cpu", action="store_true", help="gloo on the CPU at toy sizes (numbers meaningless)")
    ap.add_argument("--plot", dest="replot", metavar="JSON", help="only redraw the plot of a result file")
    a = ap.parse_args(argv)
    a.orders = [o.strip() for o in a.orders.split(",") if o.strip()]
    if [o for o in a.orders if o not in ORDERS]:
        ap.error(f"--orders: choose from {','.join(ORDERS)}")
    if a.max_tokens is not None and not a.max_tokens:
        a.max_tokens = [1 << 20, 3 << 19, 2 << 20]
    a.reps = a.reps or (1 if a.dry_run_cpu else 4)
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    import torch
    import torch.multiprocessing as mp
    geo = DRY if args.dry_run_cpu else GPU
    if args.dry_run_cpu:
        gpus = args.gpus
    else:
        if not torch.cuda.is_available():
            log("bench_ring.py needs CUDA GPUs; --dry-run-cpu runs the flow with gloo on the CPU at toy sizes.")
            return 2
        n_dev = torch.cuda.device_count()
        gpus = [p for p in args.gpus if p <= n_dev]
        if gpus != args.gpus:
            log(f"only {n_dev} GPU(s): running --gpus {gpus}")
    if not shard_takes_spec():
        log("note: the installed dilgen's ring.shard() does not accept spec= yet: Hilbert 'sequence' rows will "
            "fail with a message; raster and 'segment' rows use shard(x, P, rank)")
    dry = args.dry_run_cpu
    head = tk.header("cpu" if dry else "cuda", dry, {
        "args": vars(args),
        "spec": {"segment_lengths": geo["ws"], "dilation_rates": geo["rs"], "num_heads": geo["H"],
                 "head_dim": geo["D"], "dtype": "bfloat16", "batch": 1},
        "notes": ["strong_scaling_eff = T_1(N) / (P * T_P(N)), N = tokens_per_gpu * P, T_1 the single-device "
                  "kernel (ring_size 1) on the full N (fwd+bwd; _fwd: forward only)",
                  "efficiency_*: weak scaling, useful TFLOP/s per GPU against the 1-GPU row of the same order",
                  "check_*: every rank's rows of out, dq, dk, dv against the single-device kernel's same rows",
                  "useful FLOPs: sum_i 4*B*H*(N/w_i)*(w_i/r_i)^2*D (w_i capped at N), x3.5 fwd+bwd, / P per GPU"]})
    if not dry:
        head["device"] = f"{len(gpus) and max(gpus)} x {head['device']}"
    res = tk.Results(tk.result_path(args.out, "ring", dry), head, key=("gpus", "order", "tokens_per_gpu"),
                     append=args.append, lists=())
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for i, P in enumerate(gpus):
            log(f"[{i + 1}/{len(gpus)}] {P} {'process' if dry else 'GPU'}(s), "
                f"{args.tokens_per_gpu or geo['tokens']} tokens each, orders {args.orders} ...")
            path = Path(tmp) / f"ring_{P}.json"
            t0 = time.time()
            try:
                mp.start_processes(worker, args=(P, _free_port(), args, str(path)), nprocs=P, join=True,
                                   start_method="spawn")
            except Exception as e:  # noqa: BLE001 - a crashed rank: keep what rank 0 wrote
                log(f"  P={P}: {tk.short_err(e, 300)}")
                failed = True
            rows = json.loads(path.read_text()) if path.exists() else [{"gpus": P, "error": "no result"}]
            for r in rows:
                r.setdefault("tokens_per_gpu", args.tokens_per_gpu or geo["tokens"])
                res.add(r)
                failed |= "error" in r or r.get("check_passed") is False
            log(f"  {P}: {time.time() - t0:.0f} s")
            finish(res.rows)
            res.save()
    rows = res.all_rows()
    finish(rows)
    res.save()
    report(rows)
    if not args.no_plot:
        plot({**res.data, "rows": rows}, tk.result_path(args.out, "ring", dry, ext="png"))
    log(f"json: {res.path}")
    bad = [f"P={r['gpus']} {r.get('order')}: {r.get('error', 'check failed')[:160]}" for r in res.rows
           if "error" in r or r.get("check_passed") is False]
    if bad or failed:
        log(f"{len(bad)} row(s) failed (exit status 1):\n  " + "\n  ".join(bad))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
