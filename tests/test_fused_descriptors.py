"""The sm90 flags of the raster kernels (issue 13): the fused forward's key lanes through
tensor descriptors (fused_tma, warp-specialized loops with fused_ws), the backward's (dq: key
lanes, dK/dV fused and per branch: query and dO lanes; bwd_tma) and the softmax scale folded
into exp2's argument (fold_scale). On the CPU the interpreter runs the same emitted source; out and lse
against the float64 reference, outputs poisoned (conftest), gradients too. The planner
turns the flags on for sm90 where they were measured, and nowhere else."""
from __future__ import annotations

import pytest
import torch

import dilgen
from dilgen import codegen, planner
from dilgen.compiler import Kernel
from dilgen.reference import reference_attention
from dilgen.targets import INTERPRETER, SM80, SM90

from conftest import TOL, check_against_reference, device, rel_error

TMA = {"fused_tma": True, "fold_scale": True, "bwd_tma": True}
TMA_WS = {"fused_tma": True, "fused_ws": True, "fold_scale": True, "bwd_tma": True}

# (id, spec fields, (B, N), tuning)
CASES = [
    ("a_like_short_last", dict(segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4]), (1, 150), TMA),
    ("a_like_ws_bf16", dict(segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4], dtype="bfloat16"),
     (2, 128), TMA_WS),
    ("fused_dkdv_gqa_short_last", dict(segment_lengths=[64, 128, 256], dilation_rates=[1, 2, 4], num_heads=4,
                                       num_kv_heads=2), (1, 300), TMA),
    ("tiles_span_segments_gqa", dict(segment_lengths=[16, 64], dilation_rates=[1, 4], num_heads=8,
                                     num_kv_heads=2), (1, 100), TMA),
    ("longnet_rates_with_lanes", dict(segment_lengths=[32, 64, 96], dilation_rates=[1, 2, 6], num_heads=6,
                                      num_kv_heads=3), (1, 200), TMA),
    ("no_r1_w_gt_n", dict(segment_lengths=[64, 512], dilation_rates=[2, 4]), (1, 90), TMA),
    ("fold_only_causal_mqa", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], num_kv_heads=1,
                                  causal=True), (1, 100), {"fold_scale": True}),
    ("fold_only_causal_lanes", dict(segment_lengths=[32, 64], dilation_rates=[2, 4], causal=True),
     (1, 110), {"fold_scale": True, "lanes": "all", "lane_tma": True}),
    # segments the dK/dV key tile does not nest in: the per-branch dK/dV kernel, causal
    ("per_branch_dkdv_causal_gqa", dict(segment_lengths=[24, 48], dilation_rates=[1, 2], causal=True,
                                        num_kv_heads=2), (1, 100), {"bwd_tma": True, "fold_scale": True}),
    # sm90's causal plan for A- and C-like specs (Target.causal_max_lattice): every branch a
    # lane kernel, the per-branch dK/dV with descriptors instead of the fused lattice one;
    # GQA, a short last segment
    ("causal_lanes_per_branch_dkdv_gqa", dict(segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4], num_heads=4,
                                              num_kv_heads=2, causal=True), (1, 150),
     {"bwd_tma": True, "fold_scale": True, "lanes": "all", "lane_tma": True, "fused_dkdv": False}),
    ("per_branch_dkdv_no_r1", dict(segment_lengths=[24, 40], dilation_rates=[2, 4]), (2, 90), TMA),
    ("fold_softmax_scale_fp16", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], dtype="float16",
                                     softmax_scale=0.3), (1, 96), TMA),
    # Hilbert segment scope: the fused kernel's r = 1 branch through descriptors, the curve lane
    # branches through descriptors over their compact copies; non-square grids, short last segment
    ("hilbert_segment_curve_lanes", dict(segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4],
                                         hilbert={"scope": "segment", "grids": [[4, 8], [8, 8], [8, 16]]}),
     (1, 150), {**TMA, "lane_tma": True}),
    # causal curves: the dK/dV kernel walks listed query blocks of the compact copies through
    # descriptors (bwd_tma), the lanes their listed key blocks (lane_tma)
    # lattice programs in groups of tiles, class by class within a group (lattice_group; on
    # sm90 the runtime sizes groups to L2): one tile per group, and groups of 2 and 3 whose
    # last group is short; the fused forward, dq and fused dK/dV kernels, GQA, causal
    ("lattice_group1_longnet_rates", dict(segment_lengths=[32, 64, 96], dilation_rates=[1, 2, 6], num_heads=6,
                                          num_kv_heads=3), (2, 200), {**TMA, "lattice_group": 1}),
    ("lattice_group2_fused_dkdv_gqa", dict(segment_lengths=[64, 128, 256], dilation_rates=[1, 2, 4], num_heads=4,
                                           num_kv_heads=2), (1, 300), {**TMA, "lattice_group": 2}),
    ("lattice_group3_causal", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], causal=True),
     (1, 100), {"lattice_group": 3, "fold_scale": True}),
    ("hilbert_segment_causal_gqa", dict(segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4], num_kv_heads=2,
                                        causal=True, hilbert={"scope": "segment", "grids": [[4, 8], [8, 8], [8, 16]]}),
     (1, 150), {"bwd_tma": True, "lane_tma": True, "fold_scale": True}),
    # two chains per fused tile (dual_chain): 32-row tiles of two 16-row chains; a short last
    # segment (the second chain's rows past N), GQA, a lane branch beside the fused ones,
    # pointer loads and descriptors, the scale folded and not
    ("dual_chain_short_last", dict(segment_lengths=[128, 256, 512], dilation_rates=[1, 2, 4]),
     (1, 700), {**TMA, "dual_chain": True, "block_m": 32}),
    ("dual_chain_gqa_lane_branch", dict(segment_lengths=[128, 256, 384], dilation_rates=[1, 2, 5], num_heads=6,
                                        num_kv_heads=3), (2, 400), {"fold_scale": True, "dual_chain": True,
                                                                    "block_m": 32}),
    ("dual_chain_unfolded_fp16", dict(segment_lengths=[128, 256], dilation_rates=[1, 2], dtype="float16",
                                      softmax_scale=0.4), (1, 300), {"fused_tma": True, "fold_scale": False,
                                                                     "dual_chain": True, "block_m": 32}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_flags_forward_and_gradients(case):
    name, fields, (batch, n), tuning = case
    fields = {"num_heads": 4, "head_dim": 16, "dtype": "float32", **fields}
    spec = dilgen.Spec(name="fd_" + name, **fields)
    the_plan = planner.plan(spec, INTERPRETER, tuning)
    cfg = the_plan.config
    if name.startswith("fused_dkdv") or "fused_dkdv" in name:
        assert the_plan.fused_dkdv
    if name.endswith("per_branch_dkdv_gqa"):
        assert not the_plan.fused_dkdv
    assert cfg.fold_scale == tuning.get("fold_scale", True) and cfg.fused_tma == bool(tuning.get("fused_tma"))
    assert cfg.dual_chain == bool(tuning.get("dual_chain"))
    source = codegen.emit(the_plan)
    assert ("k_desc = tl.make_tensor_descriptor" in source) == bool(cfg.fused_tma or cfg.bwd_tma
                                                                   or tuning.get("lane_tma"))
    assert ("q_desc = tl.make_tensor_descriptor" in source) == cfg.bwd_tma
    assert ("qk2 = tl.dot(q2" in source) == cfg.dual_chain
    check_against_reference(spec, batch, n, tuning, name)


@pytest.mark.parametrize("ws, lengths, tuning", [
    ([16, 32, 64], [50, 0, 77, 16], TMA),
    ([128, 256], [300, 0, 131, 16], {**TMA, "dual_chain": True, "block_m": 32}),   # two chains per tile
], ids=["descriptors", "dual_chain"])
def test_fused_descriptors_packed_batch(ws, lengths, tuning):
    """Packed sequences (cu_seqlens): the descriptors start at each sequence's rows."""
    spec = dilgen.Spec(name="fd_packed" + ("_dual" if "dual_chain" in tuning else ""), num_heads=4,
                       head_dim=16, dtype="float32", segment_lengths=ws, dilation_rates=[1, 2, 4][:len(ws)])
    assert planner.plan(spec, INTERPRETER, tuning).config.dual_chain == ("dual_chain" in tuning)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(int(cu[-1]), 4, 16, generator=gen) for _ in range(3))
    out, lse = Kernel(spec, None, tuning)(q.to(device()), k.to(device()), v.to(device()),
                                            cu_seqlens=cu.to(device()), return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        a = int(cu[b])
        ref, ref_lse = reference_attention(q[None, a:a + n].double(), k[None, a:a + n].double(),
                                           v[None, a:a + n].double(), spec, return_lse=True)
        assert rel_error(out[a:a + n], ref[0]) < TOL["float32"], f"sequence {b}"
        assert (lse[:, a:a + n].double() - ref_lse[0]).abs().max() < 20 * TOL["float32"]


def test_decode_with_folded_scale():
    """The decode kernels share the online softmax helper: fold_scale there too."""
    spec = dilgen.Spec(name="fd_decode", num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                       segment_lengths=[8, 32], dilation_rates=[1, 2], causal=True)
    gen = torch.Generator().manual_seed(5)
    lens, T, n_max = [37, 20], 2, 40
    full_q = torch.randn(2, n_max, 4, 16, generator=gen)
    k, v = (torch.randn(2, n_max, 2, 16, generator=gen) for _ in range(2))
    q = torch.stack([full_q[b, n - T:n] for b, n in enumerate(lens)])
    with torch.no_grad():
        out = Kernel(spec, None, {"fold_scale": True}).decode(
            q.to(device()), k.to(device()), v.to(device()),
            torch.tensor(lens, dtype=torch.int32).to(device())).cpu()
    for b, n in enumerate(lens):
        ref = reference_attention(full_q[b:b + 1, :n].double(), k[b:b + 1, :n].double(),
                                  v[b:b + 1, :n].double(), spec)[0, n - T:]
        assert rel_error(out[b], ref) < TOL["float32"], f"item {b}"


def _spec(**kw):
    base = dict(name="fd_plan", num_heads=16, head_dim=128, dtype="bfloat16",
                segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4])
    base.update(kw)
    return dilgen.Spec(**base)


def test_planner_turns_fused_descriptors_on_where_measured():
    cfg = planner.plan(_spec(), SM90).config
    assert cfg.fused_tma and cfg.fold_scale and cfg.bwd_tma and not cfg.fused_ws
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (128, 128, 8, 3)
    c64 = planner.plan(_spec(head_dim=64, num_heads=32), SM90).config
    assert c64.fused_tma and c64.block_n == 128          # head_dim 64: two chains, 128 keys per step
    assert planner.plan(_spec(head_dim=64, causal=True), SM90).config.block_n == 64  # one chain: 64 keys
    for spec in (_spec(causal=True), _spec(causal=True, ring_size=2), _spec(dtype="float32"),
                 _spec(hilbert={"scope": "sequence", "grid": [1024, 32]}, causal=True), _spec(head_dim=96)):
        cfg = planner.plan(spec, SM90).config
        assert not cfg.fused_tma, spec
    # Hilbert segment scope (F): the fused kernel's r = 1 branch reads through descriptors, and
    # the curve lane branches walk their compact copies through descriptors, 128 x 128 tiles
    f = planner.plan(_spec(hilbert={"scope": "segment"}), SM90)
    assert f.config.fused_tma and f.config.lane_tma and f.config.lane_fwd == (128, 128, 8, 3)
    assert [b.lanes for b in f.branches] == [False, True, True] and all(b.curve_rows for b in f.branches[1:])
    # non-curve lane branches (r not dividing w) keep pointer loads and their tiles
    e = planner.plan(_spec(segment_lengths=[2048, 4096, 12288], dilation_rates=[1, 2, 6]), SM90).config
    assert not e.lane_tma and e.lane_fwd == (128, 64, 8, 3)
    causal = planner.plan(_spec(causal=True), SM90).config
    assert causal.fold_scale and causal.bwd_tma
    # a ring's windows read through the same boxes (keys compacted with stride g | r)
    for spec in (_spec(ring_size=2), _spec(ring_size=4, hilbert={"scope": "sequence", "grid": [256, 512]})):
        cfg = planner.plan(spec, SM90).config
        assert cfg.fused_tma and cfg.bwd_tma and cfg.block_n == 128, spec
    assert planner.plan(_spec(ring_size=2, causal=True), SM90).config.bwd_tma
    for spec in (_spec(dtype="float32"), _spec(head_dim=96)):
        assert not planner.plan(spec, SM90).config.bwd_tma, spec
    for target in (SM80, INTERPRETER):
        cfg = planner.plan(_spec(), target).config
        assert not (cfg.fused_tma or cfg.fold_scale or cfg.fused_ws or cfg.bwd_tma)


def test_lattice_group_tiles_sized_to_l2():
    """The lattice kernels' groups of tiles (runtime.lattice_group_tiles): a head whose keys and
    values fit in half of L2 keeps one group (class-major); B's 64 MB per head takes groups of a
    quarter of L2 (16 classes x 128 rows = 2048 positions x 512 bytes = 1 MiB a tile: 12 tiles);
    sm80 and the interpreter keep one group; a tuned lattice_group fixes it."""
    from dilgen.runtime import lattice_group_tiles
    b_like = _spec(segment_lengths=[2048, 4096, 8192, 16384, 32768], dilation_rates=[1, 2, 4, 8, 16])
    plan = planner.plan(b_like, SM90).to_json()
    assert plan["query"]["lattice"] == 16 and plan["config"]["l2_bytes"] == 50 * 2**20
    row = 2 * 128 * 2                          # k and v rows of a kv head, bf16
    assert lattice_group_tiles(plan, 64, 128, row) == 12          # N = 131072
    assert lattice_group_tiles(plan, 8, 128, row) == 8            # N = 16384: 16 MiB, one group
    a_like = planner.plan(_spec(), SM90).to_json()
    assert lattice_group_tiles(a_like, 64, 128, row) == 64        # A: 16 MiB per head
    assert lattice_group_tiles(a_like, 4096, 128, row) == 50      # 4M rows: 256 KiB a tile
    for target in (SM80, INTERPRETER):
        assert lattice_group_tiles(planner.plan(b_like, target).to_json(), 64, 128, row) == 64
    tuned = planner.plan(b_like, SM90, {"lattice_group": 5}).to_json()
    assert lattice_group_tiles(tuned, 64, 128, row) == 5 and lattice_group_tiles(tuned, 3, 128, row) == 3


@pytest.mark.parametrize("fields, why", [
    (dict(causal=True), "causal"),
    (dict(segment_lengths=[96, 4096, 8192]), "tiles that span segments"),
    (dict(ring_size=2), "a ring"),
])
def test_dual_chain_only_where_both_halves_share_the_keys(fields, why):
    spec = _spec(head_dim=64, **fields)
    assert not planner.plan(spec, SM90, {"dual_chain": True}).config.dual_chain, why
    assert planner.plan(_spec(head_dim=64), SM90, {"dual_chain": True}).config.dual_chain


def test_dual_chain_is_sm90s_plan_at_head_dim_64_only():
    """Where it was measured: C-like specs (head_dim 64, bf16) on sm90, with 4 warps and
    128 keys per step; head_dim 128, sm80 and the interpreter keep one chain."""
    cfg = planner.plan(_spec(head_dim=64), SM90).config
    assert cfg.dual_chain and (cfg.num_warps, cfg.block_n) == (4, 128)
    assert not planner.plan(_spec(), SM90).config.dual_chain
    assert not planner.plan(_spec(head_dim=64), SM80).config.dual_chain
    assert not planner.plan(_spec(head_dim=64, dtype="float32"), SM90).config.dual_chain
