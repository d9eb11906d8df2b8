"""The ring cost model's price of one call: schedule.transport_costs of a spec's call over its
schedule, with what each transport needs to run (heads' divisibility, local's pieces, recut's
borders, hybrid's split of the branches), and predicted_ms, the model's answer for a spec and N
(what bench_ring prints beside each row, what `dilgen explain --ring` forecasts)."""
from __future__ import annotations

import dataclasses
import math

from ...calibration import rates_for, spec_digest
from ...schedule import ring_schedule, single_device_times, transport_costs, work_of
from ..registry import twins_available
from .heads import heads_refusal, local_possible
from .hybrid import hybrid_parts
from .recut import recut_targets


def _single_device_lanes(plan: dict) -> bool:
    """Whether one device runs this spec in the lane kernels (causal, or a curve-table
    branch): the cost model's single-device rate."""
    return plan["causal"] or any(b.get("order") is not None for b in plan["branches"])


def call_costs(attn, sched: dict, batch: int, heads: int, kv_heads: int, head_dim: int,
               itemsize: int, packed: bool = False, rates=None) -> dict:
    """schedule.transport_costs of a call of `attn` over `sched` (ring_schedule of its N and
    chunk order) priced by `rates` (default: calibration.rates_for this machine over
    NCCL): what the runtime decides by, and what bench_ring prints beside each row."""
    plan = attn.plan
    P = plan["ring"]["ring_size"]
    local = local_possible(attn, sched, packed)
    split = not (local or packed) and twins_available()
    rates = rates or rates_for(P)
    digest = spec_digest(attn.spec)
    if (own := rates.window_for(digest)) is not None:     # this spec's windows, timed by its own ring call
        rates = dataclasses.replace(rates, ring_overhead=own)
    return transport_costs(plan["ring"], sched, batch=batch, heads=heads, kv_heads=kv_heads,
                           head_dim=head_dim, itemsize=itemsize, lanes=_single_device_lanes(plan),
                           heads_ok=heads_refusal(attn, P, packed) is None, local_ok=local, rates=rates,
                           spec_rate=rates.for_spec(digest),
                           recut=None if local or packed or not twins_available() else recut_targets(attn, sched),
                           hybrid=hybrid_parts(attn, sched) if split else None)


def predicted_ms(attn, n: int, transport: str, order: str = "contiguous", rates=None) -> dict:
    """What the cost model says of a call of `attn` (a GeneratedAttention, or anything with
    its .spec and .plan JSON) on n tokens, batch 1, by `transport` ("single" for a ring_size 1
    spec): predicted_fwd_ms, predicted_fwd_bwd_ms (NaN where that transport cannot run), and
    for a ring every transport's fwd+bwd ms, the remote steps and the schedule's key bytes."""
    spec, plan = attn.spec, attn.plan
    heads, kv, d = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    item = 4 if spec["dtype"] == "float32" else 2
    rates = rates or rates_for(plan["ring"]["ring_size"])
    spec_rate = rates.for_spec(spec_digest(spec))
    # what priced it: the rates' source, the fields a calibration or a first call measured, the spec's own rate
    priced = {"priced_with": {"source": rates.source, "measured": {m: getattr(rates, m) for m in rates.measured},
                              "spec_rate": list(spec_rate) if spec_rate else None,
                              "spec_ring_overhead": rates.window_for(spec_digest(spec))}}
    if plan["ring"]["ring_size"] == 1:
        f, b = single_device_times(work_of(spec), n, 1, heads, d, _single_device_lanes(plan), rates, spec_rate)
        return {"predicted_fwd_ms": f * 1e3, "predicted_fwd_bwd_ms": (f + b) * 1e3, **priced}
    sched = ring_schedule(plan["ring"], n, order)
    costs = call_costs(attn, sched, 1, heads, kv, d, item, rates=rates)
    mine = costs.get(transport, {"fwd_s": math.nan, "fwd_bwd_s": math.nan})
    return {"predicted_fwd_ms": mine["fwd_s"] * 1e3, "predicted_fwd_bwd_ms": mine["fwd_bwd_s"] * 1e3,
            "predicted_fwd_bwd_ms_by_transport": {t: c["fwd_bwd_s"] * 1e3 for t, c in costs.items()},
            "remote_steps": len(sched["steps"]) - 1, "bytes_fraction": sched["bytes_fraction"], **priced}
