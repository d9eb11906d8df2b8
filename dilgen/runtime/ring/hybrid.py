"""The ring's "hybrid" transport: the branches whose segments all lie inside a rank's pieces
(schedule local_only) run in the single-device kernels on the rank's rows, as "local" runs a
whole spec; the others run in the ring's windows, over a schedule of those branches alone
(their keys travel, the local branches' never do).

The two parts merge as the windows merge among themselves (LongNet Eq. 10 over key sets:
lse = log(e^lse_a + e^lse_b), out = (e^lse_a out_a + e^lse_b out_b) / e^lse): the local
part's (out, lse) is the fp32 accumulator the windows start from, so the last window writes
the call's output. The backward of each part reads the merged out and lse (a softmax over the
union of the key sets: P = e^(s - lse) for every branch), so the single-device backward's
dq, dk, dv of the local branches add to the windows' of the others."""
from __future__ import annotations

import torch

from ...schedule import ring_schedule
from ..backward import backward_raw
from ..forward import forward_raw
from ..registry import twin, twins_available
from .heads import _local_pieces


def split_ring(ring: dict, local: list[int]) -> tuple[dict, dict]:
    """(ring IR of the branches in `local`, of the others), branch indices kept."""
    mine = [br for br in ring["branches"] if br["index"] in local]
    rest = [br for br in ring["branches"] if br["index"] not in local]
    return dict(ring, branches=mine), dict(ring, branches=rest)


def hybrid_parts(attn, sched: dict) -> tuple[dict, dict, dict] | None:
    """(local branches' ring IR, the others', the others' schedule) of a call over `sched`, or
    None where hybrid has nothing to split (no branch, or every branch, inside the pieces);
    kept in the schedule."""
    if "_hybrid" not in sched:
        local = sched["local_only"]
        if not local or len(local) == len(attn.plan["branches"]) or sched.get("packed"):
            sched["_hybrid"] = None
        else:
            ring_l, ring_r = split_ring(attn.plan["ring"], local)
            sched["_hybrid"] = (ring_l, ring_r, ring_schedule(ring_r, sched["n"], sched["order"]))
    return sched["_hybrid"]


def hybrid_refusal(attn, sched: dict, packed: bool) -> str | None:
    """Why the "hybrid" transport cannot run this call (one line), or None."""
    if packed:
        return "packed rows (cu_seqlens) run on the ring's windows"
    if not twins_available():
        return "no dilgen.Kernel was made in this process to build the single-device kernels"
    if hybrid_parts(attn, sched) is None:
        return ("it needs some branches whose segments lie inside the ranks' pieces and some that "
                "cross them")
    return None


def local_twin(run, device):
    """The single-device module of the spec's branches inside the pieces (their segment
    lengths, rates and Hilbert grids; the heads' offsets are the model's); with dropout, its
    dropout plan."""
    hit = run.__dict__.get("_hybrid_twin")
    if hit is None:
        spec, keep = run.attn.spec, run.local_branches
        changes = {"segment_lengths": [spec["segment_lengths"][i] for i in keep],
                   "dilation_rates": [spec["dilation_rates"][i] for i in keep]}
        hil = spec.get("hilbert")
        if run.attn.plan["ring"].get("curve") is not None:
            changes["hilbert"] = None       # scope "sequence": raster kernels on curve-ordered rows
        elif hil is not None and hil.get("grids") is not None:
            changes["hilbert"] = dict(hil, grids=[hil["grids"][i] for i in keep])
        name = f"{spec['name']}_branches{'_'.join(map(str, keep))}"[:100]
        tuning = {"dropout": True} if run.dropout_args is not None else None
        hit = run._hybrid_twin = twin(run.attn, device, tuning, ring_size=1, name=name, **changes)
    return hit


def _pieces(run, fn, tensors: list, outs: list) -> None:
    """fn(tensors, dropout args) on my rows, results copied into `outs`; with dropout, per piece
    at its global start (heads._local_pieces), each local branch drawing the coins of its index
    among all the spec's branches (the streams' columns of the local branches)."""
    if run.dropout_args is None:
        for dst, res in zip(outs, fn(tensors, ())):
            dst.copy_(res)
        return

    def args_at(start: int) -> tuple:
        *args, streams = run.drop_args(start, 0)
        return (*args, streams[:, run.local_branches].contiguous())
    _local_pieces(run, args_at, fn, tensors, outs)


def local_forward(run, q, k, v, acc, lse) -> None:
    """The local branches' (out, lse) on my rows, into `acc` (fp32) and `lse`: the partial the
    windows start from."""
    tw = local_twin(run, q.device)
    _pieces(run, lambda x, args: forward_raw(tw, *x, dropout=args), [q, k, v], [acc, lse])


def add_local_grads(run, grads: tuple, q, k, v, out, lse, grad_out, grad_lse) -> None:
    """Add the local branches' dq, dk, dv on my rows, from the call's merged out and lse, to
    `grads` (the windows' fp32 accumulators)."""
    run.at = ("kernels", 0, 0)
    tw = local_twin(run, q.device)
    step, tensors = (lambda x, args: backward_raw(tw, *x, dropout=args)), [q, k, v, out, lse, grad_out, grad_lse]
    if run.dropout_args is None:    # each gradient added as it lands (no float32 copy of it first)
        parts = step(tensors, ())
    else:                           # per piece, at its global offset
        parts = [torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in grads]
        _pieces(run, step, tensors, parts)
    for acc, part in zip(grads, parts):
        acc += part
