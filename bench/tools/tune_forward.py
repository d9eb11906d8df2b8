"""Autotune dilgen's forward on the bench configs (A-F of bench/toolkit.py, causal and not)
on the GPU; prints each candidate's time and stores the winners in the dilgen cache.
Usage: python bench/tools/tune_forward.py [--configs A,B,C,D,E,F] [--causal 0,1] [--json FILE]"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/
import toolkit  # noqa: E402
toolkit.setup_paths()

import dilgen  # noqa: E402
from dilgen.autotune import tune  # noqa: E402
from dilgen.stats import forward_flops  # noqa: E402

CONFIGS = toolkit.CONFIGS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="A,B,C,D")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    for name in args.configs.split(","):
        c = CONFIGS[name]
        for causal in [bool(int(x)) for x in args.causal.split(",")]:
            spec = dilgen.Spec(name=f"bench_{name.lower()}{'_causal' if causal else ''}",
                               num_heads=c["H"], head_dim=c["D"], segment_lengths=c["ws"],
                               dilation_rates=c["rs"], causal=causal, hilbert=c.get("hilbert"))
            best, table = tune(spec, c["N"], c["B"])
            fl = forward_flops(c["ws"], c["rs"], c["H"], c["D"], causal, c["N"], c["B"])
            for cfg, ms in table:
                tag = f"{ms:.3f} ms {fl / ms / 1e9:.0f} TF/s" if isinstance(ms, float) else ms
                print(f"{name} causal={int(causal)} {tuple(cfg.values())}: {tag}", flush=True)
            best_ms = min(ms for _, ms in table if isinstance(ms, float))
            print(f"==> {name} causal={int(causal)} best {best} {best_ms:.3f} ms", flush=True)
            out.append(dict(config=name, causal=causal, best=best, best_ms=best_ms,
                            table=[(cfg, ms) for cfg, ms in table]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
