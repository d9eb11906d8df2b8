#!/usr/bin/env python3
"""CPU check of the peers' SEMANTICS against dilgen.reference (float64, SPEC.md §2).

A plain script (not collected by pytest):  python bench/tools/check_peers_cpu.py [-v]

On a CPU the gather peers run their per-segment attention with an explicit fp32 softmax,
so this checks the gathering, the per-head offsets (h mod r), short last segments,
causal masking, GQA, r not dividing w (config E: r = 6, 12), w > N, queries kept by no
branch, Hilbert ordering (config F: segment scope; also explicit grids and sequence
scope; causal compares raster positions) and the Eq. 10 merge. FlexAttention runs eagerly (unfused) on the CPU: its mask_mod / score_mod are
checked the same way, and the analytic block masks used for the GPU benchmark are
compared block by block with torch's create_block_mask.
Exit status 0 when every check passes.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent          # bench/tools
sys.path.insert(0, str(HERE.parents[1]))        # the repository (dilgen)
sys.path.insert(0, str(HERE.parent))            # bench/ (peers)

import torch  # noqa: E402

import dilgen  # noqa: E402
from dilgen.reference import reference_attention  # noqa: E402
import peers  # noqa: E402

warnings.filterwarnings("ignore")

SEG = {"scope": "segment"}
# (name, B, N, H, Hkv, D, segment_lengths, dilation_rates, causal, softmax_scale[, hilbert])
CASES = [
    ("basic", 1, 64, 4, 4, 16, [16, 32], [1, 2], False, None),
    ("basic_causal", 1, 64, 4, 4, 16, [16, 32], [1, 2], True, None),
    ("short_tail_r3", 2, 70, 6, 6, 16, [16, 32, 48], [1, 2, 3], False, None),
    ("short_tail_r3_causal", 2, 70, 6, 6, 16, [16, 32, 48], [1, 2, 3], True, None),
    ("r_not_dividing_w", 1, 53, 6, 6, 32, [10, 7, 20], [3, 2, 3], False, 0.3),
    ("r_not_dividing_w_causal", 1, 53, 6, 6, 32, [10, 7, 20], [3, 2, 3], True, 0.3),
    ("gqa", 2, 96, 6, 2, 16, [32, 64], [2, 3], False, None),
    ("gqa_causal_tail", 1, 100, 8, 2, 16, [32, 64, 16], [2, 4, 1], True, None),
    ("mqa", 1, 40, 4, 1, 16, [8, 40], [1, 4], True, None),
    ("w_gt_n", 1, 50, 4, 4, 16, [128, 16], [2, 1], False, None),
    ("r_gt_h_unkept_rows", 1, 64, 2, 2, 16, [32, 64], [4, 8], False, None),
    ("r_gt_h_unkept_causal", 1, 64, 2, 2, 16, [32, 64], [4, 8], True, None),
    ("duplicate_branch", 1, 48, 2, 2, 16, [16, 16], [1, 1], False, None),
    ("single_branch", 1, 48, 3, 3, 16, [12], [3], True, None),
    ("w1", 1, 20, 2, 2, 16, [1, 4], [1, 2], False, None),
    ("block_scale", 1, 384, 4, 4, 16, [128, 256], [1, 2], True, None),
    ("longnet_like", 1, 1024, 4, 4, 16, [128, 256, 512], [1, 2, 4], False, None),
    ("longnet_like_causal", 1, 1100, 4, 4, 16, [128, 256, 512], [1, 2, 4], True, None),
    # config E at a small size: LongNet's r = 6, 12 (not dividing w), every h mod 12 class
    ("E_like", 1, 512, 12, 12, 16, [32, 64, 128, 256, 512], [1, 2, 4, 6, 12], False, None),
    ("E_like_causal", 1, 512, 12, 12, 16, [32, 64, 128, 256, 512], [1, 2, 4, 6, 12], True, None),
    ("E_like_gqa_tail_causal", 1, 600, 12, 4, 16, [32, 64, 128, 256, 512], [1, 2, 4, 6, 12], True, None),
    # config F at a small size: Hilbert segment scope (grids 4x8, 8x8, 8x16)
    ("F_like", 1, 512, 4, 4, 16, [32, 64, 128], [1, 2, 4], False, None, SEG),
    ("F_like_causal", 1, 512, 4, 4, 16, [32, 64, 128], [1, 2, 4], True, None, SEG),
    ("F_like_tail_w_gt_n_causal", 2, 300, 4, 2, 16, [32, 64, 512], [1, 2, 4], True, None, SEG),
    ("hilbert_grids_r_not_dividing", 1, 200, 6, 6, 16, [24, 60], [5, 7], True, None,
     {"scope": "segment", "grids": [[4, 6], [6, 10]]}),
    ("hilbert_sequence", 1, 256, 4, 4, 16, [32, 64], [1, 2], False, None, {"scope": "sequence", "grid": [16, 16]}),
    ("hilbert_sequence_causal_tail", 1, 192, 6, 3, 16, [48, 100], [2, 3], True, None,
     {"scope": "sequence", "grid": [8, 24]}),
]

# block-structure cases: (name, N, H, segment_lengths, dilation_rates); both causal flags
BLOCK_CASES = [
    ("A@4096", 4096, 16, [2048, 4096, 8192], [1, 2, 4]),
    ("B@4096", 4096, 16, [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]),
    ("C@4096", 4096, 32, [1024, 2048, 4096], [1, 2, 4]),
    ("D@4096", 4096, 16, [4096, 16384], [4, 16]),
    ("E@4096", 4096, 16, [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12]),
    ("E/16@4096", 4096, 16, [128, 256, 512, 1024, 2048], [1, 2, 4, 6, 12]),
    ("B/16@4096", 4096, 16, [128, 256, 512, 1024, 2048], [1, 2, 4, 8, 16]),
    ("D/8@4096", 4096, 16, [512, 2048], [4, 16]),
    ("odd_w_tail", 1000, 6, [100, 300, 77], [1, 3, 2]),
    ("small_w", 700, 4, [5, 64, 1000], [1, 2, 3]),
    ("r_gt_block", 1024, 4, [1024, 512], [200, 1]),
]


def spec_for(name, H, Hkv, D, ws, rs, causal, scale=None, hilbert=None):
    return dilgen.Spec(name=name, num_heads=H, num_kv_heads=Hkv, head_dim=D, segment_lengths=ws,
                       dilation_rates=rs, causal=causal, dtype="float32", softmax_scale=scale,
                       hilbert=hilbert)


def compare(out, lse, ref_out, ref_lse):
    """(relative error of out, max |lse diff| over finite entries, -inf pattern equal)."""
    o = out.detach().double().cpu()
    rel = ((o - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    if lse is None:
        return rel, float("nan"), True
    l = lse.detach().double().cpu()
    fin_ref = torch.isfinite(ref_lse)
    same_pattern = bool(torch.equal(torch.isfinite(l), fin_ref)) and not torch.isnan(l).any().item()
    dl = (l[fin_ref] - ref_lse[fin_ref]).abs().max().item() if fin_ref.any() else 0.0
    zero_rows_ok = bool((o.permute(0, 2, 1, 3)[~fin_ref] == 0).all()) if (~fin_ref).any() else True
    return rel, dl, same_pattern and zero_rows_ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention checks")
    args = ap.parse_args()
    torch.manual_seed(0)
    failures = []
    t0 = time.time()

    flex_ok = not args.no_flex
    if flex_ok:
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except Exception as e:  # pragma: no cover
            print(f"flex: not available ({e!r}); skipped")
            flex_ok = False

    print("== semantics vs dilgen.reference (float64) ==")
    worst = {}
    for case in CASES:
        (name, B, N, H, Hkv, D, ws, rs, causal, scale), hilbert = case[:10], (case[10] if len(case) > 10 else None)
        spec = spec_for("chk", H, Hkv, D, ws, rs, causal, scale, hilbert)
        for dtype, tol_o, tol_l in ((torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)):
            q = torch.randn(B, N, H, D, dtype=dtype)
            k = torch.randn(B, N, Hkv, D, dtype=dtype)
            v = torch.randn(B, N, Hkv, D, dtype=dtype)
            ref_out, ref_lse = reference_attention(q, k, v, spec, return_lse=True)
            runs = [("gather_cudnn", lambda: peers.gather_cudnn(q, k, v, spec)),
                    ("gather_flash", lambda: peers.gather_flash(q, k, v, spec))]
            if flex_ok and dtype == torch.float32:
                # Hilbert specs: flex_block_mask always uses create_block_mask
                for method in (("create",) if hilbert else ("analytic", "create")):
                    runs.append((f"flex[{method}]", lambda m=method: peers.flex(q, k, v, spec, method=m)))
            for pname, fn in runs:
                try:
                    out, lse = fn()
                    if out.shape != q.shape or out.dtype != q.dtype:
                        raise AssertionError(f"out {tuple(out.shape)} {out.dtype}")
                    if lse.shape != (B, H, N) or lse.dtype != torch.float32:
                        raise AssertionError(f"lse {tuple(lse.shape)} {lse.dtype}")
                    rel, dl, pat = compare(out, lse, ref_out, ref_lse)
                    ok = rel < tol_o and dl < tol_l and pat
                    wk = (name, str(dtype)[6:], pname)
                    worst[wk] = (rel, dl)
                    msg = f"rel_out={rel:.2e} max|dlse|={dl:.2e} -inf/zero rows ok={pat}"
                except Exception as e:  # noqa: BLE001
                    ok, msg = False, f"ERROR {e!r}"
                tag = "ok  " if ok else "FAIL"
                if not ok or args.verbose:
                    print(f"  {tag} {name:24s} {str(dtype)[6:]:9s} {pname:15s} {msg}")
                if not ok:
                    failures.append(f"{name}/{dtype}/{pname}: {msg}")
        mine = {k[1:]: v for k, v in worst.items() if k[0] == name}
        print(f"  done {name:30s} " + "  ".join(f"{p}/{d}: {r:.1e}" for (d, p), (r, _) in sorted(mine.items())),
              flush=True)

    # dense_sdpa: only that it runs and, with one r=1 branch covering N, equals the reference
    spec = spec_for("chk", 4, 4, 16, [64], [1], True)
    q, k, v = (torch.randn(1, 64, 4, 16) for _ in range(3))
    out, lse = peers.dense_sdpa(q, k, v, spec)
    rel, _, _ = compare(out, None, reference_attention(q, k, v, spec), None)
    print(f"  {'ok  ' if rel < 1e-5 else 'FAIL'} dense_sdpa (one branch w=N, r=1, causal) rel_out={rel:.2e}")
    if rel >= 1e-5:
        failures.append(f"dense_sdpa: rel {rel}")

    if flex_ok:
        print("== flex block masks: analytic vs create_block_mask ==")
        for (name, N, H, ws, rs) in BLOCK_CASES:
            for causal in (False, True):
                spec = spec_for("blk", H, H, 16, ws, rs, causal)
                peers.clear_caches()
                try:
                    a_ne, a_full = peers.block_sets_of(peers.flex_block_mask(spec, N, "cpu", "analytic")[0])
                    c_ne, c_full = peers.block_sets_of(peers.flex_block_mask(spec, N, "cpu", "create")[0])
                    ne_eq = torch.equal(a_ne, c_ne)
                    full_sub = bool((a_full <= c_full).all())
                    full_eq = torch.equal(a_full, c_full)
                    ok = ne_eq and full_sub and full_eq
                    msg = (f"nonempty equal={ne_eq} ({int(a_ne.sum())} blocks), full equal={full_eq} "
                           f"({int(a_full.sum())} vs {int(c_full.sum())}), full subset={full_sub}")
                except Exception as e:  # noqa: BLE001
                    ok, msg = False, f"ERROR {e!r}"
                print(f"  {'ok  ' if ok else 'FAIL'} {name:12s} causal={causal!s:5s} {msg}", flush=True)
                if not ok:
                    failures.append(f"block mask {name} causal={causal}: {msg}")
        peers.clear_caches()

    print(f"== {len(failures)} failure(s), {time.time() - t0:.1f} s ==")
    for f in failures:
        print("  " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
