"""Permutation tables of the IR (Hilbert orders), materialised for a sequence length N.

A table maps virtual positions (curve order) to raster positions (`fwd`) and back
(`inv`), both int32 of length N, built once per (table, N, device) and kept.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..hilbert import gilbert_order, truncated_order


def _segment_table(rows: int, cols: int, n: int) -> list[int]:
    """Segment scope: every full segment walks the curve; a short last one keeps the
    curve order of the positions that exist (SPEC §2)."""
    w = rows * cols
    full = gilbert_order(rows, cols)
    out: list[int] = []
    start = 0
    while start + w <= n:
        out.extend(start + t for t in full)
        start += w
    if start < n:
        out.extend(start + t for t in truncated_order(rows, cols, n - start))
    return out


@lru_cache(maxsize=64)
def _tables_cpu(scope: str, rows: int, cols: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if scope == "sequence":
        if n != rows * cols:
            raise ValueError(
                f"hilbert scope 'sequence' with grid [{rows}, {cols}] needs N = {rows * cols} "
                f"tokens (one {rows} x {cols} image), got N = {n}")
        fwd_list = list(gilbert_order(rows, cols))
    else:
        fwd_list = _segment_table(rows, cols, n)
    fwd = torch.tensor(fwd_list, dtype=torch.int32)
    inv = torch.empty_like(fwd)
    inv[fwd.long()] = torch.arange(n, dtype=torch.int32)
    return fwd, inv


_DEVICE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def table_tensors(table: dict, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fwd, inv) for a table description of the plan (ir.TableMap.to_json())."""
    rows, cols = table["grid"]
    key = (table["scope"], rows, cols, n, str(device))
    hit = _DEVICE_CACHE.get(key)
    if hit is None:
        fwd, inv = _tables_cpu(table["scope"], rows, cols, n)
        hit = (fwd.to(device), inv.to(device))
        if len(_DEVICE_CACHE) > 64:
            _DEVICE_CACHE.clear()
        _DEVICE_CACHE[key] = hit
    return hit


def row_order_tensors(row_order: dict, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fwd, inv) of a plan's row_order (Hilbert scope "sequence", non-causal, one device):
    curve row u is raster row fwd[u], raster row p is curve row inv[p]. The runtime gathers
    q, k, v (and in the backward out, dO, lse) with fwd, runs the kernels on the curve-
    ordered rows, and gathers out, lse (dq, dk, dv) back with inv; built once per length."""
    return table_tensors(row_order, n, device)
