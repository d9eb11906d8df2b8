"""Generated backward kernels (dq, dk, dv) against autograd through a float64 dense
reference of SPEC §2, on the CPU (Triton's interpreter) or the GPU.

`dilgen.reference.reference_attention` detaches its inputs, so the differentiable
reference here rebuilds the same attention from `reference_mask_counts` (the pair
multiplicities of that module, a key kept by two branches counting twice) and is itself
checked against `reference_attention` on every case.

torch.autograd.gradcheck needs float64 inputs, which the kernels do not take (float16,
bfloat16, float32 only); `test_finite_differences` checks directional derivatives by
central differences in float32 instead.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import dilgen
from dilgen.reference import differentiable_reference, reference_attention, reference_mask_counts

from conftest import device

# Twice SPEC's forward tolerance (relative norm error), SPEC §2 "Tolerance".
GRAD_TOL = {"bfloat16": 4e-2, "float16": 1e-2, "float32": 2e-4}


def _spec(name, **kw):
    kw.setdefault("num_heads", 4)
    kw.setdefault("head_dim", 16)
    kw.setdefault("dtype", "float32")
    return dilgen.Spec(name=name, **kw)


# (id, spec fields, (B, N), loss uses lse too)
CASES = [
    ("plain_two_branches", dict(segment_lengths=[32, 64], dilation_rates=[1, 2]), (2, 128), False),
    ("plain_with_lse", dict(segment_lengths=[32, 64], dilation_rates=[1, 2]), (1, 96), True),
    ("short_last_segment", dict(segment_lengths=[32, 64], dilation_rates=[1, 2]), (1, 100), False),
    ("n_is_one", dict(segment_lengths=[16, 32], dilation_rates=[1, 2]), (1, 1), True),
    ("n_below_block", dict(segment_lengths=[16], dilation_rates=[1]), (2, 7), False),
    ("w_larger_than_n", dict(segment_lengths=[512, 1024], dilation_rates=[2, 4]), (1, 90), False),
    ("r3", dict(segment_lengths=[48], dilation_rates=[3]), (1, 100), False),
    ("r5_w_not_multiple", dict(segment_lengths=[12, 40], dilation_rates=[5, 1]), (1, 90), True),
    ("r6_r12_longnet", dict(segment_lengths=[24, 96], dilation_rates=[6, 12], num_heads=12), (1, 130), False),
    ("r_larger_than_w", dict(segment_lengths=[4, 32], dilation_rates=[8, 1]), (1, 70), False),
    ("no_branch_keeps", dict(segment_lengths=[8], dilation_rates=[3]), (1, 40), True),
    ("duplicate_branch", dict(segment_lengths=[32, 32], dilation_rates=[2, 2]), (1, 80), True),
    ("lattice_multi_segment", dict(segment_lengths=[16, 32], dilation_rates=[2, 4]), (1, 96), False),
    ("lattice_four_branches", dict(segment_lengths=[16, 32, 64, 128], dilation_rates=[1, 2, 4, 8],
                                   num_heads=8), (1, 128), False),
    ("causal_plain", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], causal=True), (2, 128), False),
    ("causal_short_last", dict(segment_lengths=[32, 64], dilation_rates=[1, 4], causal=True), (1, 110), False),
    ("causal_r3_lse", dict(segment_lengths=[30, 60], dilation_rates=[3, 6], causal=True), (1, 97), True),
    ("causal_w_gt_n", dict(segment_lengths=[256], dilation_rates=[2], causal=True), (1, 77), False),
    ("gqa", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], num_heads=8, num_kv_heads=2), (1, 96), True),
    ("gqa_group_below_r", dict(segment_lengths=[24, 36], dilation_rates=[3, 4], num_heads=6, num_kv_heads=3),
     (1, 90), False),
    ("causal_gqa_fused_dkdv", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], num_heads=4,
                                   num_kv_heads=2, causal=True), (1, 96), True),
    # no r = 1 branch: the first launches write the rows their branch does not keep (CLEAR_GAPS);
    # GQA with group 2 < r: the keys of offsets no head of the group keeps
    ("causal_gqa_gap_offsets", dict(segment_lengths=[32, 64], dilation_rates=[4, 8], num_heads=4,
                                    num_kv_heads=2, causal=True), (1, 100), False),
    # head_offsets "block" with no r = 1 branch: dK, dV fall back to zero-filled buffers
    ("causal_block_offsets_gaps", dict(segment_lengths=[24, 48], dilation_rates=[2, 4], num_heads=4,
                                       head_offsets="block", causal=True), (1, 90), True),
    ("mqa_causal", dict(segment_lengths=[32, 64], dilation_rates=[2, 4], num_heads=4, num_kv_heads=1,
                        causal=True), (1, 96), False),
    ("head_dim_64", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], head_dim=64), (1, 64), False),
    ("head_dim_128", dict(segment_lengths=[32], dilation_rates=[2], head_dim=128, num_heads=2), (1, 48), False),
    ("softmax_scale", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], softmax_scale=0.7), (1, 64), True),
    ("fp16", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], dtype="float16"), (1, 100), False),
    ("bf16", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], dtype="bfloat16"), (1, 100), True),
    ("bf16_causal_gqa", dict(segment_lengths=[32, 64], dilation_rates=[1, 4], dtype="bfloat16",
                             causal=True, num_heads=8, num_kv_heads=4), (2, 100), False),
    ("fp16_mqa_r12", dict(segment_lengths=[48, 96], dilation_rates=[1, 12], dtype="float16",
                          num_heads=6, num_kv_heads=1), (1, 130), False),
    ("hilbert_segment", dict(segment_lengths=[16, 64], dilation_rates=[1, 4],
                             hilbert={"scope": "segment"}), (1, 128), False),
    ("hilbert_segment_short_last", dict(segment_lengths=[16, 64], dilation_rates=[2, 4],
                                        hilbert={"scope": "segment"}), (1, 100), True),
    ("hilbert_segment_grids_causal", dict(segment_lengths=[15, 12], dilation_rates=[2, 3], causal=True,
                                          hilbert={"scope": "segment", "grids": [[3, 5], [3, 4]]}),
     (1, 70), False),
    ("hilbert_sequence", dict(segment_lengths=[16, 32], dilation_rates=[1, 2],
                              hilbert={"scope": "sequence", "grid": [8, 12]}), (1, 96), False),
    ("hilbert_sequence_causal_odd", dict(segment_lengths=[20, 45], dilation_rates=[2, 3], causal=True,
                                         hilbert={"scope": "sequence", "grid": [9, 10]}), (1, 90), True),
    ("hilbert_sequence_bf16_gqa", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], dtype="bfloat16",
                                       num_heads=4, num_kv_heads=2,
                                       hilbert={"scope": "sequence", "grid": [8, 8]}), (1, 64), False),
]


def _inputs(spec, batch, n, seed):
    gen = torch.Generator().manual_seed(seed)
    shape_q = (batch, n, spec.num_heads, spec.head_dim)
    shape_kv = (batch, n, spec.num_kv_heads, spec.head_dim)
    q, k, v = (torch.randn(s, generator=gen) for s in (shape_q, shape_kv, shape_kv))
    grad_out = torch.randn(shape_q, generator=gen)
    grad_lse = torch.randn((batch, spec.num_heads, n), generator=gen)
    return q, k, v, grad_out, grad_lse


def _loss(out, lse, grad_out, grad_lse, use_lse):
    """<out, grad_out> (+ <lse, grad_lse> over the rows some branch keeps), float64."""
    loss = (out.double() * grad_out.to(out.device).double()).sum()
    if use_lse:
        lse = lse.double()
        finite = torch.isfinite(lse)
        loss = loss + torch.where(finite, lse, torch.zeros_like(lse)).mul(
            grad_lse.to(lse.device).double()).sum()
    return loss


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.detach().double().cpu()
    denom = ref.norm().item()
    return (got - ref).norm().item() / (denom if denom > 0 else 1.0)


def kernel_grads(spec, q, k, v, grad_out, grad_lse, use_lse, dev=None):
    dev = dev or device()
    dt = getattr(torch, spec.dtype)
    leaves = [t.detach().to(dt).to(dev).clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = dilgen.compile(spec)(*leaves, return_lse=True)
    _loss(out, lse, grad_out, grad_lse, use_lse).backward()
    return [t.grad for t in leaves], out, lse


def reference_grads(spec, q, k, v, grad_out, grad_lse, use_lse):
    dt = getattr(torch, spec.dtype)
    # the reference sees the same (rounded) inputs as the kernel
    leaves = [t.detach().to(dt).double().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = differentiable_reference(*leaves, spec)
    _loss(out, lse, grad_out, grad_lse, use_lse).backward()
    return [t.grad for t in leaves], out, lse


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradients_match_reference(case):
    name, fields, (batch, n), use_lse = case
    spec = _spec("tb_" + name, **fields)
    q, k, v, grad_out, grad_lse = _inputs(spec, batch, n, zlib.crc32(name.encode()))
    grads, out, lse = kernel_grads(spec, q, k, v, grad_out, grad_lse, use_lse)
    ref_grads, ref_out, ref_lse = reference_grads(spec, q, k, v, grad_out, grad_lse, use_lse)

    # the differentiable reference is the SPEC's reference
    plain_out, plain_lse = reference_attention(*(t.to(getattr(torch, spec.dtype)) for t in (q, k, v)),
                                               spec, return_lse=True)
    assert torch.allclose(ref_out.detach(), plain_out, atol=1e-10)
    assert torch.equal(torch.isinf(ref_lse), torch.isinf(plain_lse))

    tol = GRAD_TOL[spec.dtype]
    for label, g, r in zip("qkv", grads, ref_grads):
        assert g is not None and g.shape == r.shape, f"d{label} missing or misshapen"
        assert g.dtype == getattr(torch, spec.dtype)
        assert torch.isfinite(g).all(), f"d{label} has NaN/inf"
        if r.norm() > 0:
            err = rel_error(g, r)
            assert err < tol, f"d{label}: relative error {err:.2e} >= {tol:.0e}"
        else:
            assert g.abs().max().item() == 0, f"d{label} should be 0"

    # queries no branch keeps: zero gradient (exactly), and the forward is untouched
    unkept = torch.isneginf(ref_lse.detach()).transpose(1, 2)   # (B, N, H)
    if unkept.any():
        assert grads[0].cpu()[unkept].abs().max().item() == 0


def test_table_covers_the_features():
    specs = [_spec("x", **c[1]) for c in CASES]
    assert len(CASES) >= 20
    assert all(b <= 2 and n <= 130 for _, _, (b, n), _ in CASES)
    assert any(s.causal for s in specs)
    assert {3, 5, 6, 12} <= {r for s in specs for r in s.dilation_rates}
    assert any(w % r for s in specs for w, r in zip(s.segment_lengths, s.dilation_rates))
    assert any(r > w for s in specs for w, r in zip(s.segment_lengths, s.dilation_rates))
    assert {"float16", "bfloat16", "float32"} <= {s.dtype for s in specs}
    assert {"segment", "sequence"} <= {s.hilbert.scope for s in specs if s.hilbert}
    assert any(s.num_kv_heads == 1 for s in specs)
    assert any(1 < s.num_kv_heads < s.num_heads for s in specs)
    assert any(len(set(zip(s.segment_lengths, s.dilation_rates))) < s.num_branches for s in specs)
    assert any(c[3] for c in CASES) and not all(c[3] for c in CASES)
    assert any(n % w and n > w for _, f, (_, n), _ in CASES for w in f["segment_lengths"])


def test_only_some_inputs_need_grad_and_grad_out_is_expanded():
    """out.sum() feeds an expanded (stride 0) grad_out; only k requires grad."""
    spec = _spec("tb_partial", segment_lengths=[16, 32], dilation_rates=[1, 2], causal=True)
    q, k, v, _, _ = _inputs(spec, 1, 48, 11)
    dev = device()
    kd = k.clone().to(dev).requires_grad_(True)
    out = dilgen.compile(spec)(q.to(dev), kd, v.to(dev))
    out.sum().backward()
    kr = k.double().clone().requires_grad_(True)
    ref_out, _ = differentiable_reference(q.double(), kr, v.double(), spec)
    ref_out.sum().backward()
    assert rel_error(kd.grad, kr.grad) < GRAD_TOL["float32"]


def test_strided_inputs():
    """q, k, v views of one tensor (D contiguous) differentiate without copies."""
    spec = _spec("tb_strided", segment_lengths=[16, 32], dilation_rates=[1, 2], num_heads=2)
    dev = device()
    gen = torch.Generator().manual_seed(12)
    big = torch.randn(1, 64, 6, 16, generator=gen).to(dev).requires_grad_(True)
    q, k, v = big[:, :, 0:2], big[:, :, 2:4], big[:, :, 4:6]
    grad_out = torch.randn(1, 64, 2, 16, generator=gen)
    out = dilgen.compile(spec)(q, k, v)
    _loss(out, None, grad_out, None, False).backward()
    ref_big = big.detach().cpu().double().requires_grad_(True)
    ref_out, _ = differentiable_reference(ref_big[:, :, 0:2], ref_big[:, :, 2:4], ref_big[:, :, 4:6], spec)
    _loss(ref_out, None, grad_out, None, False).backward()
    assert rel_error(big.grad, ref_big.grad) < GRAD_TOL["float32"]


def test_lse_only_loss():
    """A loss of lse alone (grad_out materialised as zeros): dv = 0, dq and dk exact."""
    spec = _spec("tb_lse_only", segment_lengths=[16, 32], dilation_rates=[2, 4])
    q, k, v, grad_out, grad_lse = _inputs(spec, 1, 64, 13)
    zeros = torch.zeros_like(grad_out)
    grads, _, _ = kernel_grads(spec, q, k, v, zeros, grad_lse, True)
    ref_grads, _, _ = reference_grads(spec, q, k, v, zeros, grad_lse, True)
    assert grads[2].abs().max().item() == 0
    for g, r in zip(grads[:2], ref_grads[:2]):
        assert rel_error(g, r) < GRAD_TOL["float32"]


FD_CASES = [
    ("fd_plain", dict(segment_lengths=[8, 16], dilation_rates=[1, 2], num_heads=2), (1, 24)),
    ("fd_causal_gqa_dup", dict(segment_lengths=[8, 8, 12], dilation_rates=[2, 2, 3], num_heads=4,
                               num_kv_heads=2, causal=True), (1, 21)),
    ("fd_hilbert", dict(segment_lengths=[16], dilation_rates=[2], num_heads=2,
                        hilbert={"scope": "segment"}), (1, 20)),
]


@pytest.mark.parametrize("case", FD_CASES, ids=[c[0] for c in FD_CASES])
def test_finite_differences(case):
    """Directional derivatives of <out, g> + <lse, g'> by central differences (float32)
    agree with the kernels' gradients: an autograd-free check of the backward."""
    name, fields, (batch, n) = case
    spec = _spec("tb_" + name, **fields)
    q, k, v, grad_out, grad_lse = _inputs(spec, batch, n, zlib.crc32(name.encode()))
    grads, _, _ = kernel_grads(spec, q, k, v, grad_out, grad_lse, True)
    kernel = dilgen.compile(spec)
    dev = device()
    gen = torch.Generator().manual_seed(99)
    for _ in range(2):
        dirs = [torch.randn(t.shape, generator=gen) for t in (q, k, v)]
        norm = math.sqrt(sum(d.pow(2).sum().item() for d in dirs))
        dirs = [d / norm for d in dirs]
        eps = 1e-2
        vals = []
        for sign in (1, -1):
            shifted = [(t + sign * eps * d).to(dev) for t, d in zip((q, k, v), dirs)]
            with torch.no_grad():
                out, lse = kernel(*shifted, return_lse=True)
            vals.append(_loss(out, lse, grad_out, grad_lse, True).item())
        fd = (vals[0] - vals[1]) / (2 * eps)
        analytic = sum((g.double().cpu() * d.double()).sum().item() for g, d in zip(grads, dirs))
        assert abs(fd - analytic) <= 2e-3 * max(1.0, abs(analytic)), (fd, analytic)
