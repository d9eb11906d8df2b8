"""Attention dropout on the ring: which transport draws the coins (the single-device kernels
of the spec's dropout plan, on a rank's pieces or its heads), and what a rank proposes to the
agreement (the drop threshold, compared; a seed from torch's generator, of which every rank
takes rank 0's). runtime/dropout_call.py is the single-device door; dilgen/dropout.py the coin."""
from __future__ import annotations

from ...dropout import threshold
from ..checks import InputError
from ..dropout_call import draw_seed, valid_p
from .heads import heads_refusal, local_possible


def dropout_transport(attn, sched: dict, P: int, packed: bool, forced: str) -> str:
    """The transport of a ring call (schedule `sched`) with attention dropout: "local" where
    every branch stays inside a rank, else "heads"; one InputError where neither runs it (the
    ring's windows draw no coins yet) or DILGEN_RING_TRANSPORT (`forced`) names another."""
    name = attn.spec["name"]
    if packed or attn.plan["ring"].get("curve") is not None:
        raise InputError(f"{name}: attention dropout on a ring takes fixed-length rows in raster or "
                         f"Hilbert-segment order (not packed rows, not Hilbert scope \"sequence\") yet; "
                         f"pass dropout_p=0.0")
    if forced in ("ring", "allgather"):
        raise InputError(f"{name}: DILGEN_RING_TRANSPORT={forced} draws no dropout coins (its window kernels "
                         f"take no dropout yet); unset it, or set heads")
    if forced != "heads" and local_possible(attn, sched, False):
        return "local"
    refusal = heads_refusal(attn, P, False)
    if refusal is not None:
        raise InputError(f"{name}: attention dropout on a ring runs where every segment lies inside a rank "
                         f"or by the head-parallel transport, and here neither does ({refusal}); pass "
                         f"dropout_p=0.0")
    return "heads"


def dropout_proposal(p, agreed) -> tuple[int, int]:
    """(the call's drop threshold, compared by the agreement; this rank's seed proposal from
    torch's generator, or the agreed seed again for a backward). A bad p proposes (0, 0) and
    is refused by the agreement's local check, on every rank together."""
    if not valid_p(p):
        return 0, 0
    return threshold(float(p)), agreed[0] if agreed is not None else draw_seed()
