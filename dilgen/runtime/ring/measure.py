"""The first ring call of a spec in a process measures the spec's own single-device rate
(what `dilgen calibrate --spec` measures and records, calibrate.measure_spec) before the cost
model picks a transport, when the machine's rates hold none for it, and prices with it for
the rest of the process (calibration.remember: no record, so that nodes never differ by it).

Every rank decides alike: the agreement compared the digest of the rates each rank prices
with, so every rank lacks the entry or none does; every rank times its own rows, one
all_reduce takes the slowest rank's numbers (or, if any rank could not time, none), and every
rank adds the same entry. Where no calibration measured the group's links, the first such
call measures them too (links.measure_links: a ring shift, an all-gather and an all-to-all of
32 MiB a rank, and a 4-byte shift's latency; the slowest rank's). `DILGEN_RING_MEASURE`: "auto" (default: on a GPU, not while a CUDA
graph is captured), "1" (also on the CPU), "0" (never); the agreement compares it, so ranks that
differ are refused together."""
from __future__ import annotations

import dataclasses
import os

import torch

from ...calibration import Machine, remember, spec_digest
from ...links import measure_links
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


#: the link rates a first call measures where no calibration did (links.measure_links)
LINKS = ("link_gbytes_s", "allgather_gbytes_s", "alltoall_gbytes_s", "step_latency_us")
LINK_BYTES = 32 << 20      # per rank: milliseconds of NVLink, a second or two of PCIe
_LINKS_TRIED: set = set()  # groups whose links a call measured or could not (every rank alike)


def _group_key(run, q) -> tuple:
    return getattr(run.group, "group_name", None) or id(run.group), str(q.device)


def _with_links(run, q, rates):
    """`rates` with the group's link rates measured now (every rank: the slowest rank's, one
    all_reduce inside), where every rank could allocate its buffers (one all_reduce first);
    else `rates` as they were."""
    gloo = run.dist.get_backend(run.group) == "gloo"
    device = torch.device("cpu") if gloo else q.device
    try:
        probe = torch.empty(LINK_BYTES * (run.P + 2), dtype=torch.uint8, device=device)
        del probe
        ready = torch.zeros(1, dtype=torch.float64, device=device)
    except Exception:  # noqa: BLE001 - a rank that cannot hold the buffers makes every rank skip
        ready = torch.ones(1, dtype=torch.float64, device=device)
    collective(run.dist, run.group, lambda: run.dist.all_reduce(ready, op=run.dist.ReduceOp.MAX, group=run.group),
               (ready,))
    _LINKS_TRIED.add(_group_key(run, q))
    if ready.item():
        return rates
    links = measure_links(run.group, device, LINK_BYTES)
    source = f"links: measured by this group's first ring call ({run.P} ranks, {LINK_BYTES >> 20} MiB a rank); " \
             f"the rest: {rates.source}"
    return dataclasses.replace(rates, **links, source=source,
                               measured=tuple(sorted(set(rates.measured) | set(links))))


def with_spec_rate(run, q, k, v, rates):
    """`rates`, or `rates` with this spec's rate added (measured now on every rank, remembered
    by this process) when it holds none and the call may measure; with the group's link rates
    too where no calibration measured them (the agreement compared the rates, so every rank
    decides alike)."""
    digest = run.main.__dict__.get("_spec_digest") or run.main.__dict__.setdefault(
        "_spec_digest", spec_digest(run.main.spec))          # every non-local call asks
    need_links = not set(LINKS) <= set(rates.measured) and _group_key(run, q) not in _LINKS_TRIED
    if (rates.for_spec(digest) is not None and not need_links) or not wanted(q):
        return rates
    machine = Machine.current(run.P, run.dist.get_backend(run.group), q.device)
    if need_links:
        rates = _with_links(run, q, rates)
        remember(machine, rates)
    if rates.for_spec(digest) is not None:
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
    remember(machine, rates)
    return rates
