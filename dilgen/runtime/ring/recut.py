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

import math

import torch

from ...schedule import recut_pieces
from ..backward import backward_raw
from ..forward import forward_raw
from ..registry import twins_available
from .faults import post_transfers, transfer
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


def move(run, tensors: list, src: list, dst: list, dims: list, into: list | None = None) -> list:
    """Each of `tensors` (my rows in layout src[me] along its dim in `dims`) in layout dst[me]
    (new tensors, or `into`, whose rows outside src's pieces are left as they are): post, then
    arrive."""
    return arrive(run, post(run, tensors, src, dst, dims, into))


def post(run, tensors: list, src: list, dst: list, dims: list, into: list | None = None) -> tuple:
    """move's first half: my own rows copied, and one batch of point-to-point transfers posted
    for all of the tensors, whatever their dtypes (the rows for one peer travel as the bytes of
    one buffer, pack). Returns what `arrive` waits for; in between, the device is free for
    work that needs none of the moved rows (the transfers run on their own stream)."""
    P, me = run.P, run.me
    rows = sum(ln for _, ln in dst[me])
    outs = into or [torch.empty(x.shape[:d] + (rows,) + x.shape[d + 1:], dtype=x.dtype, device=x.device)
                    for x, d in zip(tensors, dims)]
    sends, recvs, lands = [None] * P, [None] * P, []
    for peer in range(P):
        if peer == me:
            continue
        out_runs, in_runs = _between(src[me], dst[peer]), _between(src[peer], dst[me])
        if out_runs:
            sends[peer] = pack(tensors, dims, [(a, m) for a, _, m in out_runs])
        if in_runs:
            recvs[peer] = torch.empty(packed_bytes(tensors, dims, sum(m for _, _, m in in_runs)),
                                      dtype=torch.uint8, device=tensors[0].device)
            lands.append((recvs[peer], [(b, m) for _, b, m in in_runs]))
    for a, b, m in _between(src[me], dst[me]):
        for x, y, d in zip(tensors, outs, dims):
            y.narrow(d, b, m).copy_(x.narrow(d, a, m))
    return outs, dims, lands, sends, _post(run, sends, recvs)


def arrive(run, posted: tuple) -> list:
    """move's second half: wait for the transfers `post` posted and land their rows."""
    outs, dims, lands, _sends, works = posted       # the send buffers live until the wait
    for work in works:
        transfer(work.wait)
    for buf, in_runs in lands:
        unpack(buf, outs, dims, in_runs)
    return outs


def _wide_first(tensors: list) -> list[int]:
    """The order of tensors in a packed buffer: wider elements first, so that each part starts
    at a multiple of its element size (a float32 part after bfloat16 ones might not)."""
    return sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())


def packed_bytes(tensors: list, dims: list, rows: int) -> int:
    """Bytes of `rows` rows of every tensor (rows along its dim in `dims`)."""
    return sum(rows * math.prod(x.shape[:d] + x.shape[d + 1:]) * x.element_size() for x, d in zip(tensors, dims))


def pack(tensors: list, dims: list, runs: list[tuple[int, int]]) -> torch.Tensor:
    """The rows (start, length) of `runs` of every tensor, one uint8 buffer: tensor by tensor
    (_wide_first), each tensor's runs in order, each run's rows in the tensor's order."""
    return torch.cat([tensors[i].narrow(dims[i], a, m).contiguous().view(torch.uint8).flatten()
                      for i in _wide_first(tensors) for a, m in runs])


def unpack(buf: torch.Tensor, outs: list, dims: list, runs: list[tuple[int, int]]) -> None:
    """pack's inverse: the buffer's rows written into `outs` at the (start, length) of runs."""
    at = 0
    for i in _wide_first(outs):
        for b, m in runs:
            part = outs[i].narrow(dims[i], b, m)
            size = part.numel() * part.element_size()
            part.copy_(buf[at:at + size].view(part.dtype).view(part.shape))
            at += size


def _post(run, sends: list, recvs: list) -> list:
    """Post the transfers with the peers that have rows for me or take rows of mine (the
    others stay out of it); their works, to wait for."""
    dist, ops = run.dist, []
    for d in range(run.P):
        if sends[d] is not None:
            ops.append(dist.P2POp(dist.isend, sends[d], run.peer(d), run.group))
        if recvs[d] is not None:
            ops.append(dist.P2POp(dist.irecv, recvs[d], run.peer(d), run.group))
    return post_transfers(dist, ops)


def split(targets: list, pieces: list, L: int) -> tuple[list, list]:
    """Each rank's targets cut at multiples of L into (copied, viewed) layouts: a run of whole
    blocks of L (the last may end at N) that lies inside one of the rank's own pieces runs on a
    view of its rows (no copy, no transfer); the blocks that take rows of another rank are
    assembled by `move`. Both are layouts of every rank (each rank computes all of them)."""
    copied, viewed = [], []
    for mine, own in zip(targets, pieces):
        own = _merged(own)
        c, v = [], []
        for start, ln in mine:                    # start: a multiple of L (recut_pieces)
            for a in range(start, start + ln, L):
                b = min(a + L, start + ln)
                side = v if _one_piece(own, a, b) else c
                if side and side[-1][0] + side[-1][1] == a and (side is c or _one_piece(own, side[-1][0], b)):
                    side[-1] = (side[-1][0], b - side[-1][0])
                else:
                    side.append((a, b - a))
        copied.append(c)
        viewed.append(v)
    return copied, viewed


def _merged(pieces: list) -> list:
    """A rank's pieces with neighbours that are adjacent in the sequence joined (they are in
    its rows too: a rank's pieces are stored in ascending order)."""
    out = []
    for s, ln in pieces:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + ln)
        else:
            out.append((s, ln))
    return out


def _one_piece(own: list, a: int, b: int) -> bool:
    return any(s <= a and b <= s + m for s, m in own)


def _layouts(run) -> tuple[list, list]:
    """split() of this call's recut targets, kept in the schedule."""
    if "_recut_split" not in run.sched:
        L = 1
        for br in run.attn.plan["ring"]["branches"]:
            L = math.lcm(L, br["w"])
        run.sched["_recut_split"] = split(run.targets, run.pieces, L)
    return run.sched["_recut_split"]


def _runs(run, copied: list, viewed: list) -> list[tuple[str, int, int, int]]:
    """My kernel calls: (kind, global start, row in the copied tensors or in my rows, length),
    ascending; without dropout the copied pieces run as one call (their borders are
    segment borders of every branch, and the one ending at N comes last)."""
    out, row = [], 0
    for start, ln in copied:
        if run.dropout_args is not None or not out:
            out.append(("copy", start, row, ln))
        else:
            out[-1] = ("copy", out[-1][1], out[-1][2], out[-1][3] + ln)
        row += ln
    for start, ln in viewed:
        local = _local_rows(run.pieces[run.me], start, ln)[0][1]     # contiguous in my rows (split)
        out.append(("view", start, local, ln))
    return out


def _each(run, tw, fn, kind: str, rows: list, dims: list, results: list) -> None:
    """fn(views of one call's rows, dropout args at its global start) for each of _runs of
    `kind`: "view" reads my rows and writes my rows of `results`, "copy" reads the copied
    tensors and writes theirs."""
    copied, viewed = _layouts(run)
    for kind_, start, row, ln in _runs(run, copied[run.me], viewed[run.me]):
        if kind_ != kind:
            continue
        views = [None if t is None else t.narrow(d, row, ln) for t, d in zip(rows, dims)]
        for out, res in zip(results, fn(views, _dropout(run, tw, start) if run.dropout_args is not None else ())):
            out.narrow(2 if out.dim() == 3 else 1, row, ln).copy_(res)


def recut_forward(run, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of my rows by the "recut" transport: the blocks of my own rows run while the
    rows of the assembled blocks travel."""
    copied, _ = _layouts(run)
    tw = _twin(run, q.device)
    fwd = lambda x, args: forward_raw(tw, *x, dropout=args)  # noqa: E731
    run.at = ("exchange", 0, 0)
    posted = post(run, [q, k, v], run.pieces, copied, [1, 1, 1])
    run.at = ("kernels", 0, 0)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((run.B, run.H, run.n_loc), dtype=torch.float32, device=q.device)
    _each(run, tw, fwd, "view", [q, k, v], [1, 1, 1], [out, lse])
    run.at = ("exchange", 0, 0)
    qc, kc, vc = arrive(run, posted)
    run.at = ("kernels", 0, 0)
    out_c = torch.empty_like(qc, memory_format=torch.contiguous_format)
    lse_c = torch.empty((run.B, run.H, qc.shape[1]), dtype=torch.float32, device=q.device)
    _each(run, tw, fwd, "copy", [qc, kc, vc], [1, 1, 1], [out_c, lse_c])
    run.at = ("return", 0, 0)
    move(run, [out_c, lse_c], copied, run.pieces, [1, 2], into=[out, lse])
    return out, lse


def recut_backward(run, q, k, v, out, lse, grad_out, grad_lse):
    """(dq, dk, dv) of my rows by the "recut" transport, ordered as the forward."""
    copied, _ = _layouts(run)
    tw = _twin(run, q.device)
    bwd = lambda x, args: backward_raw(tw, *x, dropout=args)  # noqa: E731
    # the kernels' argument order: q, k, v, out, lse, dO, the lse's gradient
    pick = lambda t, s: t[:3] + [t[3], s[0], t[4], s[1] if len(s) > 1 else None]  # noqa: E731
    dims = [1, 1, 1, 1, 2, 1, 2]
    run.at = ("exchange", 0, 0)
    out, grad_out = out.to(q.dtype), grad_out.to(q.dtype)
    mine = [q, k, v, out, grad_out]
    stats = [lse] + ([] if grad_lse is None else [grad_lse.float()])
    posted = post(run, mine + stats, run.pieces, copied, [1] * 5 + [2] * len(stats))
    run.at = ("kernels", 0, 0)
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    _each(run, tw, bwd, "view", pick(mine, stats), dims, grads)
    run.at = ("exchange", 0, 0)
    moved = arrive(run, posted)
    run.at = ("kernels", 0, 0)
    grads_c = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in moved[:3]]
    _each(run, tw, bwd, "copy", pick(moved[:5], moved[5:]), dims, grads_c)
    run.at = ("return", 0, 0)
    move(run, grads_c, copied, run.pieces, [1, 1, 1], into=grads)
    return tuple(grads)
