"""The exact peers of bench/ (bench/peers.py) compute SPEC.md's function: every peer against
dilgen.reference (float64) on odd specs, fp32 (1e-5) and bf16 (2e-2), flex eager with both
block masks; the analytic flex block masks and bench_varlen.py's document block sets
against create_block_mask's. On the CPU, marked `slow`. The whole table takes ~9 CPU-minutes:
by default a sample of its cases runs (every kind: GQA, tails, r not dividing w, Hilbert,
dense); DILGEN_FULL_PEER_CHECK=1 runs all of it (after changing bench/peers.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_forward  # noqa: E402
import peers  # noqa: E402
from toolkit import CONFIGS  # noqa: E402

import dilgen  # noqa: E402

pytestmark = pytest.mark.slow
SEG = {"scope": "segment"}

# (name, B, N, H, Hkv, D, ws, rs, softmax_scale, hilbert); causal and not, fp32 and bf16
PEER_CASES = [
    ("basic", 1, 64, 4, 4, 16, [16, 32], [1, 2], None, None), ("gqa", 2, 96, 6, 2, 16, [32, 64], [2, 3], None, None),
    ("short_tail_r3", 2, 70, 6, 6, 16, [16, 32, 48], [1, 2, 3], None, None),
    ("r_not_dividing_w", 1, 53, 6, 6, 32, [10, 7, 20], [3, 2, 3], 0.3, None),
    ("gqa_tail", 1, 100, 8, 2, 16, [32, 64, 16], [2, 4, 1], None, None),
    ("mqa", 1, 40, 4, 1, 16, [8, 40], [1, 4], None, None), ("w_gt_n", 1, 50, 4, 4, 16, [128, 16], [2, 1], None, None),
    ("r_gt_h_unkept_rows", 1, 64, 2, 2, 16, [32, 64], [4, 8], None, None),
    ("duplicate_branch", 1, 48, 2, 2, 16, [16, 16], [1, 1], None, None),
    ("single_branch", 1, 48, 3, 3, 16, [12], [3], None, None), ("w1", 1, 20, 2, 2, 16, [1, 4], [1, 2], None, None),
    ("block_scale", 1, 384, 4, 4, 16, [128, 256], [1, 2], None, None),
    ("longnet_like_tail", 1, 1100, 4, 4, 16, [128, 256, 512], [1, 2, 4], None, None),
    ("E_like", 1, 512, 12, 12, 16, [32, 64, 128, 256, 512], [1, 2, 4, 6, 12], None, None),
    ("E_like_gqa_tail", 1, 600, 12, 4, 16, [32, 64, 128, 256, 512], [1, 2, 4, 6, 12], None, None),
    ("F_like", 1, 512, 4, 4, 16, [32, 64, 128], [1, 2, 4], None, SEG),
    ("F_like_tail_w_gt_n", 2, 300, 4, 2, 16, [32, 64, 512], [1, 2, 4], None, SEG),
    ("hilbert_grids_r_not_dividing", 1, 200, 6, 6, 16, [24, 60], [5, 7], None,
     {"scope": "segment", "grids": [[4, 6], [6, 10]]}),
    ("hilbert_sequence", 1, 256, 4, 4, 16, [32, 64], [1, 2], None, {"scope": "sequence", "grid": [16, 16]}),
    ("hilbert_sequence_tail", 1, 192, 6, 3, 16, [48, 100], [2, 3], None, {"scope": "sequence", "grid": [8, 24]}),
    ("dense_one_branch", 1, 64, 4, 4, 16, [64], [1], None, None),      # dense_sdpa == the reference
]
# analytic flex block masks, (N, H, ws, rs), both causal flags: configs A-E at N 4096, odd ones
# the configs' patterns at N = 2048 with their segments halved (create_block_mask walks every
# (head, query, key) triple: N = 4096 took four times as long for the same structure)
BLOCK_CASES = [(2048, c["H"], [w // 2 for w in c["ws"]], c["rs"]) for c in CONFIGS.values() if not c.get("hilbert")] + [
    (4096, 16, [128, 256, 512, 1024, 2048], [1, 2, 4, 6, 12]), (4096, 16, [512, 2048], [4, 16]),
    (4096, 16, [128, 256, 512, 1024, 2048], [1, 2, 4, 8, 16]), (1000, 6, [100, 300, 77], [1, 3, 2]),
    (700, 4, [5, 64, 1000], [1, 2, 3]), (1024, 4, [1024, 512], [200, 1])]

SAMPLE = {"gqa", "r_not_dividing_w", "r_gt_h_unkept_rows", "F_like_tail_w_gt_n", "hilbert_sequence_tail",
          "dense_one_branch", "E_like_gqa_tail"}
FULL = os.environ.get("DILGEN_FULL_PEER_CHECK", "") not in ("", "0")
PEER_CASES = [c for c in PEER_CASES if FULL or c[0] in SAMPLE]
BLOCK_CASES = BLOCK_CASES if FULL else BLOCK_CASES[:2] + BLOCK_CASES[-3:]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    a = bench_forward.Bench.parse(["--dry-run-cpu", "--methods", "dilgen,gather_cudnn,gather_flash,flex",
                                   "--out", str(tmp_path_factory.mktemp("bench"))])
    return bench_forward.Bench(a)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PEER_CASES, ids=[c[0] for c in PEER_CASES])
def test_peers_equal_the_float64_reference(bench, case, causal):
    name, B, N, H, Hkv, D, ws, rs, scale, hil = case
    spec = dilgen.Spec(name="chk", num_heads=H, num_kv_heads=Hkv, head_dim=D, segment_lengths=ws,
                       dilation_rates=rs, causal=causal, dtype="float32", softmax_scale=scale, hilbert=hil)
    g = torch.Generator().manual_seed(0)
    fails = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = [torch.randn(B, N, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv)]
        if name.startswith("dense"):
            runs = [("dense_sdpa", lambda: peers.dense_sdpa(*x, spec))]
        else:
            runs = [(p, lambda p=p: peers.PEERS[p](*x, spec)) for p in ("gather_cudnn", "gather_flash")]
            runs += [(f"flex[{mm}]", lambda mm=mm: peers.flex(*x, spec, method=mm)) for mm in
                     (("create",) if hil else ("analytic", "create")) if dtype == torch.float32]
        fails += [f"{str(dtype)[6:]} {r['method']}: {r.get('error') or r.get('_detail') or r.get('detail')}"
                  for r in bench.check_case(spec, x, runs, tol) if not r["passed"]]
        peers.clear_caches()
    assert not fails, fails


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", BLOCK_CASES, ids=[f"N{c[0]}_w{'-'.join(map(str, c[2]))}" for c in BLOCK_CASES])
def test_analytic_block_masks_equal_create_block_mask(bench, case, causal):
    N, H, ws, rs = case
    spec = dilgen.Spec(name="blk", num_heads=H, head_dim=16, segment_lengths=ws, dilation_rates=rs,
                       causal=causal, dtype="float32")
    rec = bench.check_block_mask(spec, N)
    peers.clear_caches()
    assert rec["passed"], rec.get("error") or rec["detail"]


@pytest.mark.parametrize("lengths", [[37, 5, 64, 19, 100, 3, 0, 41], [30, 11], [5, 17, 9, 24], [19, 22, 24, 30]])
def test_document_block_sets_cover_create_block_mask(lengths):
    """bench_varlen.py's dry run (H 2, w [8, 16], r [1, 2]): a superset of the nonempty blocks,
    full only where create_block_mask says so."""
    from torch.nn.attention.flex_attention import create_block_mask
    branches, T = [(8, 1), (16, 2)], sum(lengths)
    for causal, block in [(c, bl) for c in (False, True) for bl in (4, 8, 16)]:
        ref = create_block_mask(peers.document_mods(branches, causal, lengths, "cpu")[0], B=None, H=2,
                                Q_LEN=T, KV_LEN=T, device="cpu", BLOCK_SIZE=block, _compile=False)
        ne_ref, full_ref = peers.block_sets_of(ref)
        ne, full = peers.block_sets(branches, causal, lengths, block)
        assert int((ne_ref & ~ne).sum()) == 0 and int((full & ~full_ref).sum()) == 0, (causal, block)
