"""torchscale's sequence parallelism (`args.seq_parallel`) on dilgen's ring.

What torchscale does (microsoft/torchscale from da3d79c, `torchscale/component/
dilated_attention.py` and `utils.py`; Prov-GigaPath's vendored copy is the same): with
`args.seq_parallel` each rank of `get_data_parallel_group()`, a `dist.new_group()` of every
rank (the whole world), holds a contiguous chunk of the sequence; a branch whose segment is
longer than the chunk all-gathers its dilated k, v rows over that group (`all_gather_func`,
backward a reduce-scatter), and each rank attends its own queries. It asserts that such a
segment length is a multiple of the chunk length, and pads its segments per rank.

What this module computes instead: exactly the function one process computes on the whole
sequence (dilgen.compat.torchscale's, torchscale's single-device function with exact branch
weights), on the ring (SPEC §2.3) over the group (default: the default group, the world, as
torchscale's). The ring's kernels take head_offsets "mod" and short_segments "exact" only,
so torchscale's layout (SPEC §2.5) is rebuilt around them, exactly:

- **block offsets.** In branch (w, r) head h keeps offset floor(h / c), c = ceil(H / r).
  A call whose head slot j holds model head h = o·c + i with j = o + r·i keeps offset
  j mod r = o: the block offset, under "mod". That needs r·c slots (dummy slots hold zero
  q, k, v; their rows are dropped). Branches whose slot maps agree share one ring call
  (r = 1 agrees with any; H <= r needs no map); GigaPath's r = 1, 2, 4, 8, 16 over 16
  heads takes four calls: {1, 16}, {2}, {4}, {8}.
- **mixing.** Each call returns (out, lse) of its branches; calls are mixed by LongNet
  Eq. 10 (lse = log Σ exp lse_g, out = Σ exp(lse_g − lse)·out_g), one softmax over the
  union of all branches' keys, as one call would.
- **zero padding.** torchscale pads a segment of w' = min(w, N) rows to ⌈w'/r⌉·r rows; a
  kept query of it also sees the pad rows at its offset as keys of score 0 and value 0:
  n more terms exp(0) in its softmax denominator and nothing in the numerator. So
  out = out_exact · e^lse / (e^lse + n) = out_exact · sigmoid(lse − log n), n counted
  per (row, head) over the branches keeping it (0 when causal: pad rows follow every real
  query of their segment).
- **uneven chunks.** Rank j holds rows [j·c, j·c + n_j) with n_j = c for every rank but
  the last, which may hold fewer (N = 1 + tiles is rarely a multiple of P). The last rank
  appends c − n_j zero rows, so the ring sees N' = P·c rows. The zero rows are keys of
  score 0 and value 0, the very keys torchscale pads the last segment with, when they lie
  inside its padded length: then the count n above only adds the pad rows past N'. When
  they do not (a branch with N <= w whose zero rows reach past ⌈N/r⌉·r, as with r = 1),
  the ring runs the row packed instead (cu_seqlens [0, N, N']: the real rows as one sequence, the zero rows
  as another), one call per batch item.

Who reduces what: the ring gives each rank the exact gradients of its rows of q, k, v (it
sends dK, dV home), so every activation gradient on every rank is the one-process one.
A parameter's gradient on a rank is the share of that rank's rows; nothing here sums it
over the group: the training code does (docs/torchscale.md, "Sequence parallel").
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime.dropout_call import draw_seed
from ..spec import Spec

PREFIX = "dilgen.compat.torchscale"
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def group_size(group) -> int:
    """Ranks of `group` (None: the default group); 1 without torch.distributed set up, as
    torchscale's get_data_parallel_world_size."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    size = dist.get_world_size(group)
    if size < 1:
        raise ValueError(f"{PREFIX}: args.seq_parallel: this rank is not in the module's "
                         f"seq_parallel_group")
    return size


def chunk_rows(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's rows of the whole sequence `x` (the same on every rank): rows
    [j·c, min((j+1)·c, N)) along `dim` on rank j of `group`, c = ceil(N / P), the layout
    seq_parallel takes. N must exceed (P − 1)·c (every rank holds at least one row)."""
    import torch.distributed as dist
    P = group_size(group)
    rank = dist.get_rank(group) if P > 1 else 0
    N = x.shape[dim]
    c = -(-N // P)
    if N <= (P - 1) * c:
        raise ValueError(f"{PREFIX}: chunk_rows: N = {N} rows in chunks of {c} leave rank "
                         f"{P - 1} of {P} without a row; use fewer ranks")
    return x.narrow(dim, rank * c, min(c, N - rank * c))


# --------------------------------------------------------------------------- agreement


@dataclass(frozen=True)
class Layout:
    """The rows of one seq_parallel call: P ranks of c rows on the ring (N' = P·c), N real
    rows in all (the last rank's may be fewer than c), this rank's `rank` and its n_loc."""
    P: int
    rank: int
    c: int
    N: int
    n_loc: int

    @property
    def padded(self) -> int:
        return self.P * self.c


def _mask_flag(mask, B: int, n: int) -> int:
    """0: no padding (None or all False); 1: padding; 2: a mask of the wrong shape."""
    if mask is None:
        return 0
    if tuple(mask.shape) != (B, n):
        return 2
    return int(bool(mask.to(torch.bool).any()))


def agree(B: int, n: int, mask, device, group) -> Layout:
    """Every rank's (batch, rows, mask flag) through one all_gather over `group`; every
    rank then accepts the call, or raises the same one-line error (no rank enters the
    ring alone)."""
    import torch.distributed as dist
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([B, n, _mask_flag(mask, B, n)], dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(every, mine, group=group)
    if dist.get_backend(group) == "gloo":
        from ..runtime.ring.faults import let_go
        let_go([mine, *every])      # no gloo thread holds them if the process ends next
    table = torch.stack(every).tolist()
    batches, sizes, flags = ([row[i] for row in table] for i in range(3))
    where = f"{PREFIX}: args.seq_parallel over {P} ranks"
    if len(set(batches)) > 1:
        raise ValueError(f"{where}: the ranks disagree on the batch size (per rank: {batches})")
    if 2 in flags:
        raise ValueError(f"{where}: key_padding_mask must have shape (batch, this rank's rows) "
                         f"on every rank; rank(s) {[j for j, f in enumerate(flags) if f == 2]} "
                         f"passed another shape")
    if 1 in flags:
        raise NotImplementedError(
            f"{where}: key_padding_mask with padding (rank(s) {[j for j, f in enumerate(flags) if f]}) "
            f"is not supported: pass one slide (sequence) unpadded, or no mask")
    c, N = sizes[0], sum(sizes)
    if any(s != c for s in sizes[:-1]) or not 1 <= sizes[-1] <= c:
        raise ValueError(f"{where}: rows per rank {sizes}: rank j must hold rows [j*c, (j+1)*c) "
                         f"of the sequence, the last rank possibly fewer (but one at least); "
                         f"dilgen.compat.torchscale.chunk_rows(x) gives a rank its rows")
    return Layout(P=P, rank=rank, c=c, N=N, n_loc=n)


# --------------------------------------------------------------------------- the plan


def _slots(H: int, r: int) -> tuple:
    """Call slot j -> model head (−1: a dummy) so that "mod" offsets j mod r are the block
    offsets floor(h / ceil(H / r)) of branch rate r."""
    c = -(-H // r)
    if c == 1 or r == 1:                 # H <= r: offset h = h mod r; r = 1: offset 0
        return tuple(range(H))
    slots = [-1] * (r * c)
    for h in range(H):
        o, i = divmod(h, c)
        slots[o + r * i] = h
    return tuple(slots)


def _fits(slots: tuple, H: int, r: int) -> bool:
    c = -(-H // r)
    return all(h < 0 or h // c == j % r for j, h in enumerate(slots))


@functools.lru_cache(maxsize=64)
def plan(H: int, D: int, segments: tuple, rates: tuple, causal: bool, dtype: str, P: int) -> tuple:
    """((ring spec, slot map, its branches' indices among the model's), ...): the ring calls
    of torchscale's function (block offsets, exact segments; the zero padding is added
    afterwards)."""
    groups: list[list] = []                  # [slots, [branch indices]]
    for i, r in enumerate(rates):
        for g in groups:
            if _fits(g[0], H, r):
                g[1].append(i)
                break
        else:
            groups.append([_slots(H, r), [i]])
    return tuple((Spec(name="torchscale_seq_parallel", num_heads=len(slots), head_dim=D, dtype=dtype,
                       segment_lengths=[segments[i] for i in members],
                       dilation_rates=[rates[i] for i in members], causal=causal, ring_size=P,
                       source=f"{PREFIX} seq_parallel"), slots, tuple(members))
                 for slots, members in groups)


def _last_segment(N: int, w: int, r: int) -> tuple[int, int]:
    """torchscale's last segment of branch (w, r): (its first row, its padded length)."""
    wp = min(w, N)
    return (N - 1) // wp * wp, -(-wp // r) * r


def appended_rows_fit(N: int, padded: int, segments, rates) -> bool:
    """Whether the zero rows [N, N') the ring appends are keys torchscale pads with too:
    in every branch, the zero rows the last (exact) segment holds stay inside torchscale's
    padded last segment."""
    for w, r in zip(segments, rates):
        s0, length = _last_segment(N, w, r)
        if min(padded, s0 + w) > s0 + length:
            return False
    return True


@functools.lru_cache(maxsize=32)
def pad_counts(layout: Layout, H: int, segments: tuple, rates: tuple, packed: bool,
               device: torch.device) -> torch.Tensor | None:
    """(c, H) float32 on `device`: torchscale's zero keys that this rank's rows see and the
    ring's calls do not (in each branch's last segment, the pad rows from where the ring's
    rows end, N if packed, to torchscale's padded length, at the row's offset), summed over
    the branches keeping the row; None if all are 0. Made once per layout (every layer
    has the same)."""
    N, padded = layout.N, layout.padded
    rows = torch.arange(layout.rank * layout.c, (layout.rank + 1) * layout.c)
    counts = torch.zeros(layout.c, H)
    for w, r in zip(segments, rates):
        s0, length = _last_segment(N, w, r)
        lo = (N if packed else min(padded, s0 + w)) - s0
        if lo >= length:
            continue
        lanes = torch.tensor([float(len(range(lo + (o - lo) % r, length, r))) for o in range(r)])
        offset = torch.arange(H) // -(-H // r)          # block offsets
        inside = (rows >= s0) & (rows < N)
        kept = ((rows - s0) % r)[:, None] == offset[None, :]
        counts += torch.where(inside[:, None] & kept, lanes[offset][None, :], 0.0)
    return counts.to(device) if bool(counts.any()) else None


@functools.lru_cache(maxsize=64)
def _indices(slots: tuple, H: int, device: torch.device):
    """(model heads -> call slots, call slots -> model heads) index tensors on `device`,
    or None for a call in model head order."""
    if slots == tuple(range(H)):
        return None
    there = torch.tensor([h if h >= 0 else H for h in slots], device=device)
    back = torch.tensor([slots.index(h) for h in range(H)], device=device)
    return there, back


@functools.lru_cache(maxsize=16)
def _cu(N: int, padded: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens of the packed ring call: the real rows, then the zero rows."""
    return torch.tensor([0, N, padded], dtype=torch.int32, device=device)


# --------------------------------------------------------------------------- the call


@functools.lru_cache(maxsize=64)
def _streams(slots: tuple, members: tuple, n_branches: int, device: torch.device) -> torch.Tensor:
    """(call slots, call branches) int64 on `device`: the stream of each entry in the one-
    process call, model head h and branch i: h n_branches + i (dilgen.dropout.stream; a
    dummy slot's rows are dropped, it draws head 0's)."""
    from ..dropout import stream
    heads = torch.tensor([max(h, 0) for h in slots], device=device)
    return stream(len(slots), n_branches, heads[:, None], torch.tensor(members, device=device)[None, :])


def _dropout_call(q, k, v, spec: Spec, group, cu_seqlens, dropout):
    """_ring_call under attention dropout = (p, seed, N, streams): the call draws its heads'
    and branches' part of the one-process call's mask (ring.dropout.Counter), rows b N +
    position as one device counts them (a packed call of item b: from row b N)."""
    from .. import compiler
    from ..runtime.ring.dropout import Counter
    from ..runtime.ring.op import ring_attention, ring_varlen_attention
    p, seed, n, streams = dropout
    attn = compiler._kernel_for(spec).compiled_for(q.device).attention
    if cu_seqlens is None:
        return ring_attention(attn, q, k, v, group=group, return_lse=True, dropout_p=p,
                              counter=Counter(seed, n, 0, streams))
    outs, lses = zip(*(ring_varlen_attention(attn, q[b], k[b], v[b], cu_seqlens, group=group, return_lse=True,
                                             dropout_p=p, counter=Counter(seed, n, b * n, streams))
                       for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


def _ring_call(q, k, v, spec: Spec, group, cu_seqlens, dropout=None):
    """(out (B, c, H, D), lse (B, H, c)) of one ring spec: the plain ring, or one packed
    call per batch item."""
    from .. import compiler
    if dropout is not None:
        return _dropout_call(q, k, v, spec, group, cu_seqlens, dropout)
    if cu_seqlens is None:
        return compiler.dilated_attention(q, k, v, spec, return_lse=True, group=group)
    outs, lses = zip(*(compiler.dilated_attention(q[b], k[b], v[b], spec, return_lse=True,
                                                  group=group, cu_seqlens=cu_seqlens)
                       for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


def _in_slots(x, there: torch.Tensor, dummies: bool):
    """(B, n, H, D) in model head order -> (B, n, slots, D) in call slot order (slot index
    H: a zero head, for the dummy slots)."""
    if dummies:
        x = F.pad(x, (0, 0, 0, 1))
    return x.index_select(2, there)


def _mix(parts):
    """LongNet Eq. 10 over the calls' (out (B, n, H, D), lse (B, H, n)): rows no branch
    keeps stay out 0, lse −inf, with no NaN in the forward or the backward."""
    if len(parts) == 1:
        return parts[0]
    acc = _accumulator(parts[0][0])
    lses = torch.stack([lse.to(acc) for _, lse in parts])
    top = lses.detach().amax(0)          # any shift is exact: no gradient through it
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    terms = torch.exp(lses - top)
    total = terms.sum(0)
    some = total > 0
    total = torch.where(some, total, torch.ones_like(total))
    lse = torch.where(some, top + torch.log(total), torch.full_like(total, -math.inf))
    out = sum(o.to(acc) * (t / total).transpose(1, 2).unsqueeze(-1) for (o, _), t in zip(parts, terms))
    return out, lse


def _accumulator(x) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _pad_keys(out, lse, counts):
    """n zero keys (score 0, value 0) more in each row's softmax: out · sigmoid(lse − log n)."""
    acc = _accumulator(out)
    n = counts.to(acc)
    some = n > 0
    log_n = torch.log(torch.where(some, n, torch.ones_like(n)))
    keep = torch.where(some, torch.sigmoid(lse.to(acc).transpose(1, 2) - log_n), torch.ones_like(n))
    return out.to(acc) * keep.unsqueeze(-1)


def attend(q, k, v, layout: Layout, segments: tuple, rates: tuple, *, causal: bool, group,
           dropout_p: float = 0.0):
    """torchscale's dilated attention of this rank's rows q, k, v (B, n_loc, H, D) of the
    whole sequence: this rank's rows of the one-process result, autograd-aware. dropout_p >
    0: attention dropout, the one-process call's mask (one seed for the layer's ring calls,
    each drawing its heads' and branches' coins). The calls are mixed by their lse, which
    dropout leaves alone, and dropout scales each probability of the one softmax: the
    mixture is the one-process call's, mask included."""
    _, n, H, D = q.shape
    dtype = _DTYPES.get(q.dtype, "float32")     # others: the kernels refuse them in one line
    extra = layout.c - n
    if extra:                                   # the last rank: zero rows up to c
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, extra)) for x in (q, k, v))
    N, padded = layout.N, layout.padded
    # causal queries never see the zero rows (they follow every real row): appending fits
    packed = not causal and padded > N and not appended_rows_fit(N, padded, segments, rates)
    cu = _cu(N, padded, q.device) if packed else None
    seed = draw_seed() if dropout_p else None   # one seed a layer call, as one process draws
    parts = []
    for spec, slots, members in plan(H, D, segments, rates, causal, dtype, layout.P):
        index = _indices(slots, H, q.device)
        drop = None if not dropout_p else (dropout_p, seed, N, _streams(slots, members, len(rates), q.device))
        if index is None:
            o, lse = _ring_call(q, k, v, spec, group, cu, drop)
        else:
            o, lse = _ring_call(*(_in_slots(x, index[0], -1 in slots) for x in (q, k, v)),
                                spec, group, cu, drop)
            o, lse = o.index_select(2, index[1]), lse.index_select(1, index[1])
        parts.append((o, lse))
    out, lse = _mix(parts)
    counts = None if causal else pad_counts(layout, H, segments, rates, packed, q.device)
    if counts is not None:
        out = _pad_keys(out, lse, counts)
    return out[:, :n].to(q.dtype)
