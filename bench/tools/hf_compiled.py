"""Probe (issue 40): transformers with attn_implementation="dilgen" under torch.compile on the
GPU, beside sdpa: (1) a training step (forward + backward) compiled with fullgraph=True against
the same step eager (loss, logits and every gradient), ms per step both ways; (2) greedy
generation with a static cache and the forward compiled with mode="reduce-overhead"
(CUDA graphs), fullgraph=True, against eager generation with a dynamic cache (tokens and the
first step's logits), ms per new token both ways. The bench's model (bench_transformers.MODEL,
8 layers of 1024, bf16) and dilgen pattern. JSON: hf_compiled-DATE-<gpu>.json.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import toolkit as tk  # noqa: E402
import bench_transformers as bt  # noqa: E402


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids[:, :-1], labels=ids[:, :-1])
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), [p.grad for p in model.parameters()]


def train(impl: str, n: int, data, dev, reps: int) -> dict:
    import torch
    row = {"impl": impl, "context": n, "what": "train_step"}
    model = bt.make_model(impl, n + 1, False, dev)
    model.config.use_cache = False
    ids = next(bt.batches(data, n, seed=1)).to(dev)
    loss_e, logits_e, grads_e = step(model, ids)
    grads_e = [g.clone() for g in grads_e]
    timed = lambda fn: tk.time_ms(fn, 2, reps, dev)["median"]   # noqa: E731
    row["eager_ms"] = timed(lambda: step(model, ids))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    t0 = time.perf_counter()
    loss_c, logits_c, grads_c = step(compiled, ids)
    torch.cuda.synchronize()
    row["first_compiled_s"] = round(time.perf_counter() - t0, 1)
    row["compile_times"] = torch._dynamo.utils.compile_times(repr="str")[-4000:]
    row["loss_eager"], row["loss_compiled"] = loss_e.item(), loss_c.item()
    row["logits_rel"] = rel(logits_c, logits_e)
    row["grads_rel_max"] = max(rel(g, w) for g, w in zip(grads_c, grads_e))
    row["compiled_ms"] = timed(lambda: step(compiled, ids))
    row["tokens_per_s_eager"] = round(n / row["eager_ms"] * 1e3)
    row["tokens_per_s_compiled"] = round(n / row["compiled_ms"] * 1e3)
    del model, compiled
    tk.cleanup(dev)
    return row


def generate(impl: str, prompt: int, new: int, dev) -> dict:
    import torch
    row = {"impl": impl, "prompt": prompt, "new_tokens": new, "what": "static_cache_generate"}
    model = bt.make_model(impl, prompt + new + 8, False, dev).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 256, (1, prompt), generator=torch.Generator().manual_seed(5)).to(dev)
    steps = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, output_logits=True,
                 return_dict_in_generate=True)

    def run(**kw):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **{**steps, **kw})
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    def per_token(**kw):     # (t(new) - t(1)) / (new - 1), the best of 3
        one = min(run(**{**kw, "max_new_tokens": 1, "min_new_tokens": 1})[1] for _ in range(3))
        full = min(run(**kw)[1] for _ in range(3))
        return round((full - one) / (new - 1) * 1e3, 3)

    with torch.no_grad():
        want, _ = run()
        row["eager_ms_per_token"] = per_token()
        torch._dynamo.reset()    # transformers compiles the decoding forward itself (CUDA graphs)
        from transformers import CompileConfig
        static = dict(cache_implementation="static", compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
        t0 = time.perf_counter()
        got, _ = run(**static)
        row["first_compiled_s"] = round(time.perf_counter() - t0, 1)
        row["tokens_equal"] = bool(torch.equal(got.sequences, want.sequences))
        same = (got.sequences[0] == want.sequences[0]).tolist()
        row["first_difference_at"] = same.index(False) if False in same else None
        row["first_step_logits_rel"] = rel(got.logits[0], want.logits[0])
        row["compiled_ms_per_token"] = per_token(**static)
    del model
    tk.cleanup(dev)
    return row


def main() -> int:
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(tk.RESULTS))
    ap.add_argument("--contexts", default="4096,8192")
    ap.add_argument("--impls", default="dilgen,sdpa")
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    tk.quiet()
    dev = torch.device("cuda")
    import transformers
    res = {**tk.header(dev, extra={"transformers": transformers.__version__,
                                   "produced_by": "bench/tools/hf_compiled.py"}),
           "model": bt.MODEL, "dilgen_spec": bt.PATTERN, "rows": []}
    path = tk.result_path(a.out, "hf_compiled", tag=tk.gpu_tag(torch.cuda.get_device_name()))
    data = bt.corpus()
    jobs = [(train, (impl, int(n), data, dev, a.reps)) for n in filter(None, a.contexts.split(",")) for impl in a.impls.split(",")]
    jobs += [] if a.no_generate else [(generate, (impl, 1024, 64, dev)) for impl in a.impls.split(",")]
    for fn, args in jobs:
        try:
            row = fn(*args)
        except Exception as e:  # noqa: BLE001
            row = {"impl": args[0], "what": fn.__name__, "error": "".join(traceback.format_exception(e))[-6000:]}
            tk.cleanup(dev)
        res["rows"].append(row)
        tk.log(str({k: v for k, v in row.items() if k != "error"}) + ("\n" + row["error"] if "error" in row else ""))
        tk.write_json_atomic(path, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
