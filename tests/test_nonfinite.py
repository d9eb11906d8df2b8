"""Issue 35: which rows a non-finite key or value reaches (SPEC §2.4, docs/api.md).

One NaN (or inf) at one position p of k or v, in batch item / sequence b and kv head g. The
forward's rows outside the documented set must stay finite and equal, bit for bit, to the
run without it; the rows that attend to p must not be finite:

- k[b, p, g]: only the rows that attend to p (queries of group g that keep key p in some
  branch), out and lse;
- v[b, p, g]: out of the rows of the query tiles that overlap a segment containing p (tiles
  are windows of T = L * block_m positions from the sequence's first row; a masked
  probability is 0, and 0 * NaN = NaN inside a tile), never lse.

Fixed length (two batch items), causal GQA with a lane branch (r does not divide w) and a
short last segment, and a packed batch, on the CPU interpreter.
"""
from __future__ import annotations

import math

import pytest
import torch

import dilgen
from dilgen.reference import reference_mask_counts

CASES = {
    "fixed": (dict(num_heads=2, segment_lengths=[16, 32], dilation_rates=[1, 2]),
              dict(batch=2, n=64), [(1, 5), (1, 40)]),
    "causal_gqa_lanes": (dict(num_heads=4, num_kv_heads=2, segment_lengths=[8, 20], dilation_rates=[1, 3],
                              causal=True), dict(batch=1, n=50), [(0, 21), (0, 47)]),
    "packed": (dict(num_heads=2, segment_lengths=[8, 32], dilation_rates=[1, 2]),
               dict(lengths=[5, 40, 19]), [(1, 9), (2, 2)]),
}


def _inputs(spec, shape):
    gen = torch.Generator().manual_seed(35)
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if "lengths" in shape:
        total = sum(shape["lengths"])
        return [torch.randn(total, h, D, generator=gen) for h in (H, Hkv, Hkv)]
    return [torch.randn(shape["batch"], shape["n"], h, D, generator=gen) for h in (H, Hkv, Hkv)]


def _rows(seq_len: int, p: int, spec, tile: int) -> torch.Tensor:
    """Positions (of a sequence of seq_len) that a non-finite value at p may reach: the query
    tiles of T = tile positions from the sequence start that overlap a segment holding p."""
    reach = torch.zeros(seq_len, dtype=torch.bool)
    for w in spec.segment_lengths:
        a, e = p // w * w, min(p // w * w + w, seq_len)
        reach[a // tile * tile:min(math.ceil(e / tile) * tile, seq_len)] = True
    return reach


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # numpy's NaN matmul
@pytest.mark.parametrize("case", list(CASES))
def test_a_nonfinite_key_or_value_reaches_only_the_documented_rows(case):
    fields, shape, places = CASES[case]
    spec = dilgen.Spec(name=f"nonfinite_{case}", head_dim=16, dtype="float32", **fields)
    kernel = dilgen.compile(spec)
    plan = kernel.compiled_for(torch.device("cpu")).plan
    tile = plan.query.lattice * plan.config.block_m          # T = L * block_m
    q, k, v = _inputs(spec, shape)
    packed = "lengths" in shape
    cu = None
    if packed:
        starts = [0]
        for n in shape["lengths"]:
            starts.append(starts[-1] + n)
        cu = torch.tensor(starts, dtype=torch.int32)

    def run(k_, v_):
        if packed:
            return kernel(q, k_, v_, cu_seqlens=cu, return_lse=True)   # (T, H, D), (H, T)
        return kernel(q, k_, v_, return_lse=True)                     # (B, N, H, D), (B, H, N)

    out0, lse0 = run(k, v)
    assert torch.isfinite(out0).all() and torch.isfinite(lse0).all()
    group = spec.num_heads // spec.num_kv_heads
    checked_attending = 0
    for b, p in places:
        for g in range(spec.num_kv_heads):
            for which, bad in (("k", float("nan")), ("v", float("nan")), ("v", float("inf"))):
                if bad == float("inf") and (case != "fixed" or g):
                    continue
                kk, vv = k.clone(), v.clone()
                row = starts[b] + p if packed else p
                (kk if which == "k" else vv)[(row, g) if packed else (b, row, g)][3] = bad
                out, lse = run(kk, vv)
                seq_len = shape["lengths"][b] if packed else shape["n"]
                # allowed[h, u]: rows (of sequence / batch item b) that may be non-finite
                allowed = torch.zeros(spec.num_heads, seq_len, dtype=torch.bool)
                attends = torch.zeros(spec.num_heads, seq_len, dtype=torch.bool)
                near = _rows(seq_len, p, spec, tile)
                for h in range(g * group, (g + 1) * group):
                    attends[h] = reference_mask_counts(seq_len, spec, h)[:, p] > 0
                    allowed[h] = attends[h] if which == "k" else near
                assert not (attends & ~allowed).any(), "the documented set misses attending rows"
                if packed:
                    view_out = out[starts[b]:starts[b + 1]].transpose(0, 1)       # (H, n, D)
                    view_lse = lse[:, starts[b]:starts[b + 1]]
                    others = [(out[:starts[b]], out0[:starts[b]]), (out[starts[b + 1]:], out0[starts[b + 1]:])]
                    base_out = out0[starts[b]:starts[b + 1]].transpose(0, 1)
                    base_lse = lse0[:, starts[b]:starts[b + 1]]
                else:
                    view_out, view_lse = out[b].transpose(0, 1), lse[b]
                    others = [(out[:b], out0[:b]), (out[b + 1:], out0[b + 1:])]
                    base_out, base_lse = out0[b].transpose(0, 1), lse0[b]
                where = f"{case}: {which}[{b}, {p}, kv head {g}] = {bad}"
                for got, want in others:            # other batch items / sequences: untouched
                    assert torch.equal(got, want), f"{where} reached another batch item or sequence"
                bad_rows = ~torch.isfinite(view_out).all(-1)                  # (H, n)
                stray = bad_rows & ~allowed
                assert not stray.any(), (f"{where}: non-finite rows outside the documented set: "
                                         f"{stray.nonzero().tolist()}")
                assert torch.equal(view_out[~allowed], base_out[~allowed]), \
                    f"{where}: rows outside the documented set changed"
                assert (~torch.isfinite(view_out[attends])).any(-1).all(), \
                    f"{where}: a row that attends to the key stayed finite"
                checked_attending += int(attends.sum())
                if which == "v":                     # values never reach lse
                    assert torch.equal(view_lse, base_lse), f"{where}: lse changed"
                else:
                    assert torch.equal(view_lse[~allowed], base_lse[~allowed])
                    assert torch.isnan(view_lse[attends]).all()
    assert checked_attending > 0
