"""Attention dropout on the ring: what cannot draw the coins, and what a rank proposes to the
agreement (the drop threshold, compared; a seed from torch's generator, of which every rank
takes rank 0's). runtime/dropout_call.py is the single-device door; dilgen/dropout.py the coin."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class Counter:
    """How a ring call that computes part of a larger attention counts dropout's coins, so
    that the parts together draw the larger call's mask (compat.torchscale's seq_parallel:
    one layer in ring calls of some heads and branches each). seed: the larger call's (a
    proposal: every rank takes rank 0's); n: its sequence length (rows b n + position of a
    fixed-length batch); row0: added to every row (a packed call of batch item b: b n);
    streams: (call heads, call branches) int64 on the device, each entry's stream in the
    larger call (dropout_call.model_streams of its heads and branches)."""
    seed: int
    n: int
    row0: int
    streams: torch.Tensor


def dropout_proposal(p, agreed, counter: Counter | None = None) -> tuple[int, int]:
    """(the call's drop threshold, compared by the agreement; this rank's seed proposal from
    torch's generator or the counter, or the agreed seed again for a backward). A bad p
    proposes (0, 0) and is refused by the agreement's local check, on every rank together."""
    if not valid_p(p):
        return 0, 0
    if agreed is not None:
        return threshold(float(p)), agreed[0]
    return threshold(float(p)), counter.seed if counter is not None else draw_seed()
