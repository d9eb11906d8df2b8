"""Attention dropout's mask (issue 60, dilgen/dropout.py): the reference's Philox is Triton's
tl.philox bit for bit at the mask's 7 rounds (the kernels and the float64 reference must draw
the same mask), the 8 key lanes 32 a + 8 k + 2 c + half of a span read the 8 16-bit halves
of one call, and the kept fraction is 1 - p."""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from dilgen import dropout
from dilgen.runtime.interpreter import interpreting

ROUNDS: tl.constexpr = tl.constexpr(dropout.ROUNDS)


def _draw_fn(Out, C, seed, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    c = [tl.load(C + x * n + i, mask=m, other=0).to(tl.uint32) for x in range(4)]
    w = tl.philox(seed, c[0], c[1], c[2], c[3], n_rounds=ROUNDS)
    for x in tl.static_range(4):
        tl.store(Out + x * n + i, w[x].to(tl.int64), mask=m)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 + 7, 2**40 + 3, 2**64 - 1])
def test_philox_is_tritons_philox_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed % 1000)
    c = torch.cat([torch.arange(0, 4 * 50).reshape(4, 50), torch.randint(0, 2**32, (4, 200), generator=g),
                   torch.tensor([[2**32 - 1] * 4, [0, 2**32 - 1, 0, 1]]).T], 1)
    n = c.shape[1]
    out = torch.full((4, n), -1, dtype=torch.int64)   # poisoned: an unwritten entry fails
    from triton.runtime.interpreter import InterpretedFunction
    with interpreting():                         # CPU tensors: Triton's interpreter, as the kernels run here
        InterpretedFunction(_draw_fn)[(triton.cdiv(n, 128),)](out, c.contiguous(), seed, n, BLOCK=128)
    assert torch.equal(out, torch.stack(dropout.philox(seed, *c)))


def test_a_group_of_8_lanes_reads_the_8_halves_of_one_call_and_the_kept_fraction_is_one_minus_p():
    assert dropout.ROUNDS == 7      # FlashAttention 2's Philox 4x32-7
    for a, c in ((0, 0), (2, 3), (5, 1)):
        words = torch.stack(dropout.philox(5, 4 * a + c, 17, 9, 0))
        halves = torch.stack([(words >> 16 * x) & 0xFFFF for x in (0, 1)], 1).flatten()   # w0 lo, w0 hi, w1 lo, ...
        lanes = torch.tensor([32 * a + 8 * k + 2 * c + half for k in range(4) for half in range(2)])
        assert torch.equal(dropout.draws(5, 9, 17, lanes), halves)
    # a span's 32 lanes are 4 calls' 32 halves, each once
    span = dropout.draws(5, 9, 17, torch.arange(64, 96))
    calls = torch.stack([torch.stack(dropout.philox(5, g, 17, 9, 0)) for g in range(8, 12)])
    assert sorted(span.tolist()) == sorted(torch.cat([calls & 0xFFFF, calls >> 16]).flatten().tolist())
    q, lane = torch.arange(300)[:, None], torch.arange(200)[None, :]
    d = dropout.draws(7, 3, q, lane)
    assert d.min() >= 0 and d.max() < 1 << 16 and d.unique().numel() > 38000   # 60000 draws of 2^16 values: ~39300 distinct
    for p in (0.1, 0.5, 0.9):
        kept = dropout.keep(7, p, 3, q, lane).double().mean().item()
        sigma = math.sqrt(p * (1 - p) / d.numel())
        assert abs(kept - (1 - p)) < 4 * sigma, (p, kept)
    assert dropout.keep(7, 0.0, 3, q, lane).all()
    assert not torch.equal(dropout.keep(7, 0.5, 3, q, lane), dropout.keep(8, 0.5, 3, q, lane))  # the seed matters
    assert not torch.equal(dropout.keep(7, 0.5, 3, q, lane), dropout.keep(7, 0.5, 4, q, lane))  # and the stream
    # lanes along the last axis alone take draws' shortcut (one call per query and group of the
    # distinct lanes); lanes spread over every axis take the call per entry: the same draws
    q, stream = torch.arange(2)[:, None, None] * 64 + torch.arange(24)[:, None], torch.arange(3)[:, None, None, None]
    lane = torch.tensor([5, 700, 3, 5, 64, 95, 700, 0, 31, 200])
    full = lane.expand(3, 2, 24, lane.numel())
    assert torch.equal(dropout.draws(11, stream, q, lane), dropout.draws(11, stream, q, full))


def test_the_drawn_probability_is_within_2_to_the_minus_17_and_the_scale_undoes_it_exactly():
    for p in (1e-7, 0.1, 1 / 3, 0.5, 0.9, 1 - 1e-9):
        cut = dropout.threshold(p)
        assert 0 <= cut < 1 << 16 and abs(cut / 2**16 - p) <= 2**-17 + 1e-12 or cut == (1 << 16) - 1, (p, cut)
        assert dropout.scale(cut) * (1 - cut / 2**16) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_a_drop_probability_outside_0_1_is_refused(p):
    with pytest.raises(ValueError, match="dropout_p"):
        dropout.threshold(p)


def test_a_counter_word_past_32_bits_is_refused():
    with pytest.raises(ValueError, match="2\\^32"):
        dropout.stream(1 << 28, 1 << 4, 0, 0)
    with pytest.raises(ValueError, match="2\\^32"):
        dropout.draws(0, 0, torch.tensor([1 << 32]), 0)


def _spec(**kw):
    import dilgen
    return dilgen.Spec(**{"name": "drop", "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32",
                          "segment_lengths": [8, 16], "dilation_rates": [1, 2], **kw})


@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_drops_each_branch_entry_with_its_coin(causal):
    """The float64 reference under dropout against a direct sum: out[b, i, h] = sum over the
    branches keeping (i, j) of coin / (1 - p) * exp(s_ij - lse_i) * v_j; the lse is the one
    without dropout; p = 0 is the reference itself."""
    from dilgen.reference import differentiable_reference, reference_branch_pairs
    spec = _spec(causal=causal)
    B, N, H, D, p, seed = 2, 21, 4, 8, 0.3, 99
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, N, x, D, generator=g, dtype=torch.float64) for x in (H, 2, 2))
    plain, lse0 = differentiable_reference(q, k, v, spec)
    scale = dropout.scale(dropout.threshold(p))
    out, lse = differentiable_reference(q, k, v, spec, dropout_p=p, seed=seed)
    assert torch.equal(lse, lse0)
    assert torch.equal(differentiable_reference(q, k, v, spec, dropout_p=0.0, seed=seed)[0], plain)
    want = torch.zeros_like(out)
    for h in range(H):
        pairs = reference_branch_pairs(N, spec, h)
        s = torch.einsum("bid,bjd->bij", q[:, :, h], k[:, :, h // 2]) / math.sqrt(D)
        for b in range(B):
            for i in range(N):
                for j in range(N):
                    for br, pair in enumerate(pairs):
                        lane = j % spec.segment_lengths[br] // spec.dilation_rates[br]  # raster: j's lane
                        c = dropout.stream(H, len(pairs), h, br)
                        if pair[i, j] and dropout.keep(seed, p, c, b * N + i, lane).item():
                            want[b, i, h] += math.exp(s[b, i, j] - lse0[b, h, i]) * scale * v[b, j, h // 2]
    assert (out - want).abs().max().item() < 1e-12
    assert (out - plain).abs().max().item() > 1e-3          # something was dropped


def test_dropout_averages_to_the_output_without_it():
    """Over 200 seeds the mean output converges to the output without dropout within 3
    standard errors (issue 60's statistics)."""
    from dilgen.reference import differentiable_reference
    spec = _spec()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, x, 8, generator=g, dtype=torch.float64) for x in (4, 2, 2))
    plain = differentiable_reference(q, k, v, spec)[0]
    outs = torch.stack([differentiable_reference(q, k, v, spec, dropout_p=0.2, seed=s)[0] for s in range(200)])
    se = outs.std(0) / math.sqrt(200)
    z = ((outs.mean(0) - plain).abs() / se.clamp_min(1e-12))
    assert (z < 3).double().mean().item() > 0.99 and z.max().item() < 5, z.max().item()
