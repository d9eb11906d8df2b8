"""Attention dropout on the ring: which transport draws the coins (the single-device kernels
of the spec's dropout plan, on a rank's pieces or its heads), and what a rank proposes to the
agreement (the drop threshold, compared; a seed from torch's generator, of which every rank
takes rank 0's). runtime/dropout_call.py is the single-device door; dilgen/dropout.py the coin."""
from __future__ import annotations

import torch

from ...dropout import threshold
from ...schedule import ring_schedule
from ..checks import InputError
from ..dropout_call import SEED_BOUND
from .heads import heads_refusal, local_possible


def dropout_transport(attn, n: int, P: int, order: str, packed: bool, forced: str) -> str:
    """The transport of a ring call with attention dropout: "local" where every branch stays
    inside a rank, else "heads" (forced: DILGEN_RING_TRANSPORT); one InputError where neither runs it (the ring's windows
    draw no coins yet), or DILGEN_RING_TRANSPORT forces another."""
    name = attn.spec["name"]
    if packed or attn.plan["ring"].get("curve") is not None:
        raise InputError(f"{name}: attention dropout on a ring takes fixed-length rows in raster or "
                         f"Hilbert-segment order (not packed rows, not Hilbert scope \"sequence\") yet; "
                         f"pass dropout_p=0.0")
    if forced in ("ring", "allgather"):
        raise InputError(f"{name}: DILGEN_RING_TRANSPORT={forced} draws no dropout coins (its window kernels "
                         f"take no dropout yet); unset it, or set heads")
    if forced != "heads" and local_possible(attn, ring_schedule(attn.plan["ring"], n, order), False):
        return "local"
    refusal = heads_refusal(attn, P, False)
    if refusal is not None:
        raise InputError(f"{name}: attention dropout on a ring runs where every segment lies inside a rank "
                         f"or by the head-parallel transport, and here neither does ({refusal}); pass "
                         f"dropout_p=0.0")
    return "heads"


def valid_p(p) -> bool:
    return not isinstance(p, bool) and isinstance(p, (int, float)) and 0.0 <= float(p) < 1.0


def dropout_proposal(p, agreed) -> tuple[int, int]:
    """(the call's drop threshold, compared by the agreement; this rank's seed proposal from
    torch's generator, or the agreed seed again for a backward). A bad p proposes (0, 0) and
    is refused by the agreement's local check, on every rank together."""
    if not valid_p(p):
        return 0, 0
    seed = agreed[0] if agreed is not None else int(torch.randint(0, SEED_BOUND, (1,)).item())
    return threshold(float(p)), seed


def proposal_cut_scale(p) -> tuple[int, float]:
    """(drop_cut, drop_scale) of the kernels' dropout arguments (dropout_call)."""
    return threshold(float(p)) - (1 << 31), 1.0 / (1.0 - float(p))
