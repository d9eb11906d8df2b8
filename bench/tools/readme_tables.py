"""Print the README's forward and forward + backward tables from the committed bench JSON.

    python bench/tools/readme_tables.py bench/results/forward-2026-11-23.json bench/results/backward-2026-11-23.json

The README's tables follow the committed results: paste the output over them after a merge.
"""
from __future__ import annotations

import json
import sys


def _ms(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def table(path: str, peers: list[str]) -> str:
    rows = json.load(open(path))["rows"]
    nc = {r["config"]: r["dilgen_ms"] for r in rows if not r["causal"]}
    lines = []
    for r in sorted(rows, key=lambda r: (r["config"], r["causal"])):
        ratio = f"{r['dilgen_ms'] / nc[r['config']]:.2f}" if r["causal"] and r["config"] in nc else ""
        cells = [r["config"], "yes" if r["causal"] else "no", f"**{r['dilgen_ms']:.2f}**",
                 f"{r['useful_tflops']:.0f}"] + [_ms(r.get(f"{p}_ms")) for p in peers] + [ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    forward, backward = sys.argv[1:3]
    print(table(forward, ["gather_cudnn", "gather_flash", "flex", "dense"]))
    print()
    print(table(backward, ["gather_cudnn", "gather_flash", "dense"]))
