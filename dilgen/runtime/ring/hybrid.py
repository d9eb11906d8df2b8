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

from ...schedule import ring_schedule
from ..backward import backward_raw
from ..forward import forward_raw
from ..registry import twin, twins_available


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


def hybrid_refusal(attn, sched: dict, packed: bool, dropout: bool) -> str | None:
    """Why the "hybrid" transport cannot run this call (one line), or None."""
    if packed:
        return "packed rows (cu_seqlens) run on the ring's windows"
    if dropout:
        return "attention dropout draws each branch's coins by its index among all the spec's branches"
    if not twins_available():
        return "no dilgen.Kernel was made in this process to build the single-device kernels"
    if hybrid_parts(attn, sched) is None:
        return ("it needs some branches whose segments lie inside the ranks' pieces and some that "
                "cross them")
    return None


def local_twin(run, device):
    """The single-device module of the spec's branches inside the pieces (their segment
    lengths, rates and Hilbert grids; the heads' offsets are the model's)."""
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
        hit = run._hybrid_twin = twin(run.attn, device, None, ring_size=1, name=name, **changes)
    return hit


def local_forward(run, q, k, v):
    """(out, lse) of the local branches on my rows."""
    return forward_raw(local_twin(run, q.device), q, k, v)


def add_local_grads(run, grads: tuple, q, k, v, out, lse, grad_out, grad_lse) -> None:
    """Add the local branches' dq, dk, dv on my rows, from the call's merged out and lse, to
    `grads` (the windows' fp32 accumulators)."""
    run.at = ("kernels", 0, 0)
    for acc, part in zip(grads, backward_raw(local_twin(run, q.device), q, k, v, out, lse, grad_out, grad_lse)):
        acc += part
