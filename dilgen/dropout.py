"""Attention dropout's mask as a function (issue 60, the part the kernels and the reference share).

The mask keeps the probability of query q, key k, in branch i of batch item b and head h
(LongNet Eq. 10: the one softmax over every branch's keys, a pair kept by two branches being
two entries) when a counter-based draw clears the drop probability p:

    counter = ((((b * H + h) * n_branches + i) * N + q) * N + k)      q, k global positions
    keep    = philox(seed, counter) >= floor(p * 2^32)                  the uint32 of tl.randint

`philox` is Triton's `tl.randint(seed, offset)` (Philox 4x32, 10 rounds, the offset's low and
high words as the first two counters, the seed's as the key), reproduced here bit for bit on
int64 tensors, so the float64 reference regenerates the kernels' mask, and every transport of
the ring (which sees global positions) draws the same mask as one device. The kept entries
are scaled by 1 / (1 - p), as FlashAttention 2 defines dropout on the probabilities.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85          # Philox 4x32's key increments (Weyl)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57      # its round multipliers
ROUNDS = 10


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for 32-bit a and b (int64 tensors, exact)."""
    # split b into 16-bit halves: a * b_hi < 2^48 and a * b_lo < 2^48 fit int64
    b_lo, b_hi = b & 0xFFFF, b >> 16
    lo_part = a * b_lo
    hi_part = a * b_hi
    low = (lo_part + ((hi_part & 0xFFFF) << 16)) & _MASK32
    high = (hi_part + (lo_part >> 16)) >> 16
    return high & _MASK32, low


def philox(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """tl.randint(seed, offsets) as non-negative int64 (its uint32), for int64 offsets."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"dropout seed {seed}: must be in [0, 2^64)")
    offsets = offsets.to(torch.int64)
    c0, c1 = offsets & _MASK32, (offsets >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0


def threshold(p: float) -> int:
    """The uint32 a draw must reach to keep an entry: floor(p * 2^32)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p = {p}: must be in [0, 1)")
    return int(p * 2**32)


def counters(batch: int, heads: int, n_branches: int, n: int, b, h, branch, q, k) -> torch.Tensor:
    """The mask's counter of (b, h, branch, q, k) (broadcast int64 tensors or ints)."""
    if batch * heads * n_branches * n * n >= 2**63:
        raise ValueError(f"dropout: batch {batch} x heads {heads} x branches {n_branches} x N^2 ({n}^2) "
                         f"needs more than 63 bits of counter")
    as_t = [torch.as_tensor(x, dtype=torch.int64) for x in (b, h, branch, q, k)]
    b, h, branch, q, k = as_t
    return (((b * heads + h) * n_branches + branch) * n + q) * n + k


def keep(seed: int, p: float, offsets: torch.Tensor) -> torch.Tensor:
    """The boolean mask of the entries kept at counters `offsets`."""
    return philox(seed, offsets) >= threshold(p)
