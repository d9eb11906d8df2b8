"""`dilgen explain` (SPEC §4): the plan in words, the GFLOP count against SPEC §2, and the
--png picture (its cells against the reference's pairs, its limits, its target file)."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

import dilgen
from dilgen.spec import load_spec

from cli_helpers import (LONGNET, LONGNET_BASE, TINY, TINY_GQA_CAUSAL, dilgen_cli,
                         main_in_process, one_error_line, write_spec)


# --------------------------------------------------------------------------- explain


def _useful_gflop(data: dict, n: int) -> float:
    """Useful forward FLOPs of a non-causal, non-Hilbert spec, straight from SPEC §2:
    4·D per (query, key) pair that some branch keeps, summed over heads and branches."""
    pairs = 0
    for h in range(data["num_heads"]):
        for w, r in zip(data["segment_lengths"], data["dilation_rates"]):
            for start in range(0, n, w):
                length = min(w, n - start)
                kept = len(range(h % r, length, r))
                pairs += kept * kept
    return 4 * data["head_dim"] * pairs / 1e9


def test_explain_prints_summary_with_gflop(tmp_path):
    spec_path = write_spec(tmp_path, LONGNET)
    res = dilgen_cli(tmp_path, "explain", spec_path, "--seq-len", "4096")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "longnet_t" in out
    lines = [l for l in out.splitlines() if "GFLOP" in l]
    assert len(lines) == 1, out
    assert "4096" in lines[0]
    value = float(re.search(r"([0-9]+(?:\.[0-9]+)?)\s*GFLOP", lines[0]).group(1))
    assert value == pytest.approx(_useful_gflop(LONGNET, 4096), rel=1e-3)


@pytest.mark.parametrize("arch, want", [
    ("sm90", "kernels: forward Gluon (128 keys a block, 3 stages), dK/dV Gluon (4 stages), dQ Gluon (4 stages); "
             "Gluon for whole segments on sm90, tl otherwise"),
    ("sm80", "kernels: forward tl (fused), dK/dV tl (fused), dQ tl"),
])
def test_explain_names_the_kernels_a_plan_launches(tmp_path, arch, want):
    spec_path = write_spec(tmp_path, dict(LONGNET, head_dim=128, dtype="bfloat16",
                                          segment_lengths=[2048, 4096], dilation_rates=[1, 2]))
    res = dilgen_cli(tmp_path, "explain", spec_path, "--arch", arch)
    assert res.returncode == 0, res.stderr
    assert want in res.stdout, res.stdout
    # attention dropout runs the spec's dropout plan: every branch in the fused kernels, the
    # forward, per-branch dK/dV and dQ in Gluon on sm90
    forward, dkdv, dq = {"sm90": ("forward Gluon (128 keys a block, 3 stages)", "dK/dV Gluon (per branch, 3 stages, queries along rows)",
                                  "dQ Gluon (4 stages)"),
                         "sm80": ("forward tl (fused)", "dK/dV tl (per branch)", "dQ tl (fused)")}[arch]
    assert (f"with attention dropout (dropout_p > 0): {forward}, {dkdv}, {dq}"
            in res.stdout), res.stdout
    # sm90 reads the dropout plan's keys and queries through descriptors (head_dim 128, non-causal)
    loads = {"sm90": "; forward and backward through tensor descriptors; Philox 4x32-7",
             "sm80": "dQ tl (fused); Philox 4x32-7"}
    assert loads[arch] in res.stdout, res.stdout


@pytest.mark.parametrize("over, want", [
    # head_dim 64: one exponential in 8 on the FMA pipe; a Hilbert segment curve's branch as Gluon curve lanes
    (dict(head_dim=64, hilbert={"scope": "segment"}),
     "forward Gluon (128 keys a block, 3 stages, 1 exp2 in 8 on the FMA pipe), lanes Gluon curve (branch 1)"),
    (dict(head_dim=128, segment_lengths=[2048, 4096], dilation_rates=[1, 3]),
     "forward Gluon (128 keys a block, 3 stages), lanes tl (branch 1)"),      # r = 3 does not divide w
])
def test_explain_names_the_gluon_forward_beside_lanes(tmp_path, over, want):
    spec_path = write_spec(tmp_path, dict(LONGNET, dtype="bfloat16", **{"segment_lengths": [1024, 4096],
                                                                        "dilation_rates": [1, 4], **over}))
    res = dilgen_cli(tmp_path, "explain", spec_path, "--arch", "sm90")
    assert res.returncode == 0, res.stderr
    assert want in res.stdout, res.stdout


def test_explain_png_draws_the_pattern(tmp_path):
    """README set-up installs matplotlib (the `test` extra; `dilgen[plot]` alone)."""
    pytest.importorskip("matplotlib", reason="matplotlib comes with `pip install -e .[test]`")
    spec_path = write_spec(tmp_path, TINY)
    png = tmp_path / "pattern.png"
    rc, out, err = main_in_process("explain", spec_path, "--seq-len", "64", "--png", png)
    assert rc == 0, err
    assert f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000




def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_explain_png_of_a_long_packed_batch_draws_blocks(tmp_path):
    """Issue 31: --cu-seqlens 0,3000,10000 --png drew nothing (a 4096-token limit named
    --seq-len, which the user never passed); any N is drawn as blocks of tokens."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "cu.png"
    rc, out, err = main_in_process("explain", LONGNET_BASE, "--cu-seqlens", "0,3000,10000",
                                   "--png", png)
    assert rc == 0, err
    assert out.rstrip().endswith(f"wrote {png}") and "packed batch: 2 sequence(s)" in out
    width, height = _png_size(png)
    assert 800 < width < 2500 and 600 < height < 1600, (width, height)


def test_explain_png_limit_names_the_flag_given_before_printing(tmp_path):
    from dilgen import explain
    pytest.importorskip("matplotlib")
    png = tmp_path / "x.png"
    too_many = explain.MAX_TOKENS + 1
    for argv, flag in ((("--cu-seqlens", f"0,5,{too_many}"), f"--cu-seqlens 0,5,{too_many}"),
                       (("--seq-len", str(too_many)), f"--seq-len {too_many}")):
        rc, out, err = main_in_process("explain", LONGNET_BASE, *argv, "--png", png)
        line = one_error_line((rc, err))
        assert line.startswith(f"dilgen: error: {flag}: ") and str(explain.MAX_TOKENS) in line, line
        assert out == "" and not png.exists()          # validated before the plan is printed
    rc, out, err = main_in_process("explain", LONGNET_BASE, "--heads", "16", "--png", png)
    assert "--heads 16" in one_error_line((rc, err)) and out == ""


@pytest.mark.parametrize("target,says", [
    ("{tmp}/x.txt", "ending in .png"),                    # matplotlib would pick a format by suffix
    ("{tmp}/no/such/dir/x.png", "does not exist"),        # no folder is created silently
    ("{tmp}", "is a folder"),
    ("/dev/full", "ending in .png"),
])
def test_explain_png_target_is_checked_before_printing(tmp_path, target, says):
    pytest.importorskip("matplotlib")
    target = target.format(tmp=tmp_path)
    rc, out, err = main_in_process("explain", LONGNET_BASE, "--png", target)
    line = one_error_line((rc, err))
    assert f"--png {target}: " in line and says in line, line
    assert out == "" and not (tmp_path / "no").exists() and not (tmp_path / "x.txt").exists()


def test_explain_png_that_cannot_be_written_is_one_error_not_wrote(tmp_path, monkeypatch):
    """A full device fails the write (here the atomic write raises ENOSPC): one line, exit
    2, never "wrote", no picture. (A symlink at the name is refused before that:
    test_output_writes.)"""
    pytest.importorskip("matplotlib")
    import errno
    from dilgen import fsafe

    def full_device(path, data, mode=0o600):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(fsafe, "write_atomic", full_device)
    full = tmp_path / "full.png"
    rc, out, err = main_in_process("explain", _tiny_spec_file(tmp_path), "--seq-len", "32", "--png", full)
    line = one_error_line((rc, err))
    assert "could not write the picture (No space left on device)" in line, line
    assert "wrote" not in out and not os.path.lexists(full), (line, out)


def _tiny_spec_file(tmp_path: Path) -> Path:
    return write_spec(tmp_path / "specs", TINY)


@pytest.mark.parametrize("data,n,cu", [
    (dict(TINY), 75, None),
    (dict(TINY_GQA_CAUSAL), 70, None),
    (dict(TINY_GQA_CAUSAL, head_offsets="block", short_segments="zero_pad"), 48, None),
    (dict(TINY, segment_lengths=[16, 32], hilbert={"scope": "segment"}, causal=True), 61, None),
    (dict(TINY, hilbert={"scope": "sequence", "grid": [6, 9]}), 54, None),
    (dict(TINY_GQA_CAUSAL), 66, [0, 20, 20, 53, 66]),
], ids=["tiny", "causal_gqa", "torchscale_layout", "hilbert_segment_causal", "hilbert_sequence",
        "packed"])
def test_explain_cells_count_the_reference_pairs(data, n, cu):
    """The picture's cells (any block size) sum the pairs of dilgen.reference's mask."""
    import torch
    from dilgen import explain
    from dilgen.reference import reference_mask_counts
    spec = dilgen.Spec(**data)
    for head in range(spec.num_heads):
        ref = torch.zeros(n, n, dtype=torch.int64)
        for a, b in zip(cu or [0], cu[1:] if cu else [n]):
            if b > a:
                ref[a:b, a:b] = reference_mask_counts(b - a, spec, head)
        ref = ref.double().numpy()
        rows = list(explain.branch_rows(spec, n, head, cu))
        assert (explain.window_counts(rows, n, spec.causal) == ref).all()
        for block in (1, 4, 7, n):
            cells = -(-n // block)
            padded = torch.zeros(cells * block, cells * block, dtype=torch.float64)
            padded[:n, :n] = torch.from_numpy(ref)
            want = padded.reshape(cells, block, cells, block).sum(dim=(1, 3)).numpy()
            assert (explain.cell_counts(rows, n, block, spec.causal) == want).all(), (head, block)


def test_explain_default_png_shows_every_branch(tmp_path):
    """Issue 31: the default picture of longnet_base (w 2048/4096/8192, r 1/2/4) showed two
    squares and no dilation. Now: N = two of the longest segments in blocks (each branch's
    segments and its 1/r^2 share of pairs), and the first tokens one cell per token (each
    branch's lattice, at the head's offsets)."""
    pytest.importorskip("matplotlib")
    import numpy as np
    from dilgen import explain
    spec = load_spec(LONGNET_BASE)
    assert explain.default_seq_len(spec) == 16384
    pattern = explain.prepare_pattern(spec, explain.default_seq_len(spec))
    assert pattern.heads == [0, 1, 15] and pattern.cells <= 512 < pattern.n
    z = pattern.zoom
    assert 16 <= z <= 512 and z % 4 == 0
    i = np.arange(z)[:, None]
    j = np.arange(z)[None, :]
    for head in pattern.heads:
        counts = pattern.zoom_counts(head)
        # one more branch on each lattice: r = 1 everywhere, + r = 2, + r = 4 at the head's offsets
        want = 1 + ((i % 2 == head % 2) & (j % 2 == head % 2)) + ((i % 4 == head % 4) & (j % 4 == head % 4))
        assert (counts == want).all(), head
        mean = pattern.overview(head)
        b = pattern.block
        cell = lambda q, k: mean[q // b, k // b]      # the cell of token pair (q, k)
        assert cell(0, 0) == pytest.approx(1 + 1 / 4 + 1 / 16)
        assert cell(3000, 100) == pytest.approx(1 / 4 + 1 / 16)     # branches 1 and 2 only
        assert cell(6000, 100) == pytest.approx(1 / 16)             # branch 2 only
        assert cell(9000, 100) == 0                                 # different segments
    png = explain.draw_pattern(pattern, tmp_path / "default.png")
    width, height = _png_size(png)
    assert width < 2500 and height < 1600, (width, height)
    rc, out, err = main_in_process("explain", LONGNET_BASE, "--png", tmp_path / "cli.png")
    assert rc == 0 and (tmp_path / "cli.png").stat().st_size > 10_000, err


def test_explain_png_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # `import matplotlib` fails
    spec_path = write_spec(tmp_path, TINY)
    png = tmp_path / "pattern.png"
    rc, out, err = main_in_process("explain", spec_path, "--png", png)
    line = one_error_line((rc, err))
    assert "matplotlib" in line and "dilgen[plot]" in line, line
    assert not png.exists()


def test_explain_bad_arguments(tmp_path):
    spec_path = write_spec(tmp_path, TINY)
    rc, out, err = main_in_process("explain", spec_path, "--seq-len", "0")
    assert "--seq-len" in one_error_line((rc, err))
    rc, out, err = main_in_process("explain", spec_path, "--seq-len", "many")
    assert "--seq-len" in one_error_line((rc, err))
    bad = write_spec(tmp_path, dict(TINY, head_dim=12), "bad.json")
    rc, out, err = main_in_process("explain", bad)
    assert "head_dim" in one_error_line((rc, err))



def test_explain_names_the_kernels_a_packing_runs_on_sm90(tmp_path):
    """The Gluon forward, dK/dV and dQ take packed rows whose count is a multiple of the
    lattice L; other counts run `tl`, and explain says how to get the Gluon ones."""
    spec = {"name": "ex_pk", "segment_lengths": [2048, 4096, 8192], "dilation_rates": [1, 2, 4],
            "num_heads": 16, "head_dim": 128}
    path = write_spec(tmp_path, spec)
    rc, out, _ = main_in_process("explain", path, "--arch", "sm90", "--cu-seqlens", "0,1000,9000")
    assert rc == 0 and "on sm90: forward, dK/dV, dQ in Gluon (the rows, 9000, a multiple of L = 4)" in out
    rc, out, _ = main_in_process("explain", path, "--arch", "sm90", "--cu-seqlens", "0,1000,9001")
    assert rc == 0 and "on sm90: tl kernels, as the rows (9001) are not a multiple of L = 4" in out
    assert "append 3 row(s) as one more sequence" in out
    rc, out, _ = main_in_process("explain", path, "--arch", "sm80", "--cu-seqlens", "0,1000,9001")
    assert rc == 0 and "on sm90" not in out


def test_explain_names_the_lane_kernels_a_causal_packing_runs_on_sm90(tmp_path):
    """A causal plan's lanes, dK/dV and dq take packed rows whatever their count (rows past a
    multiple of the branch's r through boxes of their own), and LongNet's r = 6 not dividing w;
    a non-causal plan's lane branches run `tl`."""
    spec = {"name": "ex_pkc", "segment_lengths": [2048, 4096, 8192], "dilation_rates": [1, 2, 4],
            "num_heads": 16, "head_dim": 128, "causal": True}
    path = write_spec(tmp_path, spec)
    rc, out, _ = main_in_process("explain", path, "--arch", "sm90", "--cu-seqlens", "0,1000,9000")
    assert rc == 0 and out.count("in Gluon; with dropout, tl") == 3, out
    assert "lane branch [2]: lanes, dK/dV, dq in Gluon" in out
    rc, out, _ = main_in_process("explain", path, "--arch", "sm90", "--cu-seqlens", "0,1000,9002")
    assert rc == 0 and out.count("in Gluon; with dropout, tl") == 3, out
    rc, out, _ = main_in_process("explain", write_spec(tmp_path, dict(spec, name="ex_pk6", dilation_rates=[1, 2, 6]),
                                                       "c6.json"), "--arch", "sm90", "--cu-seqlens", "0,1000,9001")
    assert rc == 0 and "lane branch [2]: lanes, dK/dV, dq in Gluon" in out, out
    spec = dict(spec, name="ex_pke", causal=False, dilation_rates=[1, 2, 6])     # r = 6: a lane branch
    rc, out, _ = main_in_process("explain", write_spec(tmp_path, spec, "e.json"), "--arch", "sm90",
                                 "--cu-seqlens", "0,1000,9000")
    assert rc == 0 and "on sm90, lane branch [2]: tl (the Gluon lanes over packed rows are a causal plan's)" in out
    spec = dict(spec, name="ex_pk64", causal=True, head_dim=64, dilation_rates=[1, 2, 4])    # no lane branch
    rc, out, _ = main_in_process("explain", write_spec(tmp_path, spec, "d64.json"), "--arch", "sm90",
                                 "--cu-seqlens", "0,1000,9000")
    assert rc == 0 and out.count(": dK/dV in Gluon; with dropout, tl") == 3, out
