"""Lane kernels (issue 12): branches whose membership is per row (r not dividing w, a curve
table), or every branch with the tuning `lanes = "all"` (the GPU default for causal specs
with a wide lattice), run in their own launch over their kept lanes and merge into
(out, lse) by LongNet Eq. 10. Forward, lse and gradients against the float64 reference,
outputs poisoned (conftest), on the CPU (interpreter) or the GPU."""
from __future__ import annotations

import zlib

import pytest
import torch

import dilgen
from dilgen.compiler import Kernel
from dilgen.planner import plan
from dilgen.reference import differentiable_reference
from dilgen.targets import INTERPRETER

from conftest import device

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}

# (id, spec fields, (B, N), tuning)
CASES = [
    ("longnet_rates_mix", dict(segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 6], num_heads=6), (1, 200), None),
    ("longnet_rates_causal", dict(segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 6], num_heads=6,
                                  causal=True), (1, 200), None),
    ("r5_r3_only", dict(segment_lengths=[40, 24], dilation_rates=[3, 5]), (2, 101), None),
    ("r6_r12_gqa_short_last", dict(segment_lengths=[32, 128], dilation_rates=[6, 12], num_heads=12,
                                   num_kv_heads=4), (1, 150), None),
    ("w_gt_n_r3", dict(segment_lengths=[301], dilation_rates=[3], causal=True), (1, 70), None),
    ("hilbert_segment", dict(segment_lengths=[16, 64], dilation_rates=[1, 4], hilbert={"scope": "segment"}),
     (1, 128), None),
    ("hilbert_nonsquare_r3", dict(segment_lengths=[15, 40], dilation_rates=[3, 2],
                                  hilbert={"scope": "segment", "grids": [[3, 5], [5, 8]]}), (1, 97), None),
    ("hilbert_gqa_group_ge_r", dict(segment_lengths=[16, 64], dilation_rates=[2, 4], num_heads=8,
                                    num_kv_heads=2, hilbert={"scope": "segment"}), (1, 100), None),
    ("hilbert_causal_gqa_group_lt_r", dict(segment_lengths=[16, 64], dilation_rates=[2, 4], num_heads=8,
                                           num_kv_heads=4, causal=True, hilbert={"scope": "segment"}),
     (2, 90), None),
    ("hilbert_sequence_r3_causal", dict(segment_lengths=[16, 32], dilation_rates=[2, 3], num_heads=6,
                                        num_kv_heads=3, causal=True,
                                        hilbert={"scope": "sequence", "grid": [8, 12]}), (1, 96), None),
    ("all_causal", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], causal=True), (2, 128), {"lanes": "all"}),
    ("all_causal_mqa_no_r1", dict(segment_lengths=[32, 64], dilation_rates=[2, 4], num_kv_heads=1,
                                  causal=True), (1, 110), {"lanes": "all"}),
    ("all_noncausal_short_last", dict(segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4]), (1, 150),
     {"lanes": "all"}),
    ("all_no_branch_keeps", dict(segment_lengths=[8], dilation_rates=[3]), (1, 40), {"lanes": "all"}),
    ("bf16_mix", dict(segment_lengths=[32, 100], dilation_rates=[2, 6], dtype="bfloat16", num_heads=6,
                      causal=True), (1, 160), None),
    ("tma_ws_all_causal_gqa", dict(segment_lengths=[32, 64], dilation_rates=[2, 4], causal=True, num_heads=4,
                                   num_kv_heads=2), (1, 110), {"lanes": "all", "lane_tma": True, "lane_ws": True}),
    ("tma_mix_short_last", dict(segment_lengths=[32, 64, 100], dilation_rates=[1, 2, 6], num_heads=6), (1, 150),
     {"lane_tma": True}),
    ("fp16_all", dict(segment_lengths=[32, 64], dilation_rates=[1, 4], dtype="float16", causal=True),
     (1, 100), {"lanes": "all"}),
]


def _rel(a, b) -> float:
    b = b.detach().double().cpu()
    return ((a.detach().double().cpu() - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lane_branches_forward_and_gradients(case):
    name, fields, (batch, n), tuning = case
    fields = {"num_heads": 4, "head_dim": 16, "dtype": "float32", **fields}
    spec = dilgen.Spec(name="l_" + name, **fields)
    lanes = [b.lanes for b in plan(spec, INTERPRETER, tuning).branches]
    assert any(lanes), "the case must exercise a lane kernel"
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    dt = getattr(torch, spec.dtype)
    shapes = [(batch, n, spec.num_heads, spec.head_dim)] + 2 * [(batch, n, spec.num_kv_heads, spec.head_dim)]
    q, k, v = (torch.randn(s, generator=gen).to(dt).to(device()).requires_grad_() for s in shapes)
    out, lse = Kernel(spec, None, tuning)(q, k, v, return_lse=True)
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = differentiable_reference(*ref_in, spec)
    tol = TOL[spec.dtype]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten rows"
    assert _rel(out, ref_out) < tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), ~finite), "rows no branch keeps: lse = -inf"
    if finite.any():
        assert (lse.cpu().double()[finite] - ref_lse.detach()[finite]).abs().max() < 20 * tol
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (ref_out * grad).sum().backward()
    (out * grad.to(dt).to(out.device)).sum().backward()
    for mine, ref in zip((q, k, v), ref_in):
        assert not torch.isnan(mine.grad).any()
        if ref.grad.norm() > 0:
            assert _rel(mine.grad, ref.grad) < 2 * tol


def test_lane_launches_are_one_per_branch():
    """The fused kernel runs once for the lattice branches, then one launch per lane branch."""
    spec = dilgen.Spec(name="l_launches", num_heads=6, head_dim=16, dtype="float32",
                       segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 6])
    module = Kernel(spec).compiled_for(torch.device("cpu"))
    attn = module.attention
    calls = []
    real = attn._kernel

    def spy(interpret, source_fn=None):
        calls.append((source_fn or attn._source_fn).__name__)
        return real(interpret, source_fn)

    attn._kernel = spy
    try:
        attn.forward_raw(*(torch.randn(1, 100, h, 16) for h in (6, 6, 6)))
    finally:
        del attn._kernel
    assert calls == ["l_launches_fwd_kernel", "l_launches_fwd_lanes"]
