"""How far causal masking lowers the time of the best vendor attention kernels on the shapes
dilgen's lane kernels run (issue 12's "causal <= 0.6x non-causal"): cuDNN and FlashAttention
(torch's SDPA backends) on already-gathered, contiguous rows, no gather, no scatter, no merge.

Each branch (w, r) of a bench config is, per head, N/w independent sequences of w/r kept
rows (the lanes; r = 6, 12: the longest lane count of the branch), so the kernel floor of a
config is the sum over its branches of one SDPA call on (B * N/w, H, w/r, D). Prints and
writes (to $OUT or bench/results) the median ms of forward and forward + backward, causal and
not, and the causal / non-causal ratio of each backend. dilgen's own ratios are those of the
committed bench rows (bench/results/{forward,backward}-*.json); README sets the two side by side.

    python bench/tools/vendor_causal_floor.py [--configs A,B,C,D,E] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/
import toolkit as tk  # noqa: E402


def branch_shapes(cfg: dict) -> list[tuple[int, int, int, int]]:
    """(batch, heads, lanes, head_dim) of one gathered SDPA call per branch."""
    return [(cfg["B"] * math.ceil(cfg["N"] / w), cfg["H"], math.ceil(w / r), cfg["D"])
            for w, r in zip(cfg["ws"], cfg["rs"])]


def time_backend(backend: str, shapes, causal: bool, fwd_bwd: bool, reps: int) -> float:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    use = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    tensors = []
    for b, h, n, d in shapes:
        qkv = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=fwd_bwd)
               for _ in range(3)]
        tensors.append((qkv, torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)))

    def run():
        with sdpa_kernel([use]):
            for (q, k, v), g in tensors:
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                if fwd_bwd:
                    o.backward(g)
    if fwd_bwd:
        return tk.time_ms(run, warmup=3, reps=reps)["median"]
    with torch.no_grad():
        return tk.time_ms(run, warmup=3, reps=reps)["median"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="A,B,C,D,E")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name in tk.parse_configs(args.configs):
        cfg = tk.CONFIGS[name]
        shapes = branch_shapes(cfg)
        for backend in ("cudnn", "flash"):
            row = dict(config=name, backend=backend, shapes=shapes)
            for fb in (False, True):
                key = "fwdbwd" if fb else "fwd"
                try:
                    nc = time_backend(backend, shapes, False, fb, args.reps)
                    c = time_backend(backend, shapes, True, fb, args.reps)
                    row[f"{key}_ms"], row[f"{key}_causal_ms"], row[f"{key}_ratio"] = nc, c, c / nc
                except Exception as e:  # noqa: BLE001 - a backend that refuses a shape: say so
                    row[f"{key}_error"] = tk.short_err(e, 200)
                tk.cleanup()
            rows.append(row)
            tk.log(json.dumps(row))
    print(tk.markdown_table(
        ["config", "backend", "fwd ms", "causal", "ratio", "f+b ms", "causal", "ratio"],
        [[r["config"], r["backend"], tk.fmt(r.get("fwd_ms")), tk.fmt(r.get("fwd_causal_ms")),
          tk.fmt(r.get("fwd_ratio")), tk.fmt(r.get("fwdbwd_ms")), tk.fmt(r.get("fwdbwd_causal_ms")),
          tk.fmt(r.get("fwdbwd_ratio"))] for r in rows]))
    out = dict(tk.header(), what=__doc__.split("\n\n")[0], rows=rows)
    path = args.json or os.path.join(os.environ.get("OUT", str(tk.RESULTS)), "vendor_causal_floor.json")
    tk.write_json_atomic(path, out)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
