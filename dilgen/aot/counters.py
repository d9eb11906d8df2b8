"""What the AOT path did in this process: launch counters, the fallbacks to the JIT and
why, and a count of every Triton compile (docs/aot.md checks all three on a GPU;
bench/results/aot_proof-2026-11-21-h200.json records them)."""
from __future__ import annotations

import contextlib
import threading

#: aot_loads: stored binaries loaded onto a device; aot_launches / jit_launches: launches
#: of a stored binary / through triton.jit; jit_specializations: specializations that
#: had no usable binary (each is also a FALLBACKS entry).
STATS: dict[str, int] = {"aot_loads": 0, "aot_launches": 0, "jit_launches": 0,
                         "jit_specializations": 0}
#: One dict per specialization that fell back: kernel, reason, specialization,
#: module_sha256, env.
FALLBACKS: list[dict] = []
_LOCK = threading.Lock()


def reset_stats() -> None:
    with _LOCK:
        for k in STATS:
            STATS[k] = 0
        FALLBACKS.clear()


def bump(name: str, n: int = 1) -> None:
    with _LOCK:
        STATS[name] += n


def record_fallback(entry: dict) -> None:
    with _LOCK:
        STATS["jit_specializations"] += 1
        FALLBACKS.append(entry)


@contextlib.contextmanager
def count_compiles():
    """Count every triton.compile of the process (JIT compiles, Triton disk-cache hits
    included) while the block runs: yields a dict {"compiles", "disk_cache_hits", "names"}."""
    from triton import knobs
    counts = {"compiles": 0, "disk_cache_hits": 0, "names": []}
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        counts["disk_cache_hits" if cache_hit else "compiles"] += 1
        counts["names"].append(getattr(src, "name", "?"))
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                     cache_hit=cache_hit)

    knobs.compilation.listener = listener
    try:
        yield counts
    finally:
        knobs.compilation.listener = previous
