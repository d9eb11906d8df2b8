"""The ring's "recut" transport: every border between two ranks moves to a multiple of the
segment lengths' lcm (schedule.recut_pieces), so that no segment of any branch crosses a
rank. The rows between a border and its multiple travel to the rank that now holds them,
each rank runs the single-device kernels on its new pieces as "local" does, and the results
travel back to the rows' owners. A row's whole output (every branch) is computed on one rank,
so nothing merges: forward and backward are a permutation of rows, the kernels, and the
inverse permutation. The backward moves its inputs again (q, k, v, out, lse, dO and the lse's
gradient) rather than keep the forward's: only the rows near a border travel.

A layout is a rank's pieces, (global start, length) in ascending order, its rows stored one
after the other; moving x from layout `src` to `dst` sends each peer the rows of mine that
lie in its `dst` pieces (ascending), and copies my own in place."""
from __future__ import annotations

import torch

from ...schedule import recut_pieces
from ..backward import backward_raw
from ..forward import forward_raw
from ..registry import twins_available
from .faults import transfer
from .heads import _dropout, _twin


def recut_targets(attn, sched: dict) -> list | None:
    """schedule.recut_pieces of the call's N and chunk order, kept in the schedule."""
    if "_recut" not in sched:
        sched["_recut"] = recut_pieces(attn.plan["ring"], sched["n"], sched["order"])
    return sched["_recut"]


def recut_refusal(attn, n: int, order: str, packed: bool) -> str | None:
    """Why the "recut" transport cannot run a call of this spec on n tokens (one line), or None."""
    if packed:
        return "packed rows (cu_seqlens) run on the ring's windows"
    if not twins_available():
        return "no dilgen.Kernel was made in this process to build the single-device kernels"
    if recut_pieces(attn.plan["ring"], n, order) is None:
        return (f"the segment lengths' least common multiple is not below N = {n}, so some "
                f"segment spans every rank")
    return None


def _local_rows(layout: list, start: int, length: int) -> list[tuple[int, int, int]]:
    """The (global start, local row, length) runs of [start, start + length) in a layout."""
    out, row = [], 0
    for s, ln in layout:
        a, b = max(s, start), min(s + ln, start + length)
        if b > a:
            out.append((a, row + a - s, b - a))
        row += ln
    return out


def _between(src: list, dst: list) -> list[tuple[int, int, int]]:
    """(local row in src, local row in dst, length) of the rows both layouts hold, ascending."""
    out = []
    for s, ln in dst:
        for g, src_row, m in _local_rows(src, s, ln):
            out.append((src_row, _local_rows(dst, g, m)[0][1], m))
    return out


def move(run, tensors: list, src: list, dst: list, dims: list) -> list:
    """Each of `tensors` (my rows in layout src[me] along its dim in `dims`) in layout dst[me]:
    one batch of point-to-point transfers for all of them (of one dtype), my own rows copied."""
    P, me = run.P, run.me
    rows = sum(ln for _, ln in dst[me])
    outs = []
    for x, d in zip(tensors, dims):
        shape = list(x.shape)
        shape[d] = rows
        outs.append(torch.empty(shape, dtype=x.dtype, device=x.device))
    sends, recvs, lands = [None] * P, [None] * P, []
    for peer in range(P):
        if peer == me:
            continue
        out_runs, in_runs = _between(src[me], dst[peer]), _between(src[peer], dst[me])
        if out_runs:
            sends[peer] = torch.cat([x.narrow(d, a, m).flatten() for x, d in zip(tensors, dims)
                                     for a, _, m in out_runs])
        if in_runs:
            recvs[peer] = torch.empty(sum(x.numel() // x.shape[d] * m for x, d in zip(tensors, dims)
                                          for _, _, m in in_runs), dtype=tensors[0].dtype, device=tensors[0].device)
            lands.append((recvs[peer], in_runs))
    for a, b, m in _between(src[me], dst[me]):
        for x, y, d in zip(tensors, outs, dims):
            y.narrow(d, b, m).copy_(x.narrow(d, a, m))
    _exchange(run, sends, recvs)      # one dtype per exchange: fp32 lse-likes move in their own
    for buf, in_runs in lands:
        at = 0
        for x, y, d in zip(tensors, outs, dims):
            for _, b, m in in_runs:
                part = y.narrow(d, b, m)
                part.copy_(buf[at:at + part.numel()].view(part.shape))
                at += part.numel()
    return outs


def _exchange(run, sends: list, recvs: list) -> None:
    """Post the transfers with the peers that have rows for me or take rows of mine (the
    others stay out of it) and wait for them."""
    dist, ops = run.dist, []
    for d in range(run.P):
        if sends[d] is not None:
            ops.append(dist.P2POp(dist.isend, sends[d], run.peer(d), run.group))
        if recvs[d] is not None:
            ops.append(dist.P2POp(dist.irecv, recvs[d], run.peer(d), run.group))
    for work in (transfer(dist.batch_isend_irecv, ops) if ops else []):
        transfer(work.wait)


def _pieces_of(run, tw, fn, tensors: list, dims: list, outs: list) -> None:
    """fn(views of my new pieces, dropout args at the piece's global start) per piece, its
    results copied into `outs` (without dropout: one call on all of them, whose borders are
    segment borders of every branch)."""
    if run.dropout_args is None:
        for dst, res in zip(outs, fn(tensors, ())):
            dst.copy_(res)
        return
    row = 0
    for start, ln in run.targets[run.me]:
        views = [None if t is None else t.narrow(d, row, ln) for t, d in zip(tensors, dims)]
        for dst, res in zip(outs, fn(views, _dropout(run, tw, start))):
            dst.narrow(2 if dst.dim() == 3 else 1, row, ln).copy_(res)
        row += ln


def recut_forward(run, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of my rows by the "recut" transport."""
    src, dst = run.pieces, run.targets
    tw = _twin(run, q.device)
    run.at = ("exchange", 0, 0)
    qt, kt, vt = move(run, [q, k, v], src, dst, [1, 1, 1])
    run.at = ("kernels", 0, 0)
    n_t = qt.shape[1]
    out_t = torch.empty_like(qt, memory_format=torch.contiguous_format)
    lse_t = torch.empty((run.B, run.H, n_t), dtype=torch.float32, device=q.device)
    _pieces_of(run, tw, lambda x, args: forward_raw(tw, *x, dropout=args), [qt, kt, vt], [1, 1, 1],
               [out_t, lse_t])
    run.at = ("return", 0, 0)
    (out,) = move(run, [out_t], dst, src, [1])
    (lse,) = move(run, [lse_t], dst, src, [2])
    return out, lse


def recut_backward(run, q, k, v, out, lse, grad_out, grad_lse):
    """(dq, dk, dv) of my rows by the "recut" transport."""
    src, dst = run.pieces, run.targets
    tw = _twin(run, q.device)
    run.at = ("exchange", 0, 0)
    qt, kt, vt, ot, gt = move(run, [q, k, v, out.to(q.dtype), grad_out.to(q.dtype)], src, dst, [1] * 5)
    stats = [lse.contiguous()] + ([] if grad_lse is None else [grad_lse.float().contiguous()])
    lse_t, *glse = move(run, stats, src, dst, [2] * len(stats))
    run.at = ("kernels", 0, 0)
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (qt, kt, vt)]
    _pieces_of(run, tw, lambda x, args: backward_raw(tw, *x, dropout=args),
               [qt, kt, vt, ot, lse_t, gt, glse[0] if glse else None], [1, 1, 1, 1, 2, 1, 2], grads)
    run.at = ("return", 0, 0)
    return tuple(move(run, grads, dst, src, [1, 1, 1]))
