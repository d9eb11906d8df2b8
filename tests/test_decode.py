"""Incremental decoding with a KV cache (issue 15): kernel.decode rows against the float64
reference of the causal forward over each item's prefix (dilgen.reference), lse too, with
outputs poisoned (conftest) and every cache row the new queries do not keep set to NaN, so
that a row the kernel should not read, or an output row it does not write, fails. Bad
inputs get one clear InputError. dilgen.nn.KVCache and examples/generate_tiny_lm.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import dilgen
from dilgen.reference import reference_attention, reference_mask_counts
from dilgen.runtime import InputError

from conftest import device

ROOT = Path(__file__).resolve().parent.parent
TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# (id, spec fields, cache_seqlens per item, T new tokens, N_max)
CASES = [
    ("one_token_two_items", dict(segment_lengths=[8, 32], dilation_rates=[1, 2]), [37, 20], 1, 48),
    ("longnet_rates_r_not_dividing_w_gqa", dict(segment_lengths=[8, 32, 64], dilation_rates=[1, 3, 6],
                                                num_heads=6, num_kv_heads=2), [37, 64, 100], 3, 100),
    ("mqa_short_context_T_eq_len", dict(segment_lengths=[16, 40], dilation_rates=[2, 5], num_kv_heads=1),
     [5, 90], 5, 96),
    ("queries_no_branch_keeps", dict(segment_lengths=[8], dilation_rates=[3]), [9, 30], 4, 32),
    ("group_larger_than_r_mqa32", dict(segment_lengths=[16, 32], dilation_rates=[1, 4], num_heads=32,
                                       num_kv_heads=1), [60], 1, 64),
    ("tokens_across_segment_boundary", dict(segment_lengths=[16, 24], dilation_rates=[2, 3], num_heads=6,
                                            num_kv_heads=3), [18, 50], 6, 56),
    ("w_larger_than_context", dict(segment_lengths=[512], dilation_rates=[4], num_kv_heads=2), [33, 7], 2, 40),
    ("bf16_gqa", dict(segment_lengths=[16, 32], dilation_rates=[1, 4], num_kv_heads=2, dtype="bfloat16"),
     [37, 60], 2, 64),
    ("fp16_softmax_scale", dict(segment_lengths=[16, 32], dilation_rates=[2, 4], dtype="float16",
                                softmax_scale=0.5), [40], 3, 40),
    ("hilbert_segment_short_last", dict(segment_lengths=[16, 64], dilation_rates=[2, 4], num_heads=8,
                                        num_kv_heads=4, hilbert={"scope": "segment"}), [70, 64, 100], 3, 128),
    ("hilbert_grids_r_not_dividing_w", dict(segment_lengths=[15, 40], dilation_rates=[3, 2], num_kv_heads=2,
                                            hilbert={"scope": "segment", "grids": [[3, 5], [5, 8]]}),
     [53, 97], 4, 100),
]


def _spec(fields: dict, name: str = "dec") -> dilgen.Spec:
    base = dict(name=name, num_heads=4, head_dim=16, dtype="float32", causal=True)
    base.update(fields)
    return dilgen.Spec(**base)


def _kept_rows(spec: dilgen.Spec, n: int, T: int) -> torch.Tensor:
    """(n,) bool: cache rows that some head keeps for one of the new queries n-T .. n-1."""
    rows = torch.zeros(n, dtype=torch.bool)
    for h in range(spec.num_heads):
        rows |= (reference_mask_counts(n, spec, h)[n - T:] > 0).any(0)
    return rows


def _inputs(spec: dilgen.Spec, lens, T, n_max, seed=0):
    dev = device()
    B, H, Hkv, D = len(lens), spec.num_heads, spec.num_kv_heads, spec.head_dim
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[spec.dtype]
    full_q = torch.randn(B, n_max, H, D, generator=g).to(dt)
    k = torch.randn(B, n_max, Hkv, D, generator=g).to(dt)
    v = torch.randn(B, n_max, Hkv, D, generator=g).to(dt)
    q = torch.stack([full_q[b, n - T:n] for b, n in enumerate(lens)])
    return full_q, k, v, q, torch.tensor(lens, dtype=torch.int32), dev


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decode_matches_reference(case):
    _, fields, lens, T, n_max = case
    spec = _spec(fields)
    kernel = dilgen.compile(spec)
    full_q, k, v, q, seqlens, dev = _inputs(spec, lens, T, n_max)
    # every row the new queries do not keep (and every row past the prefix) is NaN: a
    # kernel that reads one of them returns NaN
    k_poison, v_poison = k.clone(), v.clone()
    for b, n in enumerate(lens):
        kept = torch.zeros(n_max, dtype=torch.bool)
        kept[:n] = _kept_rows(spec, n, T)
        k_poison[b, ~kept] = float("nan")
        v_poison[b, ~kept] = float("nan")
    with torch.no_grad():
        out, lse = kernel.decode(q.to(dev), k_poison.to(dev), v_poison.to(dev), seqlens.to(dev),
                                 return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (len(lens), spec.num_heads, T) and lse.dtype == torch.float32
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for b, n in enumerate(lens):
        ref, ref_lse = reference_attention(full_q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], spec,
                                           return_lse=True)
        ref, ref_lse = ref[0, n - T:], ref_lse[0, :, n - T:]
        err = ((out[b].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert err < TOL[spec.dtype], f"item {b}: relative error {err:.2e}"
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[b]), fin), "rows no branch keeps: lse -inf, others finite"
        assert torch.equal(out[b][~fin.T], torch.zeros_like(out[b][~fin.T])), "rows no branch keeps: out 0"
        if fin.any():
            assert (lse[b].double()[fin] - ref_lse[fin]).abs().max().item() < 10 * TOL[spec.dtype]


def test_no_branch_keeps_gives_zero_and_minus_inf():
    spec = _spec(dict(segment_lengths=[8], dilation_rates=[3]))
    full_q, k, v, q, seqlens, dev = _inputs(spec, [9, 30], 4, 32)
    with torch.no_grad():
        out, lse = dilgen.compile(spec).decode(q.to(dev), k.to(dev), v.to(dev), seqlens.to(dev),
                                               return_lse=True)
    assert bool(torch.isneginf(lse).any()) and bool(torch.isfinite(lse).any())


@pytest.mark.parametrize("split", [16, 48, 4096])
def test_split_sizes_agree(split):
    """The split (kept keys per program) changes only the partition: every split gives the
    rows of the reference (the runtime halves the planner's split on small GPU batches)."""
    spec = _spec(dict(segment_lengths=[16, 64], dilation_rates=[1, 2], num_kv_heads=2))
    full_q, k, v, q, seqlens, dev = _inputs(spec, [64, 41], 2, 64, seed=1)
    att = dilgen.compile(spec).compiled_for(dev).attention
    with torch.no_grad():
        out = att.decode(q.to(dev), k.to(dev), v.to(dev), seqlens.to(dev))
        from dilgen.runtime.decode import decode
        again = decode(att, q.to(dev), k.to(dev), v.to(dev), seqlens.to(dev), split=split)
    torch.testing.assert_close(again, out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- bad input

def _bad(fields=None, **kw):
    spec = _spec(fields or dict(segment_lengths=[8, 16], dilation_rates=[1, 2], num_kv_heads=2))
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    args = dict(q=torch.randn(2, 1, H, D), k=torch.randn(2, 20, Hkv, D), v=torch.randn(2, 20, Hkv, D),
                s=torch.tensor([5, 20], dtype=torch.int32))
    args.update(kw)
    return spec, args


@pytest.mark.parametrize("what,fields,override,needle", [
    ("non_causal", dict(segment_lengths=[8], dilation_rates=[1], causal=False), {}, "causal"),
    ("ring", dict(segment_lengths=[8], dilation_rates=[1], ring_size=2), {}, "ring_size"),
    ("hilbert_sequence", dict(segment_lengths=[8], dilation_rates=[2],
                              hilbert={"scope": "sequence", "grid": [4, 5]}), {}, "sequence"),
    ("T_gt_seqlens", None, dict(q=torch.randn(2, 6, 4, 16)), "cache_seqlens[0] = 5 < T = 6"),
    ("n_max_too_small", None, dict(s=torch.tensor([5, 21], dtype=torch.int32)), "N_max = 20"),
    ("seqlens_int64", None, dict(s=torch.tensor([5, 20])), "int32"),
    ("seqlens_shape", None, dict(s=torch.tensor([5], dtype=torch.int32)), "shape (2,)"),
    ("dtype", None, dict(q=torch.randn(2, 1, 4, 16, dtype=torch.float64)), "dtype"),
    ("q_heads", None, dict(q=torch.randn(2, 1, 3, 16)), "(B, T, 4, 16)"),
    ("cache_heads", None, dict(k=torch.randn(2, 20, 4, 16)), "num_kv_heads=2"),
    ("cache_batch", None, dict(k=torch.randn(3, 20, 2, 16), v=torch.randn(3, 20, 2, 16)), "(2, N_max, 2, 16)"),
    ("v_differs", None, dict(v=torch.randn(2, 19, 2, 16)), "same shape"),
    ("device", None, dict(s=torch.tensor([5, 20], dtype=torch.int32, device="meta")), "on meta"),
    ("not_contiguous", None, dict(k=torch.randn(2, 20, 16, 2).transpose(2, 3)), "contiguous"),
    ("requires_grad", None, dict(q=torch.randn(2, 1, 4, 16, requires_grad=True)), "no_grad"),
])
def test_bad_input_one_clear_error(what, fields, override, needle):
    spec, args = _bad(fields, **override)
    kernel = dilgen.compile(spec)
    with pytest.raises(InputError) as err:
        kernel.decode(args["q"], args["k"], args["v"], args["s"])
    assert needle in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------- nn, example

def test_kv_cache_decoder_block_matches_full_forward():
    """LongNetDecoderBlock(x, cache=...) token by token (after a prompt) equals the block's
    full forward; items of one batch at different lengths through KVCache.append."""
    from dilgen.nn import KVCache, LongNetDecoderBlock
    torch.manual_seed(0)
    block = LongNetDecoderBlock(64, 4, [8, 16], [1, 2], num_kv_heads=2, name="dec_block").to(device())
    x = torch.randn(2, 14, 64, device=device())
    with torch.no_grad():
        full = block(x)
        cache = KVCache.for_layer(block, batch=2, max_len=16)
        assert cache.k.shape == (2, 16, 2, 16)
        outs = [block(x[:, :10], cache=cache)]                 # prompt: forward kernel
        for i in range(10, 14):
            outs.append(block(x[:, i:i + 1], cache=cache))     # decode
        assert cache.lengths == [14, 14] and cache.seqlens.tolist() == [14, 14]
        step = torch.cat(outs, dim=1)
        torch.testing.assert_close(step, full, rtol=2e-4, atol=2e-4)
        # items at different lengths: item 1 restarts (reset rows by hand) and both advance
        cache.reset()
        dev = device()
        cache.append(torch.zeros(2, 3, 2, 16, device=dev), torch.zeros(2, 3, 2, 16, device=dev))
        cache.lengths, cache.seqlens = [3, 0], torch.tensor([3, 0], dtype=torch.int32, device=device())
        cache.append(torch.ones(2, 2, 2, 16, device=dev), torch.ones(2, 2, 2, 16, device=dev))
        assert cache.lengths == [5, 2]
        assert cache.k[0, 3:5].eq(1).all() and cache.k[1, 0:2].eq(1).all() and cache.k[0, :3].eq(0).all()
        with pytest.raises(ValueError, match="max_len"):
            cache.append(torch.ones(2, 12, 2, 16, device=dev), torch.ones(2, 12, 2, 16, device=dev))


def test_generate_tiny_lm_example():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import generate_tiny_lm
    finally:
        sys.path.pop(0)
    res = generate_tiny_lm.generate({"device": "cpu", "prompt": 20, "new": 4, "batch": 1, "seq_len": 64,
                                     "quiet": True})
    assert res["new"] == 4 and res["max_rel_err"] <= res["tolerance"]
    assert len(res["tokens"]) == 4


def test_split_choice_fills_the_gpu_and_keeps_programs_big(monkeypatch):
    """The runtime's split for LongNet's five branches on a 132-SM GPU (H_kv 8): the splits
    the H200 sweep measured best (bench/results/decode-2026-11-23-h200.json)."""
    from dilgen.runtime import decode as dec
    monkeypatch.setattr(dec, "_sm_count", lambda dev: 132)
    cfg = {"split": 2048, "block_n": 64, "lanes": [2048] * 5}
    assert [dec.choose_split(cfg, B * 8, torch.device("cuda")) for B in (1, 8, 16, 64)] == [256, 512, 1024, 2048]
    assert dec.choose_split(cfg, 8, torch.device("cpu")) == 2048       # interpreter: no halving
    assert dec.num_chunks([2048, 100, 5], 64) == [32, 34, 35]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("w, r", [(2**20, 1), (2**31 - 1, 3)])
def test_decode_work_follows_the_cache_not_w(w, r):
    """Issue 44: one token over a 50-row cache with w = 2**20 (268 s before) or w = 2**31 - 1,
    r = 3 (2.8 GB of scratch before): the chunks cover the cache's lanes, and the answer is
    the causal forward's last row against float64."""
    from dilgen.runtime.decode import cache_lanes
    spec = dilgen.Spec(name=f"decode_huge_w{r}", num_heads=2, head_dim=16, dtype="float32", causal=True,
                       segment_lengths=[w, 8], dilation_rates=[r, 2])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 50, 2, 16, generator=g) for _ in range(3))
    kernel = dilgen.compile(spec)
    attn = kernel.compiled_for(torch.device("cpu")).attention
    assert cache_lanes(attn.plan, attn.decode_kernels["config"], 50) == [-(-64 // r), 4]
    out = kernel.decode(q[:, -1:], k, v, torch.tensor([50], dtype=torch.int32))
    want = reference_attention(q, k, v, spec)[:, -1:]
    assert (out.double() - want).norm() / want.norm() < 1e-5
