"""A tiny LongNet-style language model trained with dilgen's kernels (forward and backward).

    python examples/train_tiny_lm.py                      # GPU: 300 steps, 8K tokens, bf16
    python examples/train_tiny_lm.py --device cpu --steps 6 --seq-len 64 --dim 32 --heads 2 \\
        --layers 1 --block 16                             # CPU: Triton's interpreter, seconds

Task (generated data): every sequence is a random block of `--block` tokens repeated
until it fills the sequence. The first copy is noise (loss ln V); every later token is
the token one block back, so the loss can fall only by attending `--block` positions
back: across the short segments, through the longer, dilated branches of the spec.
The model: token embedding + a learned embedding of the position inside the block,
`--layers` dilgen LongNetDecoderBlocks (causal dilated attention), LayerNorm, LM head.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time

import torch
from torch import nn

from dilgen.nn import LongNetDecoderBlock


class TinyLongNet(nn.Module):
    def __init__(self, vocab, dim, heads, layers, block, segment_lengths, dilation_rates, dtype, device):
        super().__init__()
        f = {"dtype": dtype, "device": device}
        self.block = block
        self.tok = nn.Embedding(vocab, dim, **f)
        self.pos = nn.Embedding(block, dim, **f)
        self.blocks = nn.ModuleList(
            LongNetDecoderBlock(dim, heads, segment_lengths, dilation_rates, dtype=dtype,
                                device=device, name=f"tiny_lm_layer{i}") for i in range(layers))
        self.norm = nn.LayerNorm(dim, **f)
        self.head = nn.Linear(dim, vocab, **f)

    def forward(self, tokens):
        n = tokens.shape[1]
        pos = torch.arange(n, device=tokens.device) % self.block
        x = self.tok(tokens) + self.pos(pos)[None]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def batch(gen, args, device):
    reps = math.ceil(args.seq_len / args.block) + 1
    blocks = torch.randint(0, args.vocab, (args.batch, args.block), generator=gen)
    seq = blocks.repeat(1, reps)[:, : args.seq_len + 1]
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def spec_for(args):
    """LongNet-style branches: a dense local one, a dense one over two blocks (it can copy
    directly when both copies share a segment) and a long dilated one (r = 2) over eight."""
    n = args.seq_len
    w = [min(max(16, args.block // 2), n), min(2 * args.block, n), min(8 * args.block, n)]
    return w, [1, 1, 2]


def train(args) -> dict:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    w, r = spec_for(args)
    model = TinyLongNet(args.vocab, args.dim, args.heads, args.layers, args.block, w, r, dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    t0 = time.perf_counter()
    fixed = batch(gen, args, device) if args.fixed_batch else None
    for step in range(1, args.steps + 1):
        x, y = fixed or batch(gen, args, device)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            tps = step * args.batch * args.seq_len / (time.perf_counter() - t0)
            print(f"step {step:5d}  loss {losses[-1]:.4f}  {tps:,.0f} tokens/s", flush=True)
    floor = math.log(args.vocab) * args.block / args.seq_len   # the first copy stays noise
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "date": dt.date.today().isoformat(),
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        "spec": {"segment_lengths": w, "dilation_rates": r, "causal": True},
        "args": vars(args), "steps": args.steps, "first_loss": losses[0], "last_loss": losses[-1],
        "loss_floor": floor, "losses": losses,
        "tokens_per_s": args.steps * args.batch * args.seq_len / (time.perf_counter() - t0),
    }
    try:
        import triton
        result["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def parse_args(argv=None):
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=8192 if gpu else 64)
    ap.add_argument("--block", type=int, default=512 if gpu else 16, help="repeat period (tokens)")
    ap.add_argument("--batch", type=int, default=8 if gpu else 2)
    ap.add_argument("--vocab", type=int, default=256 if gpu else 32)
    ap.add_argument("--dim", type=int, default=256 if gpu else 32)
    ap.add_argument("--heads", type=int, default=4 if gpu else 2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3 if gpu else 3e-3)
    ap.add_argument("--device", default="cuda" if gpu else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16" if gpu else "fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--fixed-batch", action="store_true", help="one batch over and over (smoke tests)")
    ap.add_argument("--json", help="write the loss history and settings here")
    return ap.parse_args(argv)


if __name__ == "__main__":
    out = train(parse_args())
    print(f"loss {out['first_loss']:.3f} -> {out['last_loss']:.3f} (floor ~{out['loss_floor']:.3f})")
