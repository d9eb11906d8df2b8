"""The ring's transports that run the single-device kernels (no ring windows):

- "local": every branch's segments lie inside one piece of a rank (schedule local_only
  covers every branch, no remote step): the rank's rows are a sequence of their own, so
  its single-device twin (ring_size 1) runs on them. No transfer, no copy.
- "heads" (DeepSpeed-Ulysses' idea, per spec): one all-to-all per tensor turns sequence
  shards into head shards, so rank p holds every position of heads [p H/P, (p+1) H/P)
  (kv heads [p H_kv/P, ...)), runs the twin with num_heads H/P and head_base p H/P
  (Spec.head_base: the heads keep their offsets) on the whole sequence, and a second
  all-to-all returns each rank its rows of out and lse. The backward runs on the head
  shards the forward kept (an eager call under autograd: they replace the saved q, k, v,
  out, lse, so the memory is the same) and exchanges only dO; a traced call's backward
  exchanges q, k, v, out, dO and lse again. It returns dq, dk, dv. Traffic per rank and
  call: (P-1)/P of its rows of each tensor moved, whatever the spec's segments; needs H
  and H_kv divisible by P.

Layout of a head-sharded tensor: (N, B, heads, D) in sequence order (so that each source
rank's piece lands in place, zigzag too); for B = 1 it is the kernels' (1, N, heads, D)."""
from __future__ import annotations

import torch

from ..backward import backward_raw
from ..forward import forward_raw
from ..registry import twin, twins_available
from .faults import post_transfers, transfer


def heads_refusal(attn, P: int, packed: bool) -> str | None:
    """Why the head-parallel transport cannot run a call of this spec (one line), or None."""
    H, Hkv = attn.spec["num_heads"], attn.spec["num_kv_heads"]
    if packed:
        return "packed rows (cu_seqlens) run on the ring's windows"
    if H % P or Hkv % P:
        return (f"num_heads = {H} and num_kv_heads = {Hkv} must both be divisible by the ring "
                f"size {P} (each rank takes H/P query heads with their kv heads)")
    if not twins_available():
        return "no dilgen.Kernel was made in this process to build the single-device kernels"
    return None


def local_possible(attn, sched: dict, packed: bool) -> bool:
    """Every branch stays inside the pieces (no remote step)."""
    return (not packed and len(sched["steps"]) == 1
            and len(sched["local_only"]) == len(attn.plan["branches"]) and twins_available())


# the head-parallel call runs in up to MAX_CHUNKS chunks of its heads, so that the
# all-to-all of chunk c + 1 (and the return of chunk c - 1) overlaps chunk c's kernels
MAX_CHUNKS = 4


def chunks_for(kv_heads_per_rank: int) -> int:
    """Chunks of a rank's heads (each a whole number of kv heads), at most MAX_CHUNKS."""
    return max(c for c in range(1, MAX_CHUNKS + 1) if kv_heads_per_rank % c == 0)


def chunks_of(run) -> int:
    return chunks_for(run.Hkv // run.P)


def _twin(run, device, chunk: int = 0, chunks: int = 1):
    """The single-device module of the call: the spec itself (local), or heads
    [p H/P + chunk H/(P C), ...) of the model (Spec.head_base) on the whole sequence."""
    cache = run.__dict__.setdefault("_twin_attn", {})
    hit = cache.get((chunk, chunks))
    if hit is None:
        spec = run.attn.spec
        # Hilbert scope "sequence": the ring's rows are curve positions, on which the
        # raster kernels run as one device runs them (the curve-ordered rows, no table)
        curve = {"hilbert": None} if run.attn.plan["ring"].get("curve") is not None else {}
        tuning = {"dropout": True} if run.dropout_args is not None else None   # dropout's plan
        if run.transport in ("local", "recut"):
            hit = twin(run.attn, device, tuning, ring_size=1, **curve)
        else:
            hc, hkc = run.H // run.P // chunks, run.Hkv // run.P // chunks
            base = spec.get("head_base", 0) + run.me * (run.H // run.P) + chunk * hc
            hit = twin(run.attn, device, tuning, ring_size=1, num_heads=hc, num_kv_heads=hkc, head_base=base,
                       name=f"{spec['name']}_heads{base}to{base + hc}"[:100], **curve)
        cache[(chunk, chunks)] = hit
    return hit


# -- sequence shards <-> head shards -------------------------------------------------------
# A rank's heads are P blocks of H/P (block d goes to rank d), each cut in C chunks; chunk c
# of every block travels in one exchange. Head-sharded rows are (N, B, heads, X) in
# sequence order, so that each source rank's piece lands in place (zigzag pieces too).
class _Posted:
    """Point-to-point transfers of one exchange with every other rank, posted
    (batch_isend_irecv); wait() makes the current stream wait for them (NCCL) or returns once
    they are done (gloo). A rank's own block never travels: the callers copy it in place."""

    def __init__(self, run, sends: list, recvs: list, keep=()):
        dist, ops = run.dist, []
        for d in range(run.P):
            if d == run.me:
                continue
            ops.append(dist.P2POp(dist.isend, sends[d], run.peer(d), run.group))
            ops.append(dist.P2POp(dist.irecv, recvs[d], run.peer(d), run.group))
        self.works = post_transfers(dist, ops)
        self.keep = (sends, recvs, keep)

    def wait(self):
        for w in self.works:
            transfer(w.wait)
        self.works = []


def _blocks(x: torch.Tensor, P: int, C: int, c: int) -> torch.Tensor:
    """(B, n, heads, X) -> chunk c of every rank's block of heads, (B, n, P, heads/(P C), X)."""
    B, n, h, X = x.shape
    return x.reshape(B, n, P, C, h // (P * C), X)[:, :, :, c]


def _post_to_heads(run, x: torch.Tensor, C: int, c: int):
    """Post the exchange of chunk c of x (B, n_loc, heads, X): returns (the head-sharded
    rows (N, B, heads/(P C), X) once waited, the posted transfers)."""
    P, B, X = run.P, x.shape[0], x.shape[3]
    hc = x.shape[2] // (P * C)
    out = torch.empty((run.N, B, hc, X), dtype=x.dtype, device=x.device)
    posted = []
    for i, (_, ln) in enumerate(run.pieces[run.me]):
        blocks = _blocks(run.piece(x, i), P, C, c)              # (B, ln, P, hc, X), a view
        lands = [out.narrow(0, *run.pieces[s][i]) for s in range(P)]
        # the other ranks' blocks packed for the wire (ln, B, hc, X); mine straight into place
        sends = [None if d == run.me else blocks[:, :, d].transpose(0, 1).contiguous() for d in range(P)]
        lands[run.me].copy_(blocks[:, :, run.me].transpose(0, 1))
        posted.append(_Posted(run, sends, lands, sends))
    return out, posted


def _post_from_heads(run, y: torch.Tensor, dst: torch.Tensor, C: int, c: int):
    """Post the return of y (N, B, hc, X), chunk c of my heads, into dst (B, n_loc, heads, X);
    returns the work whose finish() copies the received rows into place."""
    P, me = run.P, run.me
    posted, landed = [], []
    for i, (_, ln) in enumerate(run.pieces[me]):
        recv = torch.empty((P, ln, *y.shape[1:]), dtype=y.dtype, device=y.device)
        posted.append(_Posted(run, [y.narrow(0, *run.pieces[d][i]) for d in range(P)], list(recv.unbind(0)), y))
        # my own heads' rows of my piece: straight into place, no transfer
        _blocks(run.piece(dst, i), P, C, c)[:, :, me].copy_(y.narrow(0, *run.pieces[me][i]).transpose(0, 1))
        landed.append((i, recv))

    def finish():
        for p in posted:
            p.wait()
        for i, recv in landed:       # (ln, B, hc, X) from rank d -> my rows of chunk c of its block
            blocks = _blocks(run.piece(dst, i), P, C, c)
            for d in range(P):
                if d != me:
                    blocks[:, :, d].copy_(recv[d].transpose(0, 1))
    return finish


def stand_in(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's shape, dtype and device that holds head_dim elements (every row reads
    the same ones): what the backward's agreement and allocations read of a q, k or v whose
    head shards were kept."""
    return torch.empty(t.shape[-1], dtype=t.dtype, device=t.device).as_strided(t.shape, (0,) * (t.dim() - 1) + (1,))


def _wait_all(posted) -> None:
    for p in posted:
        p.wait()


def _bnhd(x: torch.Tensor) -> torch.Tensor:
    """(N, B, heads, D) -> the kernels' (B, N, heads, D) (a view for B = 1)."""
    return x.permute(1, 0, 2, 3) if x.shape[1] == 1 else x.permute(1, 0, 2, 3).contiguous()


def _nbhd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 0, 2, 3) if x.shape[0] == 1 else x.permute(1, 0, 2, 3).contiguous()


def _rows(lse: torch.Tensor) -> torch.Tensor:
    """lse-like (B, heads, n) -> (B, n, heads, 1), the layout the exchanges take."""
    return lse.permute(0, 2, 1).unsqueeze(-1)


def _pipeline(run, inputs, compute, outputs):
    """Chunk by chunk: post chunk c + 1's exchange, wait chunk c's, run its kernels
    (compute(c, head-sharded inputs) -> head-sharded results) and post their return into
    `outputs` (local tensors, (B, n_loc, heads, X) views). Every return is waited at the end."""
    C = chunks_of(run)
    run.at = ("exchange", 0, 0)
    post = lambda c: [_post_to_heads(run, x, C, c) for x in inputs]  # noqa: E731
    pending, finishes = post(0), []
    for c in range(C):
        nxt = post(c + 1) if c + 1 < C else None
        for _, posted in pending:
            _wait_all(posted)
        run.at = ("kernels", c, 0)
        results = compute(c, C, [t for t, _ in pending])
        run.at = ("return", c, 0)
        finishes += [_post_from_heads(run, y, dst, C, c) for y, dst in zip(results, outputs)]
        pending = nxt
    for finish in finishes:
        finish()


# -- the passes -----------------------------------------------------------------------------
def _dropout(run, tw, pos0: int = 0) -> tuple:
    """The kernels' dropout arguments for twin `tw` on rows whose row 0 is position pos0 of
    the whole sequence: the coins of the model's heads at global positions
    (common.dropout_rows), so every transport draws one device's mask. () without dropout."""
    return run.drop_args(pos0, tw.spec.get("head_base", 0))


def _local_pieces(run, args_at, fn, tensors, outs) -> None:
    """Under dropout, "local" (and hybrid's local branches) run each of my pieces alone at its
    global offset: fn(piece views, args_at(the piece's start): its dropout args) -> results
    written into `outs` (views on dim 1, lse-like on 2)."""
    for i, (start, ln) in enumerate(run.pieces[run.me]):
        r0 = run.rows0[i]
        views = [None if t is None else t.narrow(2 if t.dim() == 3 else 1, r0, ln) for t in tensors]
        for dst, res in zip(outs, fn(views, args_at(start))):
            dst.narrow(2 if dst.dim() == 3 else 1, r0, ln).copy_(res)


def twin_forward(run, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of my rows by the "local" or "heads" transport."""
    if run.transport == "local":
        tw = _twin(run, q.device)
        if run.dropout_args is None:
            return forward_raw(tw, q, k, v)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((run.B, run.H, run.n_loc), dtype=torch.float32, device=q.device)
        _local_pieces(run, lambda start: _dropout(run, tw, start), lambda x, args: forward_raw(tw, *x, dropout=args),
                      (q, k, v), (out, lse))
        return out, lse
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((run.B, run.H, run.n_loc), dtype=torch.float32, device=q.device)
    lse_rows = torch.empty((run.B, run.n_loc, run.H, 1), dtype=torch.float32, device=q.device)

    kept = [None] * chunks_of(run) if run.keep_heads else None

    def compute(c, C, got):
        qkv_h = [_bnhd(t) for t in got]
        tw = _twin(run, q.device, c, C)
        out_h, lse_h = forward_raw(tw, *qkv_h, dropout=_dropout(run, tw))
        if kept is not None:
            kept[c] = (*qkv_h, out_h, lse_h)
        return _nbhd(out_h), lse_h.permute(2, 0, 1).unsqueeze(-1).contiguous()
    _pipeline(run, (q, k, v), compute, (out, lse_rows))
    run.kept = kept
    lse.copy_(lse_rows.squeeze(-1).permute(0, 2, 1))
    return out, lse


def twin_backward(run, q, k, v, out, lse, grad_out, grad_lse):
    """(dq, dk, dv) of my rows by the "local" or "heads" transport. With the forward's head
    shards kept (run.kept), only dO (and the lse's gradient) travel to the heads; q, k, v
    then need only their shape, dtype and device (stand_in), out and lse are not read."""
    if run.transport == "local":
        tw = _twin(run, q.device)
        if run.dropout_args is None:
            return backward_raw(tw, q, k, v, out, lse, grad_out, grad_lse)
        grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
        _local_pieces(run, lambda start: _dropout(run, tw, start), lambda x, args: backward_raw(tw, *x, dropout=args),
                      (q, k, v, out, lse, grad_out, grad_lse), grads)
        return tuple(grads)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    kept = run.kept
    inputs = ((grad_out,) if kept else (q, k, v, out, grad_out, _rows(lse))) + \
        (() if grad_lse is None else (_rows(grad_lse),))

    def compute(c, C, got):
        if kept:
            (qh, kh, vh, oh, lse_h), got = kept[c], [None] * 4 + got[:1] + [None] + got[1:]
        else:
            qh, kh, vh, oh = (_bnhd(t) for t in got[:4])
            lse_h = got[5].squeeze(-1).permute(1, 2, 0)
        gh = _bnhd(got[4])
        glse_h = got[6].squeeze(-1).permute(1, 2, 0) if len(got) > 6 else None
        tw = _twin(run, q.device, c, C)
        grads = backward_raw(tw, qh, kh, vh, oh, lse_h, gh, glse_h, dropout=_dropout(run, tw))
        return [_nbhd(g.to(t.dtype)) for g, t in zip(grads, (q, k, v))]
    _pipeline(run, inputs, compute, (dq, dk, dv))
    return dq, dk, dv
