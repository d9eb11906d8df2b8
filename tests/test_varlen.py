"""Variable-length batches (SPEC §3): packed sequences with cu_seqlens and right-padded
batches with key_padding_mask, against the float64 reference run on each sequence alone."""
import pytest
import torch

import dilgen
import dilgen.nn
from dilgen.reference import differentiable_reference
from dilgen.runtime import InputError

TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _spec(name, w, r, *, H=4, Hkv=4, D=16, causal=False, hilbert=None, dtype="float32", **extra):
    return dilgen.Spec(name=name, num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=dtype,
                       segment_lengths=w, dilation_rates=r, causal=causal, hilbert=hilbert, **extra)


# (case, spec, sequence lengths)
CASES = [
    ("one_sequence", _spec("vl_one", [8, 16], [1, 2]), [40]),
    ("many_tiny", _spec("vl_tiny", [8, 16], [1, 2]), [1, 2, 3, 1, 5, 2]),
    ("not_multiples", _spec("vl_odd", [8, 16, 32], [1, 2, 4]), [13, 37, 21]),
    ("shorter_than_first_segment", _spec("vl_short", [16, 32], [1, 2]), [5, 11, 7]),
    ("zero_length", _spec("vl_zero", [8, 16], [1, 2]), [0, 9, 0, 17, 0]),
    ("gqa_causal", _spec("vl_gqa", [8, 16], [1, 2], H=4, Hkv=2, causal=True), [19, 6, 33]),
    ("mqa_no_r1", _spec("vl_mqa", [8, 16], [2, 4], H=4, Hkv=1), [12, 30, 7]),
    ("r_not_dividing_w", _spec("vl_r3", [12, 24], [1, 3], causal=True), [29, 14, 40]),
    ("hilbert_segment", _spec("vl_hil", [16, 32], [1, 2], hilbert={"scope": "segment"}), [21, 32, 45]),
    ("hilbert_causal", _spec("vl_hilc", [16], [2], causal=True, hilbert={"scope": "segment"}), [13, 35]),
    ("bf16", _spec("vl_bf16", [8, 16], [1, 2], dtype="bfloat16"), [17, 30]),
    ("torchscale_layout_d48", _spec("vl_ts", [8, 16], [1, 2], D=48, head_offsets="block",
                                    short_segments="zero_pad"), [13, 5, 30]),
    ("d24_gqa_causal", _spec("vl_d24", [8, 16], [1, 2], Hkv=2, D=24, causal=True), [13, 16, 30]),
]


def _err(x, y):
    return ((x.double() - y).norm() / y.norm().clamp_min(1e-30)).item()


def _inputs(spec, total, seed):
    g = torch.Generator().manual_seed(seed)
    dt = DT[spec.dtype]
    q = torch.randn(total, spec.num_heads, spec.head_dim, generator=g).to(dt)
    k = torch.randn(total, spec.num_kv_heads, spec.head_dim, generator=g).to(dt)
    v = torch.randn(total, spec.num_kv_heads, spec.head_dim, generator=g).to(dt)
    return q, k, v


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


@pytest.mark.parametrize("case,spec,lengths", CASES, ids=[c[0] for c in CASES])
def test_packed_forward_lse_and_gradients(case, spec, lengths):
    cu = _cu(lengths)
    total = int(cu[-1])
    q, k, v = (t.requires_grad_() for t in _inputs(spec, total, seed=len(case)))
    kernel = dilgen.compile(spec)
    out, lse = kernel(q, k, v, cu_seqlens=cu, return_lse=True)
    assert out.shape == q.shape and lse.shape == (spec.num_heads, total)
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    g_lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(8))
    finite = torch.isfinite(lse.detach())
    ((out * g_out).sum() + (torch.where(finite, lse, 0.0) * g_lse).sum()).backward()
    tol = TOL[spec.dtype]
    ref_grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for b, n in enumerate(lengths):
        a, e = int(cu[b]), int(cu[b + 1])
        if n == 0:
            continue
        qq, kk, vv = (t.detach()[a:e].double().unsqueeze(0).requires_grad_() for t in (q, k, v))
        ro, rl = differentiable_reference(qq, kk, vv, spec)
        rfin = torch.isfinite(rl)
        assert torch.equal(rfin[0], finite[:, a:e]), f"sequence {b}: rows with no branch differ"
        assert _err(out.detach()[a:e], ro[0].detach()) < tol, f"out of sequence {b}"
        if rfin.any():
            assert (lse.detach()[:, a:e][rfin[0]].double() - rl[0][rfin[0]]).abs().max() < 10 * tol
        ((ro * g_out[a:e].double().unsqueeze(0)).sum()
         + (torch.where(rfin, rl, 0.0) * g_lse[:, a:e].double().unsqueeze(0)).sum()).backward()
        for acc, ref in zip(ref_grads, (qq.grad, kk.grad, vv.grad)):
            acc[a:e] = ref[0]
    # gradients over every row (a one-row sequence's dq is 0: per-sequence norms are ill-posed)
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads):
        assert _err(got, ref) < 2 * tol, name


def test_launches_do_not_grow_with_the_sequence_count():
    spec = CASES[1][1]
    kernel = dilgen.compile(spec)
    attn = kernel.compiled_for(torch.device("cpu")).attention
    from unittest import mock
    real = attn._kernel

    def grids(lengths):
        calls = []

        def counting(interpret, source_fn=None):
            fn = real(interpret, source_fn=source_fn)

            class Count:
                def __getitem__(self, grid):
                    calls.append(grid)
                    return fn[grid]
            return Count()
        q, k, v = _inputs(spec, sum(lengths), 0)
        with mock.patch.object(attn, "_kernel", counting):
            kernel(q, k, v, cu_seqlens=_cu(lengths))
        return calls

    from dilgen.runtime.varlen import MAX_BUCKETS
    one, many, lots = grids([14]), grids([1, 2, 3, 1, 5, 2]), grids([1, 2, 3, 5, 8, 13] * 10)
    assert len(one) <= spec.num_branches
    # sequences launch in groups of similar length (longest first), at most MAX_BUCKETS
    # groups: the launch count does not grow with the number of sequences
    assert len(many) == 3 * len(one) and len(lots) == MAX_BUCKETS * len(one)
    assert sum(grid[0] if grid[0] % spec.num_heads == 0 and len(grid) == 3 else grid[1]
               for grid in many[::len(one)]) == 6 * spec.num_heads   # every sequence once


def test_one_call_form_and_max_seqlen():
    spec = CASES[0][1]
    q, k, v = _inputs(spec, 40, 3)
    cu = _cu([25, 15])
    a = dilgen.dilated_attention(q, k, v, spec, cu_seqlens=cu)
    b = dilgen.compile(spec)(q, k, v, cu_seqlens=cu, max_seqlen=25)
    assert torch.equal(a, b)
    with pytest.raises(InputError, match="max_seqlen = 10"):
        dilgen.compile(spec)(q, k, v, cu_seqlens=cu, max_seqlen=10)


@pytest.mark.parametrize("cu,match", [
    (torch.tensor([0, 5, 40], dtype=torch.int64), "dtype torch.int64"),
    (torch.tensor([1, 5, 40], dtype=torch.int32), r"cu_seqlens\[0\] = 1"),
    (torch.tensor([0, 20, 10, 40], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([0, 5, 39], dtype=torch.int32), "cu_seqlens\\[-1\\] = 39 but q has 40 rows"),
    (torch.tensor([[0, 40]], dtype=torch.int32), "1-D"),
    ([0, 40], "must be a torch.Tensor"),
])
def test_bad_cu_seqlens_get_one_clear_error(cu, match):
    spec = CASES[0][1]
    q, k, v = _inputs(spec, 40, 4)
    with pytest.raises(InputError, match=match):
        dilgen.compile(spec)(q, k, v, cu_seqlens=cu)


def test_packed_inputs_must_be_three_dimensional():
    spec = CASES[0][1]
    q, k, v = _inputs(spec, 40, 5)
    with pytest.raises(InputError, match="3 dims"):
        dilgen.compile(spec)(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), cu_seqlens=_cu([40]))


def test_sequence_scope_hilbert_is_refused_for_packed_batches():
    spec = _spec("vl_seq", [16], [1], hilbert={"scope": "sequence", "grid": [4, 8]})
    q, k, v = _inputs(spec, 32, 6)
    with pytest.raises(InputError, match="scope 'sequence'"):
        dilgen.compile(spec)(q, k, v, cu_seqlens=_cu([32]))


@pytest.mark.parametrize("causal", [False, True])
def test_padding_mask_equals_each_item_alone(causal):
    spec = _spec("vl_pad" + ("_c" if causal else ""), [8, 16], [1, 2], H=4, Hkv=2, causal=causal)
    B, N = 3, 24
    valid = [24, 9, 17]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, N, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(B, N, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(B, N, 2, 16, generator=g, requires_grad=True)
    mask = torch.arange(N)[None, :] >= torch.tensor(valid)[:, None]
    out, lse = dilgen.compile(spec).padded(q, k, v, mask, return_lse=True)
    assert lse.shape == (B, 4, N)
    g_out = torch.randn(out.shape, generator=g)
    (out * g_out).sum().backward()
    for b, n in enumerate(valid):
        assert torch.equal(out[b, n:].detach(), torch.zeros_like(out[b, n:]))
        assert torch.isinf(lse[b, :, n:]).all()
        assert torch.equal(q.grad[b, n:], torch.zeros_like(q.grad[b, n:]))
        assert torch.equal(k.grad[b, n:], torch.zeros_like(k.grad[b, n:]))
        qq, kk, vv = (t.detach()[b:b + 1, :n].double().requires_grad_() for t in (q, k, v))
        ro, _ = differentiable_reference(qq, kk, vv, spec)
        (ro * g_out[b:b + 1, :n].double()).sum().backward()
        assert _err(out.detach()[b, :n], ro[0].detach()) < 1e-4
        for got, ref in ((q.grad, qq.grad), (k.grad, kk.grad), (v.grad, vv.grad)):
            assert _err(got[b, :n], ref[0]) < 2e-4


def test_left_padding_equals_the_item_alone_and_holes_are_refused():
    """An item's tokens may follow left padding: its segments start at its first token."""
    spec = _spec("vl_left", [4, 8], [1, 2])
    q, k, v = (torch.randn(2, 12, 4, 16) for _ in range(3))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1, :5] = True
    kernel = dilgen.compile(spec)
    out = kernel.padded(q, k, v, mask)
    alone = kernel(q[1:, 5:], k[1:, 5:], v[1:, 5:])
    assert _err(out[1, 5:], alone[0]) < 1e-6
    assert out[1, :5].abs().max() == 0
    mask[0, 3] = True
    with pytest.raises(InputError, match="row 0 has padding between tokens"):
        kernel.padded(q, k, v, mask)


def test_ring_specs_take_packed_rows_over_a_process_group_only():
    """A ring spec takes cu_seqlens over the ranks of a process group (tests/test_ring.py runs
    them); without one the error says how to launch, and right-padded batches stay on one
    device."""
    spec = _spec("vl_ring", [8], [1]).replace(ring_size=2)
    q, k, v = _inputs(_spec("x", [8], [1]), 16, 9)
    with pytest.raises(InputError, match="init_process_group"):
        dilgen.compile(spec)(q, k, v, cu_seqlens=_cu([16]))
    with pytest.raises(InputError, match="ring_size = 2"):
        dilgen.compile(spec).padded(q.view(2, 8, 4, 16), k.view(2, 8, 4, 16), v.view(2, 8, 4, 16),
                                    torch.zeros(2, 8, dtype=torch.bool))


def test_multihead_layer_with_key_padding_mask_equals_each_item_alone():
    torch.manual_seed(0)
    layer = dilgen.nn.MultiheadDilatedAttention(32, 2, [8, 16], [1, 2], name="vl_mha")
    B, N, valid = 2, 20, [20, 13]
    x = torch.randn(B, N, 32)
    mask = torch.arange(N)[None, :] >= torch.tensor(valid)[:, None]
    y, _ = layer(x, key_padding_mask=mask)
    for b, n in enumerate(valid):
        alone, _ = layer(x[b:b + 1, :n])
        assert _err(y[b, :n].detach(), alone[0].detach().double()) < 1e-5
        # padded rows: attention output 0, so the layer gives out_proj's bias
        assert torch.allclose(y[b, n:], layer.out_proj.bias.expand(N - n, 32))


def test_explain_shows_the_tiles_of_a_packed_batch(capsys):
    from pathlib import Path
    from dilgen.cli import main
    spec = str(Path(__file__).resolve().parents[1] / "examples" / "specs" / "longnet_base.json")
    assert main(["explain", spec, "--cu-seqlens", "0,3000,10000"]) == 0
    text = capsys.readouterr().out
    assert "packed batch: 2 sequence(s), 10000 rows, longest 7000" in text
    assert "[0] w = 2048, r = 1: 3 x 2048 + 856; 55 query tile(s)" in text
    assert main(["explain", spec, "--cu-seqlens", "0,5,3"]) == 2
    assert "non-decreasing" in capsys.readouterr().err


def test_bucket_order_groups_similar_lengths_longest_first():
    from dilgen.runtime.varlen import MAX_BUCKETS, bucket_order
    order, buckets = bucket_order([5, 0, 17, 9, 16, 2, 3])
    assert order == [2, 4, 3, 0, 6, 5]                      # zero-length dropped
    assert buckets == ((0, 3, 17), (3, 5, 5), (5, 6, 2))    # each longer than half its first
    order, buckets = bucket_order([2 ** i for i in range(12)])
    assert len(buckets) == MAX_BUCKETS and buckets[-1][1] == 12
    assert bucket_order([0, 0]) == ([], ())


def test_groups_split_to_stay_within_the_grid_limit(monkeypatch):
    from dilgen.runtime import varlen
    spec = CASES[1][1]
    lengths = [1, 2, 3, 1, 5, 2]
    q, k, v = _inputs(spec, sum(lengths), 12)
    kernel = dilgen.compile(spec)
    whole = kernel(q, k, v, cu_seqlens=_cu(lengths))
    monkeypatch.setattr(varlen, "MAX_GRID_Y", 2 * spec.num_heads)   # two sequences per launch
    packing = varlen.packing_from_cu_seqlens("t", _cu(lengths), sum(lengths), q.device)
    assert all(st.numel() <= 2 for st, _, _ in packing.groups(spec.num_heads))
    assert sum(st.numel() for st, _, _ in packing.groups(spec.num_heads)) == len(lengths)
    assert torch.equal(kernel(q, k, v, cu_seqlens=_cu(lengths)), whole)


def test_lane_grid_with_tiles_fastest_computes_the_same_bits():
    """Tuning lane_tiles_fastest reorders the forward lane programs (grid (B*H * tiles,
    segments)) and, for packed batches, the dq lane programs; each tile's arithmetic is
    unchanged, so a packed causal batch gets the same out, lse and gradients bit for bit,
    every sequence's rows written (poisoned buffers otherwise show)."""
    from dilgen.compiler import Kernel
    spec = _spec("vl_tf", [8, 16, 24], [1, 2, 3], H=4, Hkv=2, causal=True)
    lengths = [29, 3, 17, 40]
    cu = _cu(lengths)
    q, k, v = _inputs(spec, int(cu[-1]), seed=3)
    do = torch.randn_like(q)
    got = []
    for fastest in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        kernel = Kernel(spec, None, {"lanes": "all", "lane_tiles_fastest": fastest})
        out, lse = kernel(*leaves, cu_seqlens=cu, return_lse=True)
        got.append([out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, do)])
    assert all(torch.isfinite(t).all() for t in got[0])
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *got):
        assert torch.equal(a, b), name


def test_offsets_and_masks_are_read_once_per_tensor(monkeypatch):
    """A model's layers pass one cu_seqlens (or mask) to every call: it is read on the host
    (a device sync on a GPU) the first time only; written in place it is read again, and a
    bad one is refused every time."""
    from dilgen.runtime import varlen
    reads = []
    for fn in ("_check_offsets", "_check_padding"):
        real = getattr(varlen, fn)
        monkeypatch.setattr(varlen, fn, lambda *a, real=real, fn=fn: reads.append(fn) or real(*a))
    spec = CASES[1][1]
    kernel = dilgen.compile(spec)
    cu = _cu([7, 0, 13])
    q, k, v = _inputs(spec, 20, 21)
    first = kernel(q, k, v, cu_seqlens=cu)
    assert torch.equal(kernel(q, k, v, cu_seqlens=cu), first) and reads == ["_check_offsets"]
    cu[1] = 3                                   # in place: lengths 3, 4, 13
    again = kernel(q, k, v, cu_seqlens=cu)
    assert reads == ["_check_offsets"] * 2
    assert torch.equal(again[:3], kernel(q[:3], k[:3], v[:3], cu_seqlens=_cu([3])))
    cu[1] = 30
    for _ in range(2):
        with pytest.raises(InputError, match="non-decreasing"):
            kernel(q, k, v, cu_seqlens=cu)
    qb, kb, vb = (t.view(2, 10, *t.shape[1:]) for t in (q, k, v))
    mask = torch.arange(10)[None, :] >= torch.tensor([10, 6])[:, None]
    padded = kernel.padded(qb, kb, vb, mask)
    assert torch.equal(kernel.padded(qb, kb, vb, mask), padded) and reads.count("_check_padding") == 1
    mask[1, 2] = True                           # a hole, written in place: read again, refused
    with pytest.raises(InputError, match="row 1 has padding between tokens"):
        kernel.padded(qb, kb, vb, mask)
