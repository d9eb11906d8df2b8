"""Variable-length batches: a packed batch of sequences of many lengths, forward and
fwd+bwd, in one process on the same inputs:

  dilgen_varlen   kernel(q, k, v, cu_seqlens=cu): one launch per branch for every sequence
  dilgen_loop     one dilgen call per sequence (what a user does without cu_seqlens)
  gather_cudnn    the peer, per sequence: gather per (branch, head group) + cuDNN + merge
  dilgen_fixed    the twin: the same spec on a fixed-length batch of as many rows
                  (B = rows / N_fixed): the rate varlen should come near

Useful FLOPs of a sequence of length n: Σ_i Σ_segments 4·H·(len/r_i)²·D (halved when causal,
x3.5 for fwd+bwd); a packed batch sums its sequences. Writes bench/results/varlen-<date>.json.

    python bench/bench_varlen.py --out bench/results            # GPU
    python bench/bench_varlen.py --dry-run-cpu                  # tiny shapes, interpreter
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402

tk.setup_paths()

SPEC = dict(H=16, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4])          # config A's branches
DRY = dict(H=2, D=16, ws=[8, 16], rs=[1, 2])


def packings(dry: bool) -> dict[str, list[int]]:
    """Named lists of sequence lengths (deterministic)."""
    if dry:
        return {"docs": [5, 17, 9, 24], "slides": [30, 11]}
    rng = random.Random(0)
    docs, total = [], 0
    while total < 131072:                  # LM packing: documents of 256 .. 16K tokens
        n = min(int(2 ** rng.uniform(8, 14)), 131072 - total)
        docs.append(n)
        total += n
    slides = [rng.randint(2000, 32000) for _ in range(8)]    # whole-slide tiles, 2K .. 32K
    return {"docs": docs, "slides": slides}


def seq_flops(n: int, cfg: dict, causal: bool) -> float:
    f = 0.0
    for w, r in zip(cfg["ws"], cfg["rs"]):
        for a in range(0, n, w):
            f += 4 * cfg["H"] * (min(w, n - a) / r) ** 2 * cfg["D"]
    return f / 2 if causal else f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(tk.RESULTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dry-run-cpu", action="store_true")
    ap.add_argument("--no-bwd", action="store_true")
    args = ap.parse_args(argv)
    import torch
    import dilgen
    import peers

    dry = args.dry_run_cpu
    dev = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        tk.log("no GPU: use --dry-run-cpu")
        return 2
    cfg = DRY if dry else SPEC
    dtype = torch.float32 if dry else torch.bfloat16
    reps = 1 if dry else args.reps
    res = tk.Results(tk.result_path(args.out, "varlen", dry), tk.header(dev, dry, {"spec": cfg}),
                     key=("packing", "causal", "pass"))
    table = []
    methods = ["dilgen_varlen", "dilgen_loop", "gather_cudnn", "dilgen_fixed"]
    todo = [(p, c, ps) for p in packings(dry) for c in (False, True)
            for ps in (("fwd",) if args.no_bwd else ("fwd", "fwd+bwd"))]
    prog = tk.Progress(len(todo), "varlen")
    for pack, causal, pas in todo:
        lengths = packings(dry)[pack]
        spec = dilgen.Spec(name=f"bench_varlen_{'causal' if causal else 'full'}", num_heads=cfg["H"],
                           head_dim=cfg["D"], dtype="float32" if dry else "bfloat16",
                           segment_lengths=cfg["ws"], dilation_rates=cfg["rs"], causal=causal)
        kernel = dilgen.compile(spec)
        total = sum(lengths)
        cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device=dev)
        g = torch.Generator(device=dev).manual_seed(1)
        shape = (total, cfg["H"], cfg["D"])
        grad = pas == "fwd+bwd"
        q, k, v = (torch.randn(shape, generator=g, device=dev, dtype=dtype).requires_grad_(grad) for _ in range(3))
        do = torch.randn(shape, generator=g, device=dev, dtype=dtype)
        bounds = [(int(cu[i]), int(cu[i + 1])) for i in range(len(lengths))]
        n_fixed = 8192 if dry is False else 32
        fixed_b = max(1, total // n_fixed)
        qf, kf, vf = (torch.randn((fixed_b, n_fixed, cfg["H"], cfg["D"]), generator=g, device=dev,
                                  dtype=dtype).requires_grad_(grad) for _ in range(3))

        def run(fn):
            def call():
                out = fn()
                if grad:
                    outs = out if isinstance(out, list) else [out]
                    torch.autograd.backward(outs, [torch.ones_like(o) if o.shape != do.shape else do for o in outs])
                return out
            return call

        fns = {
            "dilgen_varlen": lambda: kernel(q, k, v, cu_seqlens=cu, max_seqlen=max(lengths)),
            "dilgen_loop": lambda: [kernel(q[a:e].unsqueeze(0), k[a:e].unsqueeze(0), v[a:e].unsqueeze(0))
                                    for a, e in bounds if e > a],
            "gather_cudnn": lambda: [peers.gather_cudnn(q[a:e].unsqueeze(0), k[a:e].unsqueeze(0),
                                                        v[a:e].unsqueeze(0), spec)[0] for a, e in bounds if e > a],
            "dilgen_fixed": lambda: kernel(qf, kf, vf),
        }
        if dry:
            fns.pop("gather_cudnn")
        row = {"packing": pack, "causal": causal, "pass": pas, "sequences": len(lengths), "rows": total,
               "longest": max(lengths), "lengths": lengths}
        # check: varlen rows equal the per-sequence calls
        with torch.no_grad():
            a = kernel(q.detach(), k.detach(), v.detach(), cu_seqlens=cu)
            errs = [tk.rel_err(a[s:e], kernel(q.detach()[s:e].unsqueeze(0), k.detach()[s:e].unsqueeze(0),
                                             v.detach()[s:e].unsqueeze(0))[0]) for s, e in bounds]
            row["check_max_rel_err_vs_loop"] = max(errs)
            if "gather_cudnn" in fns:
                errs = [tk.rel_err(a[s:e], peers.gather_cudnn(q.detach()[s:e].unsqueeze(0), k.detach()[s:e].unsqueeze(0),
                                                              v.detach()[s:e].unsqueeze(0), spec)[0][0]) for s, e in bounds]
                row["check_max_rel_err_vs_gather_cudnn"] = max(errs)
        flops = sum(seq_flops(n, cfg, causal) for n in lengths) * (3.5 if grad else 1)
        fixed_flops = fixed_b * seq_flops(n_fixed, cfg, causal) * (3.5 if grad else 1)
        for m, fn in fns.items():
            try:
                t = tk.time_ms(run(fn), warmup=1 if dry else 3, reps=reps, device=dev)
                row[f"{m}_ms"] = round(t["median"], 4)
                row[f"{m}_tflops"] = round((fixed_flops if m == "dilgen_fixed" else flops) / t["median"] / 1e9, 1)
            except Exception as e:  # noqa: BLE001
                row[f"{m}_error"] = tk.short_err(e)
            tk.cleanup(dev)
        row["speedup_vs_loop"] = round(row["dilgen_loop_ms"] / row["dilgen_varlen_ms"], 2) if row.get("dilgen_loop_ms") else None
        if row.get("gather_cudnn_ms"):
            row["speedup_vs_gather_cudnn"] = round(row["gather_cudnn_ms"] / row["dilgen_varlen_ms"], 2)
        if row.get("dilgen_fixed_tflops"):
            row["rate_vs_fixed"] = round(row["dilgen_varlen_tflops"] / row["dilgen_fixed_tflops"], 2)
        res.add(row)
        table.append([pack, "causal" if causal else "full", pas, len(lengths), total,
                      *(tk.fmt(row.get(f"{m}_ms")) for m in methods), tk.fmt(row.get("dilgen_varlen_tflops"), ".0f"),
                      tk.fmt(row.get("rate_vs_fixed")), f"{row['check_max_rel_err_vs_loop']:.1e}"])
        prog.step(f"{pack} {'causal' if causal else 'full'} {pas}: varlen {row.get('dilgen_varlen_ms')} ms")
        del q, k, v, qf, kf, vf
        tk.cleanup(dev)
    prog.close()
    print(tk.markdown_table(["packing", "mask", "pass", "seqs", "rows", *(f"{m} ms" for m in methods),
                             "varlen TFLOP/s", "rate vs fixed", "err vs loop"], table))
    tk.log(f"wrote {res.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
