"""The sm90 plans of the specs whose times the docs cite (bench/toolkit.CONFIGS A-F, causal and
not, and bench/specs/ring_users.json on one GPU and on a ring of 2) against a golden file: a
default that changes one of them (a kernel family, a tile, lanes against the fused kernel) fails
here by name, so its author re-times that spec on a GPU before the docs' numbers go stale.
DILGEN_UPDATE_GOLDEN=1 rewrites the file."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import dilgen
from dilgen.planner import plan
from dilgen.targets import target_for_capability

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "user_plans_sm90.json"


def _specs() -> dict[str, dilgen.Spec]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from toolkit import CONFIGS, make_spec
    finally:
        sys.path.remove(str(ROOT / "bench"))
    specs = {f"{name}{' causal' if causal else ''}": make_spec(name, cfg, causal)
             for name, cfg in CONFIGS.items() for causal in (False, True)}
    for user in json.loads((ROOT / "bench" / "specs" / "ring_users.json").read_text()):
        fields = {k: v for k, v in user.items() if k not in ("name", "tokens_per_gpu")}
        if (fields.get("hilbert") or {}).get("scope") == "sequence":    # bench_ring's grid: N = 2 x tokens/GPU
            n = 2 * user["tokens_per_gpu"]
            rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
            fields["hilbert"] = dict(fields["hilbert"], grid=[rows, n // rows])
        for P in (1, 2):
            specs[f"{user['name']} P{P}"] = dilgen.Spec(name=f"u_{user['name']}", dtype="bfloat16", ring_size=P,
                                                         **fields)
    return specs


def _digest(p) -> dict:
    """What a plan chose: its kernels' configuration, the query lattice, each branch's path."""
    j = p.to_json()
    return {"config": {k: v for k, v in j["config"].items() if v is not None}, "fused_dkdv": j["fused_dkdv"],
            "lattice": j["query"]["lattice"],
            "branches": [[b["lanes"], b["membership"], b["order"] is not None] for b in j["branches"]]}


def _differences(old: dict, new: dict) -> dict:
    """{field: (golden, now)} of two digests, the config's keys one by one."""
    out = {k: (old.get(k), new.get(k)) for k in ("fused_dkdv", "lattice", "branches") if old.get(k) != new.get(k)}
    a, b = old.get("config", {}), new.get("config", {})
    return out | {f"config.{k}": (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def test_the_plans_the_docs_time_are_the_golden_ones():
    sm90 = target_for_capability(9, 0)
    got = json.loads(json.dumps({name: _digest(plan(spec, sm90)) for name, spec in _specs().items()}))
    if os.environ.get("DILGEN_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text("{\n" + ",\n".join(f"{json.dumps(name)}: {json.dumps(got[name], sort_keys=True)}"
                                             for name in sorted(got)) + "\n}\n")     # a line a plan
    want = json.loads(GOLDEN.read_text())
    changed = sorted(name for name in set(got) | set(want) if got.get(name) != want.get(name))
    detail = {name: _differences(want.get(name, {}), got.get(name, {})) for name in changed[:3]}
    assert not changed, (f"the sm90 plan of {changed} changed (golden, now): {detail}; re-time those specs on a "
                         f"GPU (bench_backward / bench_forward for A-F, bench_ring --specs for the user specs), "
                         f"then rewrite {GOLDEN.name} with DILGEN_UPDATE_GOLDEN=1")
