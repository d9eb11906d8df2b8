"""Attention dropout on the ring: what cannot draw the coins, and what a rank proposes to the
agreement (the drop threshold, compared; a seed from torch's generator, of which every rank
takes rank 0's). runtime/dropout_call.py is the single-device door; dilgen/dropout.py the coin."""
from __future__ import annotations

from ...dropout import threshold
from ..checks import InputError
from ..dropout_call import draw_seed, valid_p
from ..registry import twins_available


def dropout_refusal(attn) -> None:
    """One InputError for a ring call that cannot draw dropout's coins: no compiler to build
    the spec's dropout kernels. Every transport draws them otherwise ("local" and "heads" in
    the single-device kernels, "ring" and "allgather" in the window kernels of the dropout
    plan, packed rows as one sequence of the whole row, Hilbert scope "sequence" at the curve
    positions its ranks hold, which is where one device counts them), one device's mask on each."""
    name = attn.spec["name"]
    if not twins_available():
        raise InputError(f"{name}: attention dropout on a ring needs dilgen's compiler to build the spec's "
                         f"dropout kernels; call it through dilgen.compile(spec), not an imported module")


def dropout_proposal(p, agreed) -> tuple[int, int]:
    """(the call's drop threshold, compared by the agreement; this rank's seed proposal from
    torch's generator, or the agreed seed again for a backward). A bad p proposes (0, 0) and
    is refused by the agreement's local check, on every rank together."""
    if not valid_p(p):
        return 0, 0
    return threshold(float(p)), agreed[0] if agreed is not None else draw_seed()
