"""Attention dropout's mask (issue 60, dilgen/dropout.py): the reference's Philox is Triton's
tl.randint bit for bit (the kernels and the float64 reference must draw the same mask), the
counter of (b, h, branch, q, k) is one per entry, and the kept fraction is 1 - p."""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from dilgen import dropout
from dilgen.runtime.interpreter import interpreting


def _draw_fn(Out, Off, seed, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    off = tl.load(Off + i, mask=m, other=0)
    tl.store(Out + i, tl.randint(seed, off).to(tl.uint32, bitcast=True).to(tl.int64), mask=m)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 + 7, 2**40 + 3, 2**64 - 1])
def test_philox_is_tritons_randint_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed % 1000)
    offsets = torch.cat([torch.arange(0, 200), torch.randint(0, 2**62, (200,), generator=g),
                         torch.tensor([2**32 - 1, 2**32, 2**63 - 1])])
    out = torch.full_like(offsets, -1)           # poisoned: an unwritten entry fails
    from triton.runtime.interpreter import InterpretedFunction
    with interpreting():                         # CPU tensors: Triton's interpreter, as the kernels run here
        InterpretedFunction(_draw_fn)[(triton.cdiv(offsets.numel(), 128),)](out, offsets, seed, offsets.numel(),
                                                                              BLOCK=128)
    assert torch.equal(out, dropout.philox(seed, offsets))


def test_counters_are_one_per_entry_and_the_kept_fraction_is_one_minus_p():
    B, H, nb, N = 2, 3, 2, 40
    b, h, i, q, k = torch.meshgrid(*(torch.arange(x) for x in (B, H, nb, N, N)), indexing="ij")
    c = dropout.counters(B, H, nb, N, b, h, i, q, k).flatten()
    assert c.unique().numel() == c.numel() and c.min() == 0 and c.max() == B * H * nb * N * N - 1
    for p in (0.1, 0.5, 0.9):
        kept = dropout.keep(7, p, c).double().mean().item()
        sigma = math.sqrt(p * (1 - p) / c.numel())
        assert abs(kept - (1 - p)) < 4 * sigma, (p, kept)
    assert dropout.keep(7, 0.0, c).all()
    assert not torch.equal(dropout.keep(7, 0.5, c), dropout.keep(8, 0.5, c))     # the seed matters


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_a_drop_probability_outside_0_1_is_refused(p):
    with pytest.raises(ValueError, match="dropout_p"):
        dropout.threshold(p)


def test_a_counter_past_63_bits_is_refused():
    with pytest.raises(ValueError, match="63 bits"):
        dropout.counters(64, 64, 8, 1 << 26, 0, 0, 0, 0, 0)


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
                        c = dropout.counters(B, H, len(pairs), N, b, h, br, i, j).reshape(1)
                        if pair[i, j] and dropout.keep(seed, p, c).item():
                            want[b, i, h] += math.exp(s[b, i, j] - lse0[b, h, i]) / (1 - p) * v[b, j, h // 2]
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
