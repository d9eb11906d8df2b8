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


class _Wire:
    """Point-to-point transfers among P simulated ranks of one process: each rank's post
    records its batch; deliver() copies every send into the matching receive (same pair)."""

    def __init__(self):
        self.sends, self.recvs = {}, {}

    class P2POp:
        def __init__(self, op, tensor, peer, group):
            self.op, self.tensor, self.peer = op, tensor, peer

    def isend(self):
        pass

    def irecv(self):
        pass

    def batch_isend_irecv(self, ops, me=None):
        for o in ops:
            (self.sends if o.op == self.isend else self.recvs)[(self._me, o.peer)] = o.tensor
        return [type("Work", (), {"wait": lambda self: None})()]

    def deliver(self):
        assert {(a, b) for a, b in self.sends} == {(b, a) for a, b in self.recvs}, "unmatched transfers"
        for (a, b), buf in self.sends.items():
            dst = self.recvs[(b, a)]
            assert dst.numel() == buf.numel(), "a receive of another size than its send"
            dst.copy_(buf)
        self.sends, self.recvs = {}, {}


@pytest.mark.parametrize("seed", range(12))
def test_recut_moves_every_row_to_its_new_rank_and_back(seed):
    """recut.post / arrive over random recut layouts (P 2..4, both chunk orders, two segment
    lengths, B 1..2, bfloat16 rows beside float32 statistics), all ranks in one process: the
    copied layout holds exactly the global rows split() assigns it, and moving back restores
    every rank's rows."""
    import random
    import torch
    from dilgen.runtime.ring.recut import arrive, post, split
    rnd = random.Random(seed)
    P, order = rnd.choice([2, 3, 4]), rnd.choice(["contiguous", "zigzag"])
    w1 = rnd.choice([2, 3, 4, 6])
    ws = [w1, w1 * rnd.choice([2, 3, 5])]
    L = math.lcm(*ws)
    n = 2 * P * L * rnd.choice([1, 2, 3]) + rnd.choice([0, 2 * P])
    targets = recut_pieces(_ring(P, ws), n, order)
    assert targets is not None
    pieces = ring_pieces(n, P, order)
    copied, viewed = split(targets, pieces, L)
    B, H = rnd.choice([1, 2]), 2
    rows_of = lambda layout: torch.cat([torch.arange(s, s + ln) for s, ln in layout]) if layout else \
        torch.zeros(0, dtype=torch.long)  # noqa: E731
    # a rank's tensors: (B, rows, H, 3) bfloat16 and (B, H, rows) float32, each entry naming its global row
    def tensors(layout):
        g = rows_of(layout).float()
        x = (g[None, :, None, None] + 1000 * torch.arange(B)[:, None, None, None]).expand(B, len(g), H, 3)
        return [x.to(torch.bfloat16).contiguous(), (g[None, None, :] * 0.5).expand(B, H, len(g)).contiguous()]
    wire = _Wire()
    runs = [type("Run", (), {"P": P, "me": r, "dist": wire, "group": None, "peer": staticmethod(lambda d: d)})()
            for r in range(P)]
    mine = [tensors(pieces[r]) for r in range(P)]
    posted = []
    for r in range(P):
        wire._me = r
        posted.append(post(runs[r], mine[r], pieces, copied, [1, 2]))
    wire.deliver()
    moved = [arrive(runs[r], posted[r]) for r in range(P)]
    for r in range(P):
        want = tensors(copied[r])
        assert all(torch.equal(a, b) for a, b in zip(moved[r], want)), f"rank {r}: rows of another rank landed wrong"
        # every row of the copied blocks is some rank's, and no row of mine is both viewed and copied
        assert not set(rows_of(copied[r]).tolist()) & set(rows_of(viewed[r]).tolist())
        assert sorted(rows_of(copied[r]).tolist() + rows_of(viewed[r]).tolist()) == \
            sorted(rows_of(targets[r]).tolist())
    back, posted = [[torch.full_like(t, -1.0) for t in mine[r]] for r in range(P)], []
    for r in range(P):
        wire._me = r
        posted.append(post(runs[r], moved[r], copied, pieces, [1, 2], into=back[r]))
    wire.deliver()
    every_copied = rows_of([p for rank in copied for p in rank])
    for r in range(P):
        arrive(runs[r], posted[r])
        went = torch.isin(rows_of(pieces[r]), every_copied)       # my rows some rank assembled
        for d, got, want in zip((1, 2), back[r], mine[r]):
            out, stay = went.nonzero().flatten(), (~went).nonzero().flatten()
            # the rows that went out come back exactly; the others stay as `into` had them
            assert torch.equal(got.index_select(d, out), want.index_select(d, out)), f"rank {r}: rows came back wrong"
            assert (got.index_select(d, stay) == -1).all(), f"rank {r}: a row no rank assembled was written"
