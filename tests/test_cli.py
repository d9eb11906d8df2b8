"""SPEC.md §4 (the command line) and §5 (generated modules), driven as a user would:
`python -m dilgen.cli ...` in a fresh interpreter, with a private kernel cache and
output folder under tmp_path. A few argument checks run `dilgen.cli.main` in-process.
"""
from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dilgen
from dilgen.spec import load_spec

from cli_helpers import (LONGNET, TINY, TINY_GQA_CAUSAL, cli_env, dilgen_cli,
                         main_in_process, one_error_line, write_spec)


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
    """sm90's own flags (descriptor loads, the folded softmax scale, the Gluon kernels) choose
    other code in the same templates; with them off, sm80 and sm90 differ only in the target, the tiles and
    the L2 size the lattice kernels group their tiles to."""
    from dilgen import codegen, planner
    from dilgen.targets import SM90
    spec, runs = compiled
    (r90, p90), (r80, p80) = runs["a"], runs["c"]
    assert r90.returncode == 0 and r80.returncode == 0, r80.stderr
    assert "tl.make_tensor_descriptor" in p90.read_text()
    assert "tl.make_tensor_descriptor" not in p80.read_text()
    flags_off = {"fused_tma": False, "bwd_tma": False, "fold_scale": False, "gluon_fwd": False, "gluon_dkdv": False,
                 "gluon_dq": False}
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


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path):
    """`dilgen compile spec --dump-ir | head -1`: the reader closes the pipe; dilgen stops
    with SIGPIPE's status (141) and prints nothing on stderr ("Broken pipe" is noise)."""
    spec_path = write_spec(tmp_path, TINY)
    proc = subprocess.Popen([sys.executable, "-m", "dilgen.cli", "compile", spec_path, "--dump-ir",
                             "--out", tmp_path / "out"], cwd=tmp_path, env=cli_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()                       # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and err == "", (proc.returncode, err)


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
    env = cli_env(tmp_path)
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
