"""Spec.head_base (heads split over devices): a spec of H' heads with head_base b computes
heads b .. b + H' - 1 of the model, each with that head's offsets ((b + h) mod r). Checked
forward and backward against the float64 reference of the whole model's heads, on every
kernel family the offsets reach (fused classes, lanes, compact curve rows, the dK/dV
kernels, the sequence curve), and the spec rules."""
from __future__ import annotations

import pytest
import torch

import dilgen
from dilgen.reference import reference_attention
from dilgen.spec import SpecError

from test_backward import GRAD_TOL, _inputs, kernel_grads, reference_grads, rel_error

# (id, spec fields of the model (H heads), head_base, heads of the call, (B, N))
CASES = [
    ("lattice_classes", dict(segment_lengths=[16, 32, 64], dilation_rates=[1, 2, 4], num_heads=8), 2, 2, (1, 96)),
    ("r_not_dividing_w", dict(segment_lengths=[12, 40], dilation_rates=[5, 1], num_heads=8), 3, 2, (1, 90)),
    ("causal_gqa_lanes", dict(segment_lengths=[32, 64], dilation_rates=[1, 4], num_heads=8, num_kv_heads=4,
                              causal=True), 2, 4, (1, 100)),
    ("hilbert_segment_curve_rows", dict(segment_lengths=[16, 64], dilation_rates=[2, 4], num_heads=4,
                                        hilbert={"scope": "segment"}), 1, 2, (1, 100)),
    ("hilbert_segment_group_ge_r", dict(segment_lengths=[16, 64], dilation_rates=[3, 4], num_heads=8,
                                        num_kv_heads=2, hilbert={"scope": "segment"}), 4, 4, (1, 80)),
    ("hilbert_sequence", dict(segment_lengths=[16, 32], dilation_rates=[1, 2], num_heads=4,
                              hilbert={"scope": "sequence", "grid": [8, 12]}), 1, 2, (1, 96)),
]


@pytest.mark.parametrize("name,fields,base,heads,shape", CASES, ids=[c[0] for c in CASES])
def test_head_base_matches_the_models_heads(name, fields, base, heads, shape):
    model = dilgen.Spec(name=f"hb_{name}", head_dim=16, dtype="float32", **fields)
    group = model.group_size
    part = model.replace(num_heads=heads, num_kv_heads=heads // group, head_base=base)
    B, N = shape
    q, k, v, grad_out, grad_lse = _inputs(model, B, N, seed=len(name))
    kv = slice(base // group, (base + heads) // group)
    mine = (q[:, :, base:base + heads], k[:, :, kv], v[:, :, kv])
    # the reference of the part is the model's reference on those heads
    ref_out, ref_lse = reference_attention(*mine, part, return_lse=True)
    full_out, full_lse = reference_attention(q, k, v, model, return_lse=True)
    assert torch.equal(ref_out, full_out[:, :, base:base + heads])
    g_out, g_lse = grad_out[:, :, base:base + heads], grad_lse[:, base:base + heads]
    grads, out, lse = kernel_grads(part, *mine, g_out, g_lse, True)
    ref_grads, _, _ = reference_grads(part, *mine, g_out, g_lse, True)
    assert rel_error(out, ref_out) < 1e-4
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert (lse.cpu().double()[finite] - ref_lse[finite]).abs().max() < 1e-4
    for got, want, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert rel_error(got, want) < GRAD_TOL["float32"], what


def test_head_base_zero_is_the_plain_spec():
    spec = dilgen.Spec(name="hb_zero", num_heads=4, head_dim=16, segment_lengths=[16], dilation_rates=[2])
    assert spec.replace(head_base=0).key() == spec.key() and "head_base" not in spec.to_json()
    assert spec.replace(head_base=4).key() != spec.key()


@pytest.mark.parametrize("fields,message", [
    (dict(num_heads=4, num_kv_heads=2, head_base=1), "head_base = 1: must be a multiple of the GQA group size"),
    (dict(num_heads=4, head_base=-1), "head_base = -1: must be >= 0"),
    (dict(num_heads=4, head_base=2, head_offsets="block"), 'cannot be > 0 with head_offsets "block"'),
])
def test_head_base_rules(fields, message):
    with pytest.raises(SpecError, match=message):
        dilgen.Spec(name="hb_bad", head_dim=16, segment_lengths=[16], dilation_rates=[2], **fields)
