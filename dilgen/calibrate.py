"""`dilgen calibrate`: measure the ring cost model's rates on this machine and keep them
(dilgen.calibration: what a Rates holds, the machine key, the records)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from . import cache
from .calibration import DEFAULT, Machine, Rates, store
from .links import measure_links
from .stats import device_sync, loop_seconds, median_seconds


KERNEL_RATES = ("twin_fused_tflops", "twin_bwd", "twin_lanes_tflops", "twin_causal_bwd", "window_tflops", "window_bwd")


def measure_kernels(device, shape: dict, world_size: int) -> dict:
    """The single-device rates on `shape` (B, H, N, D, dtype; reps: a median's calls, default
    3): the fused kernels (a raster, non-causal spec) and the lane kernels (its causal twin),
    forward TFLOP/s (useful FLOPs, schedule.useful_flops) and backward over forward; a window's
    rate: the fused kernel's on N / world_size rows (a rank's), the rows a ring window runs."""
    import torch

    from .compiler import compile as compile_spec
    from .schedule import useful_flops
    B, H, N, D = (shape[k] for k in ("B", "H", "N", "D"))
    reps = shape.get("reps", 3)
    dtype = getattr(torch, shape.get("dtype", "bfloat16"))
    sync = device_sync(device)

    def rate(n: int, causal: bool) -> tuple[float, float]:
        ws = [max(n // 4, 1), max(n // 2, 1)]
        spec = {"name": f"calibrate_{n}_{int(causal)}", "num_heads": H, "num_kv_heads": H, "head_dim": D,
                "segment_lengths": ws, "dilation_rates": [1, 2], "causal": causal,
                "dtype": str(dtype).removeprefix("torch.")}
        kernel = compile_spec(spec)
        g = torch.Generator(device="cpu").manual_seed(n)
        q, k, v = (torch.randn(B, n, H, D, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
                   for _ in range(3))
        dout = torch.randn(B, n, H, D, generator=g).to(device=device, dtype=dtype)
        fwd = median_seconds(lambda: kernel(q, k, v), sync, reps)
        both = median_seconds(lambda: torch.autograd.backward(kernel(q, k, v), dout), sync, reps)
        flops = useful_flops({"causal": causal, "branches": [{"w": w, "r": r} for w, r in zip(ws, [1, 2])]},
                             n, B, H, D)
        return flops / fwd / 1e12, max(both - fwd, 1e-9) / fwd

    fused, fused_bwd = rate(N, False)
    lanes, lanes_bwd = rate(N, True)
    window = rate(max(N // world_size, 2), False)[0] if world_size > 1 else fused
    return {"twin_fused_tflops": fused, "twin_bwd": fused_bwd, "twin_lanes_tflops": lanes,
            "twin_causal_bwd": lanes_bwd, "window_tflops": window, "window_bwd": fused_bwd}


def _fit(predict, measured: float, lo: float = 0.25, hi: float = 8.0) -> float:
    """The x in [lo, hi] with predict(x) = measured (predict grows with x), by bisection."""
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def _slowest(row: list[float], device, group) -> list[float]:
    """The elementwise max of `row` over the group's ranks (on the CPU for gloo): the slowest
    rank's time, and a failure flag any rank raised (negate a rate to take the least)."""
    import torch
    import torch.distributed as dist
    both = torch.tensor(row, dtype=torch.float64, device=device if dist.get_backend(group) != "gloo" else "cpu")
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return both.tolist()


@contextlib.contextmanager
def _transport_kept():
    """DILGEN_RING_TRANSPORT as it was, whatever the block sets it to."""
    before = os.environ.get("DILGEN_RING_TRANSPORT")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DILGEN_RING_TRANSPORT", None)
        else:
            os.environ["DILGEN_RING_TRANSPORT"] = before


def _ring_specs(P: int, shape: dict) -> list[tuple[dict, str, int, tuple[tuple[str, str | None], ...]]]:
    """The specs a calibration times over P ranks, each with its chunk order, its N and the
    (transport, fitted field) pairs it measures. First, on a few rows (the kernels take
    microseconds), the least one call of each transport takes, its host's time (field None:
    Rates.<transport>_call_fwd_ms and _call_ms): a raster spec whose long branch
    crosses every rank (ring, heads) and one whose segments straddle the rank border (recut).
    Then, on ring_N rows (default N), the factors: the raster spec (ring_overhead by the ring,
    heads_fused_slowdown by the heads), a causal GQA one that one GPU runs in the lane kernels
    (heads_lanes_slowdown where its kv heads split over P; causal_window_bwd by the ring) and
    a Hilbert segment one whose long branch the windows read through a curve table
    (table_window_bwd by the ring)."""
    H, D, dtype = shape["H"], shape["D"], shape.get("dtype", "bfloat16")
    N = shape.get("ring_N", shape["N"])      # rows whose kernels outlast the host's issuing them
    small = min(N, 1024 * P)

    def base(n: int) -> dict:
        return {"num_heads": H, "num_kv_heads": H, "head_dim": D, "ring_size": P, "dtype": dtype,
                "segment_lengths": [max(n // (2 * P), 1), n], "dilation_rates": [1, 4]}
    heads = (("heads", None),) if H % P == 0 else ()
    specs = [(dict(base(small), name=f"calibrate_call_{P}"), "contiguous", small, (("ring", None),) + heads),
             (dict(base(small), name=f"calibrate_recut_{P}", segment_lengths=[max(3 * small // (4 * P), 1)],
                   dilation_rates=[1]), "contiguous", small, (("recut", None),)),
             (dict(base(N), name=f"calibrate_ring_{P}"), "contiguous", N,
              (("ring", "ring_overhead"), ("heads", "heads_fused_slowdown")))]
    lanes = (("heads", "heads_lanes_slowdown"),) if (H // 4) % P == 0 and H >= 4 else ()
    specs.append((dict(base(N), name=f"calibrate_lanes_{P}", num_kv_heads=max(H // 4, 1), dilation_rates=[1, 3],
                       causal=True), "zigzag", N, lanes + (("ring", "causal_window_bwd"),)))
    specs.append((dict(base(N), name=f"calibrate_table_{P}", hilbert={"scope": "segment"}), "contiguous", N,
                   (("ring", "table_window_bwd"),)))
    return specs


def measure_transports(group, device, shape: dict, rates: Rates) -> dict:
    """What a ring call adds over the model's kernels and links (_ring_specs): each transport's
    least time per call (its forward and fwd+bwd on a few rows), then each factor (the value
    that makes the model's fwd+bwd time, schedule.transport_costs under `rates` with those
    least times and the fit spec's own single-device rate, equal the measured one). Every time
    is the slowest rank's, every rank timing the same calls."""
    import torch
    import torch.distributed as dist

    from .compiler import compile as compile_spec
    from .runtime.ring import shard
    from .runtime.ring.costs import predicted_ms
    P, me, B = dist.get_world_size(group), dist.get_rank(group), shape["B"]
    reps, floor_calls = shape.get("reps", 3), shape.get("floor_calls", 8)
    sync = device_sync(device)
    found = {}
    slowest = lambda seconds: _slowest([seconds], device, group)[0]    # noqa: E731 - every rank timed the same call
    with _transport_kept():
        for spec, order, N, fits in _ring_specs(P, shape):
            compile_spec(dict(spec, name=spec["name"].replace("_", "_twin_", 1), ring_size=1))  # heads' twins
            kernel = compile_spec(spec)
            g = torch.Generator(device="cpu").manual_seed(7)
            dtype = getattr(torch, spec["dtype"])
            q, k, v, dout = (shard(torch.randn(B, N, h, spec["head_dim"], generator=g), P, me, order)
                             .to(device=device, dtype=dtype) for h in (spec["num_heads"], spec["num_kv_heads"],
                                                                      spec["num_kv_heads"], spec["num_heads"]))
            leaves = [t.requires_grad_(True) for t in (q, k, v)]
            if any(f is not None and f.startswith("heads") for _, f in fits):
                # a user's spec is priced by its own rate (the ring's first call measures it), so
                # the heads factors are what a heads call adds over its spec's own kernels
                from .spec import Spec
                own = spec_entry(Spec(**spec), N // P, device, group)
                rates = dataclasses.replace(rates, specs=rates.specs + (own,))
            for transport, field in fits:
                os.environ["DILGEN_RING_TRANSPORT"] = transport
                step = lambda: torch.autograd.backward(  # noqa: E731
                    kernel(*leaves, group=group, chunk_order=order), dout)
                # a floor (field None) is the least of floor_calls calls (each after a warm-up); a
                # factor, the median of reps
                clock = (lambda fn: min(median_seconds(fn, sync, 1) for _ in range(floor_calls))) \
                    if field is None else (lambda fn: median_seconds(fn, sync, reps))
                took = slowest(clock(step))
                if field is None:            # the host's time for one call: the kernels take microseconds
                    with torch.no_grad():
                        fwd = slowest(clock(lambda: kernel(*leaves, group=group, chunk_order=order)))
                    floors = {f"{transport}_call_fwd_ms": fwd * 1e3, f"{transport}_call_ms": took * 1e3}
                    found |= floors
                    rates = dataclasses.replace(rates, **floors)
                    continue
                attn = kernel.compiled_for(device).attention
                found[field] = _fit(lambda x: predicted_ms(attn, N, transport, order, rates=dataclasses.replace(
                    rates, **{field: x}))["predicted_fwd_bwd_ms"] / 1e3, took)
    return found


def calibrate(group=None, device=None, *, shape: dict | None = None, link_bytes: int = 256 << 20,
              store_result: bool = True) -> Rates:
    """Measure this machine (every rank of `group` calls it: the links are collectives), merge
    the measured fields over DEFAULT, keep them in the cache for rates_for and return them.
    Every rank ends with rank 0's numbers (broadcast), so every rank prices alike."""
    import torch
    import torch.distributed as dist
    on = dist.is_available() and dist.is_initialized()
    P = dist.get_world_size(group) if on else 1
    backend = dist.get_backend(group) if on and P > 1 else "none"
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if shape is None:
        # on the CPU Triton's interpreter runs the kernels: its times check the plumbing, not a
        # machine, so each is timed on fewer calls
        shape = (dict(B=1, H=16, N=32768, D=128, dtype="bfloat16", ring_N=65536 * P) if device.type == "cuda"
                 else dict(B=1, H=8, N=64, D=16, dtype="float32", reps=1, floor_calls=2))
    found = measure_kernels(device, shape, P)
    if on and P > 1:
        found |= measure_links(group, device if backend != "gloo" else torch.device("cpu"), link_bytes)
        row = [found]               # rank 0's kernels and links, then the factors fitted on them
        dist.broadcast_object_list(row, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        found = row[0] | measure_transports(group, device, shape, dataclasses.replace(DEFAULT, **row[0]))
        row = [found]
        dist.broadcast_object_list(row, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        found = row[0]
    from .calibration import load
    kept = (load(Machine.current(P, backend, device)) or DEFAULT).specs    # `dilgen calibrate --spec`'s
    rates = dataclasses.replace(DEFAULT, **found, measured=tuple(sorted(found)), specs=kept,
                                source=f"dilgen calibrate, {time.strftime('%Y-%m-%d %H:%M')}, shape {shape}")
    if store_result:
        store(Machine.current(P, backend, device), rates)
        if P > 1:        # the kernels' rates hold for one process of this machine too
            kernels = {k: v for k, v in found.items() if k in KERNEL_RATES}
            store(Machine.current(1, "none", device),
                  dataclasses.replace(DEFAULT, **kernels, measured=tuple(sorted(kernels)), source=rates.source))
    return rates


def _fresh_step(call, leaves, dout):
    """A timed fwd+bwd step: call(*leaves), its backward from dout, each time on fresh
    gradients, as a training step's (accumulating would time an add per leaf on top)."""
    import torch

    def step():
        for t in leaves:
            t.grad = None
        torch.autograd.backward(call(*leaves), dout)
    return step


def measure_spec(spec, n: int, device, reps: int = 3, *, as_rank: bool = True) -> tuple[float, float]:
    """(forward TFLOP/s, backward over forward) of a dilgen.Spec's single-device kernels on n
    rows, batch 1 (useful FLOPs, schedule.useful_flops). as_rank: the kernels its ring calls
    run on a rank's rows by the local, recut, hybrid and heads transports (a sequence-scope
    curve's rows arrive in curve order: raster); else the spec's own on one device (its curve's
    permutation of the rows, or its table, included)."""
    import torch

    from .compiler import compile as compile_spec
    from .schedule import useful_flops, work_of
    raster = as_rank and getattr(spec.hilbert, "scope", None) == "sequence"
    one = spec.replace(ring_size=1, name=f"calibrate_{spec.name}"[:100], **({"hilbert": None} if raster else {}))
    kernel = compile_spec(one)
    dtype = getattr(torch, spec.dtype)
    sync = device_sync(device)
    g = torch.Generator(device="cpu").manual_seed(n)
    q, k, v = (torch.randn(1, n, h, spec.head_dim, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
               for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads))
    dout = torch.randn(1, n, spec.num_heads, spec.head_dim, generator=g).to(device=device, dtype=dtype)
    with torch.no_grad():
        fwd = median_seconds(lambda: kernel(q, k, v), sync, reps)
    both = median_seconds(_fresh_step(kernel, (q, k, v), dout), sync, reps)
    return useful_flops(work_of(spec), n, 1, spec.num_heads, spec.head_dim) / fwd / 1e12, max(both - fwd, 1e-9) / fwd


def spec_entry(spec, n: int, device, group=None, optional: bool = False, *,
               as_rank: bool = True) -> tuple[str, float, float] | None:
    """(spec digest, forward TFLOP/s, backward over forward) of measure_spec on n rows: over a
    process group, every rank times its own and all take the slowest (the smallest rate, the
    largest ratio). If a rank cannot (its memory, say), every rank returns None when
    `optional`, else raises; one process alone raises what measure_spec raised."""
    import torch.distributed as dist

    from .calibration import spec_digest
    grouped = group is not None or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    if not grouped:
        return (spec_digest(spec.to_json()), *measure_spec(spec, n, device, as_rank=as_rank))
    try:
        rate, ratio = measure_spec(spec, n, device, as_rank=as_rank)
        row, why = [0.0, -rate, ratio], None
    except Exception as exc:  # noqa: BLE001 - every rank learns of it, never one rank alone
        row, why = [1.0, 0.0, 0.0], exc
    failed, neg_rate, ratio = _slowest(row, device, group)
    if failed and optional:
        return None
    if failed:
        raise RuntimeError(f"calibrating {spec.name} on {n} rows failed on a rank: "
                           f"{why if why is not None else 'see the other ranks'}") from why
    return spec_digest(spec.to_json()), -neg_rate, ratio


def window_entry(spec, seq_len: int, group, device, rates: Rates, calls: int = 5) -> tuple[str, float] | None:
    """(spec digest, the spec's own ring_overhead): its call over the group's P ranks by the
    `ring` transport on seq_len rows (zigzag chunks when causal), fwd+bwd, `calls` calls back
    to back (a training step's rate, and bench_ring's; a call alone pays its host time
    on top of its device time), the slowest rank's, and the factor that makes the model's `ring`
    price under `rates` (with the spec's own rate) equal it, as measure_transports fits the
    family's. None on every rank where a rank cannot run it, or where the call's floor binds
    (the windows' cost is not seen)."""
    import torch
    import torch.distributed as dist

    from .calibration import spec_digest
    from .compiler import compile as compile_spec
    from .runtime.ring.costs import predicted_ms
    P, me = dist.get_world_size(group), dist.get_rank(group)
    order = "zigzag" if spec.causal else "contiguous"
    ring_spec = spec.replace(ring_size=P)         # its own name: the kernels a ring call of it built
    digest = spec_digest(ring_spec.to_json())
    rates = dataclasses.replace(rates, windows=tuple(w for w in rates.windows if w[0] != digest))
    try:
        with _transport_kept():
            os.environ["DILGEN_RING_TRANSPORT"] = "ring"
            kernel = compile_spec(ring_spec)
            g = torch.Generator(device=device).manual_seed(seq_len + me)   # a rank's rows: only their time counts
            q, k, v, dout = (torch.randn(1, seq_len // P, h, spec.head_dim, generator=g, device=device,
                                         dtype=getattr(torch, spec.dtype))
                             for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads, spec.num_heads))
            leaves = [t.requires_grad_(True) for t in (q, k, v)]
            took = loop_seconds(_fresh_step(lambda *x: kernel(*x, group=group, chunk_order=order), leaves, dout),
                                device_sync(device), calls)
        row = [0.0, took]
    except Exception:  # noqa: BLE001 - every rank learns of it, never one rank alone
        row = [1.0, 0.0]
    failed, took = _slowest(row, device, group)
    if failed:
        return None
    attn = kernel.compiled_for(device).attention
    price = lambda x: predicted_ms(attn, seq_len, "ring", order, rates=dataclasses.replace(  # noqa: E731
        rates, ring_overhead=x))["predicted_fwd_bwd_ms"] / 1e3
    factor = _window_factor(price, took)
    return None if factor is None else (digest, factor)


def _window_factor(price, took: float) -> float | None:
    """The ring_overhead at which price(x) = took, or None where even the bracket's least
    prices the call at or above took (its floor binds: the windows' cost is not seen)."""
    return None if price(0.25) >= took else _fit(price, took)


def calibrate_specs(specs: list, seq_len: int, group=None, device=None) -> list[tuple[str, float, float]]:
    """`dilgen calibrate --spec`: each spec's rate (measure_spec) on one rank's rows of seq_len
    tokens (seq_len / P; the slowest rank's, every rank timing alike), added to this machine's
    record for P ranks with its ring call's own factor (window_entry), and on all seq_len rows
    to its record for one process (a rank's rate where they do not fit); the entries of other
    specs kept, a spec's older entry replaced. Returns the rate entries for P ranks."""
    import torch
    import torch.distributed as dist

    from .calibration import load
    on = dist.is_available() and dist.is_initialized()
    P = dist.get_world_size(group) if on else 1
    backend = dist.get_backend(group) if on and P > 1 else "none"
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    grp = group if on and P > 1 else None
    entries = [spec_entry(spec, seq_len // P, device, grp, as_rank=P > 1) for spec in specs]
    # one process runs all seq_len rows by the spec's own kernels: its record takes the rate
    # there, where they fit a GPU (kernels run faster on more rows), else a rank's
    alone = entries if P == 1 else [spec_entry(spec, seq_len, device, grp, optional=True, as_rank=False) or e
                                    for spec, e in zip(specs, entries)]
    records = {Machine.current(P, backend, device): entries, Machine.current(1, "none", device): alone}
    for machine, mine in records.items():
        old = load(machine) or DEFAULT
        ours = {d for d, _, _ in mine}
        priced = dataclasses.replace(old, specs=tuple(e for e in old.specs if e[0] not in ours) + tuple(mine))
        store(machine, priced)              # the ring calls below find the spec's rate
        if machine.world_size > 1:          # each spec's ring call, priced by its own rate
            timed = [window_entry(spec, seq_len, grp, device, priced) for spec in specs]
            store(machine, dataclasses.replace(priced, windows=tuple(w for w in old.windows if w[0] not in ours)
                                               + tuple(w for w in timed if w)))
    return entries


def command(link_mib: int = 256, specs: list | None = None, seq_len: int | None = None) -> list[str]:
    """`dilgen calibrate`: under torchrun, every rank of the world (links and kernels); alone,
    this process's device (kernels only). With `specs` (dilgen.Spec), only those specs' own
    rates at seq_len tokens (calibrate_specs). The lines rank 0 prints."""
    import torch
    import torch.distributed as dist
    started = False
    device = torch.device("cpu")
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():
            raise SystemExit(f"dilgen calibrate: local rank {local} has no GPU of its own ({torch.cuda.device_count()} "
                             f"visible); start one process per GPU (torchrun --nproc-per-node "
                             f"{torch.cuda.device_count()})")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        started = True
    try:
        P = dist.get_world_size() if dist.is_initialized() else 1
        machine = Machine.current(P, dist.get_backend() if P > 1 else "none", device)
        if specs:
            found = calibrate_specs(specs, seq_len, None, device)
            lines = [f"calibrated {len(found)} spec(s) on {machine.device} x {P}, {seq_len // P} rows per rank; "
                     f"record {machine.key()} in {cache.cache_dir() / 'calibration'}"]
            lines += [f"  {spec.name}: {f:.4g} TFLOP/s forward, backward {b:.3g} x the forward"
                      for spec, (_, f, b) in zip(specs, found)]
            return lines if not dist.is_initialized() or dist.get_rank() == 0 else []
        rates = calibrate(None, device, link_bytes=link_mib << 20)
        lines = [f"calibrated {machine.device} x {P} ({machine.backend}); record {machine.key()} "
                 f"in {cache.cache_dir() / 'calibration'}"]
        lines += [f"  {name:22s} {getattr(rates, name):12.4g}   (profile {getattr(DEFAULT, name):g})"
                  for name in rates.measured]
        return lines if not dist.is_initialized() or dist.get_rank() == 0 else []
    finally:
        if started:
            dist.destroy_process_group()
