"""The first ring call of a spec in a process measures the spec's own single-device rate
(what `dilgen calibrate --spec` measures and records, calibrate.measure_spec) before the cost
model picks a transport, when the machine's rates hold none for it, and prices with it for
the rest of the process (calibration.remember: no record, so that nodes never differ by it).

Every rank decides alike: the agreement compared the digest of the rates each rank prices
with, so every rank lacks the entry or none does; every rank times its own rows, one
all_reduce takes the slowest rank's numbers (or, if any rank could not time, none), and every
rank adds the same entry. `DILGEN_RING_MEASURE`: "auto" (default: on a GPU, not while a CUDA
graph is captured), "1" (also on the CPU), "0" (never); the agreement compares it, so ranks that
differ are refused together."""
from __future__ import annotations

import dataclasses
import os

import torch

from ...calibration import Machine, remember, spec_digest
from ...schedule import useful_flops, work_of
from ...stats import device_sync, median_seconds
from ..backward import backward_raw
from ..checks import InputError
from ..forward import forward_raw
from ..registry import twin
from .agreement import _MEASURE, _capturing
from .faults import collective

MODES = _MEASURE


def wanted(q) -> bool:
    """Whether a call on q may measure (DILGEN_RING_MEASURE)."""
    mode = os.environ.get("DILGEN_RING_MEASURE", "auto")
    if mode not in MODES:
        raise InputError(f"DILGEN_RING_MEASURE={mode!r}: use auto (on a GPU), 1 (always) or 0 (never)")
    return mode == "1" or (mode == "auto" and q.is_cuda and not _capturing(q))


def _time_twin(run, q, k, v) -> tuple[float, float]:
    """(forward s, backward s) of the spec's single-device kernels on my rows (one warm-up,
    the median of three)."""
    curve = {"hilbert": None} if run.main.plan["ring"].get("curve") is not None else {}
    tw = twin(run.main, q.device, None, ring_size=1, **curve)
    sync = device_sync(q.device)
    fwd = median_seconds(lambda: forward_raw(tw, q, k, v), sync, 3)
    out, lse = forward_raw(tw, q, k, v)
    return fwd, median_seconds(lambda: backward_raw(tw, q, k, v, out, lse, out, None), sync, 3)


def with_spec_rate(run, q, k, v, rates):
    """`rates`, or `rates` with this spec's rate added (measured now on every rank, remembered
    by this process) when it holds none and the call may measure."""
    digest = run.main.__dict__.get("_spec_digest") or run.main.__dict__.setdefault(
        "_spec_digest", spec_digest(run.main.spec))          # every non-local call asks
    if rates.for_spec(digest) is not None or not wanted(q):
        return rates
    try:
        fwd, bwd = _time_twin(run, q.detach(), k.detach(), v.detach())
        flops = useful_flops(work_of(run.main.spec), run.n_loc, run.B, run.H, run.D)
        row = [0.0, -flops / fwd / 1e12, bwd / fwd]
    except Exception:  # noqa: BLE001 - a rank that cannot time makes every rank skip, never one alone
        row = [1.0, 0.0, 0.0]
    gloo = run.dist.get_backend(run.group) == "gloo"
    mine = torch.tensor(row, dtype=torch.float64, device="cpu" if gloo else q.device)
    collective(run.dist, run.group, lambda: run.dist.all_reduce(mine, op=run.dist.ReduceOp.MAX, group=run.group),
               (mine,))
    failed, neg_rate, ratio = mine.tolist()
    if failed:
        return rates
    rates = dataclasses.replace(rates, specs=rates.specs + ((digest, -neg_rate, ratio),))
    remember(Machine.current(run.P, run.dist.get_backend(run.group), q.device), rates)
    return rates
