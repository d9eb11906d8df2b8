"""Lane kernels (issue 12): branches whose membership is per row (r not dividing w, a curve
table), or every branch with the tuning `lanes = "all"` (the GPU default for causal specs
with a wide lattice), run in their own launch over their kept lanes and merge into
(out, lse) by LongNet Eq. 10. Forward, lse and gradients against the float64 reference,
outputs poisoned (conftest), on the CPU (interpreter) or the GPU."""
from __future__ import annotations

import math

import pytest
import torch

import dilgen
from dilgen.compiler import Kernel
from dilgen.planner import plan
from dilgen.runtime.interpreter import interpreting
from dilgen.targets import INTERPRETER

from conftest import check_against_reference

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
    # no r = 1 branch, every branch as lanes: Delta only at rows n = h mod gcd(r) (Plan.delta_step 2)
    ("all_noncausal_no_r1_gqa_short_last", dict(segment_lengths=[32, 64], dilation_rates=[2, 4], num_heads=4,
                                                num_kv_heads=2), (2, 150), {"lanes": "all"}),
    ("all_causal_no_r1_head_base", dict(segment_lengths=[16, 64], dilation_rates=[4, 8], causal=True,
                                        head_base=1), (1, 100), {"lanes": "all"}),
    ("bf16_mix", dict(segment_lengths=[32, 100], dilation_rates=[2, 6], dtype="bfloat16", num_heads=6,
                      causal=True), (1, 160), None),
    ("tma_ws_all_causal_gqa", dict(segment_lengths=[32, 64], dilation_rates=[2, 4], causal=True, num_heads=4,
                                   num_kv_heads=2), (1, 110), {"lanes": "all", "lane_tma": True, "lane_ws": True}),
    ("tma_mix_short_last", dict(segment_lengths=[32, 64, 100], dilation_rates=[1, 2, 6], num_heads=6), (1, 150),
     {"lane_tma": True}),
    ("fp16_all", dict(segment_lengths=[32, 64], dilation_rates=[1, 4], dtype="float16", causal=True),
     (1, 100), {"lanes": "all"}),
    # curve_rows: Hilbert lane branches read compact curve-ordered copies; the table path
    # stays for packed batches and is checked here with the copies turned off
    ("hilbert_table_path", dict(segment_lengths=[16, 64], dilation_rates=[2, 4], num_heads=8, num_kv_heads=4,
                                causal=True, hilbert={"scope": "segment"}), (2, 90), {"curve_rows": False}),
    ("hilbert_curve_tma_ws_causal_gqa", dict(segment_lengths=[16, 64], dilation_rates=[2, 4], num_heads=8,
                                             num_kv_heads=4, causal=True, hilbert={"scope": "segment"}),
     (1, 100), {"lanes": "all", "lane_tma": True, "lane_ws": True}),
    ("dq_tma_ws_all_causal_gqa_short_last", dict(segment_lengths=[32, 64, 100], dilation_rates=[1, 2, 6],
                                                 causal=True, num_heads=6, num_kv_heads=3), (1, 150),
     {"lanes": "all", "lane_tma": True, "lane_ws": True, "lane_dq_tma": True}),
    ("hilbert_curve_dq_tma_causal", dict(segment_lengths=[16, 64], dilation_rates=[2, 4], num_heads=8,
                                         num_kv_heads=4, causal=True, hilbert={"scope": "segment"}),
     (1, 100), {"lanes": "all", "lane_tma": True, "lane_ws": True, "lane_dq_tma": True}),
    # sm90's lane flags (lane_tiles_fastest changes the grid of packed batches only: test_varlen)
    ("tiles_fastest_causal_gqa_batch", dict(segment_lengths=[32, 64, 100], dilation_rates=[1, 2, 6],
                                            causal=True, num_heads=6, num_kv_heads=3), (2, 150),
     {"lanes": "all", "lane_tma": True, "lane_ws": True, "lane_tiles_fastest": True}),
    # chosen lane branches (tuning lanes = [i, ...]): the long high-r branches leave the fused
    # kernel, whose lattice L falls from 8 to 2 (bench_ring's raster spec: L 32 -> 16)
    ("chosen_long_branches", dict(segment_lengths=[16, 32, 128, 256], dilation_rates=[1, 2, 4, 8]), (1, 200),
     {"lanes": [2, 3]}),
    # a chosen branch whose r leaves L (8 -> 1) while the `tl` fused dK/dV runs: that kernel's key
    # classes cover r | L only, the per-branch dK/dV the chosen one (its dK, dV were wrong before)
    ("chosen_out_of_fused_dkdv_gqa", dict(segment_lengths=[64, 512], dilation_rates=[1, 8], num_heads=4,
                                          num_kv_heads=2), (1, 512), {"lanes": [1]}),
    ("chosen_causal_gqa_short_last", dict(segment_lengths=[16, 64, 100], dilation_rates=[1, 2, 4], causal=True,
                                          num_heads=4, num_kv_heads=2), (2, 150), {"lanes": [2]}),
    ("hilbert_curve_padded_head_dim", dict(segment_lengths=[16, 64], dilation_rates=[3, 4], head_dim=24,
                                           num_heads=6, num_kv_heads=2, hilbert={"scope": "segment"}), (1, 77), None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lane_branches_forward_and_gradients(case):
    name, fields, (batch, n), tuning = case
    fields = {"num_heads": 4, "head_dim": 16, "dtype": "float32", **fields}
    spec = dilgen.Spec(name="l_" + name, **fields)
    p = plan(spec, INTERPRETER, tuning)
    assert any(b.lanes for b in p.branches), "the case must exercise a lane kernel"
    if name == "chosen_out_of_fused_dkdv_gqa":
        assert p.fused_dkdv and p.query.lattice == 1, "the case must run the fused dK/dV beside it"
        assert [b.fused_dkdv for b in p.branches] == [True, False]      # r = 8 does not divide L = 1
    check_against_reference(spec, batch, n, tuning, name)


def test_the_preprocess_computes_delta_at_the_kept_rows_only():
    """Plan.delta_step m: with every branch a lane branch of r > 1 in raster order, head h's rows
    n = (h + head_base) mod m + k m get Delta = rowsum(dO * O) and no other row is written (it
    stays NaN); m = 1 where a branch keeps rows of every residue or the rows are not raster."""
    def step(tuning=None, **fields):
        spec = dilgen.Spec(name="l_step", **{"num_heads": 4, "head_dim": 16, "dtype": "float32", **fields})
        return plan(spec, INTERPRETER, tuning).delta_step
    lanes = {"lanes": "all"}
    assert step(lanes, segment_lengths=[16, 64], dilation_rates=[4, 16]) == 4
    assert step(lanes, segment_lengths=[24, 48], dilation_rates=[4, 6]) == 2
    assert step(lanes, segment_lengths=[16, 64], dilation_rates=[4, 16], head_base=3) == 4
    assert step(lanes, segment_lengths=[16, 64], dilation_rates=[1, 4]) == 1            # r = 1 keeps every row
    assert step(lanes, segment_lengths=[18, 64], dilation_rates=[4, 16]) == 1           # 4 does not divide 18
    assert step(lanes, segment_lengths=[16, 64], dilation_rates=[4, 16], head_offsets="block") == 1
    assert step(lanes, segment_lengths=[16, 64], dilation_rates=[4, 16], hilbert={"scope": "segment"}) == 1
    assert step(lanes, segment_lengths=[16, 64], dilation_rates=[4, 16], ring_size=2) == 1
    assert step(None, segment_lengths=[16, 64], dilation_rates=[4, 16]) == 1            # the fused kernel's classes

    spec = dilgen.Spec(name="l_delta_rows", num_heads=4, head_dim=16, dtype="float32", segment_lengths=[16, 64],
                       dilation_rates=[4, 8], head_base=1)
    attn = Kernel(spec, None, lanes).compiled_for(torch.device("cpu")).attention
    m = attn.backward_kernels["config"]["delta_step"]
    assert m == 4
    B, N, H, D = 2, 100, 4, 16
    out, dout = torch.randn(B, N, H, D), torch.randn(B, N, H, D)
    delta = torch.full((B, H, N), float("nan"))
    pre = attn._kernel(True, source_fn=attn.backward_kernels["preprocess"])
    grid = (math.ceil(math.ceil(N / m) / attn.backward_kernels["config"]["pre_block"]), B * H)
    with interpreting():
        pre[grid](out, dout, delta, delta, N, *out.stride()[:3], *dout.stride()[:3], *delta.stride()[:2], False, m)
    want = (out * dout).sum(-1).transpose(1, 2)
    kept = (torch.arange(N)[None, :] % m == (torch.arange(H)[:, None] + 1) % m).expand(B, H, N)
    torch.testing.assert_close(delta[kept], want[kept])
    assert delta[~kept].isnan().all()


def test_the_plan_refuses_a_fused_dkdv_branch_it_cannot_take():
    """BranchIR.fused_dkdv (the planner's choice, read by the template and the runtime) is
    checked where the plan is made: only class-membership branches with r | L, and a plan
    whose fused dK/dV takes no branch (or that runs none) is refused."""
    import dataclasses
    spec = dilgen.Spec(name="l_fused_flags", num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                       segment_lengths=[64, 512], dilation_rates=[1, 8])
    good = plan(spec, INTERPRETER, {"lanes": [1]})
    wrong = [dataclasses.replace(good.branches[0]), dataclasses.replace(good.branches[1], fused_dkdv=True)]
    with pytest.raises(ValueError, match="branch 1: the fused dK/dV's key classes need r . L"):
        dataclasses.replace(good, branches=tuple(wrong))
    with pytest.raises(ValueError, match="Plan.fused_dkdv is False but the fused dK/dV takes branches"):
        dataclasses.replace(good, fused_dkdv=False)
    row = plan(dilgen.Spec(name="l_fused_row", num_heads=4, head_dim=16, dtype="float32",
                           segment_lengths=[64, 96], dilation_rates=[1, 5]), INTERPRETER)
    assert row.branches[1].keep_map is not None and not row.branches[1].fused_dkdv
    with pytest.raises(ValueError, match="class membership only"):
        dataclasses.replace(row.branches[1], fused_dkdv=True)


def test_chosen_lane_branches_leave_the_fused_lattice():
    """Tuning lanes = [indices]: those branches (and the ones "auto" takes) run as lanes, the
    fused kernel's L is the lcm of the rest; a bad list is refused naming the branches."""
    spec = dilgen.Spec(name="l_chosen", num_heads=4, head_dim=16, dtype="float32",
                       segment_lengths=[16, 32, 128, 256], dilation_rates=[1, 2, 4, 8])
    auto, chosen = plan(spec, INTERPRETER), plan(spec, INTERPRETER, {"lanes": [2, 3]})
    assert [b.lanes for b in auto.branches] == [False] * 4 and auto.query.lattice == 8
    assert [b.lanes for b in chosen.branches] == [False, False, True, True] and chosen.query.lattice == 2
    for bad in ([4], [1, 1], [], ["2"], [True]):
        with pytest.raises(ValueError, match="distinct branch indices 0 .. 3"):
            plan(spec, INTERPRETER, {"lanes": bad})
    with pytest.raises(ValueError, match="or a list of branch indices"):
        plan(spec, INTERPRETER, {"lanes": "some"})


def test_split_runs_as_lanes_the_branches_that_keep_the_gluon_forward_out():
    """Tuning lanes = "split" (sm90): the highest-rate lattice branches go to lanes until the
    rest's L fits the Gluon forward (bench_ring's raster spec: r 32 out, L 32 -> 16); a plan
    the Gluon forward already takes, or a target without it, is left as "auto" plans it."""
    from dilgen.targets import get_target
    sm90 = get_target("sm90")
    raster = dilgen.Spec(name="l_split", num_heads=16, head_dim=128, dtype="bfloat16",
                         segment_lengths=[2048, 8192, 32768, 131072, 524288, 1048576],
                         dilation_rates=[1, 2, 4, 8, 16, 32])
    split = plan(raster, sm90, {"lanes": "split"})
    assert [b.lanes for b in split.branches] == [False] * 5 + [True] and split.query.lattice == 16
    import dataclasses
    unsplit = dataclasses.replace(sm90, split_wide_lattice=False)
    assert split.config.gluon_fwd is not None and plan(raster, unsplit).config.gluon_fwd is None
    a_like = dilgen.Spec(name="l_split_a", num_heads=16, head_dim=128, dtype="bfloat16",
                         segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4])
    assert [b.lanes for b in plan(a_like, sm90, {"lanes": "split"}).branches] == [False] * 3
    assert [b.lanes for b in plan(raster, INTERPRETER, {"lanes": "split"}).branches] == [False] * 6
    # sm90's defaults: the split and the Gluon backward beside its lane, untuned
    flipped = sm90
    assert flipped.split_wide_lattice and flipped.gluon_bwd_beside_lanes
    untuned = plan(raster, flipped)
    assert [b.lanes for b in untuned.branches] == [False] * 5 + [True]
    assert untuned.config.gluon_fwd and untuned.config.gluon_dkdv and untuned.config.gluon_dq
    assert plan(raster, flipped, {"gluon_dkdv": False}).config.gluon_dkdv is None   # a tuning still decides


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


def test_curve_rows_copies_are_the_kept_rows_in_curve_order():
    """<name>_curve_rows: compact row s*LW + j of (head, slot) is the raster row Fwd[s*w + o + r*j]
    of that head (o from the slot), zeros past a short segment's lanes; for k/v with GQA
    (group < r and group >= r), q-like rows (one slot per head) and lse-like values."""
    from dilgen.runtime.curve_rows import compact_rows, copy_rows
    from dilgen.runtime.tables import table_tensors
    for heads, kv_heads, (w, r), n in ((8, 4, (64, 4), 150), (8, 2, (64, 3), 130), (6, 6, (16, 2), 40)):
        spec = dilgen.Spec(name=f"l_curve_rows_{heads}_{kv_heads}_{r}", num_heads=heads, num_kv_heads=kv_heads,
                           head_dim=24, dtype="float32", segment_lengths=[16, w], dilation_rates=[2, r],
                           hilbert={"scope": "segment"})
        attn = Kernel(spec).compiled_for(torch.device("cpu")).attention
        br = attn.plan["branches"][1]
        assert br["curve_rows"] and attn.curve_kernel is not None
        tables = []
        for t in attn.plan["tables"]:
            tables.extend(table_tensors(t, n, torch.device("cpu")))
        fwd = table_tensors(br["order"], n, torch.device("cpu"))[0].long()
        lw = -(-min(w, n) // r)
        assert compact_rows(br, n) == -(-n // w) * lw
        group = heads // kv_heads
        x, y = torch.randn(2, n, kv_heads, 24), torch.randn(2, n, kv_heads, 24)
        xc, yc = copy_rows(attn, True, br, tables, x, y, heads=kv_heads, group=group)
        lse = torch.randn(2, heads, n)
        lc, _ = copy_rows(attn, True, br, tables, lse, lse, heads=heads, group=1, positions_last=True)
        for h in range(heads):
            kvh = h // group
            o = h % r
            slot = o if group >= r else h - kvh * group
            for s in range(-(-n // w)):
                n_lanes = max(min(n - s * w, w) - o + r - 1, 0) // r
                rows = fwd[s * w + o + r * torch.arange(n_lanes)]
                got = xc[:, kvh, slot, s * lw: s * lw + n_lanes]
                assert torch.equal(got, x[:, rows, kvh]), (h, s)
                assert torch.equal(yc[:, kvh, slot, s * lw: s * lw + n_lanes], y[:, rows, kvh])
                assert torch.equal(xc[:, kvh, slot, s * lw + n_lanes: (s + 1) * lw],
                                   torch.zeros_like(xc[:, kvh, slot, s * lw + n_lanes: (s + 1) * lw]))
                assert torch.equal(lc[:, h, 0, s * lw: s * lw + n_lanes], lse[:, h, rows])


def test_hilbert_lanes_copy_rows_once_per_branch():
    """A Hilbert lane branch copies its rows once (k, v) and walks the copies; packed batches
    keep the table (no copy)."""
    spec = dilgen.Spec(name="l_curve_launches", num_heads=4, head_dim=16, dtype="float32",
                       segment_lengths=[16, 64], dilation_rates=[1, 4], hilbert={"scope": "segment"})
    attn = Kernel(spec).compiled_for(torch.device("cpu")).attention
    calls = []
    real = attn._kernel

    def spy(interpret, source_fn=None):
        calls.append((source_fn or attn._source_fn).__name__)
        return real(interpret, source_fn)

    attn._kernel = spy
    try:
        attn.forward_raw(*(torch.randn(1, 100, 4, 16) for _ in range(3)))
        assert calls == ["l_curve_launches_fwd_kernel", "l_curve_launches_curve_rows", "l_curve_launches_fwd_lanes"]
        calls.clear()
        from dilgen.runtime.varlen import packing_from_cu_seqlens
        packing = packing_from_cu_seqlens(spec.name, torch.tensor([0, 37, 100], dtype=torch.int32), 100,
                                          torch.device("cpu"))
        attn.forward_raw(*(torch.randn(100, 4, 16) for _ in range(3)), packing=packing)
        assert "l_curve_launches_curve_rows" not in calls and "l_curve_launches_fwd_lanes" in calls
    finally:
        del attn._kernel


@pytest.mark.parametrize("w, r, n, bm, bn", [(64, 4, 150, 4, 8), (40, 3, 97, 8, 4), (64, 2, 64, 16, 16)])
def test_causal_curve_block_lists_cover_exactly_the_visible_pairs(w, r, n, bm, bn):
    """runtime.curve_rows.block_lists: a "full" block has every key at or before every query of
    the tile (no mask needed), a skipped block has no key at or before any query, and the full
    and partial lists together hold every block with a visible pair, each once."""
    from dilgen.runtime.curve_rows import block_lists
    from dilgen.runtime.tables import table_tensors
    side = {64: (8, 8), 40: (5, 8)}[w]
    table = {"scope": "segment", "grid": list(side), "name": "t", "curve": "gilbert2d"}
    fwd = table_tensors(table, n, torch.device("cpu"))[0].long()
    _check_block_lists(block_lists({"w": w, "r": r}, fwd, n, bm, bn), fwd, w, r, n, bm, bn, True)
    # the key-major form (dkdv): tiles of bm keys, listed blocks of bn queries
    _check_block_lists(block_lists({"w": w, "r": r}, fwd, n, bm, bn, keys_listed=False), fwd, w, r, n, bm, bn, False)


def _check_block_lists(lists, fwd, w, r, n, bm, bn, keys_listed):
    counts, blocks = lists
    for s in range(-(-n // w)):
        for o in range(r):
            n_lanes = max(min(n - s * w, w) - o + r - 1, 0) // r
            pos = fwd[s * w + o + r * torch.arange(n_lanes)]
            for mt in range(counts.shape[2]):
                qs = pos[mt * bm: (mt + 1) * bm]
                n_full, n_part = counts[s, o, mt].tolist()
                full = blocks[s, o, mt, 0, :n_full].tolist()
                part = blocks[s, o, mt, 1, :n_part].tolist()
                assert len(set(full + part)) == n_full + n_part
                for jb in range(blocks.shape[-1]):
                    ks = pos[jb * bn: (jb + 1) * bn]
                    if not keys_listed:     # the tile holds keys, the listed block queries
                        qs, ks = ks, qs
                    visible = bool(len(qs) and len(ks) and (ks[:, None] <= qs[None, :]).any())
                    assert visible == (jb in full or jb in part), (s, o, mt, jb)
                    if jb in full:
                        assert len(ks if keys_listed else qs) == bn and bool((ks.max() <= qs.min()))
                    if not keys_listed:
                        qs, ks = ks, qs


def test_descriptor_allocator_is_set_in_every_thread(monkeypatch):
    """Triton keeps the TMA scratch allocator per thread (a context variable) and autograd runs
    the backward (and checkpoint recomputations) on its own thread: the runtime sets it once
    per thread, not once per process."""
    import threading
    import triton
    from dilgen.runtime import launch
    seen = []
    monkeypatch.setattr(triton, "set_allocator", lambda fn: seen.append(threading.get_ident()))
    monkeypatch.setattr(launch, "_TMA_ALLOCATOR", threading.local())
    launch.ensure_descriptor_allocator()
    launch.ensure_descriptor_allocator()
    worker = threading.Thread(target=launch.ensure_descriptor_allocator)
    worker.start()
    worker.join()
    assert len(seen) == 2 and seen[0] != seen[1]
