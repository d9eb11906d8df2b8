"""The ring's transports that run the single-device kernels (no ring windows):

- "local": every branch's segments lie inside one piece of a rank (schedule local_only
  covers every branch, no remote step): the rank's rows are a sequence of their own, so
  its single-device twin (ring_size 1) runs on them. No transfer, no copy.
- "heads" (DeepSpeed-Ulysses' idea, per spec): one all-to-all per tensor turns sequence
  shards into head shards, so rank p holds every position of heads [p H/P, (p+1) H/P)
  (kv heads [p H_kv/P, ...)), runs the twin with num_heads H/P and head_base p H/P
  (Spec.head_base: the heads keep their offsets) on the whole sequence, and a second
  all-to-all returns each rank its rows of out and lse. The backward exchanges q, k, v,
  out, dO (and lse) the same way and returns dq, dk, dv. Traffic per rank and call:
  (P-1)/P of its rows of each tensor moved, whatever the spec's segments; needs H and
  H_kv divisible by P.

Layout of a head-sharded tensor: (N, B, heads, D) in sequence order (so that each source
rank's piece lands in place, zigzag too); for B = 1 it is the kernels' (1, N, heads, D)."""
from __future__ import annotations

import torch

from ..backward import backward_raw
from ..forward import forward_raw
from ..registry import twin, twins_available
from .faults import transfer


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


def _twin(run, device):
    hit = run.__dict__.get("_twin_attn")
    if hit is None:
        spec = run.attn.spec
        # Hilbert scope "sequence": the ring's rows are curve positions, on which the
        # raster kernels run as one device runs them (the curve-ordered rows, no table)
        curve = {"hilbert": None} if run.attn.plan["ring"].get("curve") is not None else {}
        if run.transport == "local":
            hit = twin(run.attn, device, ring_size=1, **curve)
        else:
            hp, hkp = run.H // run.P, run.Hkv // run.P
            hit = twin(run.attn, device, ring_size=1, num_heads=hp, num_kv_heads=hkp,
                       head_base=spec.get("head_base", 0) + run.me * hp,
                       name=f"{spec['name']}_heads{run.me}of{run.P}"[:100], **curve)
        run._twin_attn = hit
    return hit


# -- sequence shards <-> head shards -------------------------------------------------------
def _swap(run, sends: list, recvs: list) -> None:
    """All-to-all as one batch of point-to-point transfers (NCCL and gloo alike): sends[d]
    goes to rank d, recvs[s] comes from rank s; my own part is a copy."""
    dist, ops = run.dist, []
    for d in range(run.P):
        if d == run.me:
            recvs[d].copy_(sends[d])
            continue
        ops.append(dist.P2POp(dist.isend, sends[d], run.peer(d), run.group))
        ops.append(dist.P2POp(dist.irecv, recvs[d], run.peer(d), run.group))
    for w in transfer(dist.batch_isend_irecv, ops):
        transfer(w.wait)


def _to_heads(run, x: torch.Tensor) -> torch.Tensor:
    """My rows (B, n_loc, heads, D) -> every row of my heads, (N, B, heads/P, D)."""
    P, B, D = run.P, x.shape[0], x.shape[3]
    hp = x.shape[2] // P
    out = torch.empty((run.N, B, hp, D), dtype=x.dtype, device=x.device)
    for i, (_, ln) in enumerate(run.pieces[run.me]):
        mine = run.piece(x, i).reshape(B, ln, P, hp, D).permute(2, 1, 0, 3, 4).contiguous()
        sends = list(mine.unbind(0))                               # to rank d: its heads
        _swap(run, sends, [out.narrow(0, *run.pieces[s][i]) for s in range(P)])
    return out


def _from_heads(run, y: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of _to_heads: (N, B, heads/P, D) of my heads -> my rows (B, n_loc, heads, D)."""
    P, B, D = run.P, y.shape[1], y.shape[3]
    hp = y.shape[2]
    out = torch.empty((B, run.n_loc, heads, D), dtype=y.dtype, device=y.device)
    for i, (_, ln) in enumerate(run.pieces[run.me]):
        recv = torch.empty((P, ln, B, hp, D), dtype=y.dtype, device=y.device)
        _swap(run, [y.narrow(0, *run.pieces[d][i]) for d in range(P)], list(recv.unbind(0)))
        run.piece(out, i).copy_(recv.permute(2, 1, 0, 3, 4).reshape(B, ln, heads, D))
    return out


def _lse_to_heads(run, lse: torch.Tensor) -> torch.Tensor:
    """(B, H, n_loc) of my rows -> (B, H/P, N) of my heads (the same all-to-all on rows)."""
    t = _to_heads(run, lse.permute(0, 2, 1).unsqueeze(-1))        # (N, B, H/P, 1)
    return t.squeeze(-1).permute(1, 2, 0)


def _lse_from_heads(run, lse_h: torch.Tensor) -> torch.Tensor:
    """(B, H/P, N) of my heads -> (B, H, n_loc) of my rows."""
    t = _from_heads(run, lse_h.permute(2, 0, 1).unsqueeze(-1).contiguous(), run.H)
    return t.squeeze(-1).permute(0, 2, 1)


def _bnhd(x: torch.Tensor) -> torch.Tensor:
    """(N, B, heads, D) -> the kernels' (B, N, heads, D) (a view for B = 1)."""
    return x.permute(1, 0, 2, 3) if x.shape[1] == 1 else x.permute(1, 0, 2, 3).contiguous()


def _nbhd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 0, 2, 3) if x.shape[0] == 1 else x.permute(1, 0, 2, 3).contiguous()


# -- the passes -----------------------------------------------------------------------------
def twin_forward(run, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of my rows by the "local" or "heads" transport."""
    attn = _twin(run, q.device)
    if run.transport == "local":
        return forward_raw(attn, q, k, v)
    run.at = ("exchange", 0, 0)
    qh, kh, vh = (_bnhd(_to_heads(run, x)) for x in (q, k, v))
    run.at = ("kernels", 0, 0)
    out_h, lse_h = forward_raw(attn, qh, kh, vh)
    run.at = ("return", 0, 0)
    return _from_heads(run, _nbhd(out_h), run.H), _lse_from_heads(run, lse_h)


def twin_backward(run, q, k, v, out, lse, grad_out, grad_lse):
    """(dq, dk, dv) of my rows by the "local" or "heads" transport."""
    attn = _twin(run, q.device)
    if run.transport == "local":
        return backward_raw(attn, q, k, v, out, lse, grad_out, grad_lse)
    run.at = ("exchange", 0, 0)
    qh, kh, vh, oh, gh = (_bnhd(_to_heads(run, x)) for x in (q, k, v, out, grad_out))
    lse_h = _lse_to_heads(run, lse)
    glse_h = None if grad_lse is None else _lse_to_heads(run, grad_lse)
    run.at = ("kernels", 0, 0)
    dq, dk, dv = backward_raw(attn, qh, kh, vh, oh, lse_h, gh, glse_h)
    run.at = ("return", 0, 0)
    return (_from_heads(run, _nbhd(dq), run.H), _from_heads(run, _nbhd(dk), run.Hkv),
            _from_heads(run, _nbhd(dv), run.Hkv))
