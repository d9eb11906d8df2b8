"""Fold a re-run of some methods into a committed bench_forward / bench_backward result file.

After a kernel change only dilgen's numbers move; re-running the peers (minutes of device
time: flex compiles, gathers) would only re-measure them. Run the bench with
`--methods dilgen --configs ...` into a scratch folder, then

    python bench/tools/merge_rerun.py bench/results/backward-2026-11-23.json NEW.json

replaces, in every row of the committed file that the new file has (same config and causal
flag), the re-run methods' fields (<m>_ms, <m>_first_call_s, <m>_peak_extra_gib,
timing_ms[m], useful_tflops_by_method[m]; dilgen's useful_tflops) and recomputes the
speed-ups (peer ms / dilgen ms); the peers' fields stay as measured. The row gets
`merged_from` (the new run's time, device, versions, methods), the new run's check records
replace the old ones for those rows, and the header's `earlier_runs` lists the merge. Rows
whose device differs are refused (numbers from different GPUs are not comparable). The
plots beside the file (forward / roofline or backward .png) are redrawn from the merged rows
(--no-plot leaves them).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import toolkit as tk  # noqa: E402


def _key(row: dict) -> tuple:
    return row["config"], bool(row["causal"])


def merge(old: dict, new: dict, methods: list[str]) -> list[tuple]:
    """Merge `new`'s rows for `methods` into `old` in place; returns the merged keys."""
    if old.get("device") != new.get("device"):
        raise SystemExit(f"device differs: {old.get('device')!r} vs {new.get('device')!r}")
    by_key = {_key(r): r for r in old["rows"]}
    merged = []
    stamp = {k: new.get(k) for k in ("time", "device", "torch", "triton")} | {"methods": methods}
    for row in new["rows"]:
        target = by_key.get(_key(row))
        if target is None:
            old["rows"].append(row)
            merged.append(_key(row))
            continue
        for m in methods:
            for suffix in ("_ms", "_first_call_s", "_peak_extra_gib"):
                if m + suffix in row:
                    target[m + suffix] = row[m + suffix]
            for field in ("timing_ms", "useful_tflops_by_method"):
                if m in row.get(field, {}):
                    target.setdefault(field, {})[m] = row[field][m]
        if "dilgen" in methods:
            target["useful_tflops"] = row.get("useful_tflops", target.get("useful_tflops"))
        dg = target.get("dilgen_ms")
        for k in list(target):
            if k.startswith("speedup_vs_"):
                peer = target.get(k[len("speedup_vs_"):] + "_ms")
                target[k] = peer / dg if peer and dg else None
        # errors are {method: reason}: the re-run methods' entries come from the new run
        errors = {m: e for m, e in (target.get("errors") or {}).items() if m not in methods}
        target["errors"] = errors | {m: e for m, e in (row.get("errors") or {}).items() if m in methods}
        target["merged_from"] = stamp
        merged.append(_key(row))
    keys = set(merged)
    checks = [c for c in old.get("check", []) if (c.get("config"), bool(c.get("causal"))) not in keys]
    old["check"] = checks + [c for c in new.get("check", []) if (c.get("config"), bool(c.get("causal"))) in keys]
    old.setdefault("earlier_runs", []).append(stamp | {"merged_rows": [list(k) for k in merged]})
    if "check_passed" in new:
        old["check_passed"] = bool(old.get("check_passed", True)) and bool(new["check_passed"])
    return merged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("committed", type=Path)
    ap.add_argument("rerun", type=Path)
    ap.add_argument("--methods", default="dilgen", help="the re-run methods (default dilgen)")
    ap.add_argument("--no-plot", action="store_true", help="leave the .png files beside it alone")
    a = ap.parse_args(argv)
    old, new = json.loads(a.committed.read_text()), json.loads(a.rerun.read_text())
    merged = merge(old, new, [m for m in a.methods.split(",") if m])
    tk.write_json_atomic(a.committed, old)
    print(f"merged {len(merged)} row(s) into {a.committed}: {merged}")
    if not a.no_plot:
        replot(a.committed, old)
    return 0


def replot(path: Path, data: dict) -> None:
    """Redraw the plots beside a bench_forward / bench_backward JSON from its (merged) rows,
    as those scripts draw them, so the committed pictures follow the committed numbers."""
    kind = path.name.split("-")[0]
    if kind not in ("forward", "backward"):
        return
    import bench_backward
    import bench_forward
    {"forward": bench_forward, "backward": bench_backward}[kind].draw_plots(data, data["rows"], path)
    print(f"plots redrawn beside {path}")


if __name__ == "__main__":
    sys.exit(main())
