"""Kernels for issue 16 (CPU, Triton's interpreter), against the float64 reference:

- head_dim any multiple of 8: tiles padded to the next power of two (>= 16) and masked,
  never padded in memory, forward and backward (GQA, causal, r not dividing w);
- head_offsets "block": head h keeps the lanes t mod r == floor(h / ceil(H / r));
- short_segments "zero_pad": torchscale's zero keys in each branch's softmax.
"""
from __future__ import annotations

import pytest
import torch

from dilgen import compiler, planner
from dilgen.codegen import emit
from dilgen.reference import differentiable_reference
from dilgen.runtime import InputError
from dilgen.spec import Spec, SpecError
from dilgen.targets import INTERPRETER, SM80, SM90

TOL = 1e-4   # SPEC §2.4, float32 (gradients: twice)


def _spec(H, Hkv, D, ws, rs, causal=False, **kw) -> Spec:
    return Spec(name="t16", num_heads=H, num_kv_heads=Hkv, head_dim=D, segment_lengths=list(ws),
                dilation_rates=list(rs), causal=causal, dtype="float32", **kw)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check(spec: Spec, N: int, B: int = 1, seed: int = 0) -> None:
    kernel = compiler.compile(spec, target="interpreter")
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = torch.randn(B, N, H, D, generator=g).requires_grad_()
    k = torch.randn(B, N, Hkv, D, generator=g).requires_grad_()
    v = torch.randn(B, N, Hkv, D, generator=g).requires_grad_()
    out, lse = kernel(q, k, v, return_lse=True)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = differentiable_reference(q64, k64, v64, spec)
    assert _rel(out, ref) < TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-4
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (out * dout.float()).sum().backward()
    (ref * dout).sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert _rel(got, want) < 2 * TOL


# --------------------------------------------------------------------------- head dims

@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("D", [48, 80, 24])
def test_padded_head_dims_forward_backward(D, causal):
    # GQA 4/2; w = 20 is not a multiple of r = 3 (a lane branch), w = 16, r = 2 fused
    _check(_spec(4, 2, D, [16, 20], [2, 3], causal), N=45)


def test_head_dim_8_pads_to_16():
    _check(_spec(2, 1, 8, [8, 16], [1, 2], causal=True), N=30)


def test_padded_plan_and_source():
    spec = _spec(16, 16, 48, [1024, 2048], [1, 2])
    p = planner.plan(spec, SM90)
    assert p.head_dim == 48 and p.head_dim_pad == 64 and p.to_json()["head_dim_pad"] == 64
    # tile tables are read at the padded width
    assert p.config == planner.plan(spec.replace(head_dim=64), SM90).config
    src = emit(p)
    assert "HEAD_DIM = tl.constexpr(48)" in src and "HEAD_DIM_PAD = tl.constexpr(64)" in src
    assert "tl.arange(0, HEAD_DIM)" not in src and "tl.make_tensor_descriptor" not in src.split("def ")[-1]
    # power-of-two head dims: no padding, no column masks, plan JSON without the key
    p64 = planner.plan(spec.replace(head_dim=64), SM90)
    assert p64.head_dim_pad is None and "head_dim_pad" not in p64.to_json()
    assert "< HEAD_DIM)" not in emit(p64) and "HEAD_DIM_PAD" not in emit(p64)
    # causal sm90 lane kernels: tensor descriptors for powers of two, pointer loads when padded
    causal = spec.replace(causal=True, dtype="bfloat16")
    assert planner.plan(causal.replace(head_dim=64), SM90).config.lane_tma
    assert not planner.plan(causal, SM90).config.lane_tma


# --------------------------------------------------------------------------- head_offsets "block"

@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("H, Hkv", [(5, 5), (6, 2), (3, 3)], ids=["h5", "gqa6_2", "h3_below_r4"])
def test_block_offsets(H, Hkv, causal):
    _check(_spec(H, Hkv, 48, [8, 16, 64], [1, 2, 4], causal, head_offsets="block"), N=45)


def test_block_offsets_plan():
    spec = _spec(16, 16, 48, [1024, 2048, 4096], [1, 2, 4], head_offsets="block")
    for target in (INTERPRETER, SM80, SM90):
        p = planner.plan(spec, target)
        assert all(b.lanes for b in p.branches) and not p.fused_dkdv
        assert [None if b.head_offset is None else b.head_offset.text for b in p.branches] == \
            [None, "((h) // 8)", "((h) // 4)"]
    src = emit(planner.plan(spec, SM90))
    assert "o = ((h) // 4)" in src and "o = ((h_first) // 4) + g0" in src
    # the default layout's plans carry no offset map
    assert "head_offset" not in str(planner.plan(spec.replace(head_offsets="mod"), SM90).to_json())


def test_block_offsets_refused_with_a_ring_and_by_decode():
    with pytest.raises(SpecError, match=r'head_offsets = "block" with ring_size = 2'):
        planner.plan(_spec(4, 4, 64, [16], [2], ring_size=2, head_offsets="block"), INTERPRETER)
    kernel = compiler.compile(_spec(4, 4, 48, [16], [2], causal=True, head_offsets="block"),
                              target="interpreter")
    q = torch.randn(1, 1, 4, 48)
    kv = torch.randn(1, 16, 4, 48)
    with pytest.raises(InputError, match="decode does not take head_dim = 48"):
        kernel.decode(q, kv, kv, torch.tensor([5], dtype=torch.int32))


# --------------------------------------------------------------------------- short_segments "zero_pad"

@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("offsets", ["mod", "block"])
def test_zero_pad(offsets, causal):
    # N = 45: w = 8, 16 leave short last segments, w = 64 > N is one segment padded to 48
    _check(_spec(6, 3, 48, [8, 16, 64], [1, 2, 8], causal, head_offsets=offsets,
                 short_segments="zero_pad"), N=45)


def test_zero_pad_batch_and_gqa():
    _check(_spec(8, 2, 32, [16, 32], [2, 4], head_offsets="block", short_segments="zero_pad"),
           N=37, B=2, seed=3)


def test_zero_pad_layout_slip_refused_at_call_time():
    spec = _spec(4, 4, 48, [16, 12], [2, 8], short_segments="zero_pad")
    kernel = compiler.compile(spec, target="interpreter")
    ok = torch.randn(1, 12, 4, 48)
    kernel(ok, ok, ok)                          # N <= 12: one padded segment, no slip
    x = torch.randn(1, 20, 4, 48)
    with pytest.raises(InputError) as exc:
        kernel(x, x, x)
    msg = str(exc.value)
    assert "\n" not in msg and "slip" in msg and "segment_lengths[1] = 12" in msg
