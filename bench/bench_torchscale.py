#!/usr/bin/env python3
"""torchscale's LongNet (Prov-GigaPath's slide encoder: 12 layers, 768 wide, 16 heads of 48,
segments 1024 .. 16384, ratios 1 .. 16; tests/torchscale_model.py) against the same model after
dilgen.compat.torchscale.patch, bf16, one GPU, same weights and inputs. Methods: torchscale (its
algorithm with cuDNN's SDPA and LSE), dilgen (the patched copy), no_attention (the attention
core replaced by the identity: the time both share, so torchscale / no_attention bounds any
attention's whole-model speed-up). Passes fwd (no_grad) and fwd+bwd. Per row: median ms, peak
and extra GiB; per tiles, the two models' outputs compared.

  python bench/bench_torchscale.py                        # 10K, 30K, 70K tiles, fwd and fwd+bwd
  python bench/bench_torchscale.py --tiles 70000 --passes fwd
  python bench/bench_torchscale.py --smoke                # tiny model and slides on the CPU
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))      # torchscale_model: the tests' re-expression
import toolkit as tk  # noqa: E402

PASSES = ("fwd", "fwd+bwd")
METHODS = ("torchscale", "dilgen", "no_attention")
SMOKE = dict(tiles=[40, 72], layers=1, embed=32, heads=2, segments=[16, 32], ratios=[1, 2])


def parse_args(argv=None):
    ap = tk.parser(__doc__, "warmup", "reps", "seed", "out", methods=METHODS, warmup=dict(help="warm-up calls "
                   "(default 2; smoke 0)"), reps=dict(help="timed calls, median taken (default 5; smoke 1)"))
    add = ap.add_argument
    add("--tiles", default="10000,30000,70000", help="slide lengths N (tokens = tiles)")
    add("--layers", type=int, default=12)
    add("--embed", type=int, default=768)
    add("--heads", type=int, default=16)
    add("--segments", default="1024,2048,4096,8192,16384")
    add("--ratios", default="1,2,4,8,16")
    add("--passes", default=",".join(PASSES), help=f"subset of {','.join(PASSES)}")
    add("--smoke", action="store_true", help=f"a tiny model on the CPU (numbers meaningless): {SMOKE}")
    a = ap.parse_args(argv)
    if a.smoke:
        a.tiles_list, a.layers, a.embed, a.heads = SMOKE["tiles"], SMOKE["layers"], SMOKE["embed"], SMOKE["heads"]
        a.seg_list, a.ratio_list = SMOKE["segments"], SMOKE["ratios"]
    else:
        a.tiles_list, a.seg_list, a.ratio_list = ([int(x) for x in t.replace(" ", "").split(",") if x]
                                                  for t in (a.tiles, a.segments, a.ratios))
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
    if tk.no_gpu(a.smoke, "bench_torchscale.py", "--smoke"):
        return 2
    device, dtype = torch.device("cpu" if a.smoke else "cuda"), torch.bfloat16
    tm.ATTENTION = peers._attn_cudnn        # cuDNN SDPA with LSE (the fp32 math on the CPU)
    args = tm.make_args(a.seg_list, a.ratio_list, embed_dim=a.embed, heads=a.heads,
                        ffn_dim=4 * a.embed, layers=a.layers)
    ts_model = tm.make_encoder(args, seed=a.seed, dtype=dtype).to(device)
    dg_model = copy.deepcopy(ts_model)
    replaced = compat.patch(dg_model, verbose=False)
    models = {"torchscale": ts_model, "dilgen": dg_model, "no_attention": dg_model}

    def identity_attend(q, k, v, spec):
        return v            # no attention core: what remains is the time both models share
    head = tk.header(device, dry=a.smoke, extra={
        "bench": "torchscale", "args": vars(a) | {"replaced": replaced},
        "model": {"layers": a.layers, "embed_dim": a.embed, "heads": a.heads, "head_dim": a.embed // a.heads,
                  "ffn_dim": 4 * a.embed, "segment_length": a.seg_list, "dilated_ratio": a.ratio_list,
                  "dtype": "bfloat16"},
        "torchscale_attention": "aten._scaled_dot_product_cudnn_attention (LSE)" if device.type == "cuda"
        else "fp32 math fallback (CPU smoke)", "dilgen_attention": "dilgen kernels"})
    res = tk.Results(tk.result_path(a.out, "torchscale", tag="cpu-smoke" if a.smoke else tk.gpu_tag(head["device"])),
                     head, key=("tiles", "pass", "method"))
    tk.log(f"{head.get('device')}: {len(replaced)} DilatedAttention modules patched; w {a.seg_list} r {a.ratio_list}")
    real_attend, gen = compat._attend, torch.Generator(device="cpu").manual_seed(a.seed)
    progress = tk.Progress(len(a.tiles_list) * len(a.passes) * len(a.methods))
    for n in a.tiles_list:
        x, cot = (torch.randn(1, n, a.embed, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
        outs = {}
        for pas, method in [(p, m) for p in a.passes for m in a.methods]:
            model, row = models[method], {"tiles": n, "pass": pas, "method": method, "ms": None, "peak_GiB": None}
            compat._attend = identity_attend if method == "no_attention" else real_attend
            model.train(pas != "fwd")
            xg = x.detach().clone().requires_grad_(pas != "fwd")

            def fn(model=model, xg=xg, pas=pas):
                if pas == "fwd":
                    with torch.no_grad():
                        return model(token_embeddings=xg)["encoder_out"]
                model.zero_grad(set_to_none=True)
                xg.grad = None
                model(token_embeddings=xg)["encoder_out"].backward(cot)
            with tk.failsoft(row):
                t1, first = tk.first_call_s(fn, device)
                row["first_call_s"] = round(t1, 3)
                if pas == "fwd":
                    outs[method] = first
                del first
                t = tk.time_ms(fn, a.warmup, a.reps, device)
                row["ms"], row["timing_ms"] = t["median"], t
                if (pk := tk.peak_extra_gib(fn, device, with_peak=True)) is not None:
                    row["peak_GiB"], row["extra_GiB"] = round(pk[0], 3), round(pk[1], 3)
            compat._attend = real_attend
            res.add(row)
            progress.step(f"{n} {pas} {method}: {tk.fmt(row['ms'])} ms, "
                          f"peak {tk.fmt(row['peak_GiB'])} GiB{' ' + row['error'] if 'error' in row else ''}")
            tk.cleanup(device)
        if "torchscale" in outs and "dilgen" in outs:
            err = tk.rel_err(outs["dilgen"], outs["torchscale"])
            res.data.setdefault("check", []).append({"tiles": n, "rel_err_dilgen_vs_torchscale": err})
            res.save()
            tk.log(f"  {n} tiles: dilgen vs torchscale outputs (bf16): relative difference {err:.2e}")
        del outs
    get = {(r["tiles"], r["pass"], r["method"]): r for r in res.rows}
    table, times = [], lambda x: tk.fmt(x) + "x" * bool(x)
    for n, pas in [(n, p) for n in a.tiles_list for p in a.passes]:
        ts, dg, floor = (get.get((n, pas, m), {}) for m in METHODS)        # torchscale, dilgen, no_attention
        t, d, f = ts.get("ms"), dg.get("ms"), floor.get("ms")
        table.append([n, pas, tk.fmt(t), tk.fmt(d), times(t / d if t and d else None), tk.fmt(f),
                      times((t - f) / (d - f) if t and d and f and d > f else None), times(t / f if t and f else None),
                      tk.fmt(ts.get("peak_GiB")), tk.fmt(dg.get("peak_GiB"))])
    text = tk.markdown_table(["tiles", "pass", "torchscale ms", "dilgen ms", "speed-up",
                              "no-attention ms", "attention-only speed-up", "bound (torchscale / no-attention)",
                              "torchscale peak GiB", "dilgen peak GiB"], table)
    res.data["table_md"] = text
    tk.log(f"\n{text}\n\nwrote {res.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
