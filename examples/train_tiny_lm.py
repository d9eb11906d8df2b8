"""Train a tiny LongNet-style language model through dilgen's kernels (forward and backward).

The data is a copy task: each sequence is one block of `--block` distinct random tokens,
repeated until the sequence is full. The first block cannot be predicted (about
ln(vocab) nats a token); every later token is the one that followed the current token one
block earlier, so a model that attends back one block (across the short segments) predicts
it. The loss falls from about ln(vocab) towards (block / seq_len) * ln(vocab); `copy-loss`
is the loss on the predictable positions alone.

The model: token embedding plus a linear map of the previous token's embedding (a token
shift, so one attention layer can match "my token" against "the key's previous token"),
`--layers` dilgen `LongNetDecoderBlock`s (causal dilated attention + MLP), LM head. Every
attention call, forward and backward, runs dilgen's generated kernels: Triton on the GPU,
Triton's interpreter on the CPU (slow: the CPU preset is tiny, N = 32, block 5, vocab 8,
w = [16, 32], r = [2, 4], and learns the copy in about a minute on 2 cores).

The default spec has no r = 1 branch, and the copy offset (block - 1) is a multiple of every
dilation rate, so a query and the key it needs share a residue class in each branch. (With
a dense r = 1 branch shorter than the copy offset, every head also answers every query from
its local segment, and in our CPU runs that local average kept the model from learning the
copy within a few hundred steps.)

    python examples/train_tiny_lm.py                          # GPU: N = 8192, 300 steps
    python examples/train_tiny_lm.py --steps 300 --json out/train.json
    python examples/train_tiny_lm.py --device cpu             # CPU: N = 32, 100 steps, ~1 min (*)

(*) on a 2-core AMD EPYC VM without a GPU: 78 s with an empty kernel cache, 46 s warm.

`train(params)` (a dict or an argparse.Namespace; unset keys take the device's preset) runs
the same loop and returns the summary with the loss history; tests/test_examples.py calls it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "dilgen").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))     # run from a checkout without `pip install -e .`

import torch                                                        # noqa: E402
import torch.nn.functional as F                                     # noqa: E402
from torch import nn                                                # noqa: E402

import dilgen                                                       # noqa: E402
from dilgen.nn import DilatedAttention, LongNetDecoderBlock        # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
KERNEL_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}

# Defaults by device. The GPU run is long-context flavoured (N = 8192, segments up to 8192)
# and meant to take well under a minute on an H200; the CPU run goes through Triton's
# interpreter (its cost grows with batch x heads x segments), so it stays tiny: N = 32
# (block 5, vocab 8, w = [16, 32], r = [2, 4]) learns the copy in 100 steps, about a minute
# on 2 cores. block, vocab, segments and rates follow seq_len when unset.
PRESETS = {
    "cuda": dict(steps=300, seq_len=8192, batch=16, dim=256, heads=8, layers=2, lr=1e-2,
                 log_every=25, dtype="bf16"),
    "cpu": dict(steps=100, seq_len=32, batch=4, dim=32, heads=2, layers=1, lr=2e-2,
                log_every=10, dtype="fp32"),
}
RATES = [2, 4, 8]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a tiny LongNet-style LM (dilgen causal dilated attention, forward "
                    "and backward) on a copy task. Unset options take the device's preset.")
    p.add_argument("--steps", type=int, help="optimizer steps (GPU 300, CPU 100)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence N (GPU 8192, CPU 32)")
    p.add_argument("--batch", type=int, help="sequences per step (GPU 16, CPU 4)")
    p.add_argument("--dim", type=int, help="model width (GPU 256, CPU 32)")
    p.add_argument("--heads", type=int, help="attention heads, head_dim = dim / heads (GPU 8, CPU 2)")
    p.add_argument("--layers", type=int, help="LongNetDecoderBlocks (GPU 2, CPU 1)")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate (GPU 1e-2, CPU 2e-2)")
    p.add_argument("--block", type=int,
                   help="length of the repeated block of distinct random tokens; the copy "
                        "offset is block-1 (default 65 for N >= 1024, less for shorter N: 5 at N = 32)")
    p.add_argument("--vocab", type=int,
                   help="vocabulary size, >= block (default: the power of two above block - 1, at least 8)")
    p.add_argument("--segments", type=str,
                   help="segment lengths w, comma-separated (default N/64,N/8,N, at least 16, each "
                        "length once: 16,32 at N = 32)")
    p.add_argument("--rates", type=str, help="dilation rates r, comma-separated (default 2,4,8, one per segment length)")
    p.add_argument("--device", type=str, help="cuda or cpu (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="bf16: float32 weights, bf16 autocast and bf16 kernels (GPU default); "
                        "fp32 (CPU default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (0)")
    p.add_argument("--attention-dropout", type=float, default=0.0,
                   help="attention dropout p in training, fused in the kernels (LongNet: 0.1; default 0)")
    p.add_argument("--fixed-batch", action="store_true",
                   help="train on one batch over and over (a smoke test: the loss must fall)")
    p.add_argument("--log-every", type=int, help="a progress line every k steps (GPU 25, CPU 10)")
    p.add_argument("--json", type=str, metavar="OUT", help="write the summary as JSON to OUT")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _ints(value) -> list[int]:
    return [int(x) for x in value.split(",")] if isinstance(value, str) else [int(x) for x in value]


def resolve(params=None) -> argparse.Namespace:
    """The full settings: `params` (dict, Namespace or None) over the device's preset."""
    if params is None:
        params = {}
    if isinstance(params, argparse.Namespace):
        params = vars(params)
    args = vars(build_parser().parse_args([]))
    unknown = set(params) - set(args)
    if unknown:
        raise ValueError(f"unknown training parameters: {sorted(unknown)}")
    args.update({k: v for k, v in params.items() if v is not None})
    if args["device"] is None:
        args["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(args["device"]).type
    if kind not in PRESETS:
        raise ValueError(f"--device {args['device']}: dilgen runs on cuda or cpu")
    for k, v in PRESETS[kind].items():
        if args.get(k) is None:
            args[k] = v
    n = args["seq_len"]
    if args["block"] is None:       # block - 1: a multiple of 8 (of 4 at N = 32)
        args["block"] = min(65, 8 * (n // 128) + 1) if n >= 128 else max(2, n // 8 + 1)
    if args["vocab"] is None:
        args["vocab"] = max(8, 1 << (args["block"] - 1).bit_length())
    if args["segments"] is not None:
        args["segments"] = _ints(args["segments"])
    else:   # N/64, N/8, N, at least 16 and at most N; a length that repeats counts once
        args["segments"] = sorted({min(n, max(16, n // 64)), min(n, max(32, n // 8)), n})
    args["rates"] = (_ints(args["rates"]) if args["rates"] is not None
                     else RATES[:len(args["segments"])])
    a = argparse.Namespace(**args)
    _check(a)
    return a


def _check(a: argparse.Namespace) -> None:
    for name in ("steps", "seq_len", "batch", "dim", "heads", "layers", "log_every"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} = {getattr(a, name)}: must be >= 1")
    if a.dim % a.heads:
        raise ValueError(f"--dim {a.dim} must be divisible by --heads {a.heads}")
    if not 2 <= a.block <= a.seq_len:
        raise ValueError(f"--block {a.block} must be in [2, seq_len = {a.seq_len}]")
    if a.vocab < a.block:
        raise ValueError(f"--vocab {a.vocab} must be >= --block {a.block} (a block has distinct tokens)")
    if len(a.segments) != len(a.rates):
        raise ValueError(f"--segments {a.segments} and --rates {a.rates}: one of each per branch")
    if not any((a.block - 1) % r == 0 and w >= a.block for w, r in zip(a.segments, a.rates)):
        print(f"warning: no branch reaches the copy offset {a.block - 1} (that needs a segment "
              f"length >= {a.block} whose rate divides {a.block - 1}): the copy-loss will not fall",
              file=sys.stderr)


def make_batch(gen: torch.Generator, batch: int, seq_len: int, vocab: int, block: int):
    """(inputs, targets), each (batch, seq_len) int64 on the CPU: per sequence one block of
    `block` distinct random tokens, tiled; the targets are the inputs shifted by one."""
    blocks = torch.rand(batch, vocab, generator=gen).argsort(dim=1)[:, :block]
    seq = blocks.repeat(1, math.ceil((seq_len + 1) / block))[:, :seq_len + 1]
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def use_kernel_dtype(block: LongNetDecoderBlock, dtype: torch.dtype) -> None:
    """Mixed precision: the weights stay float32 (so the layer's spec says float32), while
    under torch.autocast the projections hand the kernel bf16 q, k, v. Give the layer a
    kernel compiled for the compute dtype instead."""
    attn = block.attn
    attn.spec = attn.spec.replace(dtype=KERNEL_DTYPE_NAMES[dtype])
    attn.attention = DilatedAttention(attn.spec, attn.attention.dropout)


class TinyLongNetLM(nn.Module):
    """Token embedding + token shift, LongNetDecoderBlocks, LayerNorm, LM head."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, segments, rates,
                 kernel_dtype: torch.dtype = torch.float32, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.shift = nn.Linear(dim, dim, bias=False)   # mixes in the previous token's embedding
        self.blocks = nn.ModuleList(
            LongNetDecoderBlock(dim, heads, segments, rates, dropout=attention_dropout, name="tiny_lm")
            for _ in range(layers))
        if kernel_dtype != torch.float32:
            for block in self.blocks:
                use_kernel_dtype(block, kernel_dtype)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.tok(tokens)
        x = e + self.shift(F.pad(e[:, :-1], (0, 0, 1, 0)))   # position 0: no previous token
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _is_cpu_preset(a: argparse.Namespace) -> bool:
    """True when `a` trains with the CPU preset's model, data and schedule (the run whose
    outcome the progress lines announce)."""
    preset = resolve(dict(device="cpu", seed=a.seed))
    keys = ("steps", "seq_len", "batch", "dim", "heads", "layers", "lr", "block", "vocab",
            "segments", "rates", "dtype", "fixed_batch")
    return all(getattr(a, k) == getattr(preset, k) for k in keys)


def _lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 10% of the steps, then cosine decay to 10% of peak."""
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _kernel_launches(model: TinyLongNetLM, device: torch.device) -> int:
    """dilgen launches (forward calls + backward calls) of the model's attention kernels."""
    kernels = {id(k): k for k in (b.attn.attention.kernel.compiled_for(device).attention
                                  for b in model.blocks)}
    derived = {id(t): t for k in kernels.values() for t in k.__dict__.get("_twins", {}).values()}
    return sum(k.launches for k in (*kernels.values(), *derived.values()))      # with dropout's modules


def train(params=None) -> dict:
    """Train with `params` and return the summary: settings, per-step `losses` and
    `copy_losses` (the positions past the first block), first/last loss, tokens/s,
    versions, dilgen kernel launches. Writes it as JSON when params["json"] is set."""
    a = resolve(params)
    device = torch.device(a.device)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS
    dtype = DTYPES[a.dtype]
    say = (lambda *x: None) if a.quiet else (lambda *x: print(*x, flush=True))
    det_before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        torch.manual_seed(a.seed)
        model = TinyLongNetLM(a.vocab, a.dim, a.heads, a.layers, a.segments, a.rates,
                              kernel_dtype=dtype, attention_dropout=a.attention_dropout).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
        gen = torch.Generator().manual_seed(a.seed + 1)
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        copy_mask = (torch.arange(a.seq_len) >= a.block).to(device)  # targets copyable from a block back
        tokens_per_step = a.batch * a.seq_len
        n_params = sum(p.numel() for p in model.parameters())
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
        say(f"tiny LongNet LM, {n_params / 1e6:.2f}M params: {a.layers} x LongNetDecoderBlock(dim "
            f"{a.dim}, {a.heads} heads, w {a.segments}, r {a.rates}, causal, attention dropout "
            f"{a.attention_dropout}), vocab {a.vocab}; "
            f"N {a.seq_len}, batch {a.batch}, block {a.block}; {a.dtype} on {where}")
        say(f"ln(vocab) = {math.log(a.vocab):.3f}; loss floor (perfect copying) about "
            f"{a.block / a.seq_len * math.log(a.vocab):.3f}")
        if device.type == "cpu":
            if _is_cpu_preset(a):
                say("CPU run in Triton's interpreter, about 0.6 s a step on 2 cores (about a "
                    "minute in all). Expect: the loss stays near ln(vocab) for about 20 steps, "
                    "then falls; by step 100 it is about 0.75 (copy-loss about 0.4; floor "
                    f"{a.block / a.seq_len * math.log(a.vocab):.2f})")
            else:
                say("CPU run in Triton's interpreter: slow, its cost grows with batch x heads x "
                    "segments; the copy is learned after a plateau that grows with block and "
                    "vocab (about 20 steps with the CPU preset, 55 with the GPU's), so a short "
                    "run may show only the plateau")

        launches0 = _kernel_launches(model, device)
        losses, copy_losses, pending = [], [], []
        t_start = time.perf_counter()
        t_first = None                 # wall time of step 1: kernel compiles, warmup
        t_mark, step_mark = t_start, 0
        fixed = make_batch(gen, a.batch, a.seq_len, a.vocab, a.block) if a.fixed_batch else None
        for step in range(a.steps):
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, a.steps, a.lr)
            inputs, targets = fixed or make_batch(gen, a.batch, a.seq_len, a.vocab, a.block)
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast:
                logits = model(inputs)
            tok_loss = F.cross_entropy(logits.float().view(-1, a.vocab), targets.view(-1),
                                       reduction="none").view(a.batch, a.seq_len)
            loss = tok_loss.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            pending.append(torch.stack([loss.detach(), tok_loss.detach()[:, copy_mask].mean()]))
            if step == 0 or (step + 1) % a.log_every == 0 or step + 1 == a.steps:
                vals = torch.stack(pending).float().cpu()          # waits for the device
                pending.clear()
                losses.extend(vals[:, 0].tolist())
                copy_losses.extend(vals[:, 1].tolist())
                now = time.perf_counter()
                rate = tokens_per_step * (step + 1 - step_mark) / (now - t_mark)
                if step == 0:
                    t_first = now - t_start
                t_mark, step_mark = now, step + 1
                say(f"step {step + 1:5d}/{a.steps}  loss {losses[-1]:.4f}  copy-loss "
                    f"{copy_losses[-1]:.4f}  lr {opt.param_groups[0]['lr']:.1e}  {rate:,.0f} tok/s"
                    + ("  (first step: kernel compiles)" if step == 0 else ""))
        total = time.perf_counter() - t_start
        launches = _kernel_launches(model, device) - launches0
    finally:
        torch.use_deterministic_algorithms(det_before)

    rest = a.steps - 1
    result = {
        "example": "examples/train_tiny_lm.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": where,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": _triton_version(), "dilgen": dilgen.__version__},
        "settings": {k: v for k, v in vars(a).items() if k not in ("json", "quiet")},
        "params": n_params,
        "steps": a.steps,
        "tokens_per_step": tokens_per_step,
        "ln_vocab": math.log(a.vocab),
        "loss_floor": a.block / a.seq_len * math.log(a.vocab),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "first_copy_loss": copy_losses[0],
        "last_copy_loss": copy_losses[-1],
        "seconds_total": total,
        "seconds_first_step": t_first,
        "tokens_per_s": tokens_per_step * rest / (total - t_first) if rest else tokens_per_step / total,
        "dilgen_kernel_launches": launches,
        "losses": losses,
        "copy_losses": copy_losses,
    }
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    say(f"loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}, copy-loss "
        f"{result['first_copy_loss']:.3f} -> {result['last_copy_loss']:.3f}; {total:.1f} s, "
        f"{result['tokens_per_s']:,.0f} tok/s after the first step; {launches} dilgen launches"
        + (f"; wrote {a.json}" if a.json else ""))
    return result


def _triton_version() -> str:
    import triton
    return triton.__version__


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
