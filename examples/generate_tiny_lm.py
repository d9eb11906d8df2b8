"""Generate with the tiny LongNet LM of examples/train_tiny_lm.py through dilgen's KV-cache
decoding, checking every step against the full forward.

The model is train_tiny_lm's TinyLongNetLM (token embedding + token shift, causal
LongNetDecoderBlocks, LM head). A prompt of `--prompt` tokens (a block of distinct random
tokens, repeated: the copy task of train_tiny_lm) fills one dilgen.nn.KVCache per block
(the forward kernel), then `--new` tokens are generated greedily one at a time: each step
embeds the new token, runs every block with `block(x, cache=cache)` (kernel.decode over
the kept rows of the cache) and picks the next token. After every step the logits of the
new token are compared with the last row of the full forward over the whole sequence so
far (the model's ordinary forward); the relative error must stay within SPEC's tolerance
of the kernel dtype (fp32 1e-4, bf16 2e-2, with a margin of 2x for the layers stacked).

With `--train-steps K` the model first trains K steps on the copy task with
train_tiny_lm.py's loop (on the GPU, 300 steps learn it: generation then continues the
repeated block, copy accuracy 0.95 on an H100; the CPU command below gives 1.00). No
checkpoint is loaded (train_tiny_lm.py saves none): without --train-steps the weights are
random, the check is the same, and the run says so, since its copy accuracy (generated
tokens that follow the previous one as it was followed a block earlier) is then about 0.

    python examples/generate_tiny_lm.py --device cpu        # interpreter, tiny, ~10 s (*)
    python examples/generate_tiny_lm.py                     # GPU: N = 8192 context, bf16
    python examples/generate_tiny_lm.py --train-steps 300 --new 256
    python examples/generate_tiny_lm.py --device cpu --seq-len 32 --dim 32 --heads 2 \
        --prompt 24 --new 8 --train-steps 100       # CPU, learns the copy, ~80 s (*)

(*) on a 2-core AMD EPYC VM without a GPU, with an empty kernel cache (the first: 7 s warm).

`generate(params)` returns the summary (tests/test_decode.py calls it).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)          # run from a checkout; import train_tiny_lm beside this file

import torch                                                        # noqa: E402
import torch.nn.functional as F                                     # noqa: E402

from dilgen.nn import KVCache                                       # noqa: E402
import train_tiny_lm as tiny                                        # noqa: E402

TOL = {"fp32": 2e-4, "bf16": 4e-2}
# a CPU run that learns the copy (train_tiny_lm's CPU preset: N = 32, 2 heads of 16)
CPU_TRAINED = ("python examples/generate_tiny_lm.py --device cpu --seq-len 32 --dim 32 --heads 2 "
               "--prompt 24 --new 8 --train-steps 100")
PRESETS = {
    "cuda": dict(seq_len=8192, prompt=4096, new=64, batch=4, dim=256, heads=8, layers=2, dtype="bf16"),
    "cpu": dict(seq_len=128, prompt=40, new=12, batch=2, dim=64, heads=4, layers=1, dtype="fp32"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Greedy generation with the tiny LongNet LM through "
                                            "dilgen's KV-cache decoding, every step checked against "
                                            "the full forward. Unset options take the device's preset.")
    p.add_argument("--device", type=str, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--seq-len", type=int, help="cache length N_max (segments follow it, as in training)")
    p.add_argument("--prompt", type=int, help="prompt tokens (GPU 4096, CPU 40)")
    p.add_argument("--new", type=int, help="tokens to generate (GPU 64, CPU 12)")
    p.add_argument("--batch", type=int, help="sequences (GPU 4, CPU 2)")
    p.add_argument("--dim", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--dtype", choices=sorted(tiny.DTYPES))
    p.add_argument("--train-steps", type=int, default=0, help="train on the copy task first (0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    return p


def resolve(params=None) -> argparse.Namespace:
    params = vars(params) if isinstance(params, argparse.Namespace) else dict(params or {})
    args = vars(build_parser().parse_args([]))
    unknown = set(params) - set(args)
    if unknown:
        raise ValueError(f"unknown parameters: {sorted(unknown)}")
    args.update({k: v for k, v in params.items() if v is not None})
    if args["device"] is None:
        args["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    for k, v in PRESETS[torch.device(args["device"]).type].items():
        if args.get(k) is None:
            args[k] = v
    a = argparse.Namespace(**args)
    if a.prompt < 1 or a.new < 1 or a.prompt + a.new > a.seq_len:
        raise ValueError(f"--prompt {a.prompt} + --new {a.new} must fit in --seq-len {a.seq_len}")
    return a


def step_logits(model, caches, tokens: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """Logits of the T new `tokens` (B, T) given the caches; `prev` (B,) is the token before
    them (None at the start): TinyLongNetLM's token shift needs its embedding."""
    e = model.tok(tokens)
    before = torch.zeros_like(e[:, :1]) if prev is None else model.tok(prev)[:, None]
    x = e + model.shift(torch.cat([before, e[:, :-1]], dim=1))
    for block, cache in zip(model.blocks, caches):
        x = block(x, cache=cache)
    return model.head(model.norm(x))


def _train(model, a, device, dtype, say) -> None:
    t = tiny.resolve({"seq_len": a.seq_len, "device": a.device})
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(a.seed + 1)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    for step in range(a.train_steps):
        for group in opt.param_groups:
            group["lr"] = tiny._lr_at(step, a.train_steps, t.lr)
        inputs, targets = (x.to(device) for x in tiny.make_batch(gen, t.batch, a.seq_len, t.vocab, t.block))
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().view(-1, t.vocab), targets.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 == a.train_steps:
            say(f"train step {step + 1}/{a.train_steps}: loss {loss.item():.4f}")


def generate(params=None) -> dict:
    a = resolve(params)
    say = (lambda *x: None) if a.quiet else (lambda *x: print(*x, flush=True))
    device = torch.device(a.device)
    dtype = tiny.DTYPES[a.dtype]
    t = tiny.resolve({"seq_len": a.seq_len, "device": a.device, "dim": a.dim, "heads": a.heads,
                      "layers": a.layers})
    torch.manual_seed(a.seed)
    model = tiny.TinyLongNetLM(t.vocab, a.dim, a.heads, a.layers, t.segments, t.rates,
                               kernel_dtype=dtype).to(device)
    say(f"tiny LongNet LM: {a.layers} x LongNetDecoderBlock(dim {a.dim}, {a.heads} heads, w "
        f"{t.segments}, r {t.rates}); vocab {t.vocab}, {a.dtype} on {device}")
    if a.train_steps:
        _train(model, a, device, dtype, say)
    model.eval()
    gen = torch.Generator().manual_seed(a.seed + 2)
    prompt, _ = tiny.make_batch(gen, a.batch, a.prompt, t.vocab, t.block)
    prompt = prompt.to(device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    caches = [KVCache.for_layer(block, a.batch, a.seq_len, device=device) for block in model.blocks]
    tol = TOL[a.dtype]
    errs, seq, step_s = [], prompt, []
    with torch.no_grad(), autocast:
        logits = step_logits(model, caches, prompt, None)[:, -1]        # prefill: forward kernel
        for i in range(a.new):
            nxt = logits.float().argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = step_logits(model, caches, nxt[:, None], seq[:, -2])[:, -1]   # decode
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t0)
            full = model(seq)[:, -1]                                      # the full forward
            err = ((logits.double() - full.double()).norm() / full.double().norm()).item()
            errs.append(err)
            if err > tol:
                raise AssertionError(f"step {i + 1}: decode logits differ from the full forward by "
                                     f"{err:.2e} (> {tol:.0e})")
    gen_tokens = seq[:, a.prompt:]
    copy_acc = copy_accuracy(seq, a.prompt, t.block)
    weights = f"trained {a.train_steps} step(s)" if a.train_steps else "random"
    summary = {"device": str(device), "dtype": a.dtype, "batch": a.batch, "prompt": a.prompt,
               "new": a.new, "max_rel_err": max(errs), "tolerance": tol,
               "median_step_ms": 1e3 * sorted(step_s)[len(step_s) // 2],
               "copy_accuracy": copy_acc, "train_steps": a.train_steps, "weights": weights,
               "tokens": gen_tokens[0].tolist()}
    say(f"generated {a.new} tokens x {a.batch} sequences after a {a.prompt}-token prompt; every step "
        f"matches the full forward (max relative error {max(errs):.1e}, tolerance {tol:.0e}); "
        f"median decode step {summary['median_step_ms']:.2f} ms (all layers); copy accuracy "
        f"{copy_acc:.2f} ({'random (untrained) weights' if not a.train_steps else weights})")
    if not a.train_steps:
        say(untrained_note(t.vocab))
    return summary


def copy_accuracy(seq: torch.Tensor, prompt: int, block: int) -> float:
    """Share of the generated tokens seq[:, prompt:] that make the copy step the model was
    trained on: the token after the current one is the one that followed it a block earlier
    (the prompt's last block, tiled, is a cycle of distinct tokens). Each step is judged on
    its own previous token, so one slip costs one token; a token outside the block is
    wrong, and so is the step after it. nan if the prompt holds no whole block."""
    if prompt < block:
        return math.nan
    cycle = seq[:, prompt - block:prompt]                               # (B, block)
    prev = seq[:, prompt - 1:-1]                                        # (B, new)
    hit = prev[:, :, None] == cycle[:, None, :]                         # (B, new, block)
    nxt = torch.gather(cycle, 1, (hit.int().argmax(-1) + 1) % block)   # successor in the cycle
    right = hit.any(-1) & (seq[:, prompt:] == nxt)
    return right.float().mean().item()


def untrained_note(vocab: int) -> str:
    """What the copy accuracy of a run without --train-steps means, and how to train."""
    return (f"note: these are random (untrained) weights, as no --train-steps were given, and no "
            f"checkpoint is loaded: a copy accuracy near 0 (chance {1 / vocab:.2f}) is expected; the "
            f"check above (decode == full forward) holds for any weights. To generate from a model "
            f"that has learned the copy, train it first in the same run with train_tiny_lm.py's "
            f"loop: `python examples/generate_tiny_lm.py --train-steps 300 --new 256` (GPU), or "
            f"`{CPU_TRAINED}` (CPU, about 80 s on a 2-core VM)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    generate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
