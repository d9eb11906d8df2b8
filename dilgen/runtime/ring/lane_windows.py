"""A remote window of one dilated branch as dense attention on its lanes (opt-in:
DILGEN_RING_LANE_WINDOWS=1; on 2 x H200 it moved the user specs by no more than two runs differ).

In a segment of branch (w, r), query head h keeps the rows ≡ h (mod r) of the segment and
attends the keys of the same rows (LongNet's offsets, o = h mod r, one kv head per query
head). The ring sends a remote key piece compacted with stride g = r (run._compact: kv head h
keeps its rows h mod r), so where a window's query and key pieces both lie in one segment of
that branch, r-aligned, the window is, head by head, dense attention between the compacted
query rows and the compacted keys: the single-device kernels of a one-segment spec (r = 1)
on (n/r) rows compute it, at the rate of one GPU's dense kernels. Its (out, lse) merges into
the window accumulator like any partial key set (LongNet Eq. 10):
lse = log(e^lse_a + e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
The backward runs the same twin on the compacted rows with the call's final out and lse
(the softmax over every branch's keys): dQ adds into my rows, dK, dV are the compacted
partials the ring sends home."""
from __future__ import annotations

import torch

from ..backward import backward_raw
from ..forward import forward_raw
from ..registry import twin
from .run import _compact

#: windows run as lanes in this process, by pass (the tests read it)
RAN = {"forward": 0, "backward": 0}


def lane_window(run, step, bits: int, q_off: int, n_q: int, k_off: int, n_k: int, g: int, device):
    """(twin, r, row index) where this remote window runs as lanes (the module docstring),
    else None (the fused window kernel runs it)."""
    spec = run.attn.spec
    if (not getattr(run, "lane_windows", False) or not step["offset"] or run.packed
            or run.dropout_args is not None or spec["causal"] or spec["num_heads"] != spec["num_kv_heads"]
            or spec.get("head_offsets", "mod") != "mod" or spec.get("head_base", 0) or spec.get("hilbert")
            or bits & (bits - 1)):
        return None
    br = next(b for b in run.attn.plan["branches"] if bits >> b["index"] & 1)
    r, w = br["r"], min(br["w"], run.N)
    start = q_off // w * w
    if (r == 1 or g != r or n_q != n_k or n_q % r or w % r or start + w > run.N
            or not (start <= q_off and q_off + n_q <= start + w and start <= k_off and k_off + n_k <= start + w)
            or (q_off - start) % r or (k_off - start) % r):
        return None
    n_c, H = n_q // r, spec["num_heads"]
    tw = twin(run.attn, device, None, ring_size=1, segment_lengths=[n_c], dilation_rates=[1],
              name=f"{spec['name']}_lanes{n_c}"[:100])
    if tw is None:
        return None
    key = ("lane rows", n_c, r, H, str(device))
    rows = run.attn._device_tensors.get(key)
    if rows is None:       # row r t + (h mod r) of the piece: head h's t-th lane row
        heads = torch.arange(H, device=device)
        t = torch.arange(n_c, device=device)
        rows = run.attn._keep(key, (r * t[:, None] + heads[None, :] % r).contiguous())
    return tw, r, rows


def _indices(rows: torch.Tensor, B: int, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gather/scatter indices of each head's lane rows: into (B, n, H, D) along the rows, and
    into (B, H, n) along the last dim."""
    return rows[None, :, :, None].expand(B, -1, H, D), rows.t()[None].expand(B, -1, -1)


def lane_forward(found, qv, kk, vv, acc_v, lse_v) -> None:
    """Merge the window's dense lane attention into my piece's fp32 accumulator and lse."""
    tw, r, rows = found
    RAN["forward"] += 1
    out_c, lse_c = forward_raw(tw, _compact(qv, r), kk, vv)
    idx, lidx = _indices(rows, *acc_v.shape[:1], *acc_v.shape[2:])
    a, la = acc_v.gather(1, idx), lse_v.gather(2, lidx)
    top = torch.maximum(la, lse_c)
    new = top + torch.log(torch.exp(la - top) + torch.exp(lse_c - top))
    wa, wb = (torch.exp(x - new).transpose(1, 2)[..., None] for x in (la, lse_c))
    acc_v.scatter_(1, idx, a * wa + out_c.float() * wb)
    lse_v.scatter_(2, lidx, new)


def lane_backward(found, qv, kk, vv, ov, lse_v, dov, dlse_v, dqv, dkk, dvv) -> None:
    """dQ of my lane rows (into my fp32 dq piece) and the compacted partial dK, dV."""
    tw, r, rows = found
    RAN["backward"] += 1
    q_c, o_c, do_c = (_compact(x, r) for x in (qv, ov, dov))
    idx, lidx = _indices(rows, *dqv.shape[:1], *dqv.shape[2:])
    dlse = None if dlse_v is None else dlse_v.gather(2, lidx)
    dq_c, dk_c, dv_c = backward_raw(tw, q_c, kk, vv, o_c, lse_v.gather(2, lidx), do_c, dlse)
    dqv.scatter_add_(1, idx, dq_c.float())
    dkk += dk_c.float()
    dvv += dv_c.float()
