"""dilgen inside Hugging Face transformers (attn_implementation="dilgen") against the
model's own "sdpa" and "flex_attention" on the same work.

    --train   a Llama-shaped model (8 layers, hidden 1024, 16 heads, 4 kv heads, byte-level)
              trained at 32K and 128K tokens of context on the Python standard library's own
              source files: loss curve, tokens/s and peak memory per attention implementation
              (the same batches for every one; "did not fit" is a result too)
    --decode  generation's cost per layer and step: the attention call over a KV cache of
              S keys, batch 1 and 8, eager and replayed from a CUDA graph, dilgen vs sdpa

Without a GPU, --dry-run-cpu runs both at toy sizes (dilgen in Triton's interpreter).
Writes bench/results/transformers-<date>-<gpu>.json (and a PNG of the loss curves).
"""
from __future__ import annotations

import random
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit  # noqa: E402

PATTERN = {"segment_lengths": [2048, 4096, 8192, 16384, 32768], "dilation_rates": [1, 2, 4, 8, 16]}
MODEL = dict(vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, attention_dropout=0.0, tie_word_embeddings=False)
DRY_PATTERN = {"segment_lengths": [16, 32], "dilation_rates": [1, 2]}
DRY_MODEL = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
IMPLS = ("dilgen", "sdpa", "flex_attention")


def corpus() -> bytes:
    """The standard library's .py files, sorted, as one byte string (every machine has it)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return b"\n".join(p.read_bytes() for p in files)


def batches(data: bytes, n: int, seed: int):
    """Random windows of n + 1 bytes, the same sequence for every implementation."""
    import torch
    rng = random.Random(seed)
    while True:
        i = rng.randrange(0, len(data) - n - 1)
        yield torch.frombuffer(bytearray(data[i:i + n + 1]), dtype=torch.uint8).long()[None]


def make_model(impl: str, n: int, dry: bool, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import dilgen.integrations.transformers  # noqa: F401  registers "dilgen"
    config = LlamaConfig(**(DRY_MODEL if dry else MODEL), max_position_embeddings=n)
    config.dilgen_spec = dict(DRY_PATTERN if dry else PATTERN)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation=impl)
    return model.to(device=device, dtype=torch.float32 if dry else torch.bfloat16)


def train_one(impl: str, n: int, data: bytes, seconds: float, dry: bool, device) -> dict:
    """Train from the same initial weights on the same batches for `seconds` after two
    warm-up steps (compilation); loss of every step, tokens/s over the timed steps."""
    import torch
    row = {"impl": impl, "context": n}
    try:
        model = make_model(impl, n, dry, device)
        model.config.use_cache = False
        model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
        losses, t_steps, stream, start = [], [], batches(data, n, seed=1), None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        while True:
            ids = next(stream).to(device)
            t0 = time.perf_counter()
            loss = model(ids[:, :-1], labels=ids[:, :-1]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 4))            # .item() synchronises
            t_steps.append(time.perf_counter() - t0)
            if len(losses) == 2:
                start = time.perf_counter()
            if start is not None and (time.perf_counter() - start > seconds or (dry and len(losses) >= 4)):
                break
        timed = sorted(t_steps[2:] or t_steps)
        step_s = timed[len(timed) // 2]
        row.update(status="ok", steps=len(losses), losses=losses, first_steps_s=[round(t, 2) for t in t_steps[:2]],
                   step_s=round(step_s, 4), tokens_per_s=round(n / step_s), peak_gib=round(
                       torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None)
    except torch.cuda.OutOfMemoryError:
        row.update(status="did not fit (out of memory)")
    except Exception as e:  # noqa: BLE001 - a failed implementation is a row
        row.update(status=f"failed: {toolkit.short_err(e)}")
    finally:
        toolkit.cleanup(device)
    toolkit.log(f"  {impl:15s} N={n}: {row['status']} {row.get('tokens_per_s', '')} tok/s "
                f"peak {row.get('peak_gib')} GiB, loss {row.get('losses', [None])[-1]}")
    return row


def decode_one(impl: str, batch: int, S: int, graph: bool, dry: bool, device) -> dict:
    """Microseconds per call of one layer's attention over a cache of S keys (one new token),
    through transformers' attention interface: eager wall time per call, or per replay of a
    CUDA graph holding 20 calls."""
    import torch
    from transformers import AttentionInterface
    model = make_model(impl, S + 1, dry, device)
    attn, fn = model.model.layers[0].self_attn, AttentionInterface().get_interface(impl, None)
    H, Hkv, D = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    dtype = next(model.parameters()).dtype
    q, k, v = (torch.randn(batch, h, s, D, device=device, dtype=dtype) for h, s in ((H, 1), (Hkv, S), (Hkv, S)))
    call = lambda: fn(attn, q, k, v, None, scaling=attn.scaling)[0]  # noqa: E731
    with torch.inference_mode():
        for _ in range(3):
            call()
        n, run, per = 3 if dry else 500, call, 1
        if graph:                    # one replay: 20 calls
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20):
                    call()
            g.replay()
            n, run, per = n // 20 + 1, g.replay, 20
        rounds = []                  # the best of three: host time is noisy
        for _ in range(3):
            toolkit.sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                run()
            toolkit.sync(device)
            rounds.append((time.perf_counter() - t0) / (n * per) * 1e6)
        us = min(rounds)
    return {"impl": impl, "batch": batch, "cache": S, "cuda_graph": graph, "us_per_layer_step": round(us, 1)}


def plot(rows, path):
    ok = [r for r in rows if r.get("losses")]
    contexts = sorted({r["context"] for r in ok})

    def draw(axes):
        for ax, n in zip(axes if len(contexts) > 1 else [axes], contexts):
            for r in (r for r in ok if r["context"] == n):
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['impl']} ({r['tokens_per_s']} tok/s)")
            ax.set(title=f"Llama 8x1024, context {f'{n // 1024}K' if n >= 1024 else n} tokens",
                   xlabel="step (one sequence)", ylabel="training loss (bytes)")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    return toolkit.figure(path, None, draw, (6 * len(contexts), 4), len(contexts)) if ok else None


def main(argv=None) -> None:
    ap = toolkit.parser(__doc__, "out", "dry_run_cpu")
    add = ap.add_argument
    add("--train", action="store_true", help="only the training runs (default: both)")
    add("--decode", action="store_true", help="only the decode timings (default: both)")
    add("--contexts", default="32768,131072", help="training contexts (dry run: 128)")
    add("--impls", default=",".join(IMPLS), help=f"a subset of {','.join(IMPLS)}")
    add("--seconds", type=float, default=90.0, help="timed training per run")
    add("--cache", type=int, default=32768, help="cached keys for --decode")
    args = ap.parse_args(argv)
    import torch
    import transformers
    if toolkit.no_gpu(args.dry_run_cpu, "bench_transformers.py"):
        raise SystemExit(2)
    dry, device = args.dry_run_cpu, torch.device("cpu" if args.dry_run_cpu else "cuda")
    impls = [i for i in toolkit.pick(args.impls, IMPLS, "--impls") if not (dry and i == "flex_attention")]
    result = {**toolkit.header(device, dry, {"transformers": transformers.__version__}),
              "model": DRY_MODEL if dry else MODEL, "dilgen_spec": DRY_PATTERN if dry else PATTERN,
              "train": [], "decode": []}
    path = toolkit.result_path(args.out, "transformers", dry, tag=None if dry else toolkit.gpu_tag(result["device"]))
    if args.train or not args.decode:
        data = corpus()
        toolkit.log(f"corpus: {len(data) / 2**20:.1f} MiB of standard-library source")
        contexts = [128] if dry else [int(x) for x in args.contexts.split(",")]
        for n, impl in [(n, impl) for n in contexts for impl in impls]:
            result["train"].append(train_one(impl, n, data, args.seconds, dry, device))
            toolkit.write_json_atomic(path, result)
        plot(result["train"], path.with_suffix(".png"))
    if args.decode or not args.train:
        S = 64 if dry else args.cache
        for batch, graph, impl in [(b, g, i) for b in (1, 8) for g in ((False,) if dry else (False, True))
                                   for i in impls if i != "flex_attention"]:
            result["decode"].append(decode_one(impl, batch, S, graph, dry, device))
            toolkit.log(f"  decode {result['decode'][-1]}")
        toolkit.write_json_atomic(path, result)
    rows = [[r["impl"], r["context"], r["status"], r.get("tokens_per_s"), r.get("peak_gib"),
             r.get("losses", [None])[-1]] for r in result["train"]]
    if rows:
        print(toolkit.markdown_table(["impl", "context", "status", "tokens/s", "peak GiB", "last loss"], rows))
    drows = [[r["impl"], r["batch"], r["cache"], "graph" if r["cuda_graph"] else "eager", r["us_per_layer_step"]]
             for r in result["decode"]]
    if drows:
        print(toolkit.markdown_table(["impl", "batch", "cached keys", "mode", "µs per layer-step"], drows))
    toolkit.log(f"wrote {path}")


if __name__ == "__main__":
    main()
