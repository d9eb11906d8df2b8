"""Which rows each rank of a ring holds: `shard` gives a rank its rows of a full tensor,
`unshard` puts every rank's rows back together (raster order); Hilbert scope "sequence"
shards runs of the curve."""
from __future__ import annotations

import torch

from ...schedule import ring_pieces
from ..checks import InputError
from ..tables import table_tensors


def _curve_of(spec) -> tuple[int, int] | None:
    """(rows, cols) of a Hilbert scope "sequence" spec (a Spec or its JSON dict), else None."""
    if spec is None:
        return None
    hil = spec.get("hilbert") if isinstance(spec, dict) else spec.hilbert
    if hil is None:
        return None
    scope = hil.get("scope") if isinstance(hil, dict) else hil.scope
    grid = hil.get("grid") if isinstance(hil, dict) else hil.grid
    return tuple(grid) if scope == "sequence" else None


def _curve_tables(curve: tuple[int, int], n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = curve
    if n != rows * cols:
        raise InputError(f"hilbert scope 'sequence' with grid [{rows}, {cols}] needs N = "
                         f"{rows * cols} tokens (one {rows} x {cols} image), got N = {n}")
    fwd, inv = table_tensors({"scope": "sequence", "grid": [rows, cols]}, n, device)
    return fwd.long(), inv.long()


def shard(x: torch.Tensor, ring_size: int, rank: int, order: str = "contiguous",
          dim: int = 1, *, spec=None) -> torch.Tensor:
    """Rank `rank`'s rows of a full (B, N, ...) tensor (raster order), in the ring's chunk
    order. With a Hilbert scope "sequence" `spec`, the rows are first put in curve order,
    so that each rank holds a run of the curve (a compact region of the image) in curve
    order, as the ring kernels take it; `unshard(..., spec=spec)` undoes both steps."""
    curve = _curve_of(spec)
    if curve is not None:
        x = x.index_select(dim, _curve_tables(curve, x.shape[dim], x.device)[0])
    n = x.shape[dim]
    parts = 2 * ring_size if order == "zigzag" else ring_size
    if n % parts:
        raise InputError(f"N = {n} is not divisible by {parts} "
                         f"({'2 x ' if order == 'zigzag' else ''}ring_size {ring_size}); "
                         f"pad or trim the sequence to a multiple of {parts}")
    pieces = ring_pieces(n, ring_size, order)[rank]
    return torch.cat([x.narrow(dim, s, ln) for s, ln in pieces], dim=dim)


def unshard(chunks: list[torch.Tensor], order: str = "contiguous", dim: int = 1, *,
            spec=None) -> torch.Tensor:
    """Inverse of `shard`: the full tensor, in raster order, from every rank's rows (rank
    order); pass the same `spec` as to shard."""
    full = _unshard_pieces(chunks, order, dim)
    curve = _curve_of(spec)
    if curve is not None:
        full = full.index_select(dim, _curve_tables(curve, full.shape[dim], full.device)[1])
    return full


def _unshard_pieces(chunks: list[torch.Tensor], order: str, dim: int) -> torch.Tensor:
    P = len(chunks)
    n = sum(c.shape[dim] for c in chunks)
    pieces = ring_pieces(n, P, order)
    out = [None] * sum(len(p) for p in pieces)
    flat = []
    for rank, c in enumerate(chunks):
        row = 0
        for s, ln in pieces[rank]:
            flat.append((s, c.narrow(dim, row, ln)))
            row += ln
    flat.sort(key=lambda x: x[0])
    out = [t for _, t in flat]
    return torch.cat(out, dim=dim)
