"""Variable-length batches: packed sequences (FlashAttention's cu_seqlens) and padded
batches (a key padding mask) as a Packing, and the per-sequence tables the kernels read.

A packing is a list of sequences, sequence b being the rows starts[b] + [0, lengths[b]) of
q, k, v laid out as (rows, heads, D). The kernels of a plan run as for a batch of
sequences of the longest length, with VARLEN set (templates/common.jinja `varlen_rows`):
program b (the batch index) shifts its row pointers to starts[b] and takes lengths[b] as
N, so each sequence computes exactly what it computes alone (segments restart at its
first row, causal is per sequence, curve tables are packed per sequence) in the same
launches as a fixed-length call (forward.forward_raw, backward.backward_raw),
reading q, k, v in place. Rows outside every sequence (padding) get out = 0, lse = -inf
and zero gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import InputError, check_max_seqlen
from .readings import remembered
from .tables import _tables_cpu


@dataclass(frozen=True)
class Packing:
    """Where the sequences of a variable-length call lie in its rows."""
    starts: torch.Tensor        # (S,) int32 on the device of q
    lengths: torch.Tensor       # (S,) int32
    max_len: int                # longest sequence: sizes the grid
    covers_all: bool            # the sequences tile every row (cu_seqlens); else padding rows exist
    # launch groups (first, end, longest) over starts/lengths, which are then ordered
    # longest first: each group's grid is sized by its own longest sequence, so short
    # sequences do not launch the empty programs of the longest one; () = one group
    buckets: tuple = ()
    # starts and lengths as read on the host (ordered as the tensors), () when unknown
    starts_host: tuple = ()
    lengths_host: tuple = ()

    @property
    def num_seqs(self) -> int:
        return int(self.starts.numel())

    def groups(self, heads: int = 1) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(starts, lengths, longest) of each launch group, split so that a grid dimension of
        sequences x `heads` programs stays within CUDA's 65535."""
        spans = self.buckets or ((0, self.num_seqs, self.max_len),)
        most = max(1, MAX_GRID_Y // max(1, heads))
        return [(self.starts[i:min(i + most, b)], self.lengths[i:min(i + most, b)], n)
                for a, b, n in spans for i in range(a, max(b, a + 1), most)]


#: At most this many launch groups (so launches stay independent of the sequence count).
MAX_BUCKETS = 4
#: CUDA's limit on a grid's second and third dimensions (the fused kernels put sequences x
#: heads there).
MAX_GRID_Y = 65535


def bucket_order(lengths: list[int]) -> tuple[list[int], tuple]:
    """Sequence indices longest first (zero-length ones dropped: they launch nothing) and
    launch groups (first, end, longest) whose sequences are longer than half the group's
    longest, the shortest groups merged so that there are at most MAX_BUCKETS."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for pos, i in enumerate(order):
        if buckets and (2 * lengths[i] > buckets[-1][2] or len(buckets) == MAX_BUCKETS):
            buckets[-1][1] = pos + 1
        else:
            buckets.append([pos, pos + 1, lengths[i]])
    return order, tuple(tuple(b) for b in buckets)


def _bucketed(starts: list[int], lengths: list[int], covers_all: bool, device: torch.device) -> Packing:
    """The Packing of sequences read on the host: ordered longest first (bucket_order), their
    starts and lengths copied to `device` in one copy that does not wait for the GPU (from
    pinned memory, non-blocking)."""
    order, buckets = bucket_order(lengths)
    starts, lengths = [starts[i] for i in order], [lengths[i] for i in order]
    host = torch.tensor([starts, lengths], dtype=torch.int32).reshape(2, len(order))
    if device.type == "cuda":
        table = host.pin_memory().to(device, non_blocking=True)
    else:
        table = host.to(device)
    return Packing(table[0], table[1], max(lengths, default=0), covers_all, buckets,
                   tuple(starts), tuple(lengths))


def _fail(name: str, msg: str):
    return InputError(f"{name}: {msg}")


def _check_cu_tensor(name: str, cu_seqlens, device: torch.device) -> None:
    """cu_seqlens is a 1-D int32 tensor of B + 1 >= 2 offsets on the CPU or q's device."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise _fail(name, f"cu_seqlens must be a torch.Tensor (int32, B + 1 offsets), got "
                          f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise _fail(name, f"cu_seqlens has dtype {cu_seqlens.dtype}; pass cu_seqlens.to(torch.int32) "
                          f"(as FlashAttention's varlen functions take it)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise _fail(name, f"cu_seqlens must be 1-D with B + 1 >= 2 offsets, got shape "
                          f"{tuple(cu_seqlens.shape)}")
    device, at = torch.device(device), cu_seqlens.device
    if at.type != "cpu" and (at.type != device.type or device.index not in (None, at.index)):
        raise _fail(name, f"cu_seqlens is on {cu_seqlens.device} but q is on {device}; "
                          f"move it to {device} (or keep it on the CPU: no device sync)")


def packing_from_cu_seqlens(name: str, cu_seqlens, total: int, device: torch.device,
                            max_seqlen: int | None = None) -> Packing:
    """Check FlashAttention-style offsets (int32, B+1 values, cu[0] = 0, non-decreasing,
    cu[-1] = total rows; zero-length sequences are allowed) and return their packing. The
    offsets are read on the host, so that nothing is read out of bounds, and remembered while
    the tensor holds them (readings.remembered): offsets on the CPU are compared with that
    reading every call; offsets on the GPU cost one device sync when first seen (or written
    in place), then a comparison on the device each call."""
    _check_cu_tensor(name, cu_seqlens, device)
    device = torch.device(device)
    limit = None if max_seqlen is None else check_max_seqlen(name, max_seqlen)   # an int >= 0, or refused
    return remembered(cu_seqlens, (total, str(device), limit),
                      lambda: _check_offsets(name, cu_seqlens.tolist(), total, device, limit), "cu_seqlens")


def read_cu_seqlens(name: str, cu_seqlens, total: int, device: torch.device,
                    max_seqlen: int | None = None) -> list[int]:
    """The offsets as packing_from_cu_seqlens checks them, read on the host now (the ring,
    whose ranks exchange them on the host every call)."""
    _check_cu_tensor(name, cu_seqlens, device)
    limit = None if max_seqlen is None else check_max_seqlen(name, max_seqlen)
    cu = cu_seqlens.tolist()
    _offset_lengths(name, cu, total, limit)
    return cu


def _check_offsets(name: str, cu: list[int], total: int, device: torch.device,
                   max_seqlen: int | None) -> Packing:
    return _bucketed(cu[:-1], _offset_lengths(name, cu, total, max_seqlen), True, device)


def _offset_lengths(name: str, cu: list[int], total: int, max_seqlen: int | None) -> list[int]:
    """The sequence lengths of offsets read on the host, or one InputError naming the rule."""
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
        if max_seqlen < longest:
            raise _fail(name, f"max_seqlen = {max_seqlen} but sequence {lengths.index(longest)} has "
                              f"{longest} rows; pass max_seqlen >= the longest sequence (or omit it)")
    return lengths


def packing_from_padding_mask(name: str, key_padding_mask, batch: int, seq_len: int,
                              device: torch.device) -> Packing:
    """A padded batch (B, N) bool, True = padding (nn.MultiheadAttention's convention):
    item b's tokens are one run of rows b*N + [first_b, first_b + valid_b) of the (B*N,
    heads, D) view, after left padding, before right padding, or both; its segments start
    at its first token. Holes (padding between tokens) are refused. The mask is read on the
    host and remembered while it holds what was read, as cu_seqlens are
    (packing_from_cu_seqlens)."""
    m = key_padding_mask
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
        got = m.dtype if isinstance(m, torch.Tensor) else type(m).__name__
        raise _fail(name, f"key_padding_mask must be a bool tensor (B, N), True = padding; got {got}")
    if tuple(m.shape) != (batch, seq_len):
        raise _fail(name, f"key_padding_mask has shape {tuple(m.shape)}; the input is "
                          f"(B, N) = ({batch}, {seq_len})")
    if m.device.type == "meta":
        raise _fail(name, "key_padding_mask is on the meta device (it has no values); pass the "
                          f"mask on {device}")
    return remembered(m, (str(device),), lambda: _check_padding(name, m, batch, seq_len, torch.device(device)),
                      "key_padding_mask")


def _check_padding(name: str, m: torch.Tensor, batch: int, seq_len: int, device: torch.device) -> Packing:
    """Each item's valid rows and first token, and whether it has holes, read in one copy."""
    keep = ~m
    valid = keep.sum(dim=1, dtype=torch.int32)
    first = torch.where(valid > 0, keep.int().argmax(dim=1), 0).to(torch.int32)
    pos = torch.arange(seq_len, device=m.device)[None, :]
    expect = (pos < first[:, None]) | (pos >= (first + valid)[:, None])
    holes = (expect != m).any(dim=1).to(torch.int32)
    valid, first, holes = torch.stack([valid, first, holes]).tolist()
    if any(holes):
        raise _fail(name, f"key_padding_mask row {holes.index(1)} has padding between tokens: an item's "
                          f"tokens must be one run (left or right padding); pack such items "
                          f"with cu_seqlens instead")
    starts = [b * seq_len + first[b] for b in range(batch)]
    return _bucketed(starts, valid, False, device)


_TABLE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def packed_tables(plan: dict, packing: Packing, rows: int, device: torch.device) -> list[torch.Tensor]:
    """Every curve table of the plan laid out over the rows: sequence b's table (positions
    local to the sequence, for its own length) at rows starts[b] + [0, lengths[b])."""
    if not plan["tables"]:
        return []
    starts = packing.starts_host or tuple(packing.starts.tolist())
    lengths = packing.lengths_host or tuple(packing.lengths.tolist())
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


def check_packed_plan(attn) -> None:
    """Refuse a plan the single-device packed launches cannot run."""
    plan = attn.plan
    name = attn.spec["name"]
    if plan["ring"]["ring_size"] > 1:
        raise _fail(name, f"the single-device packed launches got a spec with ring_size = "
                          f"{plan['ring']['ring_size']}: on a ring call kernel(q, k, v, "
                          f"cu_seqlens=cu) on every rank (dilgen.runtime.ring.ring_varlen_attention)")
    if plan.get("row_order") or any(t["scope"] == "sequence" for t in plan["tables"]):
        raise _fail(name, "hilbert scope 'sequence' fixes N = rows * cols (one image), so a "
                          "sequence of another length has no curve: pad the images to the grid, "
                          "or use scope 'segment'")
