"""The autotune pass: time candidate block configurations of one spec on the GPU and
store the winner in the cache, where `dilgen.compile` finds it (keyed by spec, target
and toolchain)."""
from __future__ import annotations

import sys

from . import cache
from .compiler import Kernel, target_for_device, toolchain
from .spec import Spec

# (block_m, block_n, num_warps, num_stages), by head_dim, for sm80/sm90.
CANDIDATES = {
    "small": [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3),
              (128, 64, 8, 3), (128, 64, 4, 4)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4),
          (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 2)],
    256: [(64, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 4, 2)],
}


def candidates(head_dim: int) -> list[dict]:
    rows = CANDIDATES.get(head_dim, CANDIDATES["small"])
    return [dict(zip(("block_m", "block_n", "num_warps", "num_stages"), r)) for r in rows]


def tune(spec: Spec, seq_len: int, batch: int = 1, verbose: bool = True) -> tuple[dict, list]:
    """Time every candidate on random inputs of (batch, seq_len); store and return the
    fastest configuration and the table of (config, ms or error)."""
    import torch
    import triton

    device = torch.device("cuda")
    target = target_for_device(device)
    dt = getattr(torch, spec.dtype)
    q = torch.randn(batch, seq_len, spec.num_heads, spec.head_dim, device=device, dtype=dt)
    k = torch.randn(batch, seq_len, spec.num_kv_heads, spec.head_dim, device=device, dtype=dt)
    v = torch.randn_like(k)
    table = []
    cands = candidates(spec.head_dim)
    for i, cfg in enumerate(cands, 1):
        try:
            kernel = Kernel(spec, target, tuning=cfg)
            kernel(q, k, v)
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(lambda: kernel(q, k, v), warmup=10, rep=40,
                                         return_mode="median")
        except Exception as exc:  # a config that does not fit (shared memory) just loses
            ms = None
            table.append((cfg, f"{type(exc).__name__}: {str(exc)[:80]}"))
        else:
            table.append((cfg, ms))
        if verbose:
            sys.stderr.write(f"\r  autotune {spec.name}: {i}/{len(cands)}")
    if verbose:
        sys.stderr.write("\n")
    timed = [(ms, cfg) for cfg, ms in table if isinstance(ms, float)]
    if not timed:
        raise RuntimeError(f"autotune {spec.name}: no candidate ran: {table}")
    best_ms, best = min(timed, key=lambda x: x[0])
    key = cache.make_key(spec=spec.key(), target=target.key(), **toolchain())
    cache.store_tuning(key, best, {"spec": spec.name, "target": target.name, "seq_len": seq_len,
                                   "batch": batch, "ms": best_ms, **toolchain()})
    return best, table
