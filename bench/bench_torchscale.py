#!/usr/bin/env python3
"""torchscale's LongNet (Prov-GigaPath's slide encoder: 12 layers, 768 wide, 16 heads of 48,
segments 1024 .. 16384, ratios 1 .. 16; tests/torchscale_model.py) against the same model after
dilgen.compat.torchscale.patch, bf16, one GPU, same weights and inputs. Methods: torchscale (its
algorithm with cuDNN's SDPA and LSE), dilgen (the patched copy), no_attention (the attention
core replaced by the identity: the time both share, so torchscale / no_attention bounds any
attention's whole-model speed-up). Passes fwd (no_grad) and fwd+bwd. Per row: median ms, peak
and extra GiB; per tiles, the two models' outputs compared. Methods the kernels refuse
(dilgen.spec.unsupported_by_kernels) get a row saying so.

  python bench/bench_torchscale.py                        # 10K, 30K, 70K tiles, fwd and fwd+bwd
  python bench/bench_torchscale.py --tiles 70000 --passes fwd
  python bench/bench_torchscale.py --smoke                # tiny model and slides on the CPU
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))      # torchscale_model: the tests' re-expression
import toolkit as tk  # noqa: E402
from toolkit import log  # noqa: E402

tk.setup_paths()

PASSES = ("fwd", "fwd+bwd")
METHODS = ("torchscale", "dilgen", "no_attention")
SMOKE = dict(tiles=[100, 300], layers=2, embed=64, heads=4, segments=[16, 32, 64], ratios=[1, 2, 4])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="10000,30000,70000", help="slide lengths N (tokens = tiles)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embed", type=int, default=768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--segments", default="1024,2048,4096,8192,16384")
    ap.add_argument("--ratios", default="1,2,4,8,16")
    ap.add_argument("--passes", default=",".join(PASSES), help=f"subset of {','.join(PASSES)}")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 2; smoke 0)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls, median taken (default 5; smoke 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(tk.RESULTS), help="output folder (default bench/results)")
    ap.add_argument("--smoke", action="store_true", help=f"a tiny model on the CPU (numbers meaningless): {SMOKE}")
    a = ap.parse_args(argv)
    if a.smoke:
        a.tiles_list, a.layers, a.embed, a.heads = SMOKE["tiles"], SMOKE["layers"], SMOKE["embed"], SMOKE["heads"]
        a.seg_list, a.ratio_list = SMOKE["segments"], SMOKE["ratios"]
    else:
        a.tiles_list, a.seg_list, a.ratio_list = _ints(a.tiles), _ints(a.segments), _ints(a.ratios)
    if len(a.seg_list) != len(a.ratio_list):
        ap.error("--segments and --ratios must have the same length")
    a.passes, a.methods = tk.pick(a.passes, PASSES, "--passes"), tk.pick(a.methods, METHODS)
    a.warmup = a.warmup if a.warmup is not None else (0 if a.smoke else 2)
    a.reps = a.reps if a.reps is not None else (1 if a.smoke else 5)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    import torchscale_model as tm
    import peers
    from dilgen.compat import torchscale as compat
    from dilgen.spec import unsupported_by_kernels

    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if device.type != "cuda" and not a.smoke:
        log("no CUDA device: run with --smoke for the CPU flow")
        return 2
    dtype = torch.bfloat16
    tm.ATTENTION = peers._attn_cudnn        # cuDNN SDPA with LSE (the fp32 math on the CPU)

    args = tm.make_args(a.seg_list, a.ratio_list, embed_dim=a.embed, heads=a.heads,
                        ffn_dim=4 * a.embed, layers=a.layers)
    ts_model = tm.make_encoder(args, seed=a.seed, dtype=dtype).to(device)
    dg_model = copy.deepcopy(ts_model)
    replaced = compat.patch(dg_model, verbose=False)
    models = {"torchscale": ts_model, "dilgen": dg_model, "no_attention": dg_model}

    def identity_attend(q, k, v, spec):
        return v            # no attention core: what remains is the time both models share
    refusal = unsupported_by_kernels(compat.spec_for(args, a.heads, a.embed // a.heads))
    dilgen_attention = "dilgen kernels"
    if refusal and a.smoke:      # kernels pending: the smoke run's patched model uses the float64 reference
        from dilgen.reference import differentiable_reference
        compat._attend = lambda q, k, v, spec: differentiable_reference(
            q.double(), k.double(), v.double(), spec)[0].to(q.dtype)
        dilgen_attention, refusal = "float64 reference (kernels pending; smoke only)", None

    head = tk.header(device, dry=a.smoke, extra={
        "bench": "torchscale", "args": vars(a) | {"replaced": replaced},
        "model": {"layers": a.layers, "embed_dim": a.embed, "heads": a.heads,
                  "head_dim": a.embed // a.heads, "ffn_dim": 4 * a.embed,
                  "segment_length": a.seg_list, "dilated_ratio": a.ratio_list, "dtype": "bfloat16"},
        "torchscale_attention": "aten._scaled_dot_product_cudnn_attention (LSE)" if device.type == "cuda"
        else "fp32 math fallback (CPU smoke)", "dilgen_attention": dilgen_attention})
    tag = "cpu-smoke" if a.smoke else tk.gpu_tag(head.get("device", "gpu"))
    res = tk.Results(Path(a.out) / f"torchscale-{head['date']}-{tag}.json", head, key=("tiles", "pass", "method"))
    log(f"{head.get('device')}: {len(replaced)} DilatedAttention modules patched; "
        f"w {a.seg_list} r {a.ratio_list}; dilgen: {'pending: ' + refusal if refusal else dilgen_attention}")

    real_attend = compat._attend     # after the smoke run's possible stand-in
    gen = torch.Generator(device="cpu").manual_seed(a.seed)
    progress = tk.Progress(len(a.tiles_list) * len(a.passes) * len(a.methods), "torchscale")
    for n in a.tiles_list:
        x = torch.randn(1, n, a.embed, generator=gen).to(device=device, dtype=dtype)
        cot = torch.randn(1, n, a.embed, generator=gen).to(device=device, dtype=dtype)
        outs = {}
        for pas in a.passes:
            for method in a.methods:
                model = models[method]
                row = {"tiles": n, "pass": pas, "method": method, "ms": None, "peak_GiB": None}
                compat._attend = identity_attend if method == "no_attention" else real_attend
                if method == "dilgen" and refusal:
                    row["skipped"] = refusal
                    res.add(row)
                    progress.step(f"{n} {pas} {method}: skipped (kernels pending)")
                    continue
                if pas == "fwd":
                    model.eval()

                    def fn(model=model):
                        with torch.no_grad():
                            return model(token_embeddings=x)["encoder_out"]
                else:
                    model.train()
                    xg = x.detach().clone().requires_grad_(True)

                    def fn(model=model, xg=xg):
                        for p in model.parameters():
                            p.grad = None
                        xg.grad = None
                        model(token_embeddings=xg)["encoder_out"].backward(cot)
                try:
                    t0 = time.perf_counter()
                    first = fn()
                    tk.sync(device)
                    row["first_call_s"] = round(time.perf_counter() - t0, 3)
                    if pas == "fwd":
                        outs[method] = first
                    del first
                    t = tk.time_ms(fn, a.warmup, a.reps, device)
                    row["ms"], row["timing_ms"] = t["median"], t
                    if device.type == "cuda":
                        tk.cleanup(device)
                        base = torch.cuda.memory_allocated(device)
                        torch.cuda.reset_peak_memory_stats(device)
                        fn()
                        torch.cuda.synchronize(device)
                        peak = torch.cuda.max_memory_allocated(device)
                        row["peak_GiB"] = round(peak / 2**30, 3)
                        row["extra_GiB"] = round((peak - base) / 2**30, 3)
                except Exception as e:  # noqa: BLE001 - OOM and friends: the row says so
                    row["error"] = tk.short_err(e)
                compat._attend = real_attend
                res.add(row)
                progress.step(f"{n} {pas} {method}: {tk.fmt(row['ms'])} ms, "
                              f"peak {tk.fmt(row['peak_GiB'])} GiB{' ' + row['error'] if 'error' in row else ''}")
                tk.cleanup(device)
        if "torchscale" in outs and "dilgen" in outs:
            err = tk.rel_err(outs["dilgen"], outs["torchscale"])
            res.data.setdefault("check", []).append({"tiles": n, "rel_err_dilgen_vs_torchscale": err})
            res.save()
            log(f"  {n} tiles: dilgen vs torchscale outputs (bf16): relative difference {err:.2e}")
        del outs
    get = {(r["tiles"], r["pass"], r["method"]): r for r in res.rows}
    table = []
    for n in a.tiles_list:
        for pas in a.passes:
            ts, dg = get.get((n, pas, "torchscale"), {}), get.get((n, pas, "dilgen"), {})
            floor = get.get((n, pas, "no_attention"), {}).get("ms")
            speed = ts["ms"] / dg["ms"] if ts.get("ms") and dg.get("ms") else None
            bound = ts["ms"] / floor if ts.get("ms") and floor else None
            attn = ((ts["ms"] - floor) / (dg["ms"] - floor)
                    if ts.get("ms") and dg.get("ms") and floor and dg["ms"] > floor else None)
            table.append([n, pas, tk.fmt(ts.get("ms")), tk.fmt(dg.get("ms")),
                          tk.fmt(speed, ".2f") + ("x" if speed else ""), tk.fmt(floor),
                          tk.fmt(attn, ".2f") + ("x" if attn else ""),
                          tk.fmt(bound, ".2f") + ("x" if bound else ""),
                          tk.fmt(ts.get("peak_GiB")), tk.fmt(dg.get("peak_GiB"))])
    text = tk.markdown_table(["tiles", "pass", "torchscale ms", "dilgen ms", "speed-up",
                              "no-attention ms", "attention-only speed-up", "bound (torchscale / no-attention)",
                              "torchscale peak GiB", "dilgen peak GiB"], table)
    res.data["table_md"] = text
    log(f"\n{text}\n\nwrote {res.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
