#!/usr/bin/env python3
"""Context-parallel training on dilgen's ring (docs/training.md "Context parallel") at P = 1
and P = 2 GPUs: examples/train_context_parallel.py (the transformers bench's Llama, 8 x 1024,
GQA 4, head_dim 64, LongNet rates to 32K, bf16, gradient checkpointing) run as a user runs it,
under torchrun. Parts:
  check   P = 2 `--check` on NCCL: loss and every gradient against one process (float32, 1e-5)
  losses  the first 50 steps at a context both hold: P = 2's losses against P = 1's (bf16)
  scale   peak GiB at two contexts per P (tokens/s per GPU: P = 1 on N, P = 2 on 2N), the line
          through them, then the longest context the line predicts, trained, stepping down
          until one trains

  python bench/bench_context_parallel.py [--parts losses,scale]       # every part (2 GPUs), or some
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import toolkit as tk  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "train_context_parallel.py"
PARTS = ("check", "losses", "scale")
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
            proc.wait(timeout=60)
            rc = 124
        log.seek(0)
        return rc, (f"timed out after {timeout} s; " if rc == 124 else "") + log.read()


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
    rows = {P: res.add(dict(train(P, 65536, 50, "--warmup", 5), part="losses")) for P in (1, 2)}
    a, b = rows[1].get("losses"), rows[2].get("losses")
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


def main(argv=None) -> int:
    ap = tk.parser(__doc__, "out")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    a = ap.parse_args(argv)
    parts = tk.pick(a.parts, PARTS, "--parts")
    import torch
    if torch.cuda.device_count() < 2:
        tk.log(f"bench_context_parallel.py needs 2 GPUs ({torch.cuda.device_count()} here)")
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    head = tk.header("cuda", extra={"bench": "context_parallel", "parts": parts, "loss_tolerance": LOSS_TOL})
    res = tk.Results(tk.result_path(a.out, "context_parallel", tag=tk.gpu_tag(head["device"])), head,
                     key=("part", "gpus", "context"), append=True)
    for name in parts:
        tk.log(f"{name}:")
        part_scale(res, head["gpu_memory_gib"]) if name == "scale" else globals()[f"part_{name}"](res)
        res.save()
    cols = ("part", "gpus", "context", "step_s", "tokens_per_s_per_gpu", "peak_gib", "error")
    res.data["table_md"] = tk.markdown_table(cols, [[str(r.get(c, "—"))[:40] for c in cols] for r in res.all_rows()])
    tk.log(f"\n{res.data['table_md']}\n\nwrote {res.save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
