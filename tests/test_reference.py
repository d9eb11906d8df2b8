"""Tests of dilgen.reference: the gilbert curve and the dense float64 reference.

The brute-force implementation below is written differently on purpose: it loops over
branches, segments and queries, computes each branch's softmax output o_i and lse_i
explicitly, and merges branches with LongNet Eq. 10.
"""

import math
import zlib
from types import SimpleNamespace

import pytest
import torch

from dilgen.reference import (
    _gilbert_raster_order,
    reference_attention,
    reference_mask_counts,
)


# ----------------------------------------------------------------------------- curve

VECTORS = {
    (4, 4): [0, 1, 5, 4, 8, 12, 13, 9, 10, 14, 15, 11, 7, 6, 2, 3],
    (2, 4): [0, 4, 5, 1, 2, 6, 7, 3],
    (3, 5): [0, 5, 10, 11, 6, 1, 2, 7, 12, 13, 14, 9, 8, 3, 4],
}


@pytest.mark.parametrize("shape", sorted(VECTORS))
def test_curve_vectors(shape):
    assert _gilbert_raster_order(*shape) == VECTORS[shape]


def _d2xy(n, d):
    """Classic Hilbert d -> (x, y) on an n x n grid (n a power of two)."""
    x = y = 0
    s, t = 1, d
    while s < n:
        rx = 1 & (t // 2)
        ry = 1 & (t ^ rx)
        if ry == 0:
            if rx == 1:
                x, y = s - 1 - x, s - 1 - y
            x, y = y, x
        x += s * rx
        y += s * ry
        t //= 4
        s *= 2
    return x, y


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_curve_is_classic_hilbert_on_squares(k):
    n = 1 << k
    expected = []
    for d in range(n * n):
        x, y = _d2xy(n, d)
        expected.append(y * n + x)  # x = col, y = row
    assert _gilbert_raster_order(n, n) == expected


SHAPES = [(1, 1), (1, 7), (7, 1), (2, 2), (2, 3), (3, 2), (2, 5), (3, 3), (3, 5),
          (5, 3), (4, 6), (6, 4), (5, 5), (5, 7), (6, 10), (8, 8), (7, 9), (9, 7),
          (8, 16), (16, 8), (12, 20), (1, 16), (4, 5), (5, 4), (6, 9), (15, 14)]


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_curve_is_permutation_with_unit_steps(rows, cols):
    order = _gilbert_raster_order(rows, cols)
    assert sorted(order) == list(range(rows * cols))
    assert order[0] == 0  # starts at (row 0, col 0)
    cells = [divmod(o, cols) for o in order]
    steps = [(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in zip(cells, cells[1:])]
    unit = [s for s in steps if s in ((0, 1), (1, 0))]
    diag = [s for s in steps if s == (1, 1)]
    assert len(unit) + len(diag) == len(steps)
    # A Hamiltonian path with unit steps ending where gilbert2d ends is impossible
    # when the longer side is odd and the shorter one even (>= 4): gilbert2d then takes
    # exactly one diagonal step. Every other shape is walked with unit steps only.
    long_side, short_side = max(rows, cols), min(rows, cols)
    if long_side % 2 == 1 and short_side % 2 == 0 and short_side >= 4:
        assert len(diag) == 1
    else:
        assert len(diag) == 0


def test_curve_first_split_along_longer_side():
    # 2 x 4 (cols >= rows): the curve covers the left half (cols 0-1) before the right
    o = _gilbert_raster_order(2, 4)
    assert {c % 4 for c in o[:4]} == {0, 1}
    # 4 x 2 (rows > cols): the top half (rows 0-1) comes first
    o = _gilbert_raster_order(4, 2)
    assert {c // 2 for c in o[:4]} == {0, 1}


# ----------------------------------------------------------------------------- brute force


def _spec(H, Hkv, D, ws, rs, causal=False, hilbert=None, scale=None):
    return SimpleNamespace(
        name="t", num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype="float32",
        segment_lengths=tuple(ws), dilation_rates=tuple(rs), causal=causal,
        hilbert=hilbert, ring_size=1, softmax_scale=scale,
    )


def _hil(scope, grids=None, grid=None):
    return SimpleNamespace(scope=scope, grids=grids, grid=grid)


def _segments_in_selection_order(n, w, branch, spec):
    """List of segments, each a list of raster positions in selection (lane) order."""
    hb = spec.hilbert
    if hb is None:
        return [list(range(s, min(s + w, n))) for s in range(0, n, w)]
    if hb.scope == "segment":
        if hb.grids is not None:
            rows, cols = hb.grids[branch]
        else:
            k = int(round(math.log2(w)))
            rows, cols = 2 ** (k // 2), 2 ** (k - k // 2)
        curve = _gilbert_raster_order(rows, cols)
        segs = []
        for start in range(0, n, w):
            length = min(w, n - start)
            segs.append([start + off for off in curve if off < length])
        return segs
    assert hb.scope == "sequence"
    rows, cols = hb.grid
    curve = _gilbert_raster_order(rows, cols)  # curve index -> raster position
    return [curve[s:s + w] for s in range(0, n, w)]


def _brute_force(q, k, v, spec):
    q, k, v = (t.double() for t in (q, k, v))
    B, N, H, D = q.shape
    Hkv = k.shape[2]
    scale = spec.softmax_scale if spec.softmax_scale is not None else D ** -0.5
    out = torch.zeros(B, N, H, D, dtype=torch.float64)
    lse = torch.full((B, H, N), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kvh = h // (H // Hkv)
            parts = [[] for _ in range(N)]  # per query: list of (lse_i, o_i)
            for bi, (w, r) in enumerate(zip(spec.segment_lengths, spec.dilation_rates)):
                for seg in _segments_in_selection_order(N, w, bi, spec):
                    kept = seg[h % r::r]
                    for i in kept:
                        keys = [j for j in kept if (not spec.causal) or j <= i]
                        sc = torch.stack([scale * torch.dot(q[b, i, h], k[b, j, kvh])
                                          for j in keys])
                        mx = sc.max()
                        e = torch.exp(sc - mx)
                        lse_i = mx + torch.log(e.sum())
                        o_i = (e[:, None] * v[b, keys, kvh]).sum(0) / e.sum()
                        parts[i].append((lse_i, o_i))
            for i in range(N):
                if not parts[i]:
                    continue  # out 0, lse -inf
                lses = torch.stack([p[0] for p in parts[i]])
                total = torch.logsumexp(lses, 0)
                out[b, i, h] = sum(torch.exp(l - total) * o for l, o in parts[i])
                lse[b, h, i] = total
    return out, lse


CASES = {
    "short_last_segment": (13, _spec(2, 2, 8, (4, 8), (1, 2))),
    "rate3": (20, _spec(4, 4, 8, (6, 12), (1, 3))),
    "w_gt_n": (10, _spec(4, 4, 8, (4, 16), (2, 4))),
    "causal": (17, _spec(4, 4, 8, (4, 8, 16), (1, 2, 4), causal=True)),
    "gqa_causal": (12, _spec(4, 2, 8, (4, 8), (1, 2), causal=True)),
    "mqa_rate6": (14, _spec(3, 1, 8, (5, 12), (3, 6), scale=0.3)),
    "duplicate_branch": (9, _spec(2, 2, 8, (4, 4), (1, 1))),
    "hilbert_segment": (37, _spec(2, 2, 8, (8, 16), (1, 2), causal=True,
                                  hilbert=_hil("segment"))),
    "hilbert_segment_grids": (31, _spec(3, 3, 8, (15, 6), (2, 3), causal=True,
                                        hilbert=_hil("segment", grids=((3, 5), (2, 3))))),
    "hilbert_sequence": (30, _spec(2, 2, 8, (8, 16), (1, 2), causal=True,
                                   hilbert=_hil("sequence", grid=(5, 6)))),
    "hilbert_sequence_nc": (16, _spec(2, 1, 8, (4, 8), (2, 2),
                                      hilbert=_hil("sequence", grid=(4, 4)))),
    "unkept_queries": (10, _spec(2, 2, 8, (4,), (2,))),
}


def _inputs(n, spec, seed, B=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    D = spec.head_dim
    q = torch.randn(B, n, spec.num_heads, D, generator=g).to(dtype)
    k = torch.randn(B, n, spec.num_kv_heads, D, generator=g).to(dtype)
    v = torch.randn(B, n, spec.num_kv_heads, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_brute_force(case):
    n, spec = CASES[case]
    q, k, v = _inputs(n, spec, seed=zlib.crc32(case.encode()) % 1000)
    out, lse = reference_attention(q, k, v, spec, return_lse=True)
    bo, bl = _brute_force(q, k, v, spec)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == q.shape and lse.shape == (q.shape[0], spec.num_heads, n)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(bl))
    fin = torch.isfinite(bl)
    assert torch.allclose(lse[fin], bl[fin], atol=1e-10, rtol=0)
    assert torch.allclose(out, bo, atol=1e-10, rtol=0)
    assert torch.equal(reference_attention(q, k, v, spec), out)


def test_unkept_queries_give_zero_and_neg_inf():
    n, spec = CASES["unkept_queries"]
    q, k, v = _inputs(n, spec, seed=1)
    out, lse = reference_attention(q, k, v, spec, return_lse=True)
    # w = 4, r = 2: head 0 keeps offsets 0, 2; head 1 keeps offsets 1, 3
    for h in range(2):
        for i in range(n):
            if (i % 4) % 2 == h % 2:
                assert torch.isfinite(lse[:, h, i]).all()
                assert (out[:, i, h] != 0).any()
            else:
                assert torch.isneginf(lse[:, h, i]).all()
                assert (out[:, i, h] == 0).all()


def test_duplicate_branch_counts_twice():
    n = 9
    one = _spec(2, 2, 8, (4,), (1,))
    two = _spec(2, 2, 8, (4, 4), (1, 1))
    q, k, v = _inputs(n, one, seed=3)
    o1, l1 = reference_attention(q, k, v, one, return_lse=True)
    o2, l2 = reference_attention(q, k, v, two, return_lse=True)
    assert torch.allclose(o1, o2, atol=1e-12)
    assert torch.allclose(l2, l1 + math.log(2), atol=1e-12)


def test_mask_counts():
    spec = _spec(4, 4, 8, (2, 4), (1, 2))
    m = reference_mask_counts(6, spec, 0)
    assert m.dtype == torch.int64 and m.shape == (6, 6)
    # branch (2,1): blocks {0,1},{2,3},{4,5}; branch (4,2) head 0: {0,2},{4}
    exp = torch.zeros(6, 6, dtype=torch.int64)
    for a, b in [(0, 1), (2, 3), (4, 5)]:
        exp[a:b + 1, a:b + 1] += 1
    for s in ([0, 2], [4]):
        for i in s:
            for j in s:
                exp[i, j] += 1
    assert torch.equal(m, exp)
    spec.causal = True
    assert torch.equal(reference_mask_counts(6, spec, 0), torch.tril(exp))


def test_hilbert_sequence_outputs_in_raster_order():
    # permuting the image positions along the curve and running plain segments in curve
    # order (causal off) must give the same rows, returned in raster order
    spec = _spec(2, 2, 8, (4, 8), (1, 2), hilbert=_hil("sequence", grid=(4, 6)))
    plain = _spec(2, 2, 8, (4, 8), (1, 2))
    q, k, v = _inputs(24, spec, seed=5)
    curve = torch.tensor(_gilbert_raster_order(4, 6))
    out = reference_attention(q, k, v, spec)
    out_c = reference_attention(q[:, curve], k[:, curve], v[:, curve], plain)
    assert torch.allclose(out[:, curve], out_c, atol=1e-12)


def test_errors():
    q, k, v = _inputs(12, _spec(2, 2, 8, (4,), (1,)), seed=0)
    with pytest.raises(ValueError):  # sequence scope needs N = rows*cols
        reference_attention(q, k, v, _spec(2, 2, 8, (4,), (1,),
                                           hilbert=_hil("sequence", grid=(4, 4))))
    with pytest.raises(ValueError):  # w not a power of two without grids
        reference_attention(q, k, v, _spec(2, 2, 8, (6,), (1,), hilbert=_hil("segment")))
    with pytest.raises(ValueError):  # rows*cols != w
        reference_attention(q, k, v, _spec(2, 2, 8, (6,), (1,),
                                           hilbert=_hil("segment", grids=((2, 2),))))


def test_larger_n_is_fast_and_finite():
    spec = _spec(2, 1, 16, (512, 1024, 2048), (1, 2, 4), causal=True)
    q, k, v = _inputs(2048, spec, seed=7, B=1, dtype=torch.bfloat16)
    out, lse = reference_attention(q, k, v, spec, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
