#!/usr/bin/env python3
"""Forward of dilgen, its exact peers (gather_cudnn, gather_flash, flex) and two reference points
(dense, cudnn_floor), configs A-F x {non-causal, causal}, bf16, one GPU; bench/README.md has the
methods, options and fields. Every method checked against the float64 reference before timing
(flex's block masks against create_block_mask), then timed (bench_backward.py's flow), the
peers against dilgen at full size, the bf16 matmul ceiling. Writes forward-<date>.json, .png
and roofline-<date>.png; exit status 1 if dilgen failed its check.

  python bench/bench_forward.py                          # A-F, both causal flags
  python bench/bench_forward.py --configs A,F --no-causal --quick
  python bench/bench_forward.py --methods dilgen --merge-into bench/results/forward-DATE.json
  python bench/bench_forward.py --check-peers            # the peers' semantics on the CPU
  python bench/bench_forward.py --host --configs A,C      # host time per call (bench/README.md)
"""
from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_backward  # noqa: E402
import toolkit as tk  # noqa: E402

CHECK_N = {"A": 4096, "B": 2048, "C": 4096, "D": 2048, "E": 2048, "F": 4096}   # fp64 reference: ~N² per head
TOL = 2e-2               # SPEC §2, bf16: relative error of out and max |lse - lse_ref|
SEG = {"scope": "segment"}
# --check-peers: (name, B, N, H, Hkv, D, ws, rs, softmax_scale, hilbert); causal and not, fp32 and bf16
PEER_CASES = [
    ("basic", 1, 64, 4, 4, 16, [16, 32], [1, 2], None, None), ("gqa", 2, 96, 6, 2, 16, [32, 64], [2, 3], None, None),
    ("short_tail_r3", 2, 70, 6, 6, 16, [16, 32, 48], [1, 2, 3], None, None),
    ("r_not_dividing_w", 1, 53, 6, 6, 32, [10, 7, 20], [3, 2, 3], 0.3, None),
    ("gqa_tail", 1, 100, 8, 2, 16, [32, 64, 16], [2, 4, 1], None, None),
    ("mqa", 1, 40, 4, 1, 16, [8, 40], [1, 4], None, None), ("w_gt_n", 1, 50, 4, 4, 16, [128, 16], [2, 1], None, None),
    ("r_gt_h_unkept_rows", 1, 64, 2, 2, 16, [32, 64], [4, 8], None, None),
    ("duplicate_branch", 1, 48, 2, 2, 16, [16, 16], [1, 1], None, None),
    ("single_branch", 1, 48, 3, 3, 16, [12], [3], None, None), ("w1", 1, 20, 2, 2, 16, [1, 4], [1, 2], None, None),
    ("block_scale", 1, 384, 4, 4, 16, [128, 256], [1, 2], None, None),
    ("longnet_like_tail", 1, 1100, 4, 4, 16, [128, 256, 512], [1, 2, 4], None, None),
    ("E_like", 1, 512, 12, 12, 16, [32, 64, 128, 256, 512], [1, 2, 4, 6, 12], None, None),
    ("E_like_gqa_tail", 1, 600, 12, 4, 16, [32, 64, 128, 256, 512], [1, 2, 4, 6, 12], None, None),
    ("F_like", 1, 512, 4, 4, 16, [32, 64, 128], [1, 2, 4], None, SEG),
    ("F_like_tail_w_gt_n", 2, 300, 4, 2, 16, [32, 64, 512], [1, 2, 4], None, SEG),
    ("hilbert_grids_r_not_dividing", 1, 200, 6, 6, 16, [24, 60], [5, 7], None,
     {"scope": "segment", "grids": [[4, 6], [6, 10]]}),
    ("hilbert_sequence", 1, 256, 4, 4, 16, [32, 64], [1, 2], None, {"scope": "sequence", "grid": [16, 16]}),
    ("hilbert_sequence_tail", 1, 192, 6, 3, 16, [48, 100], [2, 3], None, {"scope": "sequence", "grid": [8, 24]}),
    ("dense_one_branch", 1, 64, 4, 4, 16, [64], [1], None, None),      # dense_sdpa == the reference
]
# --check-peers: analytic flex block masks, (N, H, ws, rs), both causal flags: configs A-E at N 4096, odd ones
BLOCK_CASES = [(4096, c["H"], c["ws"], c["rs"]) for c in tk.CONFIGS.values() if not c.get("hilbert")] + [
    (4096, 16, [128, 256, 512, 1024, 2048], [1, 2, 4, 6, 12]), (4096, 16, [512, 2048], [4, 16]),
    (4096, 16, [128, 256, 512, 1024, 2048], [1, 2, 4, 8, 16]), (1000, 6, [100, 300, 77], [1, 3, 2]),
    (700, 4, [5, 64, 1000], [1, 2, 3]), (1024, 4, [1024, 512], [200, 1])]


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
               ("--check-peers", dict(action="store_true", help="only check the peers against float64 on the CPU")),
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
            rec = {"method": m if isinstance(m, str) else m[0]}
            try:
                out, lse = (self.callables(m, spec, x)[1] if isinstance(m, str) else m[1])()
                rec["rel_err_vs_ref"] = tk.rel_err(out.cpu(), ref_out)
                rec["max_abs_lse_err"], rec["lse_inf_pattern_ok"] = (0.0, True) if lse is None else \
                    tk.lse_diff(lse.cpu(), ref_lse)
                zero = bool((out.cpu().transpose(1, 2)[~ref_lse.isfinite()] == 0).all())   # rows no branch keeps
                rec["passed"] = bool(rec["rel_err_vs_ref"] < tol and rec["max_abs_lse_err"] < tol
                                     and rec["lse_inf_pattern_ok"] and zero)
                rec["_detail"] = (f"rel_err {rec['rel_err_vs_ref']:.2e}  max|dlse| {rec['max_abs_lse_err']:.2e}  "
                                  f"-inf pattern (out 0) ok {rec['lse_inf_pattern_ok'] and zero}")
            except Exception as e:  # noqa: BLE001
                rec.update(error=tk.short_err(e), passed=False)
            recs.append(rec)
        if "flex" in self.a.methods and self.peers.FLEX_MASK_METHOD == "analytic" and spec.hilbert is None:
            recs.append(self.check_block_mask(spec, x[0].shape[1]))
        return recs

    def check_block_mask(self, spec, n):
        from torch.nn.attention.flex_attention import create_block_mask
        rec = {"method": "flex_block_mask"}
        try:
            bm_a, mask_mod, _, _ = self.peers.flex_block_mask(spec, n, self.dev, "analytic")
            bm_c = create_block_mask(mask_mod, B=None, H=spec.num_heads, Q_LEN=n, KV_LEN=n, device=self.dev)
            (a_ne, a_full), (c_ne, c_full) = self.peers.block_sets_of(bm_a), self.peers.block_sets_of(bm_c)
            rec.update(nonempty_equal=self.torch.equal(a_ne, c_ne), full_equal=self.torch.equal(a_full, c_full))
            rec["passed"] = rec["nonempty_equal"] and rec["full_equal"]
            rec["detail"] = f"analytic == create_block_mask: nonempty {rec['nonempty_equal']}, full {rec['full_equal']}"
        except Exception as e:  # noqa: BLE001
            rec.update(error=tk.short_err(e), passed=False)
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
        """The bars, and the roofline: useful TFLOP/s against the matmul ceiling."""
        bench_backward.Bench.draw(data, rows, path)
        title = f"{data.get('device')}, torch {data.get('torch')}, triton {data.get('triton')}, {data.get('date')}"
        plot_roofline(rows, ("dilgen", "gather_cudnn", "gather_flash", "flex"),
                      (data.get("matmul_ceiling") or {}).get("tflops"),
                      Path(path).with_name(Path(path).name.replace("forward", "roofline", 1)).with_suffix(".png"),
                      f"useful TFLOP/s of the exact methods, bf16 forward — {title}")

    @classmethod
    def check_peers(cls, a):
        a.dry_run_cpu = True
        return check_peers(cls(a, results=False))


def plot_roofline(rows, methods, ceiling_tflops, path, title: str):
    """Useful TFLOP/s per (config, causal) and method (rows' useful_tflops_by_method), under the
    measured matmul ceiling."""
    def ceiling(ax):
        if ceiling_tflops:
            ax.axhline(ceiling_tflops, color="black", linestyle="--", linewidth=1)
            ax.text(len(rows) - 0.5, ceiling_tflops, f"bf16 matmul ceiling {ceiling_tflops:.3g} TFLOP/s",
                    ha="right", va="bottom", fontsize=8)
    return tk.plot_bars(rows, methods, path, "useful TFLOP/s (same work figure for every method)", title,
                        lambda r, m: (r.get("useful_tflops_by_method") or {}).get(m), log_scale=False, extra=ceiling)


def check_peers(b: Bench) -> int:
    """--check-peers: every peer against dilgen.reference (float64) on odd specs, fp32 (1e-5) and bf16
    (2e-2), flex eager with both block masks; the analytic block masks and bench_varlen.py's
    document block sets against create_block_mask's. Exit status 1 on any failure."""
    torch, peers, fails = b.torch, b.peers, 0
    g = torch.Generator().manual_seed(0)
    for (name, B, N, H, Hkv, D, ws, rs, scale, hil), causal in [(c, f) for c in PEER_CASES for f in (False, True)]:
        spec = b.dilgen.Spec(name="chk", num_heads=H, num_kv_heads=Hkv, head_dim=D, segment_lengths=ws,
                             dilation_rates=rs, causal=causal, dtype="float32", softmax_scale=scale, hilbert=hil)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            x = [torch.randn(B, N, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv)]
            if name.startswith("dense"):
                runs = [("dense_sdpa", lambda: peers.dense_sdpa(*x, spec))]
            else:
                runs = [(p, lambda p=p: peers.PEERS[p](*x, spec)) for p in ("gather_cudnn", "gather_flash")]
                runs += [(f"flex[{mm}]", lambda mm=mm: peers.flex(*x, spec, method=mm)) for mm in
                         (("create",) if hil else ("analytic", "create")) if dtype == torch.float32]
            for rec in b.check_case(spec, x, runs, tol):
                fails += not rec["passed"]
                if not rec["passed"]:
                    tk.log(f"  FAIL {name} causal={causal} {str(dtype)[6:]} {rec['method']}: "
                           f"{rec.get('error') or rec.get('_detail')}")
            peers.clear_caches()
        tk.log(f"  done {name} causal={causal}")
    for (N, H, ws, rs), causal in [(c, f) for c in BLOCK_CASES for f in (False, True)]:
        spec = b.dilgen.Spec(name="blk", num_heads=H, head_dim=16, segment_lengths=ws, dilation_rates=rs,
                             causal=causal, dtype="float32")
        rec = b.check_block_mask(spec, N)
        fails += not rec["passed"]
        tk.log(f"  {'ok  ' if rec['passed'] else 'FAIL'} block mask N={N} H={H} w {ws} r {rs} causal={causal}: "
               f"{rec.get('error') or rec['detail']}")
        peers.clear_caches()
    from torch.nn.attention.flex_attention import create_block_mask
    branches = [(8, 1), (16, 2)]                      # bench_varlen.py's dry run: H 2, w [8, 16], r [1, 2]
    for lengths in ([37, 5, 64, 19, 100, 3, 0, 41], [30, 11], [5, 17, 9, 24], [19, 22, 24, 30]):
        for causal, block in [(c, bl) for c in (False, True) for bl in (4, 8, 16)]:
            T = sum(lengths)
            ref = create_block_mask(peers.document_mods(branches, causal, lengths, "cpu")[0], B=None, H=2,
                                    Q_LEN=T, KV_LEN=T, device="cpu", BLOCK_SIZE=block, _compile=False)
            (ne_ref, full_ref) = peers.block_sets_of(ref)
            ne, full = peers.block_sets(branches, causal, lengths, block)
            missing, wrong = int((ne_ref & ~ne).sum()), int((full & ~full_ref).sum())   # a superset; full only if so
            fails += bool(missing or wrong)
            tk.log(f"  {'FAIL' if missing or wrong else 'ok  '} document block sets {lengths} causal={causal} "
                   f"block {block}: {missing} pairs missing, {wrong} wrongly full")
    tk.log(f"== {fails} failure(s), {time.time() - b.t0:.0f} s ==")
    return 1 if fails else 0


# --------------------------------------------------------------------------- --host: the host path
HOST_SMALL = [(f"N{n // 1024}K_B{b}", b, n) for n in (2048, 4096, 8192) for b in (1, 8)]   # config A's spec
HOST_PASSES = ("fwd", "fwd_bwd", "packed", "padded", "decode")


def host_us(torch, fn, calls: int = 20, rounds: int = 5) -> dict:
    """Host µs per call with the GPU kept busy: a long sleep kernel is queued first, so the
    timed calls only enqueue behind it and the wall clock measures the host alone. `busy` is
    False when the sleep ended before the calls did (a call waited for the GPU: a sync)."""
    times, busy = [], True
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)                   # ~0.2 s at 2 GHz
        asleep = torch.cuda.Event()
        asleep.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        busy &= not asleep.query()
        torch.cuda.synchronize()
        times.append((t1 - t0) / calls * 1e6)
    return {"host_us": sorted(times)[len(times) // 2], "host_us_min": min(times), "gpu_stayed_busy": busy}


def one_call_ms(torch, fn, reps: int = 20) -> float:
    """Median ms of one call, the GPU idle before it (event pair, synchronised each time)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def host_cases(configs, small: bool):
    """(row name, spec's config, B, N, config) of --host: the configs at full size, config A's
    spec at small shapes."""
    for name in configs:
        c = tk.CONFIGS[name]
        yield name, name, c["B"], c["N"], c
    for name, b, n in HOST_SMALL if small else ():
        yield name, "A", b, n, {**tk.CONFIGS["A"], "B": b, "N": n}


def host_calls(torch, dilgen, kernel, causal_kernel, B, N, c, dev):
    """{pass: fn} of one case: the calls a model makes (dilgen.Kernel, as users call it)."""
    gen = torch.Generator(dev).manual_seed(B * N)   # not the default one: a failed capture breaks it
    q, k, v, g = (torch.randn(B, N, c["H"], c["D"], device=dev, dtype=torch.bfloat16, generator=gen)
                  for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    rows = [t.reshape(B * N, c["H"], c["D"]) for t in (q, k, v)]
    cu = torch.arange(0, B * N + 1, N // 4, dtype=torch.int32, device=dev)
    mask = torch.zeros(B, N, dtype=torch.bool, device=dev)
    mask[:, N - 64:] = True
    cache_len = torch.full((B,), N, dtype=torch.int32, device=dev)
    q1 = q[:, -1:].contiguous()

    sdpa = torch.nn.functional.scaled_dot_product_attention
    heads_first = lambda *ts: [t.transpose(1, 2) for t in ts]   # noqa: E731  (B, H, N, D) views
    calls = {"fwd": lambda: kernel(q, k, v),
             "fwd_bwd": lambda: torch.autograd.grad(kernel(qg, kg, vg), (qg, kg, vg), g),
             "packed": lambda: kernel(*rows, cu_seqlens=cu, max_seqlen=N // 4),
             "padded": lambda: kernel.padded(q, k, v, mask),
             "decode": lambda: causal_kernel.decode(q1, k, v, cache_len, validate=False)}
    peer = {"fwd": lambda: sdpa(*heads_first(q, k, v)),
            "fwd_bwd": lambda: torch.autograd.grad(sdpa(*heads_first(qg, kg, vg)), (qg, kg, vg), g.transpose(1, 2)),
            "decode": lambda: sdpa(*heads_first(q1, k, v))}
    return calls, peer, (q, k, v, g, qg, kg, vg)


def host_checks(torch, dilgen, kernel, tensors, dev, graph: bool = False) -> dict:
    """A replayed call (replay.py) and, with `graph`, a CUDA-graph replay equal a fresh call,
    bit for bit (forward and backward)."""
    from dilgen.runtime import set_poison
    q, k, v, g, qg, kg, vg = tensors
    attn = kernel.compiled_for(dev).attention

    def step():
        out, lse = kernel(qg, kg, vg, return_lse=True)
        return (out, lse, *torch.autograd.grad(out, (qg, kg, vg), g))
    set_poison(True)     # an unwritten row is NaN in one call and not the other
    try:
        attn._replays.clear()
        fresh = step()
        recorded = len(attn._replays)
        again = step()
        with torch.no_grad():    # a no-gradient call goes straight to its recipe (GeneratedAttention._replayed)
            attn._replays.clear()
            plain = [kernel(q, k, v, return_lse=True) for _ in range(2)]
    finally:
        set_poison(False)
    same = lambda xs: all(torch.equal(a, b) for a, b in zip(fresh, xs))   # noqa: E731
    chk = {"recipes_recorded": recorded, "replay_equal": same(again) and all(map(torch.equal, *plain)),
           "finite": all(bool(torch.isfinite(t).all()) for t in (fresh[0], *fresh[2:]))}
    if not graph:
        return chk
    try:
        stream = torch.cuda.Stream()      # warm-up on a side stream, as torch.cuda.graphs asks
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            captured = step()
        cuda_graph.replay()
        torch.cuda.synchronize()
        chk["cuda_graph_equal"] = same(captured)
    except Exception as e:  # noqa: BLE001
        import traceback
        chk["cuda_graph_equal"], chk["graph_error"] = False, traceback.format_exc()[-1500:] + tk.short_err(e)
    return chk


def host_bench(a) -> int:
    """--host: host µs per call of every pass, one call against back to back, dilgen beside
    cuDNN SDPA on the dense problem; replay and CUDA-graph checks. host-<date>.json."""
    import torch
    import dilgen
    from dilgen.runtime import replay
    if tk.no_gpu(False, "bench_forward.py --host"):
        return 2
    dev = torch.device("cuda")
    res = tk.Results(tk.result_path(a.out, "host", tag=tk.gpu_tag(torch.cuda.get_device_name())),
                     tk.header(dev, extra={"notes": [
                         "host_us: wall µs per call while the GPU runs a long sleep queued first (launch cost only)",
                         "gpu_stayed_busy false: the call waited for the GPU (a device-to-host sync)",
                         "one_call_ms: event pair around one call after a synchronise; back_to_back_ms: 10 calls",
                         "dilgen_op: the same call through the torch custom op with launch replay off (DILGEN_REPLAY=0 "
                         "path), the host path before replay", "peer: SDPA (cuDNN or flash, torch's choice) on the "
                         "dense problem of the same shape"]}), key=("config", "pass", "method"))
    failed = False
    for name, of, B, N, c in host_cases(a.configs, not a.quick):
        kernel = dilgen.compile(tk.make_spec(of, c, False, "host"))
        causal = dilgen.compile(tk.make_spec(of, c, True, "host"))
        calls, peer, tensors = host_calls(torch, dilgen, kernel, causal, B, N, c, dev)
        try:
            chk = host_checks(torch, dilgen, kernel, tensors, dev)
        except Exception as e:  # noqa: BLE001
            chk = {"error": tk.short_err(e)}
        failed |= not (chk.get("replay_equal") and chk.get("finite"))
        res.add({"config": name, "pass": "check", "method": "dilgen", "B": B, "N": N, **chk})
        tk.log(f"{name} B={B} N={N}: checks {chk}")
        methods = [("dilgen", calls), ("peer", peer)]
        attn = kernel.compiled_for(dev).attention
        methods.append(("dilgen_op", {"fwd": lambda x=tensors[:3]: torch.ops.dilgen.attention_fwd(*x, attn.op_key)}))
        for method, fns in methods:
            for p, fn in fns.items():
                row = {"config": name, "pass": p, "method": method, "B": B, "N": N}
                try:
                    replay.ENABLED = method != "dilgen_op"     # the op's dispatch, no replay
                    fn()
                    row.update(host_us(torch, fn))
                    if p in ("fwd", "decode") and method != "dilgen_op":
                        row["one_call_ms"] = one_call_ms(torch, fn)
                        row["back_to_back_ms"] = tk.time_ms(fn, 3, 10, dev)["median"]
                except Exception as e:  # noqa: BLE001
                    row["error"] = tk.short_err(e)
                finally:
                    replay.ENABLED = True
                res.add(row)
                tk.log(f"  {name:9s} {p:8s} {method:10s} " + (
                    f"host {row['host_us']:7.1f} us  busy {row['gpu_stayed_busy']}" +
                    (f"  one {row['one_call_ms']:.3f} ms  b2b {row['back_to_back_ms']:.3f} ms" if "one_call_ms" in row
                     else "") if "host_us" in row else row["error"]))
        del calls, peer, tensors
        tk.cleanup(dev)
        res.save()
    for name, of, B, N, c in host_cases(a.configs, not a.quick):   # last: a failed capture spoils the process
        kernel = dilgen.compile(tk.make_spec(of, c, False, "host"))
        tensors = host_calls(torch, dilgen, kernel, kernel, B, N, c, dev)[2]
        try:
            chk = host_checks(torch, dilgen, kernel, tensors, dev, graph=True)
        except Exception as e:  # noqa: BLE001
            chk = {"cuda_graph_equal": False, "graph_error": tk.short_err(e)}
        res.add({"config": name, "pass": "cuda_graph", "method": "dilgen", "B": B, "N": N, **chk})
        tk.log(f"{name} B={B} N={N}: CUDA graph {chk}")
        res.save()
    tk.log(f"json: {res.path}")
    return 1 if failed else 0


def main(argv=None):
    a = Bench.parse(argv)
    if a.host:
        tk.quiet()
        return host_bench(a)
    return bench_backward.main(argv, Bench)


if __name__ == "__main__":
    sys.exit(main())
