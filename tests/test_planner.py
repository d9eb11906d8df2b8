"""Planner and IR: pure Python, fast. The Hilbert curve of SPEC's test vectors."""
from __future__ import annotations

import dataclasses
import json

import pytest

import dilgen
from dilgen.hilbert import gilbert_order, truncated_order
from dilgen.planner import plan
from dilgen.targets import INTERPRETER, SM80, SM90

VECTORS = {
    (4, 4): [0, 1, 5, 4, 8, 12, 13, 9, 10, 14, 15, 11, 7, 6, 2, 3],
    (2, 4): [0, 4, 5, 1, 2, 6, 7, 3],
    (3, 5): [0, 5, 10, 11, 6, 1, 2, 7, 12, 13, 14, 9, 8, 3, 4],
}


@pytest.mark.parametrize("grid", sorted(VECTORS))
def test_hilbert_test_vectors(grid):
    assert list(gilbert_order(*grid)) == VECTORS[grid]


@pytest.mark.parametrize("rows, cols", [(1, 7), (7, 1), (2, 2), (8, 8), (8, 16), (5, 9), (6, 7), (32, 64)])
def test_curve_is_a_permutation_starting_at_origin(rows, cols):
    order = gilbert_order(rows, cols)
    assert sorted(order) == list(range(rows * cols)) and order[0] == 0


def test_truncated_order_keeps_curve_order():
    assert truncated_order(4, 4, 10) == (0, 1, 5, 4, 8, 9, 7, 6, 2, 3)


def _spec(**kw):
    kw.setdefault("name", "p")
    kw.setdefault("num_heads", 8)
    kw.setdefault("head_dim", 64)
    return dilgen.Spec(**kw)


def test_lattice_classes_for_nested_rates():
    p = plan(_spec(segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4]), SM90)
    assert p.query.lattice == 4
    assert p.query.class_order[0] == 0                      # d = 0 is kept by every branch
    assert list(p.query.class_work) == sorted(p.query.class_work, reverse=True)
    assert [b.key_map.text for b in p.branches] == ["j + o + 2048*s", "2*j + o + 4096*s", "4*j + o + 8192*s"]
    assert all(b.keep_map is None and b.single_segment for b in p.branches)


def test_row_membership_when_r_does_not_divide_w():
    p = plan(_spec(segment_lengths=[10], dilation_rates=[3]), SM90)
    assert p.query.lattice == 1 and p.branches[0].keep_map is not None
    assert p.branches[0].keep_map.text == "((((u) % 10)) % 3)"


def test_hilbert_tables_in_ir():
    p = plan(_spec(segment_lengths=[16, 64], dilation_rates=[3, 2], hilbert={"scope": "segment"}), SM90)
    assert [t.name for t in p.tables] == ["segment_4x4", "segment_8x8"]
    # r = 1 keeps every position of a segment in any order: no table, a raster branch
    p = plan(_spec(segment_lengths=[16, 64], dilation_rates=[1, 2], hilbert={"scope": "segment"}), SM90)
    assert [t.name for t in p.tables] == ["segment_8x8"]
    assert p.branches[0].order is None and not p.branches[0].lanes and p.branches[1].lanes
    # scope "sequence", non-causal: the runtime permutes whole rows (row_order), the kernels
    # read no table; causal keeps the query-order table (its mask compares raster positions)
    p = plan(_spec(segment_lengths=[16], dilation_rates=[1], hilbert={"scope": "sequence", "grid": [8, 8]}), SM90)
    assert p.query.order is None and not p.tables and p.row_order.name == "curve_8x8"
    assert p.to_json()["row_order"]["scope"] == "sequence"
    p = plan(_spec(segment_lengths=[16], dilation_rates=[1], causal=True,
                   hilbert={"scope": "sequence", "grid": [8, 8]}), SM90)
    assert p.query.order is not None and p.query.order.name == "curve_8x8" and p.row_order is None
    assert "row_order" not in p.to_json()


def test_plan_key_is_stable_and_target_dependent():
    spec = _spec(segment_lengths=[64, 128], dilation_rates=[1, 2])
    assert plan(spec, SM90).key() == plan(spec, SM90).key()
    assert plan(spec, SM90).key() != plan(spec, SM80).key() or plan(spec, SM90).config == plan(spec, SM80).config
    assert plan(spec, SM90).key() != plan(spec, INTERPRETER).key()
    json.loads(plan(spec, SM90).dumps())


def test_tuning_overrides_blocks():
    spec = _spec(segment_lengths=[2048], dilation_rates=[1])
    p = plan(spec, SM90, {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2})
    assert (p.config.block_m, p.config.block_n, p.config.num_warps, p.config.num_stages) == (64, 32, 4, 2)
    with pytest.raises(ValueError, match="unknown tuning"):
        plan(spec, SM90, {"bogus": 1})


def test_backward_tiles_are_planned_and_tunable():
    spec = _spec(segment_lengths=[2048, 4096], dilation_rates=[1, 2], head_dim=128)
    p = plan(spec, SM90)
    # the fused dkdv kernel's own tile (H200 sweep); dq from the backward table
    assert p.fused_dkdv and p.config.bwd_kv == (128, 64, 8, 3) and p.config.bwd_dq == (128, 64, 8, 3)
    causal = plan(spec.replace(causal=True), SM90)
    assert causal.config.bwd_kv == (64, 32, 4, 3)
    assert causal.config.bwd_dq == (64, 32, 4, 3)          # the H200 sweep's causal dq tile
    fallback = plan(spec.replace(segment_lengths=[128, 256]), SM90)  # 2*128 does not divide 128
    assert fallback.fused_dkdv and fallback.config.bwd_kv == (64, 32, 4, 3)
    unfused = plan(spec.replace(segment_lengths=[64, 128]), SM90)    # nor 2*64 64
    assert not unfused.fused_dkdv and unfused.config.bwd_kv == (64, 32, 4, 3)
    tuned = plan(spec, SM90, {"bwd_kv": [128, 64, 8, 3], "bwd_dq": [64, 32, 4, 3]})
    assert tuned.config.bwd_kv == (128, 64, 8, 3) and tuned.config.bwd_dq == (64, 32, 4, 3)
    assert tuned.key() != p.key()
    with pytest.raises(ValueError, match="bwd_kv"):
        plan(spec, SM90, {"bwd_kv": [64, 32, 4]})


def test_fused_dkdv_only_for_raster_lattice_branches():
    def fused(**kw):
        return plan(_spec(**kw), SM90).fused_dkdv
    assert fused(segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4])
    # causal on sm90: the per-branch dkdv's square diagonals beat the lattice tile's L times
    # wider one from L = 2 on (Target.causal_max_lattice); sm80 keeps the fused one up to L = 4
    assert not fused(segment_lengths=[2048, 4096], dilation_rates=[1, 2], causal=True)
    assert fused(segment_lengths=[2048], dilation_rates=[1], causal=True)
    assert plan(_spec(segment_lengths=[2048, 4096], dilation_rates=[1, 2], causal=True), SM80).fused_dkdv
    # the tuning key fused_dkdv = False takes the per-branch dkdv whatever the target says
    assert not plan(_spec(segment_lengths=[2048, 4096], dilation_rates=[1, 2]), SM90,
                    {"fused_dkdv": False}).fused_dkdv
    # a lane branch (3 does not divide w; a curve table) takes the per-branch dkdv after
    # the fused launch of the others
    assert fused(segment_lengths=[2048, 4096], dilation_rates=[1, 3])
    assert fused(segment_lengths=[2048, 4096], dilation_rates=[1, 2], hilbert={"scope": "segment"})
    assert not fused(segment_lengths=[2048, 4096], dilation_rates=[3, 6])    # every branch a row-membership one
    # scope "sequence": non-causal runs on permuted rows (row_order), so fused like raster;
    # causal reads the query-order table, so per branch
    assert fused(segment_lengths=[2048], dilation_rates=[1], hilbert={"scope": "sequence", "grid": [32, 64]})
    assert not fused(segment_lengths=[2048], dilation_rates=[1], causal=True,
                     hilbert={"scope": "sequence", "grid": [32, 64]})
    assert not fused(segment_lengths=[2048, 4096], dilation_rates=[1, 2], ring_size=2)
    assert not fused(segment_lengths=[64, 128], dilation_rates=[1, 2])         # L*64 does not divide 64


def test_planner_imports_no_torch():
    import subprocess
    import sys
    code = ("import sys, dilgen.planner, dilgen.codegen; "
            "bad = [m for m in ('torch', 'triton') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_lane_branches_are_the_row_membership_ones():
    """r not dividing w, or a curve table: the branch runs as a lane kernel (its own launch,
    query tiles along its kept lanes); the fused kernel keeps the lattice of the others."""
    p = plan(_spec(segment_lengths=[2048, 4096, 8192, 16384, 32768], dilation_rates=[1, 2, 4, 6, 12]), SM90)
    assert [b.lanes for b in p.branches] == [False, False, False, True, True]
    assert p.query.lattice == 4 and p.fused_dkdv
    assert all(b.single_segment for b in p.branches)
    # work of the fused kernel's classes counts only its own branches
    assert sum(p.query.class_work) == 4 * 2048 + 2 * 2048 + 2048
    # a ring keeps every branch in the fused (windowed) kernel
    ring = plan(_spec(segment_lengths=[2048, 16384], dilation_rates=[1, 6], ring_size=2), SM90)
    assert not any(b.lanes for b in ring.branches)


def test_lanes_all_tuning():
    spec = _spec(segment_lengths=[2048, 4096], dilation_rates=[1, 2], causal=True)
    p = plan(spec, SM90, {"lanes": "all"})
    assert all(b.lanes for b in p.branches) and p.query.lattice == 2 and not p.fused_dkdv
    with pytest.raises(ValueError, match="lanes"):
        plan(spec, SM90, {"lanes": "some"})


def test_no_branch_keeping_every_row_runs_lanes_on_sm90():
    """Non-causal with no r = 1 branch: every branch a lane branch with descriptor loads on
    sm90 (the fused kernel would tile lattice classes that no branch keeps); an r = 1 branch
    keeps the fused kernel; sm80 keeps it either way; torchscale's block offsets keep the
    lanes' pointer loads."""
    d = dict(segment_lengths=[4096, 16384], dilation_rates=[4, 16], num_heads=16, head_dim=128)
    p = plan(_spec(**d), SM90)
    assert all(b.lanes for b in p.branches) and p.config.lane_tma and p.config.lane_ws
    p = plan(_spec(**dict(d, dilation_rates=[1, 16])), SM90)
    assert not any(b.lanes for b in p.branches) and not p.config.lane_tma
    p = plan(_spec(**d), SM80)
    assert not any(b.lanes for b in p.branches) and not p.config.lane_tma
    p = plan(_spec(**dict(d, head_offsets="block")), SM90)
    assert all(b.lanes for b in p.branches) and not p.config.lane_tma


@pytest.mark.parametrize("head_dim, ring_size, causal, fwd_tma, bwd_tma", [
    (128, 1, False, True, True),       # A: the forward's descriptors pay at head_dim 128
    (128, 1, True, False, True),       # causal: the forward keeps pointer loads, as without dropout
    (64, 1, False, False, True),       # C: the backward's only
    (128, 2, False, False, False)])    # a ring's windows start their blocks before the window
def test_the_dropout_plan_reads_through_descriptors_where_they_pay(head_dim, ring_size, causal, fwd_tma, bwd_tma):
    spec = dilgen.Spec(name="drop_plan", num_heads=8, head_dim=head_dim, dtype="bfloat16", causal=causal,
                       segment_lengths=[2048, 4096], dilation_rates=[1, 2], ring_size=ring_size)
    config = plan(spec, SM90, {"dropout": True}).config
    assert (config.fused_tma, config.bwd_tma, config.dual_chain, config.fused_ws) == (fwd_tma, bwd_tma, False, False)
    assert plan(spec, SM90, {"dropout": True, "fused_tma": False, "bwd_tma": False}).config.bwd_tma is False


def test_the_dropout_plan_runs_the_gluon_forward_where_one_device_can():
    """sm90, non-causal, one device: the Gluon forward and dQ (common.gluon_coins); a ring's
    windows and causal specs keep the `tl` kernels, and the dK/dV is the `tl` one."""
    spec = dict(name="drop_gluon", num_heads=8, head_dim=128, dtype="bfloat16", segment_lengths=[2048, 4096],
                dilation_rates=[1, 2])
    config = plan(dilgen.Spec(**spec), SM90, {"dropout": True}).config
    assert config.gluon_fwd == (128, 3) and config.gluon_dq == 4 and not (config.gluon_dkdv or config.gluon_lanes)
    for other in (dict(ring_size=2), dict(causal=True)):
        config = plan(dilgen.Spec(**spec, **other), SM90, {"dropout": True}).config
        assert config.gluon_fwd is None and config.gluon_dq is None, other


def test_dkdv_rows_first_is_the_dropout_plans_or_the_gluon_dkdvs_and_refused_elsewhere():
    spec = dilgen.Spec(name="rows_first", num_heads=4, head_dim=64, dtype="bfloat16",
                       segment_lengths=[256, 512], dilation_rates=[1, 2])
    assert plan(spec, SM90, {"dropout": True, "dkdv_rows_first": True}).config.dkdv_rows_first
    assert not plan(spec, SM90, {"dropout": True}).config.dkdv_rows_first
    with pytest.raises(dilgen.SpecError, match="dkdv_rows_first applies to the dropout plan's dK/dV or to the Gluon"):
        plan(spec, SM90, {"dkdv_rows_first": True})       # the fused dK/dV
    causal = dataclasses.replace(spec, causal=True)           # the Gluon per-branch dK/dV
    assert plan(causal, SM90).config.gluon_dkdv_lanes and not plan(causal, SM90).config.dkdv_rows_first
    assert plan(causal, SM90, {"dkdv_rows_first": True}).config.dkdv_rows_first
    wide = dataclasses.replace(causal, head_dim=128)          # its default at head_dim 128, not with dropout
    assert plan(wide, SM90).config.dkdv_rows_first and not plan(wide, SM90, {"dkdv_rows_first": False}).config.dkdv_rows_first
    assert not plan(wide, SM90, {"dropout": True}).config.dkdv_rows_first
    assert not plan(wide, SM80).config.dkdv_rows_first
