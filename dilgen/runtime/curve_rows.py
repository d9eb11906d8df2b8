"""Compact curve-ordered copies of the rows a Hilbert lane branch keeps (BranchIR.curve_rows).

A lane branch with a curve table reads, in every key loop, rows whose raster positions come
from the table: a dependent load per key and a gather per tile. Instead the runtime copies
the rows the branch keeps, once per call and in curve order, into contiguous buffers
(`<name>_curve_rows`, one pass over the source), and the lane kernels walk those: kept lane
j of segment s of a head's offset is row s*LW + j, LW = ceil(min(w, N) / r). Outputs and
gradients of k, v still go to raster rows through the table, once per tile.

Layout (B, heads, slots, n_rows, row): k and v keep min(group, r) slots per kv head (one per
offset its query heads use), q, dO, lse and Delta one per query head.
"""
from __future__ import annotations

import math

import torch

from .interpreter import interpreting
from .replay import recording

CURVE_BLOCK = 64      # compact rows per program (templates: CURVE_BLOCK)


def compact_rows(branch: dict, n: int) -> int:
    """Rows per (head, slot) of a branch's compact copies at sequence length n."""
    w, r = branch["w"], branch["r"]
    return math.ceil(n / w) * math.ceil(min(w, n) / r)


def uses_curve_rows(plan: dict, branch_index: int, packing) -> bool:
    """Whether a launch of this branch reads compact copies (packed batches keep the table)."""
    return packing is None and bool(plan["branches"][branch_index].get("curve_rows"))


def lane_key_args(attn, interpret: bool, branch: dict, tables: list, k: torch.Tensor,
                  v: torch.Tensor, packing, tile, dummy: torch.Tensor) -> tuple[tuple, tuple]:
    """The extra arguments of a forward or dq lane launch in a plan with curve_rows branches:
    (KC, VC[, CurveBlockCount, CurveBlocks]) and (CURVE_ROWS,). Launches that do not read
    copies (other branches, packed batches) get k, v and `dummy` in their place."""
    plan = attn.plan
    curve = uses_curve_rows(plan, branch["index"], packing)
    H, Hkv = plan["num_heads"], plan["num_kv_heads"]
    args = copy_rows(attn, interpret, branch, tables, k, v, heads=Hkv, group=H // Hkv) if curve else (k, v)
    if plan["causal"]:      # key block lists of a curve's causal mask
        args += attn._block_lists(branch, k.shape[1], tile, k.device) if curve else (dummy, dummy)
    return args, (curve,)


def copy_rows(attn, interpret: bool, branch: dict, tables: list, x: torch.Tensor,
              y: torch.Tensor, *, heads: int, group: int, positions_last: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(xc, yc): the branch's kept rows of x and y in curve order, compact.

    x, y: (B, N, heads, D) rows (k and v, or q and dO), or with positions_last (B, heads, N)
    float32 values per position (lse and Delta)."""
    if positions_last:
        B, _, N = x.shape
        row = row_pad = 1
        strides = (x.stride(0), x.stride(2), x.stride(1), y.stride(0), y.stride(2), y.stride(1))
    else:
        B, N = x.shape[0], x.shape[1]
        row = x.shape[3]
        row_pad = attn.plan.get("head_dim_pad") or row     # the kernels' tile width
        strides = (x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2))
    slots = min(group, branch["r"])
    n_rows = compact_rows(branch, N)
    shape = (B, heads, slots, n_rows) + (() if positions_last else (row,))
    xc = torch.empty(shape, dtype=x.dtype, device=x.device)
    yc = torch.empty(shape, dtype=y.dtype, device=y.device)
    if B == 0 or n_rows == 0:
        return xc, yc
    kernel = attn._kernel(interpret, source_fn=attn.curve_kernel)
    grid = (B * heads * slots, math.ceil(n_rows / CURVE_BLOCK))
    args = (x, y, xc, yc, *tables, N, *strides, heads, group, slots, row, row_pad, branch["index"])
    recorder = recording()
    if interpret:
        with interpreting():
            kernel[grid](*args)
    elif recorder is not None:     # a recorded call: a replay allocates xc, yc afresh
        recorder.launch(kernel, grid, args, {"num_warps": 4, "num_stages": 1})
        recorder.temporary(xc, yc)
    else:
        kernel[grid](*args, num_warps=4, num_stages=1)
    return xc, yc


def block_lists(branch: dict, fwd: torch.Tensor, n: int, block_m: int, block_n: int,
                keys_listed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal masks along a curve, as lists of key blocks per query tile of a lane kernel.

    For segment s, offset o and query tile mt (lanes mt*block_m + [0, block_m)), the key
    blocks jb (lanes jb*block_n + [0, block_n)) split by the raster positions p = fwd[u]:
    "full" when every key lies at or before every query (no mask), skipped when every key
    lies after every query, "partial" otherwise. Returns counts (n_seg, n_off, n_qt, 2) int32
    (full, partial) and blocks (n_seg, n_off, n_qt, 2, n_kb) int32, each list ascending, for
    the n_off = min(r, w) offsets a segment has (an offset o >= w keeps no lane: the kernels
    (common.curve_block_lists) give it empty lists without reading these).
    keys_listed=False: the key-major form (the dkdv kernel): tiles of block_m keys, listed
    blocks of block_n queries."""
    w, r = branch["w"], branch["r"]
    n_off = min(r, w)
    n_seg, lw = math.ceil(n / w), math.ceil(min(w, n) / r)
    n_qt, n_kb = math.ceil(lw / block_m), math.ceil(lw / block_n)
    dev = fwd.device
    s = torch.arange(n_seg, device=dev).view(-1, 1, 1)
    o = torch.arange(n_off, device=dev).view(1, -1, 1)
    j = torch.arange(lw, device=dev).view(1, 1, -1)
    n_lanes = ((torch.clamp(n - s * w, max=w) - o + r - 1).clamp(min=0)) // r
    valid = j < n_lanes
    pos = fwd.long()[torch.where(valid, s * w + o + r * j, 0)]

    def tiles(size, count):
        pad = count * size - lw
        p = torch.nn.functional.pad(pos, (0, pad)).view(n_seg, n_off, count, size)
        ok = torch.nn.functional.pad(valid, (0, pad)).view(n_seg, n_off, count, size)
        lo = torch.where(ok, p, n).amin(-1)
        hi = torch.where(ok, p, -1).amax(-1)
        return lo, hi, ok.any(-1), ok.all(-1)

    q_lo, q_hi, q_any, _ = tiles(block_m, n_qt)
    k_lo, k_hi, k_any, k_all = tiles(block_n, n_kb)
    if keys_listed:
        full = q_any[..., :, None] & k_all[..., None, :] & (k_hi[..., None, :] <= q_lo[..., :, None])
        skip = ~q_any[..., :, None] | ~k_any[..., None, :] | (k_lo[..., None, :] > q_hi[..., :, None])
    else:   # tiles (block_m) are keys, listed blocks (block_n) are queries
        t_lo, t_hi, t_any, b_lo, b_hi, b_any, b_all = q_lo, q_hi, q_any, k_lo, k_hi, k_any, k_all
        full = t_any[..., :, None] & b_all[..., None, :] & (b_lo[..., None, :] >= t_hi[..., :, None])
        skip = ~t_any[..., :, None] | ~b_any[..., None, :] | (b_hi[..., None, :] < t_lo[..., :, None])
    part = ~full & ~skip
    counts = torch.stack([full.sum(-1), part.sum(-1)], -1).to(torch.int32).contiguous()
    first = [torch.argsort((~m).to(torch.int8), dim=-1, stable=True) for m in (full, part)]
    blocks = torch.stack(first, -2).to(torch.int32).contiguous()
    return counts, blocks
