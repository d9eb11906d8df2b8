"""The ring cost model's forecast of a spec over 1 .. P GPUs (`dilgen explain --ring P`).

For each GPU count p (1, the powers of two below P, and P) that divides the rows: the
transport the runtime would pick (runtime.ring.costs.predicted_ms, the same model the ring call
decides by), its predicted forward and forward + backward ms at N tokens (batch 1), the
strong-scaling efficiency that implies, T(1) / (p T(p)), and the bytes of the call's tensors
on one GPU (q, k, v, out and their gradients, the LSE). Priced with one set of rates for every
count, calibration.rates_for(P): this machine's calibration over P ranks (its kernels' rates
too), else the committed profile, and the lines say which. A spec that fits
one GPU's memory and gains little on more can run on fewer ranks.
"""
from __future__ import annotations

import math
import types

from .calibration import DEFAULT, rates_for
from .spec import Spec, SpecError


def gpu_counts(P: int) -> list[int]:
    """1, the powers of two below P, and P."""
    counts, p = [], 1
    while p < P:
        counts.append(p)
        p *= 2
    return counts + [P]


def call_bytes(spec: Spec, n: int, p: int) -> int:
    """Bytes of one call's tensors on one of p GPUs, batch 1: q, k, v, out and their
    gradients in the spec's dtype, the LSE and its float32 twin of the backward."""
    item = 4 if spec.dtype == "float32" else 2
    rows = n // p
    return rows * (2 * (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * item + 2 * spec.num_heads * 4)


def forecast(spec: Spec, n: int, P: int) -> list[dict]:
    """A row per GPU count: gpus, transport, fwd_ms, fwd_bwd_ms, efficiency, gib_per_gpu (or
    gpus and why, where the spec does not run on that many)."""
    from .compiler import Kernel
    from .planner import plan
    from .runtime.ring.costs import predicted_ms
    from .schedule import pick_transport
    from .targets import get_target
    Kernel(spec.replace(ring_size=1))          # the single-device twins the heads and local transports run
    order = "zigzag" if spec.causal else "contiguous"
    rates = rates_for(P)             # one set for every count: P's calibration holds its kernels' rates too
    rows, single = [], None
    for p in gpu_counts(P):
        parts = 2 * p if spec.causal and p > 1 else p
        if n % parts:
            rows.append({"gpus": p, "why": f"N = {n} is not a multiple of {parts}"})
            continue
        try:
            sp = spec.replace(ring_size=p)
        except SpecError as exc:
            rows.append({"gpus": p, "why": str(exc).splitlines()[0]})
            continue
        attn = types.SimpleNamespace(spec=sp.to_json(), plan=plan(sp, get_target("sm90")).to_json())
        if p == 1:
            got, transport = predicted_ms(attn, n, "single", order, rates=rates), "single device"
        else:
            by = predicted_ms(attn, n, "ring", order, rates=rates)["predicted_fwd_bwd_ms_by_transport"]
            transport = pick_transport({t: {"fwd_bwd_s": ms} for t, ms in by.items() if math.isfinite(ms)})
            got = predicted_ms(attn, n, transport, order, rates=rates)
        row = {"gpus": p, "transport": transport, "fwd_ms": got["predicted_fwd_ms"],
               "fwd_bwd_ms": got["predicted_fwd_bwd_ms"], "gib_per_gpu": call_bytes(sp, n, p) / 2**30,
               "calibrated": rates is not DEFAULT, "spec_rate": got["priced_with"]["spec_rate"] is not None,
               "spec_ring_overhead": got["priced_with"].get("spec_ring_overhead") is not None}
        single = single or (row["fwd_bwd_ms"] if p == 1 else None)
        row["efficiency"] = single / (p * row["fwd_bwd_ms"]) if single else None
        rows.append(row)
    return rows


def forecast_lines(spec: Spec, n: int, P: int) -> list[str]:
    """forecast() as the lines `dilgen explain --ring P` prints."""
    rows = forecast(spec, n, P)
    measured = any(r.get("calibrated") for r in rows)
    own = [what for what, key in (("single-device rate", "spec_rate"), ("ring factor", "spec_ring_overhead"))
           if any(r.get(key) for r in rows)]
    lines = [f"  forecast at N = {n} (batch 1; rates: "
             + ("this machine's calibration" if measured else
                "the committed 4 x H200 profile; `dilgen calibrate` measures this machine")
             + (f", with this spec's own {' and '.join(own)}" if own else
                (", the family rates for this spec (`dilgen calibrate --spec` measures its own)" if measured else ""))
             + "):",
             "    GPUs  transport      fwd ms  fwd+bwd ms  efficiency  call tensors per GPU"]
    for r in rows:
        if "why" in r:
            lines.append(f"    {r['gpus']:<5d} -- {r['why']}")
            continue
        eff = "" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(f"    {r['gpus']:<5d} {r['transport']:<13s} {r['fwd_ms']:8.2f}  {r['fwd_bwd_ms']:10.2f}  "
                     f"{eff:>10s}  {r['gib_per_gpu']:.2f} GiB")
    return lines
