"""Work counts (useful FLOPs by the brief's formula) and the timers the calibrations use."""
from __future__ import annotations

import statistics
import time


def median_seconds(fn, sync, reps: int) -> float:
    """Median seconds of fn() over `reps` calls after one warm-up (sync() around each)."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loop_seconds(fn, sync, calls: int) -> float:
    """Seconds per call of `calls` calls of fn() back to back after one warm-up, one sync() at
    the end: the host issues a call while the device runs the last, as a training step does
    (and as bench_ring times its rows). A fixed count, so ranks whose calls meet in a
    collective run the same number."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


def device_sync(device):
    """A callable that waits for `device`'s queued work (nothing to wait for on the CPU)."""
    import torch
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def forward_flops(segment_lengths, dilation_rates, num_heads: int, head_dim: int, causal: bool,
                  seq_len: int, batch: int = 1) -> float:
    """Σ_i 4·B·H·(N/w_i)·(w_i/r_i)²·D for the forward pass; halved when causal.
    A segment longer than N counts as one segment of length N."""
    total = 0.0
    for w, r in zip(segment_lengths, dilation_rates):
        w = min(w, seq_len)
        total += 4 * batch * num_heads * (seq_len / w) * (w / r) ** 2 * head_dim
    return total / 2 if causal else total


def useful_flops(plan, seq_len: int, batch: int = 1) -> float:
    s = plan.spec
    return forward_flops(s["segment_lengths"], s["dilation_rates"], s["num_heads"],
                         s["head_dim"], s["causal"], seq_len, batch)
