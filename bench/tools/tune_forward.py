"""Autotune dilgen's forward on the bench configs (A-F of bench/toolkit.py, causal and not)
on the GPU: dilgen.autotune.tune times every candidate tile and stores the winner in the
dilgen cache, where dilgen.compile finds it. Prints each candidate's time.

    python bench/tools/tune_forward.py [--configs A,B,C,D,E,F] [--causal 0,1] [--json FILE]
    python bench/tools/tune_forward.py --dry-run-cpu --configs A    # toy sizes, interpreter, 2 candidates, nothing stored
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/
import toolkit as tk  # noqa: E402
tk.setup_paths()

from dilgen.autotune import candidates, tune  # noqa: E402
from dilgen.compiler import Kernel, target_for_device  # noqa: E402


def dry_tune(spec, cfg):
    """The CPU stand-in of tune(): two candidates in Triton's interpreter, nothing stored."""
    import torch
    dev = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(cfg["B"], cfg["N"], cfg["H"], cfg["D"], generator=g, dtype=torch.bfloat16)
               for _ in range(3))
    table = []
    for cand in candidates(cfg["D"])[:2]:
        try:
            kern = Kernel(spec, target_for_device(dev), tuning=cand)
            table.append((cand, tk.time_ms(lambda: kern(q, k, v), 0, 1, dev)["median"]))
        except Exception as e:  # noqa: BLE001 - a tile that does not fit just loses
            table.append((cand, tk.short_err(e, 80)))
    timed = [(ms, c) for c, ms in table if isinstance(ms, float)]
    return min(timed, key=lambda x: x[0])[1], table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(tk.CONFIGS))
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run-cpu", action="store_true")
    args = ap.parse_args()
    configs = tk.DRY_CONFIGS if args.dry_run_cpu else tk.CONFIGS
    out = []
    for name in tk.parse_configs(args.configs, configs):
        c = configs[name]
        for causal in [bool(int(x)) for x in args.causal.split(",")]:
            spec = tk.make_spec(name, c, causal)
            best, table = dry_tune(spec, c) if args.dry_run_cpu else tune(spec, c["N"], c["B"])
            fl = tk.useful_flops(c, causal)
            for cfg, ms in table:
                tag = f"{ms:.3f} ms {fl / ms / 1e9:.0f} TF/s" if isinstance(ms, float) else ms
                print(f"{name} causal={int(causal)} {tuple(cfg.values())}: {tag}", flush=True)
            best_ms = min(ms for _, ms in table if isinstance(ms, float))
            print(f"==> {name} causal={int(causal)} best {best} {best_ms:.3f} ms", flush=True)
            out.append(dict(config=name, causal=causal, best=best, best_ms=best_ms,
                            table=[(cfg, ms) for cfg, ms in table]))
    if args.json:
        tk.write_json_atomic(args.json, {**tk.header("cpu" if args.dry_run_cpu else "cuda", args.dry_run_cpu),
                                         "rows": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
