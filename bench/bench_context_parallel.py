#!/usr/bin/env python3
"""Context-parallel training on dilgen's ring (docs/training.md "Context parallel") at P = 1
and P = 2 GPUs: examples/train_context_parallel.py (the transformers bench's Llama, 8 x 1024,
GQA 4, head_dim 64, LongNet rates to 32K, bf16, gradient checkpointing) run as a user runs it,
under torchrun, and GigaPath's slide encoder (12 x 768, 16 heads of 48, its five segment
lengths) on torchscale's `seq_parallel` (docs/torchscale.md). Parts:

  check   P = 2 `--check` on NCCL: loss and every gradient against one process (float32, 1e-5)
  losses  the first 50 steps at a context both hold: P = 2's losses against P = 1's (bf16)
  scale   peak GiB at two contexts per P (tokens/s per GPU: P = 1 on N, P = 2 on 2N), the line
          through them, then the longest context the line predicts, trained, stepping down
          until one trains
  slide   a 70K-tile slide forward (and forward + backward): 2 GPUs against 1, outputs compared

  python bench/bench_context_parallel.py                      # every part (2 GPUs)
  python bench/bench_context_parallel.py --parts losses,slide
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))      # torchscale_model: GigaPath's structure
import toolkit as tk  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "train_context_parallel.py"
PARTS = ("check", "losses", "scale", "slide")
LOSS_TOL = 2e-2          # |loss(P=2) - loss(P=1)| / loss(P=1), any of the 50 steps (bf16 training)
UNIT = 1 << 17           # contexts tried in steps of UNIT * P tokens


def torchrun(P: int, script, args, timeout: int) -> tuple[int, str]:
    """(exit code, the run's output; 124 past `timeout`, with what it printed until then)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={P}",
           str(script), *map(str, args)]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:    # SIGTERM: torchrun stops its ranks (their own sessions)
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
        log.seek(0)
        text = log.read()
    return rc, (f"timed out after {timeout} s; " if rc == 124 else "") + text


def train(P: int, context: int, steps: int, *extra, timeout: int = 420) -> dict:
    """One example run: its JSON row, or {"error": ...} ("out of memory" when it ran out)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        rc, text = torchrun(P, EXAMPLE, ["--context", context, "--steps", steps, "--json", out, *extra], timeout)
        row = json.loads(out.read_text()) if rc == 0 and out.exists() else {"gpus": P, "context": context}
    if rc != 0:
        row["error"] = "out of memory" if "out of memory" in text.lower() else text[:60] + " ... " + text[-600:]
    tk.log(f"  P={P} context {context}: " + (row.get("error") or f"{row['tokens_per_s_per_gpu']} tokens/s "
                                              f"per GPU, peak {row['peak_gib']} GiB"))
    return row


def part_check(res) -> None:
    res.add(dict(train(2, 16384, 3, "--check", timeout=300), part="check"))


def part_losses(res) -> None:
    rows = {P: train(P, 65536, 50, "--warmup", 5) for P in (1, 2)}
    a, b = rows[1].get("losses"), rows[2].get("losses")
    for P, row in rows.items():
        res.add(dict(row, part="losses"))
    if a and b:
        rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
        worst = max(range(len(rel)), key=rel.__getitem__)
        res.data["losses_compared"] = {"steps": len(rel), "largest_relative_difference": rel[worst],
                                       "at_step": worst, "tolerance": LOSS_TOL, "passed": rel[worst] <= LOSS_TOL}
        tk.log(f"  losses P=2 vs P=1: largest relative difference {rel[worst]:.2e} at step {worst}")


def part_scale(res, gib: float) -> None:
    longest, fits = {}, {P: [res.add(dict(train(P, c * P, 5), part="scale")) for c in (4 * UNIT, 8 * UNIT)]
                         for P in (1, 2)}           # both P's rates first, then the long runs
    for P, fit in fits.items():
        if any("error" in r for r in fit):
            continue
        (c0, m0), (c1, m1) = [(r["context"], r["peak_gib"]) for r in fit]
        per_token = (m1 - m0) / (c1 - c0)
        guess = int((0.97 * gib - (m0 - per_token * c0)) / per_token) // (UNIT * P) * (UNIT * P)
        tk.log(f"  P={P}: {per_token * 2**30:.0f} bytes per token, predicted longest context {guess}")
        for c in range(guess, max(guess - 4 * UNIT * P, 0), -UNIT * P):
            row = res.add(dict(train(P, c, 3, "--warmup", 1), part="longest", predicted=guess))
            if "error" not in row:
                longest[P] = c
                break
    if 1 in longest and 2 in longest:
        res.data["longest"] = {"P1": longest[1], "P2": longest[2], "ratio": round(longest[2] / longest[1], 3)}
    per_gpu = {r["gpus"]: r["tokens_per_s_per_gpu"] for r in res.rows
               if r.get("part") == "scale" and r.get("context") == 8 * UNIT * r["gpus"] and "error" not in r}
    if 1 in per_gpu and 2 in per_gpu:
        res.data["per_gpu_rate"] = {"N": 8 * UNIT, "P1": per_gpu[1], "P2_on_2N": per_gpu[2],
                                    "ratio": round(per_gpu[2] / per_gpu[1], 3)}


def part_slide(res, tiles: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for P in (1, 2):
            rc, text = torchrun(P, __file__, ["--slide-worker", tmp, "--tiles", tiles], 420)
            row = json.loads(Path(tmp, f"slide{P}.json").read_text()) if rc == 0 else {"error": text[-600:]}
            res.add(dict(row, part="slide", gpus=P, tiles=tiles))
            tk.log(f"  slide P={P}: {row}")
        if rc == 0:
            import torch
            one = torch.load(Path(tmp, "out1_0.pt"))
            two = torch.cat([torch.load(Path(tmp, f"out2_{r}.pt")) for r in range(2)], dim=1)
            res.data["slide_compared"] = {"relative_difference": tk.rel_err(two, one), "tolerance": 2e-2}
            tk.log(f"  slide 2 GPUs vs 1: relative difference {tk.rel_err(two, one):.2e} (bf16)")


def slide_worker(out_dir: str, tiles: int) -> None:
    """One rank of the slide part: GigaPath's LongNetViT (random weights, eval: no dropout),
    its tokens cut by chunk_rows, forward timed (no_grad) and forward + backward."""
    import torch
    import torch.distributed as dist

    import torchscale_model as tm
    from dilgen.compat import torchscale as compat
    dist.init_process_group("nccl")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    model = tm.make_slide_encoder(seed=0, dtype=torch.float32, in_chans=1536, embed_dim=768, depth=12,
                                  slide_ngrids=1000).to(device=device, dtype=torch.bfloat16)
    compat.patch(model, verbose=False)
    model.encoder.args.seq_parallel = P > 1
    tiles_x, coords = tm.make_slide(model, 1, tiles, seed=1)
    with torch.no_grad():
        x = model.patch_embed(tiles_x.to(device)) + \
            model.pos_embed[:, model.coords_to_pos(coords.to(device), model.tile_size)].squeeze(0)
        full = torch.cat([model.cls_token + model.pos_embed[:, :1], x], dim=1)
    mine = compat.chunk_rows(full).contiguous()

    def fwd():
        with torch.no_grad():
            return model.norm(model.encoder(token_embeddings=mine)["encoder_out"])

    def fwd_bwd():
        xg = mine.detach().requires_grad_(True)
        model.norm(model.encoder(token_embeddings=xg)["encoder_out"]).float().square().mean().backward()

    out = fwd()
    torch.save(out.cpu(), Path(out_dir, f"out{P}_{rank}.pt"))
    row = {}
    for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        dist.barrier()
        row[f"{name}_ms"] = tk.time_ms(fn, 2, 5, device)["median"]
    row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if rank == 0:
        Path(out_dir, f"slide{P}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = tk.parser(__doc__, "out")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    ap.add_argument("--tiles", type=int, default=70000, help="slide tiles (70000)")
    ap.add_argument("--slide-worker", metavar="DIR", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.slide_worker:
        slide_worker(a.slide_worker, a.tiles)
        return 0
    parts = tk.pick(a.parts, PARTS, "--parts")
    import torch
    if torch.cuda.device_count() < 2:
        tk.log(f"bench_context_parallel.py needs 2 GPUs ({torch.cuda.device_count()} here)")
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    head = tk.header("cuda", extra={"bench": "context_parallel", "example": "examples/train_context_parallel.py",
                                    "parts": parts, "loss_tolerance": LOSS_TOL})
    res = tk.Results(tk.result_path(a.out, "context_parallel", tag=tk.gpu_tag(head["device"])), head,
                     key=("part", "gpus", "context"), append=True)
    for name in parts:
        tk.log(f"{name}:")
        if name == "scale":
            part_scale(res, head["gpu_memory_gib"])
        elif name == "slide":
            part_slide(res, a.tiles)
        else:
            globals()[f"part_{name}"](res)
        res.save()
    table = [[r["part"], r["gpus"], r.get("context", r.get("tiles")), r.get("tokens_per_s_per_gpu", "—"),
              r.get("peak_gib", "—"), r.get("fwd_ms", "—"), r.get("fwd+bwd_ms", "—"), r.get("error", "")[:40]]
             for r in res.all_rows()]
    res.data["table_md"] = tk.markdown_table(["part", "gpus", "context / tiles", "tokens/s per GPU", "peak GiB",
                                              "slide fwd ms", "slide fwd+bwd ms", "error"], table)
    tk.log(f"\n{res.data['table_md']}\n\nwrote {res.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
