"""`dilgen build` (SPEC §4): ahead of time, every spec of a folder into the kernel cache:
its progress, what it rebuilds, and the folders and caches it refuses in one line."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from cli_helpers import (TINY, TINY_GQA_CAUSAL, cli_env, dilgen_cli,
                         main_in_process, one_error_line, write_spec)


# --------------------------------------------------------------------------- build


def test_build_progress_then_nothing_to_do(tmp_path):
    specs = tmp_path / "specs"
    write_spec(specs, TINY)
    write_spec(specs, TINY_GQA_CAUSAL)
    env = cli_env(tmp_path)
    first = dilgen_cli(tmp_path, "build", specs, "--arch", "interpreter", env=env)
    assert first.returncode == 0, first.stderr
    assert "Traceback" not in first.stderr
    # a pipe or a log, not a terminal: one plain line per kernel, no bar frames
    assert not re.search(r"\[#+-*\]", first.stdout), first.stdout
    assert "\r" not in first.stdout and "spec 2/2: " in first.stdout, first.stdout
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


def test_build_prints_a_line_per_binary_as_it_is_stored(tmp_path, cache_dir, monkeypatch):
    """Issue 57: through a pipe, `dilgen build --arch sm90` printed its spec's line and then
    nothing for minutes, while the binaries compiled. Now a line says how many binaries
    there are, one per binary as it is stored (each printed before the next compile starts,
    with the seconds elapsed), and the summary counts specs and binaries as such. The
    compile itself (ptxas, minutes) is replaced: the launch model, the binder and the CLI
    are the real ones."""
    import contextlib
    import io

    from dilgen import aot
    from dilgen.aot import build as aot_build
    from dilgen.cli import main
    out = io.StringIO()                                  # not a terminal: plain lines
    seen: list[str] = []

    def compile_job(job):
        seen.append(out.getvalue())
        return b"", "{}"

    monkeypatch.setattr(aot_build, "compile_job", compile_job)
    monkeypatch.setattr(aot_build, "store_job", lambda job, cubin, meta: None)
    for module in (aot, aot_build):                      # a wheel without ptxas builds too
        monkeypatch.setattr(module, "ptxas_path", lambda: "ptxas")
    write_spec(tmp_path / "specs", dict(TINY, name="aot_pipe", dtype="float16"))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["build", str(tmp_path / "specs"), "--arch", "sm90", "--seq-len", "64"])
    lines = out.getvalue().splitlines()
    assert rc == 0 and lines[0] == "spec 1/1: aot_pipe [sm90]", lines
    n = int(re.fullmatch(r"  (\d+) binaries to compile for sm90", lines[1]).group(1))
    assert n == len(seen) >= 4, lines
    per_binary = lines[2:2 + n]
    for i, line in enumerate(per_binary, 1):
        assert re.fullmatch(rf"  binary {i}/{n}: aot_pipe_\w+ \[\w+\] for sm90, \d+\.\d s elapsed",
                            line), line
    for i, before in enumerate(seen):                    # printed as stored, not at the end
        assert before.count("  binary ") == i, before
    assert lines[2 + n:] == [f"built 1 of 1 spec(s) for sm90; 0 up to date; compiled {n} "
                             f"binaries ahead of time (0 already in the cache)"], lines


def test_build_dropout_compiles_the_dropout_plans_kernels_too(tmp_path, cache_dir, monkeypatch):
    """`dilgen build --dropout`: each spec's dropout plan (the module a call with dropout_p > 0
    runs) is built and its kernels compiled ahead of time beside the spec's own, and the
    runtime then finds that module in the cache. The compile (ptxas) is replaced; the launch
    model and the binder are the real ones."""
    import contextlib
    import io

    import dilgen
    from dilgen import aot
    from dilgen.aot import build as aot_build
    from dilgen.cli import main
    from dilgen import compiler
    from dilgen.compiler import Kernel
    from dilgen.targets import SM90
    compiled: list = []
    monkeypatch.setattr(aot_build, "compile_job", lambda job: compiled.append(job) or (b"", "{}"))
    monkeypatch.setattr(aot_build, "store_job", lambda job, cubin, meta: None)
    for module in (aot, aot_build):
        monkeypatch.setattr(module, "ptxas_path", lambda: "ptxas")
    specs = tmp_path / "specs"
    write_spec(specs, dict(TINY, name="aot_drop", dtype="float16"))
    write_spec(specs, dict(TINY_GQA_CAUSAL, name="aot_drop_causal", dtype="float16"))

    def run(*extra):
        compiled.clear()
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
            rc = main(["build", str(specs), "--arch", "sm90", "--seq-len", "64", *extra])
        assert rc == 0, out.getvalue()
        return out.getvalue(), {job.module_path for job in compiled}, len(compiled)

    _, plain_modules, plain = run()
    out, modules, with_dropout = run("--dropout")
    assert with_dropout > plain and len(modules) == 2 * len(plain_modules) == 4, (plain, with_dropout, modules)
    assert "not compiled ahead of time" not in out, out
    spec = dilgen.spec_from_dict(dict(TINY, name="aot_drop", dtype="float16"))
    monkeypatch.setattr(compiler, "_MODULES", {})           # a new process: the cache on disk
    assert Kernel(spec, SM90, {"dropout": True}).compiled_for("cuda").cache_hit


def test_build_progress_bar_on_a_terminal(tmp_path, cache_dir):
    """On a terminal (stdout.isatty()) with tqdm installed, `dilgen build` draws a bar."""
    import contextlib
    import io

    from dilgen.cli import main

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    specs = tmp_path / "specs"
    write_spec(specs, dict(TINY, name="bar_a"))
    out = Terminal()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["build", str(specs), "--arch", "interpreter"])
    assert rc == 0 and re.search(r"\[#+-*\]", out.getvalue()), out.getvalue()


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
    assert out.splitlines()[:2] == ["spec 1/2: plain_a [interpreter]",
                                    "spec 2/2: plain_b [interpreter]"], out
    assert "built 2 of 2" in out and not re.search(r"\[#+-*\]", out), out
    from dilgen import compiler
    monkeypatch.setattr(compiler, "_MODULES", {})          # as a second process would start
    rc, out, err = main_in_process("build", specs, "--arch", "interpreter")
    assert rc == 0 and out.splitlines()[:2] == ["spec 1/2: plain_a [interpreter]",
                                                "spec 2/2: plain_b [interpreter]"], out
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


