"""The ring's "recut" transport's plan and price (schedule.recut_pieces, transport_costs) and
its refusal; its rows and gradients against the float64 reference run in test_ring.py
(CASES_P2, CASES_P4: recut_*) and test_dropout.py (forced_recut_*)."""
import math

import pytest

import dilgen
from dilgen.calibration import DEFAULT
from dilgen.runtime.checks import InputError
from dilgen.schedule import (pick_transport, recut_moved_rows, recut_pieces, ring_pieces, ring_schedule,
                             transport_costs)


def _ring(P: int, ws: list[int], causal: bool = False) -> dict:
    return {"ring_size": P, "causal": causal, "one_kv_head_per_query_head": True,
            "branches": [{"index": i, "w": w, "r": 1, "raster": True} for i, w in enumerate(ws)]}


@pytest.mark.parametrize("P, ws, n, order", [
    (2, [1000, 48000], 200_000, "contiguous"),
    (2, [3000, 30000], 131_072, "zigzag"),
    (4, [4, 16], 64, "zigzag"),
    (4, [6, 10], 240, "contiguous"),
    (8, [24, 40], 960, "zigzag"),
])
def test_recut_borders_are_segment_borders_and_the_pieces_tile_the_sequence(P, ws, n, order):
    got = recut_pieces(_ring(P, ws), n, order)
    L = math.lcm(*ws)
    rows = sorted(p for rank in got for p in rank)
    assert rows[0][0] == 0 and sum(ln for _, ln in rows) == n
    for (a, la), (b, _) in zip(rows, rows[1:]):
        assert a + la == b and b % L == 0          # contiguous, every border on a multiple of L
    for rank in got:
        assert rank == sorted(rank) and all(ln > 0 for _, ln in rank)
    # no choice of borders leaves fewer rows on the busiest rank than one more block of L
    assert max(sum(ln for _, ln in rank) for rank in got) <= n / P + L * (2 if order == "zigzag" else 1)


def test_recut_of_the_straddling_spec_moves_its_border_to_96000():
    assert recut_pieces(_ring(2, [1000, 48000]), 200_000) == [[(0, 96_000)], [(96_000, 104_000)]]
    assert recut_moved_rows([[(0, 100_000)], [(100_000, 100_000)]], [[(0, 96_000)], [(96_000, 104_000)]]) \
        == [4_000, 4_000]


def test_recut_keeps_aligned_pieces_and_refuses_a_segment_over_the_sequence():
    assert recut_pieces(_ring(2, [16, 32]), 128, "zigzag") == [[(0, 32), (96, 32)], [(32, 64)]]
    assert recut_pieces(_ring(2, [16, 128]), 128) is None          # one segment spans every rank
    assert recut_pieces(_ring(2, [40, 48]), 200) is None           # lcm 240: no border inside
    assert recut_pieces(_ring(2, [48, 80]), 256) == [[(0, 240)], [(240, 16)]]   # one border, at 240


def test_the_cost_model_prices_recut_by_its_busiest_rank_and_the_moved_rows():
    ring, n = _ring(2, [1000, 48000]), 200_000
    sched = ring_schedule(ring, n)
    shape = dict(batch=1, heads=16, kv_heads=16, head_dim=128, itemsize=2, lanes=False, heads_ok=True,
                 local_ok=False, rates=DEFAULT)
    costs = transport_costs(ring, sched, **shape, recut=recut_pieces(ring, n))
    without = transport_costs(ring, sched, **shape)
    assert "recut" not in without and set(without) < set(costs)
    local = transport_costs(ring, sched, **dict(shape, local_ok=True))["local"]["fwd_bwd_s"]
    # the busiest rank holds 104,000 of the 100,000 rows a rank holds, plus 4,000 rows moved
    assert 1.04 * local < costs["recut"]["fwd_bwd_s"] < 1.1 * local
    assert pick_transport(costs) == "recut"
    # moving more rows costs more: the same borders priced as if 40,000 rows moved
    far = transport_costs(ring, sched, **shape, recut=[[(0, 60_000)], [(60_000, 140_000)]])
    assert far["recut"]["fwd_bwd_s"] > costs["recut"]["fwd_bwd_s"]


def test_a_forced_recut_that_cannot_run_is_refused_by_name(monkeypatch):
    from dilgen.runtime.ring.run import _check_geometry
    spec = dilgen.Spec(name="recut_refused", num_heads=2, head_dim=16, segment_lengths=[16, 128],
                       dilation_rates=[1, 4], ring_size=2)
    kernel = dilgen.compile(spec)
    dilgen.compile(spec.replace(ring_size=1, name="recut_refused_twin"))
    attn = kernel.compiled_for(__import__("torch").device("cpu")).attention
    monkeypatch.setenv("DILGEN_RING_TRANSPORT", "recut")
    with pytest.raises(InputError, match=r"DILGEN_RING_TRANSPORT=recut cannot run this call: the segment "
                                         r"lengths' least common multiple is not below N = 128"):
        _check_geometry(attn, 64, 2, "contiguous", False)
    _check_geometry(attn, 128, 2, "contiguous", False)             # N = 256: the border moves to 128
    assert ring_pieces(256, 2) == recut_pieces(attn.plan["ring"], 256)


def test_recut_runs_whole_blocks_of_its_own_rows_on_views_and_copies_only_the_blocks_that_take_rows():
    from dilgen.runtime.ring.recut import split
    n, ws = 200_000, [1000, 48000]
    targets = recut_pieces(_ring(2, ws), n)
    copied, viewed = split(targets, ring_pieces(n, 2), 48_000)
    # rank 0 keeps [0, 96000) on a view; rank 1 assembles the block [96000, 144000) that takes
    # rank 0's rows 96000..99999 and runs its own [144000, 200000) on a view
    assert (copied, viewed) == ([[], [(96_000, 48_000)]], [[(0, 96_000)], [(144_000, 56_000)]])
    # zigzag: rank 1's two chunks are adjacent, so its block [60000, 90000) is one view
    n = 131_072
    copied, viewed = split(recut_pieces(_ring(2, [3000, 30000]), n, "zigzag"), ring_pieces(n, 2, "zigzag"), 30_000)
    assert copied == [[(90_000, 30_000)], [(30_000, 30_000)]]
    assert viewed == [[(0, 30_000), (120_000, 11_072)], [(60_000, 30_000)]]


def test_the_first_call_measures_a_spec_only_where_asked(monkeypatch):
    import torch

    from dilgen.runtime.ring.measure import wanted
    q = torch.zeros(1, 4, 2, 16)
    assert not wanted(q)                                       # auto: on a GPU only
    monkeypatch.setenv("DILGEN_RING_MEASURE", "1")
    assert wanted(q)
    monkeypatch.setenv("DILGEN_RING_MEASURE", "0")
    assert not wanted(q)
    monkeypatch.setenv("DILGEN_RING_MEASURE", "sometimes")
    with pytest.raises(InputError, match="DILGEN_RING_MEASURE='sometimes': use auto"):
        wanted(q)


def test_a_recut_move_packs_rows_of_every_dtype_into_one_buffer_and_back():
    """recut.pack / unpack: float32 statistics beside bfloat16 rows in one uint8 buffer (one
    transfer a peer), wider elements first so every part is aligned; the rows land where
    their runs say, the rows between them untouched."""
    import torch
    from dilgen.runtime.ring.recut import pack, packed_bytes, unpack
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(2, 40, 3, 8, generator=g).to(torch.bfloat16)
    lse = torch.randn(2, 3, 40, generator=g)
    half = torch.randn(2, 40, 3, 8, generator=g).half()
    runs_out, runs_in = [(5, 7), (20, 3)], [(1, 7), (30, 3)]
    buf = pack([rows, lse, half], [1, 2, 1], runs_out)
    assert buf.dtype == torch.uint8 and buf.numel() == packed_bytes([rows, lse, half], [1, 2, 1], 10)
    outs = [torch.full_like(rows, 7.0), torch.full_like(lse, 7.0), torch.full_like(half, 7.0)]
    unpack(buf, outs, [1, 2, 1], runs_in)
    for src, dst, d in zip([rows, lse, half], outs, [1, 2, 1]):
        for (a, m), (b, _) in zip(runs_out, runs_in):
            assert torch.equal(dst.narrow(d, b, m), src.narrow(d, a, m))
        untouched = torch.ones(dst.shape[d], dtype=torch.bool)
        for b, m in runs_in:
            untouched[b:b + m] = False
        assert (dst.index_select(d, untouched.nonzero().flatten()) == 7.0).all()


# -- a remote window of one branch as dense attention on its lanes (ring/lane_windows.py) ------
LANES = {"DILGEN_RING_LANE_WINDOWS": "1"}
LANE_CASES = [
    {"name": "lanes_one_branch", "spec": {"segment_lengths": [64], "dilation_rates": [4], "num_heads": 4},
     "shape": [2, 64], "env": LANES, "lane_windows": True},
    {"name": "lanes_hybrid", "spec": {"segment_lengths": [8, 16, 128], "dilation_rates": [1, 2, 4], "num_heads": 4},
     "shape": [1, 128], "transport": "hybrid", "env": LANES, "lane_windows": True},
    {"name": "lanes_allgather_bf16", "spec": {"segment_lengths": [64], "dilation_rates": [2], "dtype": "bfloat16"},
     "shape": [1, 64], "transport": "allgather", "env": LANES, "lane_windows": True},
    {"name": "lanes_r_over_heads", "spec": {"segment_lengths": [128], "dilation_rates": [8], "num_heads": 2},
     "shape": [1, 128], "env": LANES, "lane_windows": True},
    {"name": "lanes_heads_over_r", "spec": {"segment_lengths": [64], "dilation_rates": [2], "num_heads": 8},
     "shape": [1, 64], "env": LANES, "lane_windows": True},
    # what lanes do not take runs the fused windows: GQA (one offset per query head, not kv head)
    {"name": "lanes_gqa_fused", "spec": {"segment_lengths": [64], "dilation_rates": [4], "num_heads": 4,
                                         "num_kv_heads": 2}, "shape": [1, 64], "env": LANES},
]


@pytest.mark.ranks
@pytest.mark.timeout(400)
def test_lane_windows_match_the_single_device_reference(tmp_path):
    """Every rank's out, lse and gradients against the float64 reference, with the remote
    windows of a lone branch run as dense attention on its lanes (checked to have run)."""
    from test_ring import _run_ring
    reports = _run_ring(2, LANE_CASES, tmp_path, timeout_s=360)
    fails = [f for r in reports for f in r["fails"]]
    assert not fails, "\n".join(fails)
    assert all(r["passed"] == [c["name"] for c in LANE_CASES] for r in reports)
