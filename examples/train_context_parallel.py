"""Train a transformers Llama with attn_implementation="dilgen" at a context split over P
GPUs (context parallelism: dilgen.integrations.context_parallel, docs/training.md).

    torchrun --nproc-per-node 2 examples/train_context_parallel.py                  # 2 GPUs, NCCL, bf16
    torchrun --nproc-per-node 2 examples/train_context_parallel.py --context 524288 --json out/cp.json
    torchrun --nproc-per-node 2 examples/train_context_parallel.py --cpu --check    # CPU, gloo, interpreter

The model is the transformers bench's (bench/bench_transformers.py: 8 layers of hidden
1024, 16 heads, 4 kv heads (GQA 4), head_dim 64, byte-level; LongNet rates w = 2K ... 32K,
r = 1 ... 16), trained with AdamW on windows of the Python standard library's own source
(every rank draws the same windows, then keeps its rows), gradient checkpointing on. Each
step prints the loss (the mean over every token of every rank), tokens/s and the peak
memory; --json OUT writes them (rows: gpus, context, tokens_per_s, tokens_per_s_per_gpu,
peak_gib, losses). --cpu runs a tiny model of the same shape family (hidden 64, 2 layers,
4 heads, 2 kv heads, 256 tokens, w = [16, 64]) in float32 on gloo, kernels in Triton's
interpreter.

--check trains the same model from the same weights on the same windows in one process
(each rank keeps such a copy: small contexts only) and compares, at every step, the loss and
every parameter's gradient (after the context-parallel reduction): float32, relative error
<= 1e-5 (a gradient that is 0 in exact arithmetic compares as 0 below 1e-9); it exits 1
otherwise. Without torchrun it runs as one process (P = 1).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

# the transformers bench's model and pattern (bench/bench_transformers.py MODEL and PATTERN)
MODEL = dict(vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64, attention_dropout=0.0,
             tie_word_embeddings=False)
PATTERN = {"segment_lengths": [2048, 4096, 8192, 16384, 32768], "dilation_rates": [1, 2, 4, 8, 16]}
CPU_MODEL = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
CPU_PATTERN = {"segment_lengths": [16, 64], "dilation_rates": [1, 2]}
TOL = 1e-5


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny model, float32, gloo, Triton's interpreter")
    p.add_argument("--context", type=int, help="tokens per sequence, all ranks together (GPU 131072 x P, CPU 256)")
    p.add_argument("--steps", type=int, help="optimizer steps (GPU 20, CPU 3)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s (kernel builds) (2)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (3e-4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the windows (0)")
    p.add_argument("--check", action="store_true",
                   help="compare loss and every gradient with one process at every step (float32); exit 1 past 1e-5")
    p.add_argument("--checkpointing", choices=("on", "off"),
                   help="gradient checkpointing: recompute each layer in backward (GPU on, CPU off)")
    p.add_argument("--json", metavar="OUT", help="write the run's row as JSON to OUT (rank 0)")
    a = p.parse_args(argv)
    return a


def setup(cpu: bool):
    """(rank, P, device): the process group torchrun describes, or one process of its own."""
    if "RANK" not in os.environ:                     # run without torchrun: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    use_gpu = not cpu and torch.cuda.is_available()
    dist.init_process_group("nccl" if use_gpu else "gloo")
    if use_gpu:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def corpus() -> bytes:
    """The standard library's .py files, sorted, as one byte string (every machine has it)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return b"\n".join(p.read_bytes() for p in files)


def windows(n: int, seed: int):
    """Random windows of n bytes, the same sequence on every rank (the seed, not the rank)."""
    data, rng = corpus(), random.Random(seed)
    while True:
        i = rng.randrange(0, len(data) - n)
        yield torch.frombuffer(bytearray(data[i:i + n]), dtype=torch.uint8).long()[None]


def build(cpu: bool, dtype, device, seed: int):
    import dilgen.integrations.transformers  # noqa: F401  registers "dilgen"
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**(CPU_MODEL if cpu else MODEL), max_position_embeddings=1 << 24)
    config.dilgen_spec = dict(CPU_PATTERN if cpu else PATTERN)
    config.use_cache = False
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation="dilgen")
    return model.to(device=device, dtype=dtype)


def grad_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||; 0 below 1e-9 absolute (a gradient 0 in exact arithmetic)."""
    diff = (got.double() - want.double()).norm().item()
    return 0.0 if diff < 1e-9 else diff / max(want.double().norm().item(), 1e-300)


def train(a: argparse.Namespace) -> dict:
    from dilgen.integrations.context_parallel import context_parallel
    rank, P, device = setup(a.cpu)
    gpu = device.type == "cuda"
    context = a.context or (131072 * P if gpu else 256)
    steps = a.steps or (20 if gpu else 3)
    dtype = torch.float32 if (a.check or not gpu) else torch.bfloat16
    model = build(not gpu, dtype, device, a.seed)
    ref = build(not gpu, dtype, device, a.seed) if a.check else None     # one process, the whole sequence
    checkpointing = (a.checkpointing or ("on" if gpu else "off")) == "on"
    if checkpointing:
        for m in (model, ref):
            if m is not None:
                m.gradient_checkpointing_enable()
    cp = context_parallel(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=0.0) for m in (model, ref) if m is not None]
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, worst, stream = [], [], 0.0, windows(context, a.seed)
    for step in range(steps):
        ids = next(stream).to(device)
        batch = cp.shard({"input_ids": ids, "labels": ids})
        if gpu:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = cp.loss(out.logits, batch["shift_labels"])
        loss.backward()
        cp.reduce_gradients()
        if ref is not None:
            ref_loss = ref(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            errors = {n: grad_error(p.grad, q.grad) for (n, p), (_, q) in zip(model.named_parameters(),
                                                                             ref.named_parameters())}
            errors["(loss)"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            name = max(errors, key=errors.get)
            worst = max(worst, errors[name])
            if rank == 0:
                print(f"step {step}: loss {loss.item():.6f}, one process {ref_loss.item():.6f}; largest "
                      f"relative error {errors[name]:.2e} ({name})", flush=True)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 5))            # .item() synchronises
        times.append(time.perf_counter() - t0)
        if rank == 0 and ref is None:
            print(f"step {step}: loss {losses[-1]:.4f}, {times[-1]:.2f} s", flush=True)
    timed = sorted(times[a.warmup:] or times)
    step_s = timed[len(timed) // 2]
    row = {"gpus": P if gpu else 0, "ranks": P, "context": context, "dtype": str(dtype).removeprefix("torch."),
           "steps": steps, "step_s": round(step_s, 4), "tokens_per_s": round(context / step_s),
           "tokens_per_s_per_gpu": round(context / step_s / P), "losses": losses,
           "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2) if gpu else None,
           "device": torch.cuda.get_device_name(device) if gpu else "cpu",
           "checkpointing": checkpointing}
    if a.check:
        row["check"] = {"largest_relative_error": worst, "tolerance": TOL, "passed": worst <= TOL}
    return row


def main(argv=None) -> int:
    a = parse(argv)
    row = train(a)
    if dist.get_rank() == 0:
        print(f"{row['ranks']} rank(s), context {row['context']}: {row['tokens_per_s']} tokens/s "
              f"({row['tokens_per_s_per_gpu']} per rank), peak {row['peak_gib']} GiB", flush=True)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(row, indent=1) + "\n")
    ok = row.get("check", {}).get("passed", True)
    if a.check:
        print(f"rank {dist.get_rank()}: check {'passed' if ok else 'FAILED'}: largest relative error "
              f"{row['check']['largest_relative_error']:.2e} (tolerance {TOL:.0e})", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
