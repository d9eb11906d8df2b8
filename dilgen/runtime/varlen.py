"""Variable-length batches: packed sequences (FlashAttention's cu_seqlens) and right-padded
batches (a key padding mask), forward and backward.

A packing is a list of sequences, sequence b being the rows starts[b] + [0, lengths[b]) of
q, k, v laid out as (rows, heads, D). Every branch runs in the lane kernels with VARLEN set
(templates/common.jinja `varlen_rows`): program b of the grid (sequences * H, lane tiles,
segments of the longest sequence) shifts its row pointers to starts[b] and takes
lengths[b] as N, so each sequence computes exactly what it computes alone (segments restart
at its first row, causal is per sequence, curve tables are packed per sequence) in one
launch per branch, reading q, k, v in place. Rows outside every sequence (padding) get
out = 0 and lse = -inf, and zero gradients.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tables import _tables_cpu


@dataclass(frozen=True)
class Packing:
    """Where the sequences of a variable-length call lie in its rows."""
    starts: torch.Tensor        # (S,) int32 on the device of q
    lengths: torch.Tensor       # (S,) int32
    max_len: int                # longest sequence: sizes the grid
    covers_all: bool            # the sequences tile every row (cu_seqlens); else padding rows exist

    @property
    def num_seqs(self) -> int:
        return int(self.starts.numel())


def _fail(name: str, msg: str):
    from . import InputError
    return InputError(f"{name}: {msg}")


def packing_from_cu_seqlens(name: str, cu_seqlens, total: int, device: torch.device,
                            max_seqlen: int | None = None) -> Packing:
    """Check FlashAttention-style offsets (int32, B+1 values, cu[0] = 0, non-decreasing,
    cu[-1] = total rows; zero-length sequences are allowed) and return their packing. Reads
    the offsets on the host once (a device sync), so that nothing is read out of bounds."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise _fail(name, f"cu_seqlens must be a torch.Tensor (int32, B + 1 offsets), got "
                          f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise _fail(name, f"cu_seqlens has dtype {cu_seqlens.dtype}; pass cu_seqlens.to(torch.int32) "
                          f"(as FlashAttention's varlen functions take it)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise _fail(name, f"cu_seqlens must be 1-D with B + 1 >= 2 offsets, got shape "
                          f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise _fail(name, f"cu_seqlens is on {cu_seqlens.device} but q is on {device}; "
                          f"move it to {device}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise _fail(name, f"cu_seqlens[0] = {cu[0]}: must be 0 (offsets of sequences in the packed rows)")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise _fail(name, f"cu_seqlens[{i}] = {cu[i]} < cu_seqlens[{i - 1}] = {cu[i - 1]}: "
                              f"offsets must be non-decreasing")
    if cu[-1] != total:
        raise _fail(name, f"cu_seqlens[-1] = {cu[-1]} but q has {total} rows; the last offset "
                          f"must equal the number of packed rows")
    lengths = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    longest = max(lengths)
    if max_seqlen is not None:
        if int(max_seqlen) < longest:
            raise _fail(name, f"max_seqlen = {max_seqlen} but sequence {lengths.index(longest)} has "
                              f"{longest} rows; pass max_seqlen >= the longest sequence (or omit it)")
    starts_t = cu_seqlens[:-1].contiguous()
    lengths_t = (cu_seqlens[1:] - cu_seqlens[:-1]).contiguous()
    return Packing(starts_t, lengths_t, longest, True)


def packing_from_padding_mask(name: str, key_padding_mask, batch: int, seq_len: int,
                              device: torch.device) -> Packing:
    """A right-padded batch (B, N) bool, True = padding (nn.MultiheadAttention's convention):
    item b is rows b*N + [0, valid_b) of the (B*N, heads, D) view. Left padding or holes
    are refused: the valid rows of an item must come first."""
    m = key_padding_mask
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
        got = m.dtype if isinstance(m, torch.Tensor) else type(m).__name__
        raise _fail(name, f"key_padding_mask must be a bool tensor (B, N), True = padding; got {got}")
    if tuple(m.shape) != (batch, seq_len):
        raise _fail(name, f"key_padding_mask has shape {tuple(m.shape)}; the input is "
                          f"(B, N) = ({batch}, {seq_len})")
    m = m.to(device)
    valid = (~m).sum(dim=1, dtype=torch.int32)
    # right padding: position n is padding iff n >= valid_b
    expect = torch.arange(seq_len, device=device)[None, :] >= valid[:, None]
    if not torch.equal(expect, m):
        bad = int((expect != m).any(dim=1).nonzero()[0, 0])
        raise _fail(name, f"key_padding_mask row {bad} is not right padding (valid tokens first, "
                          f"then padding): left padding or holes are not supported; move the "
                          f"padding of each item to its end")
    starts = torch.arange(batch, dtype=torch.int32, device=device) * seq_len
    return Packing(starts, valid.contiguous(), int(valid.max()), False)


_TABLE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def packed_tables(plan: dict, packing: Packing, rows: int, device: torch.device) -> list[torch.Tensor]:
    """Every curve table of the plan laid out over the rows: sequence b's table (positions
    local to the sequence, for its own length) at rows starts[b] + [0, lengths[b])."""
    if not plan["tables"]:
        return []
    starts = tuple(packing.starts.tolist())
    lengths = tuple(packing.lengths.tolist())
    out: list[torch.Tensor] = []
    for t in plan["tables"]:
        rows_, cols = t["grid"]
        key = (t["scope"], rows_, cols, rows, starts, lengths, str(device))
        hit = _TABLE_CACHE.get(key)
        if hit is None:
            fwd = torch.zeros(rows, dtype=torch.int32)
            inv = torch.zeros(rows, dtype=torch.int32)
            for s0, n in zip(starts, lengths):
                if n:
                    f, i = _tables_cpu(t["scope"], rows_, cols, n)
                    fwd[s0:s0 + n] = f
                    inv[s0:s0 + n] = i
            if len(_TABLE_CACHE) > 32:
                _TABLE_CACHE.clear()
            hit = _TABLE_CACHE[key] = (fwd.to(device), inv.to(device))
        out.extend(hit)
    return out


def branch_order(plan: dict) -> list[int]:
    """Every branch, r = 1 first (it keeps every row, so it writes without a merge)."""
    return sorted(range(len(plan["branches"])), key=lambda i: (plan["branches"][i]["r"] != 1, i))


def _grid(branch: dict, max_len: int, block_m: int) -> tuple[int, int]:
    w, r = branch["w"], branch["r"]
    n = max(max_len, 1)
    return math.ceil(n / w), math.ceil(math.ceil(min(w, n) / r) / block_m)


def _check_plan(attn) -> None:
    plan = attn.plan
    name = attn.spec["name"]
    if attn.lane_kernel is None:
        raise _fail(name, "variable-length batches need the lane kernels, which ring specs "
                          "(ring_size > 1) do not have: call a ring_size = 1 spec on packed rows")
    if any(t["scope"] == "sequence" for t in plan["tables"]):
        raise _fail(name, "hilbert scope 'sequence' fixes N = rows * cols (one image), so a "
                          "sequence of another length has no curve: pad the images to the grid, "
                          "or use scope 'segment'")


def check_varlen_inputs(spec: dict, q, k, v) -> int:
    """q (rows, H, D), k and v (rows, H_kv, D) of the spec's dtype on one device: the rows."""
    from . import InputError, _check_inputs
    name = spec["name"]
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise InputError(f"{name}: with cu_seqlens, {label} must have 3 dims (total, heads, "
                             f"head_dim), got shape {tuple(t.shape)}")
    _check_inputs(spec, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    return q.shape[0]


def forward_varlen_raw(attn, q, k, v, packing: Packing) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (rows, H, D), lse (H, rows) float32) of a variable-length call, no autograd."""
    from . import _POISON, _ensure_descriptor_allocator, _interpreting
    _check_plan(attn)
    plan, cfg = attn.plan, attn.plan["config"]
    rows, H = q.shape[0], plan["num_heads"]
    out = torch.empty((rows, H, q.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, rows), dtype=torch.float32, device=q.device)
    order = branch_order(plan)
    first_writes = packing.covers_all and plan["branches"][order[0]]["r"] == 1
    if _POISON:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    if not first_writes:        # rows no launch writes: no branch keeps them, or padding
        out.zero_()
        lse.fill_(float("-inf"))
    if packing.num_seqs == 0 or packing.max_len == 0:
        return out, lse
    interpret = q.device.type == "cpu"
    tables = packed_tables(plan, packing, rows, q.device)
    # b (the sequence) moves the row pointers itself: batch strides are 0
    strides = (0, q.stride(0), q.stride(1), 0, k.stride(0), k.stride(1),
               0, v.stride(0), v.stride(1), 0, out.stride(0), out.stride(1), 0, lse.stride(0))
    kernel = attn._kernel(interpret, source_fn=attn.lane_kernel)
    opts = {} if interpret else {"num_warps": cfg["lane_fwd"][2], "num_stages": cfg["lane_fwd"][3]}
    if cfg.get("lane_tma") and not interpret:
        _ensure_descriptor_allocator()
    accumulate = not first_writes
    for i in order:
        n_seg, n_tiles = _grid(plan["branches"][i], packing.max_len, cfg["lane_fwd"][0])
        args = (q, k, v, out, lse, *tables, packing.max_len, n_tiles, packing.starts, packing.lengths,
                *strides, interpret, i, accumulate, True)
        grid = (packing.num_seqs * H, n_tiles, n_seg)
        if interpret:
            with _interpreting():
                kernel[grid](*args)
        else:
            kernel[grid](*args, **opts)
        accumulate = True
    attn.launches += 1
    return out, lse


def backward_varlen_raw(attn, q, k, v, out, lse, grad_out, grad_lse, packing: Packing):
    """(dq, dk, dv) of a variable-length call; grad_lse (H, rows) may be None."""
    from . import _POISON, _interpreting
    from .backward import backward_inputs
    _check_plan(attn)
    kernels = attn.backward_kernels
    if kernels is None:
        raise NotImplementedError(f"dilgen ({attn.spec['name']}): this generated module has no "
                                  f"backward kernels")
    conf, plan = kernels["config"], attn.plan
    rows, H, _ = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    dev = q.device
    interpret = dev.type == "cpu"
    grad_out, lse, delta, dlse, has_dlse = backward_inputs(out, lse, grad_out, grad_lse)
    order = branch_order(plan)
    first_writes = packing.covers_all and plan["branches"][order[0]]["r"] == 1
    dq = torch.empty(q.shape, dtype=torch.float32, device=dev)
    if _POISON:
        dq.fill_(float("nan"))
        delta.fill_(float("nan"))
    if not first_writes:
        dq.zero_()
    dk = torch.zeros(k.shape, dtype=torch.float32, device=dev)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=dev)
    if packing.num_seqs == 0 or packing.max_len == 0:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    tables = packed_tables(plan, packing, rows, dev)
    launch = {name: ({} if interpret else dict(opts)) for name, opts in conf["launch"].items()}
    pre = attn._kernel(interpret, source_fn=kernels["preprocess"])
    dkdv = attn._kernel(interpret, source_fn=kernels["dkdv"])
    dq_lanes = attn._kernel(interpret, source_fn=kernels["dq_lanes"])
    qs = (0, q.stride(0), q.stride(1))
    ks = (0, k.stride(0), k.stride(1))
    vs = (0, v.stride(0), v.stride(1))
    dos = (0, grad_out.stride(0), grad_out.stride(1))
    ls = (0, lse.stride(0))
    seqs = (packing.starts, packing.lengths)
    S, L = packing.num_seqs, packing.max_len

    def launches():
        # Delta over every row (one "batch" of `rows` positions: it does not see sequences)
        pre[(math.ceil(rows / conf["pre_block"]), H)](
            out, grad_out, dlse, delta, rows, 0, out.stride(0), out.stride(1), *dos, *ls,
            has_dlse, **launch["preprocess"])
        kv_bn = conf["kv_block_n"]
        for br in plan["branches"]:
            w, r = br["w"], br["r"]
            n_jt = math.ceil(math.ceil(min(w, L) / r) / kv_bn)
            dkdv[(math.ceil(L / w) * min(group, r) * n_jt, S * Hkv)](
                q, k, v, grad_out, dk, dv, lse, delta, *tables, L, n_jt, *seqs,
                *qs, *ks, *vs, *dos, 0, dk.stride(0), dk.stride(1), *ls,
                interpret, br["index"], True, **launch["dkdv"])
        accumulate = not first_writes
        for i in order:
            n_seg, n_tiles = _grid(plan["branches"][i], L, conf["lane_dq_block_m"])
            dq_lanes[(S * H, n_tiles, n_seg)](
                q, k, v, grad_out, dq, lse, delta, *tables, L, n_tiles, *seqs,
                *qs, *ks, *vs, *dos, 0, dq.stride(0), dq.stride(1), *ls,
                interpret, i, accumulate, True, **launch["dq_lanes"])
            accumulate = True

    if interpret:
        with _interpreting():
            launches()
    else:
        launches()
    attn.launches += 1
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
