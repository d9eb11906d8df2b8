#!/usr/bin/env python3
"""Forward of dilgen, its exact peers (gather_cudnn, gather_flash, flex) and two reference points
(dense, cudnn_floor), configs A-F x {non-causal, causal}, bf16, one GPU (bench/README.md): each
checked against float64, then timed as bench_backward.py does, with the bf16 matmul ceiling.
Writes forward-<date>.json, .png, roofline-<date>.png; exit 1 if dilgen failed its check.

  python bench/bench_forward.py                          # A-F, both causal flags
  python bench/bench_forward.py --configs A,F --no-causal --quick
  python bench/bench_forward.py --methods dilgen --merge-into bench/results/forward-DATE.json
  python bench/bench_forward.py --host --configs A,C      # host time per call (bench/README.md)
"""
from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_backward  # noqa: E402
import toolkit as tk  # noqa: E402

CHECK_N = {"A": 4096, "B": 2048, "C": 4096, "D": 2048, "E": 2048, "F": 4096}   # fp64 reference: ~N² per head
TOL = 2e-2               # SPEC §2, bf16: relative error of out and max |lse - lse_ref|
class Bench(bench_backward.Bench):
    """bench_backward.Bench with the forward alone as the step, checked with the LSE."""
    kind, prefix, fwd_bwd = "forward", "bench", False
    CHECKED = ("dilgen", "gather_cudnn", "gather_flash")
    NOTES = ["useful_gflop: Σ_i 4·B·H·(N/w_i)·(w_i/r_i)²·D, halved when causal (dilgen.stats)",
             "useful_tflops: dilgen's; useful_tflops_by_method: the same work / each method's time",
             "dense: plain dense SDPA; cudnn_floor: cuDNN on the gathered lane shapes, no gather, scatter or merge; "
             "REFERENCE POINTS only (not the same math)", "speedup_vs_X = X_ms / dilgen_ms", "X_peak_extra_gib: "
             "max_memory_allocated during one call minus what was allocated before it minus its outputs"]

    OPTIONS = (("--flex-mask", dict(choices=("analytic", "create"), default="analytic", help="flex BlockMask "
                                    "from the segment structure (checked equal to create_block_mask's) or "
                                    "create_block_mask; Hilbert: create")),
               ("--flex-max-n", dict(type=int, default=1 << 30, help="no flex above this N")),
               ("--matmul-n", dict(type=int, default=8192, help="size of the matmul ceiling (0: skip)")),
               ("--host", dict(action="store_true", help="host µs per call of every pass (GPU kept busy), one "
                                                          "call vs back to back, replay checks: host-<date>.json")))

    def check_n(self, cname):
        return self.a.check_n or (2048 if self.a.quick else CHECK_N[cname])

    def callables(self, m, spec, x):
        """(fn timed, fn whose result is compared): forward, (out, lse) both."""
        q, k, v = x
        fn = (self.peers.lane_floor(spec, q.shape[0], q.shape[1], self.dev) if m == "cudnn_floor"
              else functools.partial(self.attend(m, spec, lse=True), q, k, v))
        return fn, fn

    def compare(self, row, m, res, base, against):
        err = row.setdefault(f"rel_err_vs_{against}", {})[m] = tk.rel_err(res[0], base[0])
        d, pat = tk.lse_diff(res[1], base[1])
        row.setdefault(f"lse_max_abs_diff_vs_{against}", {})[m] = d
        row.setdefault(f"lse_inf_pattern_equal_vs_{against}", {})[m] = pat
        return f"  vs {against}: rel_err {err:.1e}, max|dlse| {d:.1e}" + ("" if pat else " (-inf differ!)")

    def row_extra(self, cfg, causal):
        return {"dense_gflop": 4 * cfg["B"] * cfg["H"] * cfg["N"] ** 2 * cfg["D"] / (2 if causal else 1) / 1e9,
                "rel_err_vs_dilgen": {}, "lse_max_abs_diff_vs_dilgen": {}, "lse_inf_pattern_equal_vs_dilgen": {}}

    def check_case(self, spec, x, methods, tol=TOL):
        """Records of `methods` against dilgen.reference (float64) on inputs x."""
        from dilgen.reference import reference_attention
        try:
            ref_out, ref_lse = reference_attention(*x, spec, return_lse=True)
        except Exception as e:  # noqa: BLE001
            return [{"method": "reference", "error": tk.short_err(e), "passed": False}]
        recs = []
        for m in methods:
            with tk.failsoft(rec := {"method": m if isinstance(m, str) else m[0]}, passed=False):
                out, lse = (self.callables(m, spec, x)[1] if isinstance(m, str) else m[1])()
                rec["rel_err_vs_ref"] = tk.rel_err(out.cpu(), ref_out)
                rec["max_abs_lse_err"], rec["lse_inf_pattern_ok"] = (0.0, True) if lse is None else \
                    tk.lse_diff(lse.cpu(), ref_lse)
                zero = bool((out.cpu().transpose(1, 2)[~ref_lse.isfinite()] == 0).all())   # rows no branch keeps
                rec["passed"] = bool(rec["rel_err_vs_ref"] < tol and rec["max_abs_lse_err"] < tol
                                     and rec["lse_inf_pattern_ok"] and zero)
                rec["_detail"] = (f"rel_err {rec['rel_err_vs_ref']:.2e}  max|dlse| {rec['max_abs_lse_err']:.2e}  "
                                  f"-inf pattern (out 0) ok {rec['lse_inf_pattern_ok'] and zero}")
            recs.append(rec)
        if "flex" in self.a.methods and self.peers.FLEX_MASK_METHOD == "analytic" and spec.hilbert is None:
            recs.append(self.check_block_mask(spec, x[0].shape[1]))
        return recs

    def check_block_mask(self, spec, n):
        from torch.nn.attention.flex_attention import create_block_mask
        with tk.failsoft(rec := {"method": "flex_block_mask"}, passed=False):
            bm_a, mask_mod, _, _ = self.peers.flex_block_mask(spec, n, self.dev, "analytic")
            bm_c = create_block_mask(mask_mod, B=None, H=spec.num_heads, Q_LEN=n, KV_LEN=n, device=self.dev)
            (a_ne, a_full), (c_ne, c_full) = self.peers.block_sets_of(bm_a), self.peers.block_sets_of(bm_c)
            rec.update(nonempty_equal=self.torch.equal(a_ne, c_ne), full_equal=self.torch.equal(a_full, c_full))
            rec["passed"] = rec["nonempty_equal"] and rec["full_equal"]
            rec["detail"] = f"analytic == create_block_mask: nonempty {rec['nonempty_equal']}, full {rec['full_equal']}"
        return rec

    def timing(self):
        super().timing()
        if self.a.matmul_n:        # the roofline's ceiling: TFLOP/s of one bf16 n³ matmul (n <= 512 on the CPU)
            torch, n = self.torch, self.a.matmul_n if self.dev.type == "cuda" else min(self.a.matmul_n, 512)
            a, b = (torch.randn(n, n, device=self.dev, dtype=torch.bfloat16) for _ in range(2))
            t = tk.time_ms(lambda: a @ b, self.a.warmup, self.a.reps, self.dev)
            mm = self.res.data["matmul_ceiling"] = {"n": n, "dtype": "bfloat16", "ms": t["median"],
                                                    "tflops": 2 * n ** 3 / t["median"] / 1e9, "timing_ms": t}
            tk.log(f"\n== matmul ceiling: bf16 {n}^3: {mm['ms']:.3f} ms = {mm['tflops']:.0f} TFLOP/s ==")
            self.res.save()

    @staticmethod
    def draw(data, rows, path):
        """The bars, and the roofline: useful TFLOP/s per (config, causal) of the exact methods (rows'
        useful_tflops_by_method) under the measured matmul ceiling."""
        bench_backward.Bench.draw(data, rows, path)
        top = (data.get("matmul_ceiling") or {}).get("tflops")

        def ceiling(ax):
            if top:
                ax.axhline(top, color="black", linestyle="--", linewidth=1)
                ax.text(len(rows) - 0.5, top, f"bf16 matmul ceiling {top:.3g} TFLOP/s", ha="right", va="bottom",
                        fontsize=8)
        roof = Path(path).with_name(Path(path).name.replace("forward", "roofline", 1)).with_suffix(".png")
        return tk.plot_bars(rows, ("dilgen", "gather_cudnn", "gather_flash", "flex"), roof, "useful TFLOP/s (same "
                            "work figure for every method)", "useful TFLOP/s of the exact methods, bf16 forward — "
                            f"{data.get('device')}, torch {data.get('torch')}, triton {data.get('triton')}, "
                            f"{data.get('date')}", lambda r, m: (r.get("useful_tflops_by_method") or {}).get(m),
                            log_scale=False, extra=ceiling)


def host_us(torch, fn, calls: int = 20, rounds: int = 5) -> dict:
    """Host µs per call, the calls queued behind a long sleep kernel (the GPU busy: the wall
    clock times the host alone); gpu_stayed_busy False: a call waited for the GPU (a sync)."""
    times, busy = [], True
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)                   # ~0.2 s at 2 GHz
        asleep, t0 = torch.cuda.Event(), time.perf_counter()
        asleep.record()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        busy &= not asleep.query()
    return {"host_us": sorted(times)[rounds // 2], "gpu_stayed_busy": busy}


def host_calls(torch, kernel, causal_kernel, B, N, c, dev):
    """({pass: fn} of dilgen.Kernel as users call it, {pass: fn} of SDPA, the tensors)."""
    gen = torch.Generator(dev).manual_seed(B * N)   # not the default one: a failed capture breaks it
    q, k, v, g = (torch.randn(B, N, c["H"], c["D"], device=dev, dtype=torch.bfloat16, generator=gen) for _ in "qkvg")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    rows = [t.reshape(B * N, c["H"], c["D"]) for t in (q, k, v)]
    cu = torch.arange(0, B * N + 1, N // 4, dtype=torch.int32, device=dev)
    mask = torch.arange(N, device=dev).expand(B, N) >= N - 64
    cache_len, q1 = torch.full((B,), N, dtype=torch.int32, device=dev), q[:, -1:].contiguous()
    sdpa, grad = torch.nn.functional.scaled_dot_product_attention, torch.autograd.grad
    heads_first = lambda *ts: [t.transpose(1, 2) for t in ts]   # noqa: E731  (B, H, N, D) views
    calls = {"fwd": lambda: kernel(q, k, v), "fwd_bwd": lambda: grad(kernel(qg, kg, vg), (qg, kg, vg), g),
             "packed": lambda: kernel(*rows, cu_seqlens=cu, max_seqlen=N // 4),
             "padded": lambda: kernel.padded(q, k, v, mask),
             "decode": lambda: causal_kernel.decode(q1, k, v, cache_len, validate=False)}
    peer = {"fwd": lambda: sdpa(*heads_first(q, k, v)), "decode": lambda: sdpa(*heads_first(q1, k, v)),
            "fwd_bwd": lambda: grad(sdpa(*heads_first(qg, kg, vg)), (qg, kg, vg), g.transpose(1, 2))}
    return calls, peer, (q, k, v, g, qg, kg, vg)


def host_checks(torch, kernel, tensors, dev) -> dict:
    """Replayed calls (dilgen/runtime/replay.py; with and without gradients) and a CUDA-graph
    replay of forward + backward equal a fresh call, bit for bit (a poisoned, unwritten row is NaN: unequal)."""
    from dilgen.runtime import set_poison
    q, k, v, g, qg, kg, vg = tensors
    attn = kernel.compiled_for(dev).attention

    def step(leaves=(qg, kg, vg)):
        out, lse = kernel(*leaves, return_lse=True)
        return (out, lse, *torch.autograd.grad(out, leaves, g))
    set_poison(True)     # an unwritten row is NaN in one call and not the other
    try:
        attn._replays.clear()
        fresh, again = step(), step()
        recorded = sum(hasattr(r, "launches") for r in attn._replays.values())   # recipes, not refusals
        with torch.no_grad():
            attn._replays.clear()
            plain = [kernel(q, k, v, return_lse=True) for _ in range(2)]
    finally:
        set_poison(False)
    same = lambda xs: all(torch.equal(a, b) for a, b in zip(fresh, xs))   # noqa: E731
    chk = {"recipes_recorded": recorded, "replay_equal": same(again) and all(map(torch.equal, *plain))}
    try:     # as torch.cuda.make_graphed_callables: warm-up on a side stream, capture, replay
        cuda_graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # leaves whose gradient accumulators are not the default stream's
            step(leaves := tuple(t.detach().clone().requires_grad_() for t in (q, k, v)))
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(cuda_graph):
            captured = step(leaves)
        cuda_graph.replay()
        chk["cuda_graph_equal"] = same(captured)
    except Exception as e:  # noqa: BLE001
        chk["cuda_graph_equal"], chk["graph_error"] = False, tk.short_err(e, 1500)
    return chk


def host_bench(a) -> int:
    """--host: host µs per call of every pass beside SDPA on the dense problem, one call against
    back to back, replay and CUDA-graph checks: host-<date>.json."""
    import torch
    import dilgen
    tk.quiet()
    dev = torch.device("cuda")
    notes = [host_us.__doc__, "one_call_ms: the GPU idle before each call; peer: SDPA on the dense problem"]
    res = tk.Results(tk.result_path(a.out, "host", tag=tk.gpu_tag(torch.cuda.get_device_name())),
                     tk.header(dev, extra={"notes": notes}), key=("config", "pass", "method"))
    cases = [(n, n, tk.CONFIGS[n]["B"], tk.CONFIGS[n]["N"]) for n in a.configs]
    cases += [(f"N{n // 1024}K_B{b}", "A", b, n) for n in (2048, 4096, 8192) for b in (1, 8) if not a.quick]
    failed = False
    for name, of, B, N in cases:
        c = {**tk.CONFIGS[of], "B": B, "N": N}
        kernel, causal = (dilgen.compile(tk.make_spec(of, c, x, "host")) for x in (False, True))
        calls, peer, tensors = host_calls(torch, kernel, causal, B, N, c, dev)
        with tk.failsoft(chk := {}):
            chk.update(host_checks(torch, kernel, tensors, dev))
        failed |= not chk.get("replay_equal")
        tk.log(f"{name} {res.add({'config': name, 'pass': 'check', 'method': 'dilgen', 'B': B, 'N': N, **chk})}")
        for method, fns in [("dilgen", calls), ("peer", peer)]:
            for p, fn in fns.items():
                with tk.failsoft(row := {"config": name, "pass": p, "method": method, "B": B, "N": N}):
                    fn()
                    row.update(host_us(torch, fn))
                    if p in ("fwd", "decode"):
                        row.update(one_call_ms=tk.time_ms(fn, 0, 20, dev, alone=True)["median"],
                                   back_to_back_ms=tk.time_ms(fn, 3, 10, dev)["median"])
                tk.log(f"  {name:9s} {p:8s} {method:7s} {json.dumps(res.add(row))}")
        del calls, peer, tensors
        tk.cleanup(dev)
        res.save()
    tk.log(f"json: {res.path}")
    return 1 if failed else 0


def main(argv=None):
    a = Bench.parse(argv)
    if a.host:
        return 2 if tk.no_gpu(False, "bench_forward.py --host") else host_bench(a)
    return bench_backward.main(argv, Bench)


if __name__ == "__main__":
    sys.exit(main())
