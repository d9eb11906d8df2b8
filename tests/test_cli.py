"""SPEC.md §4 (the command line) and §5 (generated modules), driven as a user would:
`python -m dilgen.cli ...` in a fresh interpreter, with a private kernel cache and
output folder under tmp_path. A few argument checks run `dilgen.cli.main` in-process.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dilgen
from dilgen.spec import load_spec

from conftest import run_cli

LONGNET = {"name": "longnet_t", "num_heads": 16, "num_kv_heads": 16, "head_dim": 128,
           "dtype": "bfloat16", "segment_lengths": [2048, 4096, 8192],
           "dilation_rates": [1, 2, 4], "causal": False, "hilbert": None, "ring_size": 1}
TINY = {"name": "tiny_attn", "num_heads": 2, "head_dim": 16, "dtype": "float32",
        "segment_lengths": [16, 32], "dilation_rates": [1, 2]}
TINY_GQA_CAUSAL = {"name": "tiny_gqa_causal", "num_heads": 4, "num_kv_heads": 2,
                   "head_dim": 16, "dtype": "float32", "causal": True,
                   "segment_lengths": [8, 24], "dilation_rates": [1, 3]}


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILGEN_")}
    env["DILGEN_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def dilgen_cli(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dilgen.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=tmp_path,
                          env=env or _env(tmp_path), timeout=300)


def write_spec(folder: Path, data: dict, filename: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (filename or f"{data['name']}.json")
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def one_error_line(res: subprocess.CompletedProcess | tuple) -> str:
    rc, stderr = (res.returncode, res.stderr) if hasattr(res, "returncode") else res
    assert "Traceback" not in stderr, stderr
    assert rc == 2, (rc, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {stderr!r}"
    assert lines[0].startswith("dilgen: error:"), lines[0]
    return lines[0]


def main_in_process(*argv) -> tuple[int, str, str]:
    return run_cli(argv)


def header_of(source: str) -> list[str]:
    lines = []
    for line in source.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


# --------------------------------------------------------------------------- compile


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """LONGNET compiled for sm90 twice (two output folders) and for sm80."""
    root = tmp_path_factory.mktemp("compile")
    spec_path = write_spec(root / "specs", LONGNET)
    runs = {}
    for tag, arch in (("a", "sm90"), ("b", "sm90"), ("c", "sm80")):
        res = dilgen_cli(root, "compile", spec_path, "--arch", arch, "--out", root / tag)
        runs[tag] = (res, root / tag / "longnet_t.py")
    return load_spec(spec_path), runs


def test_compile_writes_module_with_provenance_header(compiled):
    from dilgen import codegen
    spec, runs = compiled
    res, path = runs["a"]
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert path.is_file()
    assert (path.parent / "__init__.py").is_file(), "the output folder must be importable"
    source = path.read_text()
    assert source.startswith("#")
    header = "\n".join(header_of(source))
    assert spec.name in header
    assert spec.key() in header
    assert re.search(r"(?im)^#.*target.*\bsm90\b", header), header
    assert re.search(rf"(?i)dilgen[^\n]*{re.escape(dilgen.__version__)}", header), header
    assert codegen.template_hash() in header
    compile(source, str(path), "exec")


def test_compile_prints_where_and_summary(compiled):
    spec, runs = compiled
    res, path = runs["a"]
    out = res.stdout
    assert str(path) in out or path.name in out
    assert "wrote" in out
    assert spec.name in out
    assert spec.key()[:12] in out
    assert "sm90" in out
    for i in range(spec.num_branches):
        assert f"[{i}]" in out
    assert len(out.splitlines()) <= 40, "the summary must fit on one screen"


def test_compile_is_byte_identical(compiled):
    _, runs = compiled
    (ra, a), (rb, b) = runs["a"], runs["b"]
    assert ra.returncode == rb.returncode == 0
    assert a.read_bytes() == b.read_bytes()


def test_compile_sm80_differs_from_sm90_only_in_target_tiles_and_sm90_flags(compiled):
    """sm90's own flags (descriptor loads, the folded softmax scale) choose other code in the
    same templates; with them off, sm80 and sm90 differ only in the target, the tiles and
    the L2 size the lattice kernels group their tiles to."""
    from dilgen import codegen, planner
    from dilgen.targets import SM90
    spec, runs = compiled
    (r90, p90), (r80, p80) = runs["a"], runs["c"]
    assert r90.returncode == 0 and r80.returncode == 0, r80.stderr
    assert "tl.make_tensor_descriptor" in p90.read_text()
    assert "tl.make_tensor_descriptor" not in p80.read_text()
    flags_off = {"fused_tma": False, "bwd_tma": False, "fold_scale": False}
    s90 = codegen.emit(planner.plan(spec, SM90, flags_off)).splitlines()
    s80 = p80.read_text().splitlines()
    changed = [line for line in difflib.unified_diff(s90, s80, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert changed, "sm80 and sm90 modules must differ (at least the target)"
    allowed = re.compile(r"sm80|sm90|plan key|block|BLOCK|warps|WARPS|stages|STAGES|bwd_kv|bwd_dq|fused_dkdv|lane_fwd|lane_dq|lane_tiles_fastest|l2_bytes")
    unexpected = [line for line in changed if not allowed.search(line)]
    assert not unexpected, "unexpected sm80/sm90 differences:\n" + "\n".join(unexpected)
    s90 = p90.read_text().splitlines()
    t90 = [l for l in header_of("\n".join(s90)) if re.search(r"(?i)target", l)]
    t80 = [l for l in header_of("\n".join(s80)) if re.search(r"(?i)target", l)]
    assert t90 and t80 and t90 != t80
    assert "sm80" in " ".join(t80) and "sm90" in " ".join(t90)


def test_compile_sm70_is_refused(tmp_path):
    spec_path = write_spec(tmp_path, TINY)
    res = dilgen_cli(tmp_path, "compile", spec_path, "--arch", "sm70", "--out", tmp_path / "out")
    line = one_error_line(res)
    assert "sm70" in line
    assert not (tmp_path / "out" / "tiny_attn.py").exists()


@pytest.mark.parametrize("arch", ["bogus", "sm", "cuda"])
def test_compile_unknown_arch_is_refused(tmp_path, arch):
    spec_path = write_spec(tmp_path, TINY)
    rc, out, err = main_in_process("compile", spec_path, "--arch", arch, "--out", tmp_path / "o")
    assert arch in one_error_line((rc, err))
    assert not (tmp_path / "o" / "tiny_attn.py").exists()


@pytest.mark.parametrize("arch", ["sm100", "sm120"])
def test_compile_newer_arch_says_which_plan_it_builds(tmp_path, arch):
    """Issue 35: a GPU newer than every target builds the sm90 plan, and says so in one
    stderr line (not silently `target sm90`); the module is the sm90 one, byte for byte."""
    spec_path = write_spec(tmp_path, TINY)
    rc, out, err = main_in_process("compile", spec_path, "--arch", arch, "--out", tmp_path / "new")
    assert rc == 0, err
    assert err.splitlines() == [f"dilgen: --arch {arch}: no {arch} templates yet; building the "
                                f"sm90 plan (Hopper's tiles and TMA; Triton compiles its kernels "
                                f"for {arch} when they first run; not measured on {arch})"], err
    assert "target sm90" in out
    rc, _, err90 = main_in_process("compile", spec_path, "--arch", "sm90", "--out", tmp_path / "s90")
    assert rc == 0 and err90 == ""
    assert (tmp_path / "new" / "tiny_attn.py").read_bytes() == (tmp_path / "s90" / "tiny_attn.py").read_bytes()


@pytest.mark.parametrize("arch", ["sm75", "foo", "sm_90"])
def test_compile_unknown_older_arch_lists_the_accepted_values(tmp_path, arch):
    spec_path = write_spec(tmp_path, TINY)
    rc, out, err = main_in_process("compile", spec_path, "--arch", arch, "--out", tmp_path / "o")
    line = one_error_line((rc, err))
    assert arch in line and "choose one of sm90, sm80, interpreter" in line, line


def test_help_lists_the_accepted_arches():
    for command in ("compile", "build", "explain"):
        rc, out, err = main_in_process(command, "--help")
        text = " ".join(out.split())
        assert rc == 0 and "sm90 (Hopper), sm80 (Ampere) or interpreter (CPU)" in text, out
        assert "a newer GPU (sm100, sm120, ...) the sm90 plan" in text, out


def test_build_newer_arch_builds_the_sm90_module_without_binaries(tmp_path, cache_dir):
    """`dilgen build --arch sm100`: the sm90 plan's module goes into the cache (where a
    Blackwell GPU finds it), with no sm90 cubins a sm100 GPU could not load."""
    write_spec(tmp_path / "specs", TINY)
    rc, out, err = main_in_process("build", tmp_path / "specs", "--arch", "sm100")
    assert rc == 0, err
    assert err.startswith("dilgen: --arch sm100: no sm100 templates yet; building the sm90 plan")
    assert len(err.splitlines()) == 1, err
    assert "not compiled ahead of time (runs through the JIT): sm100: no sm100 target, so no " \
           "sm100 binaries" in out, out
    from dilgen import cache
    from dilgen.compiler import cache_key
    from dilgen.spec import spec_from_dict
    from dilgen.targets import SM90
    assert cache.load(cache_key(spec_from_dict(TINY), SM90)) is not None
    assert not list(cache_dir.rglob("*.cubin"))


def test_dump_ir_is_json_with_affine_key_maps(tmp_path):
    spec_path = write_spec(tmp_path, LONGNET)
    res = dilgen_cli(tmp_path, "compile", spec_path, "--dump-ir", "--out", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    ir = json.loads(res.stdout)           # stdout is the JSON and nothing else
    spec = load_spec(spec_path)
    assert ir["spec_key"] == spec.key()
    assert ir["target"] == "sm90"
    branches = ir["branches"]
    assert len(branches) == spec.num_branches
    exprs = [b["key_map"]["expr"] for b in branches]
    kinds = [b["key_map"]["kind"] for b in branches]
    assert kinds == ["affine"] * 3
    assert exprs == ["j + o + 2048*s", "2*j + o + 4096*s", "4*j + o + 8192*s"]
    assert [(b["w"], b["r"]) for b in branches] == spec.branches()


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


def test_explain_png_draws_the_pattern(tmp_path):
    """README set-up installs matplotlib (the `test` extra; `dilgen[plot]` alone)."""
    pytest.importorskip("matplotlib", reason="matplotlib comes with `pip install -e .[test]`")
    spec_path = write_spec(tmp_path, TINY)
    png = tmp_path / "pattern.png"
    rc, out, err = main_in_process("explain", spec_path, "--seq-len", "64", "--png", png)
    assert rc == 0, err
    assert f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


LONGNET_BASE = Path(__file__).resolve().parents[1] / "examples" / "specs" / "longnet_base.json"


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


# --------------------------------------------------------------------------- build


def test_build_progress_then_nothing_to_do(tmp_path):
    specs = tmp_path / "specs"
    write_spec(specs, TINY)
    write_spec(specs, TINY_GQA_CAUSAL)
    env = _env(tmp_path)
    first = dilgen_cli(tmp_path, "build", specs, "--arch", "interpreter", env=env)
    assert first.returncode == 0, first.stderr
    assert "Traceback" not in first.stderr
    assert re.search(r"\[#+-*\]", first.stdout), "no progress bar"
    assert "2/2" in first.stdout
    assert "nothing to do" not in first.stdout
    assert "built 2" in first.stdout
    assert any((tmp_path / "cache").rglob("*.py")), "nothing was written to the kernel cache"

    second = dilgen_cli(tmp_path, "build", specs, "--arch", "interpreter", env=env)
    assert second.returncode == 0, second.stderr
    assert "nothing to do" in second.stdout

    # change one spec: exactly that one is built again
    write_spec(specs, dict(TINY, causal=True))
    third = dilgen_cli(tmp_path, "build", specs, "--arch", "interpreter", env=env)
    assert third.returncode == 0, third.stderr
    assert "nothing to do" not in third.stdout
    assert "built 1 of 2" in third.stdout


def test_build_progress_without_tqdm_prints_plain_lines(tmp_path, cache_dir, monkeypatch):
    """tqdm is optional (`pip install dilgen[cli]`): without it, `dilgen build` prints one
    plain line per kernel as it starts, and the same summary."""
    monkeypatch.setitem(sys.modules, "tqdm", None)          # `from tqdm import tqdm` fails
    with pytest.raises(ImportError):
        from tqdm import tqdm  # noqa: F401
    specs = tmp_path / "specs"
    write_spec(specs, dict(TINY, name="plain_a"))
    write_spec(specs, dict(TINY_GQA_CAUSAL, name="plain_b"))
    rc, out, err = main_in_process("build", specs, "--arch", "interpreter")
    assert rc == 0, err
    assert out.splitlines()[:2] == ["1/2 plain_a [interpreter]",
                                    "2/2 plain_b [interpreter]"], out
    assert "built 2 of 2" in out and not re.search(r"\[#+-*\]", out), out
    from dilgen import compiler
    monkeypatch.setattr(compiler, "_MODULES", {})          # as a second process would start
    rc, out, err = main_in_process("build", specs, "--arch", "interpreter")
    assert rc == 0 and out.splitlines()[:2] == ["1/2 plain_a [interpreter]",
                                                "2/2 plain_b [interpreter]"], out
    assert "nothing to do" in out


def test_build_refuses_a_folder_with_a_bad_spec_before_building(tmp_path):
    specs = tmp_path / "specs"
    write_spec(specs, TINY)
    write_spec(specs, dict(TINY, name="zz_bad", num_kv_heads=3))
    res = dilgen_cli(tmp_path, "build", specs, "--arch", "interpreter")
    line = one_error_line(res)
    assert "num_kv_heads" in line and "zz_bad.json" in line
    assert not any((tmp_path / "cache").rglob("*.py")), "built something before refusing"


def test_errors_name_the_spec_file_as_the_user_can_open_it(tmp_path, monkeypatch):
    """Issue 31: `dilgen build baddir` names baddir/neg.json, not neg.json (the user never
    typed that name); compile and explain name the file as given too."""
    monkeypatch.chdir(tmp_path)
    write_spec(tmp_path / "baddir", TINY)
    write_spec(tmp_path / "baddir", dict(TINY, num_heads=-1), "neg.json")
    for argv, shown in ((("build", "baddir"), "baddir/neg.json"),
                        (("build", "baddir/"), "baddir/neg.json"),
                        (("compile", "baddir/neg.json"), "baddir/neg.json"),
                        (("explain", "./baddir/neg.json"), "baddir/neg.json")):
        rc, out, err = main_in_process(*argv, "--arch", "interpreter")
        line = one_error_line((rc, err))
        assert line.startswith(f"dilgen: error: {shown}: num_heads = -1: must be >= 1"), line
        assert (Path(shown)).is_file()


@pytest.mark.parametrize("where", ["file", "proc"])
def test_build_refuses_an_unwritable_cache_in_one_line(tmp_path, monkeypatch, where):
    """Issue 35: `dilgen build` fills the cache, so an unwritable one is refused in one
    line naming it and DILGEN_CACHE_DIR (a run-time compile falls back instead)."""
    from dilgen import cache
    monkeypatch.setattr(cache, "_FALLBACK", {})
    bad = tmp_path / "afile" if where == "file" else Path(f"/proc/self/dilgen-{os.getpid()}")
    if where == "file":
        bad.write_text("")
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(bad))
    write_spec(tmp_path / "specs", TINY)
    rc, out, err = main_in_process("build", tmp_path / "specs", "--arch", "interpreter")
    line = one_error_line((rc, err))
    assert line.startswith(f"dilgen: error: the kernel cache {bad} is not writable ("), line
    assert "DILGEN_CACHE_DIR" in line and cache._FALLBACK == {}
    assert out == ""


def test_compile_out_onto_a_file_is_refused(tmp_path, monkeypatch):
    """Issue 35: `--out afile` (an existing file) names the file and what --out takes,
    instead of `[Errno 17] File exists: 'afile'`; so does a file above the folder."""
    monkeypatch.chdir(tmp_path)
    spec_path = write_spec(tmp_path, TINY)
    Path("afile").write_text("keep\n")
    for out_arg, shown in (("afile", "--out afile is a file"),
                           ("afile/sub", "--out afile/sub: afile is a file")):
        rc, out, err = main_in_process("compile", spec_path, "--out", out_arg)
        line = one_error_line((rc, err))
        assert line.startswith(f"dilgen: error: {shown}; --out takes a folder"), line
    assert Path("afile").read_text() == "keep\n"


def test_build_bad_folder(tmp_path):
    rc, out, err = main_in_process("build", tmp_path / "missing")
    assert "missing" in one_error_line((rc, err))
    (tmp_path / "empty").mkdir()
    rc, out, err = main_in_process("build", tmp_path / "empty")
    assert "empty" in one_error_line((rc, err))


# --------------------------------------------------------------------------- errors


def test_missing_spec_file(tmp_path):
    res = dilgen_cli(tmp_path, "compile", tmp_path / "nope.json", "--out", tmp_path / "out")
    assert "nope.json" in one_error_line(res)
    assert not (tmp_path / "out").exists()


def test_no_command_and_unknown_command(tmp_path):
    for argv in ((), ("frobnicate",), ("compile",)):
        rc, out, err = main_in_process(*argv)
        one_error_line((rc, err))


def test_version_and_help():
    rc, out, err = main_in_process("--version")
    assert rc == 0 and dilgen.__version__ in out + err
    rc, out, err = main_in_process("--help")
    assert rc == 0 and "compile" in out and "build" in out and "explain" in out


@pytest.mark.parametrize("name", ["../evil", "..", "evil/x", "/tmp/evil", "evil.py",
                                  "sub\\evil", "Evil", ""])
def test_name_can_never_write_outside_out(tmp_path, name):
    spec_path = write_spec(tmp_path / "specs", dict(TINY, name=name), "spec.json")
    out = tmp_path / "work" / "out"
    before = sorted(p for p in tmp_path.parent.glob("*evil*"))
    rc, stdout, err = main_in_process("compile", spec_path, "--out", out)
    assert "name" in one_error_line((rc, err))
    assert not out.exists()
    assert not list(tmp_path.rglob("*evil*"))
    assert sorted(tmp_path.parent.glob("*evil*")) == before


def test_name_evil_via_subprocess(tmp_path):
    spec_path = write_spec(tmp_path / "specs", dict(TINY, name="../evil"), "spec.json")
    res = dilgen_cli(tmp_path, "compile", spec_path, "--out", tmp_path / "work" / "out")
    line = one_error_line(res)
    assert "name" in line and "../evil" in line
    assert not (tmp_path / "work").exists()
    assert not (tmp_path / "evil.py").exists()


# --------------------------------------------------------------------------- §5 import


IMPORT_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from dilgen.reference import reference_attention
    from dilgen.spec import load_spec

    results = {}
    for pkg, name, spec_file in json.loads(sys.argv[2]):
        module = __import__(f"{pkg}.{name}", fromlist=["attention"])
        attention = module.attention
        spec = load_spec(spec_file)
        torch.manual_seed(0)
        B, N = 2, 40
        q = torch.randn(B, N, spec.num_heads, spec.head_dim)
        k = torch.randn(B, N, spec.num_kv_heads, spec.head_dim)
        v = torch.randn(B, N, spec.num_kv_heads, spec.head_dim)
        out = attention(q, k, v)
        out2, lse = attention(q, k, v, return_lse=True)
        ref, ref_lse = reference_attention(q, k, v, spec, return_lse=True)
        finite = torch.isfinite(ref_lse)
        results[name] = {
            "file": module.__file__,
            "shape": list(out.shape), "dtype": str(out.dtype),
            "lse_shape": list(lse.shape), "lse_dtype": str(lse.dtype),
            "err": ((out.double() - ref).norm() / ref.norm()).item(),
            "err2": ((out2.double() - ref).norm() / ref.norm()).item(),
            "lse_err": ((lse.double()[finite] - ref_lse[finite]).norm()
                        / ref_lse[finite].norm()).item(),
            "lse_inf_match": bool((torch.isfinite(lse) == finite).all()),
        }
    results["modules"] = sorted(m for m in sys.modules if m.startswith("dilgen"))
    print(json.dumps(results))
""")


def test_generated_module_imports_and_runs_in_fresh_process(tmp_path):
    pkg = "genpkg"
    out_dir = tmp_path / pkg
    env = _env(tmp_path)
    jobs = []
    for data in (TINY, TINY_GQA_CAUSAL):
        spec_path = write_spec(tmp_path / "specs", data)
        res = dilgen_cli(tmp_path, "compile", spec_path, "--arch", "interpreter",
                         "--out", out_dir, env=env)
        assert res.returncode == 0, res.stderr
        jobs.append((pkg, data["name"], str(spec_path)))
    # the importing process gets an empty cache: importing must not plan or emit again
    run_env = dict(env, DILGEN_CACHE_DIR=str(tmp_path / "fresh-cache"))
    script = tmp_path / "use_it.py"
    script.write_text(IMPORT_SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(tmp_path), json.dumps(jobs)],
                         capture_output=True, text=True, cwd=tmp_path, env=run_env, timeout=300)
    assert res.returncode == 0, res.stderr
    results = json.loads(res.stdout.strip().splitlines()[-1])
    for _, name, _ in jobs:
        r = results[name]
        assert Path(r["file"]).resolve() == (out_dir / f"{name}.py").resolve()
        assert r["dtype"] == "torch.float32" and r["lse_dtype"] == "torch.float32"
        assert r["lse_shape"] == [2, load_spec(tmp_path / "specs" / f"{name}.json").num_heads, 40]
        assert r["err"] < 1e-4 and r["err2"] < 1e-4, r
        assert r["lse_err"] < 1e-4 and r["lse_inf_match"], r
    modules = results["modules"]
    for forbidden in ("dilgen.planner", "dilgen.codegen", "dilgen.compiler"):
        assert forbidden not in modules, f"importing a generated module loaded {forbidden}"
    fresh = tmp_path / "fresh-cache"
    assert not fresh.exists() or not any(fresh.rglob("*.py")), "import emitted into the cache"
