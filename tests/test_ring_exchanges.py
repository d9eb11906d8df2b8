"""The ring's data movement among simulated ranks: every rank of a P-rank call runs in this
process, and a stand-in for torch.distributed's point-to-point calls carries each send to the
matching receive (the same pair, in posting order). Random layouts check that the rows and
heads land where the transport says, and come back (no kernels run: only the moves)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from dilgen.schedule import recut_pieces, ring_pieces


class _Wire:
    """Point-to-point transfers among simulated ranks: each rank's batch_isend_irecv records
    its sends and receives (`me` set before it posts); deliver() copies the k-th send from a to
    b into the k-th receive b posted from a."""

    class P2POp:
        def __init__(self, op, tensor, peer, group):
            self.op, self.tensor, self.peer, self.group = op, tensor, peer, group

    def __init__(self):
        self.me, self.sends, self.recvs = 0, {}, {}

    def isend(self):
        pass

    def irecv(self):
        pass

    def get_backend(self, group=None):
        return "wire"

    def batch_isend_irecv(self, ops):
        for o in ops:
            if o.op == self.isend:
                self.sends.setdefault((self.me, o.peer), []).append(o.tensor)
            else:
                self.recvs.setdefault((o.peer, self.me), []).append(o.tensor)
        return [type("Work", (), {"wait": lambda self: None})()]

    def deliver(self):
        assert self.sends.keys() == self.recvs.keys(), "a send with no receive, or a receive with no send"
        for pair, bufs in self.sends.items():
            dsts = self.recvs[pair]
            assert len(bufs) == len(dsts), f"{pair}: {len(bufs)} sends against {len(dsts)} receives"
            for buf, dst in zip(bufs, dsts):
                assert dst.shape == buf.shape and dst.dtype == buf.dtype, f"{pair}: {buf.shape} into {dst.shape}"
                dst.copy_(buf)
        self.sends, self.recvs = {}, {}


def _ring(P: int, ws: list[int]) -> dict:
    return {"ring_size": P, "causal": False, "one_kv_head_per_query_head": True,
            "branches": [{"index": i, "w": w, "r": 1, "raster": True} for i, w in enumerate(ws)]}


def _runs(P: int, wire: _Wire, pieces: list, N: int = 0) -> list:
    """P RingRuns holding only the geometry the moves read (no agreement, no kernels)."""
    from dilgen.runtime.ring.run import RingRun
    runs = []
    for me in range(P):
        run = RingRun.__new__(RingRun)
        run.P, run.me, run.N, run.dist, run.group, run.pieces = P, me, N, wire, None, pieces
        run.rows0 = [sum(ln for _, ln in pieces[me][:i]) for i in range(len(pieces[me]))]
        run.peer = lambda r: r
        runs.append(run)
    return runs


def _rows_of(layout) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + ln) for s, ln in layout]) if layout else torch.zeros(0, dtype=torch.long)


@pytest.mark.parametrize("seed", range(12))
def test_recut_moves_every_row_to_its_new_rank_and_back(seed):
    """recut.post / arrive over random recut layouts (P 2..4, both chunk orders, two segment
    lengths, B 1..2, bfloat16 rows beside float32 statistics), all ranks in one process: the
    copied layout holds exactly the global rows split() assigns it, and moving back restores
    every rank's rows."""
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
    # a rank's tensors: (B, rows, H, 3) bfloat16 and (B, H, rows) float32, each entry naming its global row
    def tensors(layout):
        g = _rows_of(layout).float()
        x = (g[None, :, None, None] + 1000 * torch.arange(B)[:, None, None, None]).expand(B, len(g), H, 3)
        return [x.to(torch.bfloat16).contiguous(), (g[None, None, :] * 0.5).expand(B, H, len(g)).contiguous()]
    wire = _Wire()
    runs = _runs(P, wire, pieces)
    mine = [tensors(pieces[r]) for r in range(P)]
    posted = []
    for r in range(P):
        wire.me = r
        posted.append(post(runs[r], mine[r], pieces, copied, [1, 2]))
    wire.deliver()
    moved = [arrive(runs[r], posted[r]) for r in range(P)]
    for r in range(P):
        want = tensors(copied[r])
        assert all(torch.equal(a, b) for a, b in zip(moved[r], want)), f"rank {r}: rows of another rank landed wrong"
        # every row of the copied blocks is some rank's, and no row of mine is both viewed and copied
        assert not set(_rows_of(copied[r]).tolist()) & set(_rows_of(viewed[r]).tolist())
        assert sorted(_rows_of(copied[r]).tolist() + _rows_of(viewed[r]).tolist()) == \
            sorted(_rows_of(targets[r]).tolist())
    back, posted = [[torch.full_like(t, -1.0) for t in mine[r]] for r in range(P)], []
    for r in range(P):
        wire.me = r
        posted.append(post(runs[r], moved[r], copied, pieces, [1, 2], into=back[r]))
    wire.deliver()
    every_copied = _rows_of([p for rank in copied for p in rank])
    for r in range(P):
        arrive(runs[r], posted[r])
        went = torch.isin(_rows_of(pieces[r]), every_copied)       # my rows some rank assembled
        for d, got, want in zip((1, 2), back[r], mine[r]):
            out, stay = went.nonzero().flatten(), (~went).nonzero().flatten()
            # the rows that went out come back exactly; the others stay as `into` had them
            assert torch.equal(got.index_select(d, out), want.index_select(d, out)), f"rank {r}: rows came back wrong"
            assert (got.index_select(d, stay) == -1).all(), f"rank {r}: a row no rank assembled was written"


@pytest.mark.parametrize("seed", range(10))
def test_heads_turns_sequence_shards_into_head_shards_and_back(seed):
    """heads._post_to_heads / _post_from_heads over random calls (P 2 or 4, both chunk orders,
    B 1-2, 1-2 chunks of 1-2 heads each per rank): after the exchange rank p holds every
    position of the chunk's heads of block p, in sequence order; the return puts each rank's
    rows of those heads back and writes no other head."""
    from dilgen.runtime.ring.heads import _post_from_heads, _post_to_heads
    rnd = random.Random(seed)
    P, order = rnd.choice([2, 4]), rnd.choice(["contiguous", "zigzag"])
    B, C, hc, X = rnd.choice([1, 2]), rnd.choice([1, 2]), rnd.choice([1, 2]), rnd.choice([1, 3])
    H, N = P * C * hc, 2 * P * rnd.choice([2, 3])
    pieces = ring_pieces(N, P, order)
    wire = _Wire()
    runs = _runs(P, wire, pieces, N)

    def values(rows):        # entry (b, row, h, x) names its global row, head and batch item
        g = rows.float()[None, :, None, None]
        return (g * 1000 + torch.arange(H)[None, None, :, None] * 10 + torch.arange(B)[:, None, None, None]
                ).expand(B, len(rows), H, X).contiguous()
    mine = [values(_rows_of(pieces[r])) for r in range(P)]
    whole = values(torch.arange(N))
    for c in range(C):
        sharded = []
        for r in range(P):
            wire.me = r
            sharded.append(_post_to_heads(runs[r], mine[r], C, c))
        wire.deliver()
        for r, (out, posted) in enumerate(sharded):
            for p in posted:
                p.wait()
            heads = [r * C * hc + c * hc + j for j in range(hc)]
            assert torch.equal(out, whole[:, :, heads].permute(1, 0, 2, 3)), f"rank {r}, chunk {c}: wrong head shard"
        back, finishes = [torch.full_like(x, -1.0) for x in mine], []
        for r in range(P):
            wire.me = r
            finishes.append(_post_from_heads(runs[r], sharded[r][0], back[r], C, c))
        wire.deliver()
        chunk = [d * C * hc + c * hc + j for d in range(P) for j in range(hc)]
        others = [h for h in range(H) if h not in chunk]
        for r, finish in enumerate(finishes):
            finish()
            assert torch.equal(back[r][:, :, chunk], mine[r][:, :, chunk]), f"rank {r}, chunk {c}: rows came back wrong"
            assert (back[r][:, :, others] == -1).all(), f"rank {r}, chunk {c}: another chunk's heads written"


@pytest.mark.parametrize("seed", range(16))
def test_ring_steps_pair_every_send_with_a_receive_of_its_shape_and_ship_the_kept_rows(seed):
    """RingRun.post_keys and post_returns over random ring schedules (P 2-4, both chunk
    orders, causal or not, GQA, two or three branches with random segments and rates): in
    every step each rank's sends meet a receive of the same shape on their peer, forward
    (the key pieces, compacted) and backward (the partial dK, dV going home); a compacted
    piece holds, for kv head h, the sender's rows j*g + (h mod g) (the rows head h's query
    offsets keep), whatever _compact does."""
    import dilgen
    from dilgen.planner import plan
    from dilgen.schedule import ring_schedule
    from dilgen.targets import get_target
    rnd = random.Random(seed)
    P, order, causal = rnd.choice([2, 3, 4]), rnd.choice(["contiguous", "zigzag"]), rnd.choice([False, True])
    H, Hkv = rnd.choice([(4, 4), (8, 8), (4, 4), (4, 2), (8, 2)])   # MHA twice as often: its strides exceed 1
    n_loc = 2 * rnd.choice([4, 6, 8, 12])
    N = P * n_loc
    ws, rs = [], []
    for _ in range(rnd.choice([2, 3])):
        r = rnd.choice([1, 2, 3, 4])
        ws.append(r * rnd.choice([1, 2, 3, 4, 6, 8]))
        rs.append(r)
    spec = dilgen.Spec(name="exch", num_heads=H, num_kv_heads=Hkv, head_dim=8, segment_lengths=ws,
                       dilation_rates=rs, causal=causal, ring_size=P)
    sched = ring_schedule(plan(spec, get_target("interpreter")).ring.to_json(), N, order)
    pieces = sched["pieces"]
    wire = _Wire()
    runs = _runs(P, wire, pieces, N)
    B = 2
    keys = [(_rows_of(pieces[r]).float()[None, :, None, None] * 100 + torch.arange(Hkv)[None, None, :, None]
             + 0.5 * torch.arange(B)[:, None, None, None]).expand(B, n_loc, Hkv, 3).contiguous() for r in range(P)]
    for step in sched["steps"][1:]:
        posted = []
        for r in range(P):
            wire.me = r
            posted.append(runs[r].post_keys(step, (keys[r], keys[r] + 0.25)))
        wire.deliver()
        t = step["offset"]
        for r in range(P):
            got = posted[r].wait()
            if not step["ranks"][r]["recv"]:
                assert got == []
                continue
            src = (r - t) % P
            for i, ((start, ln), g, (k, v)) in enumerate(zip(pieces[src], step["ranks"][r]["stride"], got)):
                rows = torch.arange(ln // g)[:, None] * g + torch.arange(Hkv)[None, :] % g     # (n/g, Hkv)
                want = torch.stack([keys[src][:, runs[src].rows0[i] + rows[:, h], h] for h in range(Hkv)], dim=2)
                assert torch.equal(k, want) and torch.equal(v, want + 0.25), f"step {t}: rank {r}'s piece {i} of {src}"
        partials = [[[torch.ones(b.shape, dtype=torch.float32) for b in bufs] for bufs in posted[r].recv]
                    if step["ranks"][r]["recv"] else None for r in range(P)]
        returns = []
        for r in range(P):
            wire.me = r
            returns.append(runs[r].post_returns(step, partials[r], keys[r]))
        wire.deliver()
        for r, ex in enumerate(returns):
            if ex is not None:
                for _, _, bufs in (ex.wait() if step["ranks"][r]["send"] else []):
                    assert all((b == 1).all() for b in bufs), f"step {t}: rank {r}'s partials came home wrong"
