"""Attention dropout's mask as a function (issue 60, the part the kernels and the reference share).

The mask keeps the probability of query q and key k in branch i and head h (LongNet Eq. 10:
the one softmax over every branch's keys, a pair kept by two branches being two entries)
when a 16-bit draw clears the cut of p. Every batch draws as one sequence of its rows: q is
the query's row, b N + position for item b of a fixed-length batch (the position counted
along the curve for Hilbert scope "sequence"), its row in a packed one. The key enters through its lane j in
branch i, its index among the segment's dilated keys (key = segment start + offset + r j, or
the curve's lane for Hilbert). One Philox call serves 8 lanes, spread over a span of 32:
write j = 32 a + 8 k + 2 c + half (k, c in 0..3, half in 0..1), then

    stream = h n_branches + i
    w_0, w_1, w_2, w_3 = philox(seed, (4 a + c, q, stream, 0))     q = b N + position
    draw   = 16-bit half `half` of word w_k                         (low half first)
    keep   = draw >= cut,  cut = round(p 2^16)

The 8 lanes of one call (k and half vary, a and c fixed) are the columns one thread holds of
a Hopper or Ampere MMA accumulator (column pairs 2c, 2c + 1 every 8 columns), so the kernels
draw each call in the registers of the probabilities it thins, as FlashAttention 2 draws in
fragment order. `philox` is Philox 4x32 with 7 rounds, FlashAttention 2's (Triton's
`tl.philox(..., n_rounds=7)`; Salmon et al. 2011 find 7 rounds Crush-resistant), the seed's low
and high words as the key, reproduced here bit for bit on int64 tensors, so the float64
reference regenerates the kernels' mask, and every transport of the ring (which sees global
positions and whole segments) draws the same mask as one device. One call serves 8 entries,
a quarter of a 32-bit draw each: FlashAttention 2 serves 16 at 8 bits; 16 bits keep p within
2^-17 of what was asked. The kept entries are scaled by 2^16 / (2^16 - cut) = 1 / (1 - p'),
p' = cut / 2^16 the probability actually drawn, so dropout leaves the expectation exact.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85          # Philox 4x32's key increments (Weyl)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57      # its round multipliers
ROUNDS = 7                                       # FlashAttention 2's Philox 4x32-7
GROUP = 8                                        # key lanes per Philox call: 4 words x 2 halves
SPAN = 32                                        # lanes 32 a .. 32 a + 31: 4 calls (c), interleaved
BITS = 16                                        # bits of one draw
_ONE = 1 << BITS


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for 32-bit a and b (int64 tensors, exact)."""
    # split b into 16-bit halves: a * b_hi < 2^48 and a * b_lo < 2^48 fit int64
    b_lo, b_hi = b & 0xFFFF, b >> 16
    lo_part = a * b_lo
    hi_part = a * b_hi
    low = (lo_part + ((hi_part & 0xFFFF) << 16)) & _MASK32
    high = (hi_part + (lo_part >> 16)) >> 16
    return high & _MASK32, low


def philox(seed: int, c0, c1, c2, c3) -> tuple[torch.Tensor, ...]:
    """tl.philox(seed, c0, c1, c2, c3, n_rounds=ROUNDS) for uint32 counters: its 4 words as non-negative int64
    (broadcast int64 tensors or ints in [0, 2^32))."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"dropout seed {seed}: must be in [0, 2^64)")
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64) & _MASK32
                                               for c in (c0, c1, c2, c3)))
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """The 16-bit draw an entry must reach to be kept: round(p 2^16), below 2^16."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p = {p}: must be in [0, 1)")
    return min(round(p * _ONE), _ONE - 1)


def scale(cut: int) -> float:
    """The kept entries' weight 1 / (1 - p') for p' = cut / 2^16 (the expectation stays exact)."""
    return _ONE / (_ONE - cut)


def stream(heads: int, n_branches: int, h, branch):
    """The third counter word of (head h, branch); refuses heads x branches past 2^32."""
    if heads * n_branches > _MASK32:
        raise ValueError(f"dropout: heads {heads} x branches {n_branches} passes 2^32 (one 32-bit counter word)")
    return h * n_branches + branch


def draws(seed: int, stream_, q, lane) -> torch.Tensor:
    """The 16-bit draws (int64) of query positions q and key lanes `lane` (broadcast tensors)
    in counter stream `stream_`: lane 32 a + 8 k + 2 c + half is half `half` of word k of the
    call (4 a + c, q, stream_, 0)."""
    q = torch.as_tensor(q, dtype=torch.int64)
    lane = torch.as_tensor(lane, dtype=torch.int64)
    stream_ = torch.as_tensor(stream_, dtype=torch.int64)
    if (q >= 1 << 32).any():
        raise ValueError("dropout: a query position passes 2^32 (one 32-bit counter word)")
    if lane.dim() and all(s == 1 for s in lane.shape[:-1]) and all(t.dim() == 0 or t.shape[-1] == 1
                                                                   for t in (q, stream_)):
        # lanes along the last axis only (a branch's keys repeat their lanes in every segment):
        # one call per query and group of the distinct lanes, then each lane's half word
        lanes, where = torch.unique(lane.reshape(-1), return_inverse=True)
        groups, call = torch.unique(4 * (lanes // SPAN) + (lanes % GROUP) // 2, return_inverse=True)
        words = torch.stack(philox(seed, groups, q, stream_, 0), -1)      # [..., group, word]
        half = words[..., call, (lanes % SPAN) // GROUP] >> (BITS * (lanes % 2))
        return (half & (_ONE - 1))[..., where].broadcast_to(torch.broadcast_shapes(q.shape, lane.shape, stream_.shape))
    a, within = lane // SPAN, lane % SPAN
    k, c, half = within // GROUP, (within % GROUP) // 2, within % 2
    words = torch.stack(torch.broadcast_tensors(*philox(seed, 4 * a + c, q, stream_, 0)))
    word = torch.gather(words, 0, k.expand(words.shape[1:])[None]).squeeze(0)
    return (word >> (BITS * half)) & (_ONE - 1)


def keep(seed: int, p: float, stream_, q, lane) -> torch.Tensor:
    """The boolean mask of the entries kept (query positions q, key lanes `lane`)."""
    return draws(seed, stream_, q, lane) >= threshold(p)
