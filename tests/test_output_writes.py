"""Every file dilgen writes where a user points it (`compile --out`, DILGEN_DUMP_DIR,
`explain --png`) goes to a temporary name in its folder and is moved onto its name; a
symlink or a non-regular file at the name, or a dump folder another user can write, is
refused in one line and never followed (issue 56 item 4). And the command line's standard
streams: closed, full or ASCII-only, one line and exit 2, never a traceback (issue 57 §4).
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import TINY, cli_env, main_in_process, one_error_line, write_spec

NAME = TINY["name"]
SUB = f"{NAME}-sm90"                      # the dump's per-compile folder: <name>-<target>
STAGES = ("0-spec.json", "1-plan.json", "2-source.py")


@pytest.fixture
def spec_path(tmp_path):
    return write_spec(tmp_path / "specs", TINY)


@pytest.fixture
def dump(tmp_path, monkeypatch):
    folder = tmp_path / "dump"
    monkeypatch.setenv("DILGEN_DUMP_DIR", str(folder))
    return folder


def victim_file(tmp_path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def private_sub(dump: Path) -> Path:
    (dump / SUB).mkdir(parents=True, mode=0o700)
    os.chmod(dump, 0o700)
    return dump / SUB


# --------------------------------------------------------------------------- compile --out


def test_out_init_dangling_symlink_is_refused_not_followed(tmp_path, spec_path):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "planted" / "x.py"
    target.parent.mkdir()
    (out / "__init__.py").symlink_to(target)
    line = one_error_line(main_in_process("compile", spec_path, "--out", out)[::2])
    assert "__init__.py is a symlink" in line, line
    assert not target.exists(), "the link's target was created"
    assert not (out / f"{NAME}.py").exists(), "the module was written before the refusal"


@pytest.mark.parametrize("what", ["symlink", "fifo"])
def test_out_module_name_that_is_not_a_regular_file_is_refused(tmp_path, spec_path, what):
    out, victim = tmp_path / "out", victim_file(tmp_path)
    out.mkdir()
    if what == "symlink":
        (out / f"{NAME}.py").symlink_to(victim)
    else:
        os.mkfifo(out / "__init__.py")
    line = one_error_line(main_in_process("compile", spec_path, "--out", out)[::2])
    assert ("is a symlink" if what == "symlink" else "is not a regular file") in line, line
    assert victim.read_text() == "precious\n"
    assert what == "fifo" or (out / f"{NAME}.py").is_symlink()


def test_out_empty_is_refused(tmp_path, spec_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(main_in_process("compile", spec_path, "--out", "")[::2])
    assert "--out ''" in line, line
    assert not (tmp_path / f"{NAME}.py").exists() and not (tmp_path / "__init__.py").exists()


# --------------------------------------------------------------------------- DILGEN_DUMP_DIR


def test_dump_source_symlink_to_a_victim_is_refused(tmp_path, spec_path, dump):
    victim = victim_file(tmp_path)
    (private_sub(dump) / "2-source.py").symlink_to(victim)
    line = one_error_line(main_in_process("compile", spec_path, "--out", tmp_path / "out")[::2])
    assert "DILGEN_DUMP_DIR=" in line and "2-source.py is a symlink" in line, line
    assert victim.read_text() == "precious\n"
    assert not (dump / SUB / "0-spec.json").exists(), "a stage was written before the refusal"
    assert not (tmp_path / "out" / f"{NAME}.py").exists()


def test_dump_dangling_spec_link_target_is_not_created(tmp_path, spec_path, dump):
    target = tmp_path / "created_by_dilgen.json"
    (private_sub(dump) / "0-spec.json").symlink_to(target)
    line = one_error_line(main_in_process("compile", spec_path, "--out", tmp_path / "out")[::2])
    assert "0-spec.json is a symlink" in line, line
    assert not target.exists()


@pytest.mark.parametrize("where", ["root", "sub"])
def test_dump_folder_that_others_can_write_is_refused(tmp_path, spec_path, dump, where):
    folder = dump if where == "root" else private_sub(dump)
    folder.mkdir(exist_ok=True)
    os.chmod(folder, 0o777)
    line = one_error_line(main_in_process("compile", spec_path, "--out", tmp_path / "out")[::2])
    assert f"into {folder} (group or others can write it (mode 0777))" in line, line
    assert not (dump / SUB / "2-source.py").exists()


def test_dump_folder_that_is_a_symlink_is_refused(tmp_path, spec_path, dump):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    dump.symlink_to(elsewhere)
    line = one_error_line(main_in_process("compile", spec_path, "--out", tmp_path / "out")[::2])
    assert f"into {dump} (it is a symlink)" in line, line
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a folder to another user (uid 65534) needs root")
def test_dump_folder_of_another_user_is_refused(tmp_path, spec_path, dump):
    dump.mkdir()
    os.chown(dump, 65534, 65534)
    os.chmod(dump, 0o777)
    line = one_error_line(main_in_process("compile", spec_path, "--out", tmp_path / "out")[::2])
    assert str(dump) in line and "owned by uid 65534" in line, line
    assert list(dump.iterdir()) == []


def test_dump_folders_dilgen_makes_are_private_whatever_the_umask(tmp_path, spec_path, monkeypatch):
    dump = tmp_path / "new" / "dump"
    monkeypatch.setenv("DILGEN_DUMP_DIR", str(dump))
    old = os.umask(0)
    try:
        rc, _, err = main_in_process("compile", spec_path, "--out", tmp_path / "out")
    finally:
        os.umask(old)
    assert rc == 0, err
    for folder in (dump, dump / SUB):
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700, folder
    for name in STAGES:
        assert stat.S_IMODE(os.lstat(dump / SUB / name).st_mode) == 0o600, name


def test_written_files_are_whole_and_replace_links_not_write_through_them(tmp_path, spec_path,
                                                                          monkeypatch):
    """A second run over old files (one a hard link to a file elsewhere) leaves exactly
    the bytes a clean run writes, and the file elsewhere untouched: each name is replaced,
    not written through."""
    monkeypatch.setenv("DILGEN_DUMP_DIR", str(tmp_path / "dump_clean"))
    rc, _, err = main_in_process("compile", spec_path, "--out", tmp_path / "clean")
    assert rc == 0, err
    dump = tmp_path / "dump_again"
    monkeypatch.setenv("DILGEN_DUMP_DIR", str(dump))
    out = tmp_path / "again"
    out.mkdir()
    victim, victim2 = victim_file(tmp_path), tmp_path / "victim2.txt"
    victim2.write_text("also precious\n")
    os.link(victim, out / f"{NAME}.py")
    os.link(victim2, private_sub(dump) / "2-source.py")
    (dump / SUB / "0-spec.json").write_text('{"half": ')
    rc, _, err = main_in_process("compile", spec_path, "--out", out)
    assert rc == 0, err
    assert victim.read_text() == "precious\n" and victim2.read_text() == "also precious\n"
    for name in (f"{NAME}.py", "__init__.py"):
        assert (out / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name
    for name in STAGES:
        assert (dump / SUB / name).read_bytes() == (tmp_path / "dump_clean" / SUB / name).read_bytes()
    assert (dump / SUB / "2-source.py").read_bytes() == (out / f"{NAME}.py").read_bytes()
    left = [p.name for folder in (out, dump / SUB) for p in folder.iterdir() if p.name.startswith(".")]
    assert left == [], f"temporary files left behind: {left}"


# --------------------------------------------------------------------------- explain --png


@pytest.mark.parametrize("dangling", [False, True])
def test_explain_png_onto_a_symlink_is_refused(tmp_path, spec_path, dangling):
    pytest.importorskip("matplotlib")
    victim = tmp_path / "gone.png" if dangling else victim_file(tmp_path)
    png = tmp_path / "pattern.png"
    png.symlink_to(victim)
    rc, out, err = main_in_process("explain", spec_path, "--seq-len", "32", "--png", png)
    line = one_error_line((rc, err))
    assert f"--png {png}: is a symlink" in line, line
    assert out == "", "a refused --png prints nothing"
    assert (not victim.exists()) if dangling else victim.read_text() == "precious\n"


# --------------------------------------------------------------------------- standard streams


def run_with_fds(tmp_path, *args, close=(), stderr=subprocess.PIPE, env=None):
    """`python -m dilgen.cli ARGS` with the descriptors in `close` closed in the child."""
    def close_fds():
        for fd in close:
            os.close(fd)
    return subprocess.run([sys.executable, "-m", "dilgen.cli", *map(str, args)],
                          stdout=subprocess.DEVNULL if 1 in close else subprocess.PIPE,
                          stderr=subprocess.DEVNULL if 2 in close else stderr,
                          preexec_fn=close_fds, cwd=tmp_path, env=env or cli_env(tmp_path),
                          text=True, timeout=300)


@pytest.mark.parametrize("command", ["compile", "explain"])
def test_closed_stdout_is_one_line_not_a_traceback(tmp_path, spec_path, command):
    extra = ["--out", tmp_path / "out"] if command == "compile" else []
    res = run_with_fds(tmp_path, command, spec_path, *extra, close=(1,))
    line = one_error_line(res)
    assert "standard output is closed" in line, line
    assert not (tmp_path / "out").exists(), "refused before any work"


def test_ascii_stdout_and_a_non_ascii_out_folder(tmp_path, spec_path):
    env = dict(cli_env(tmp_path), PYTHONIOENCODING="ascii")
    out = tmp_path / "sortie-\u00e9"
    res = run_with_fds(tmp_path, "compile", spec_path, "--out", out, env=env)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert (out / f"{NAME}.py").is_file()
    hint = next(x for x in res.stdout.splitlines() if x.startswith("import: "))
    compile(hint[len("import: "):], "<hint>", "exec")      # escaped, and still valid Python


def test_bad_spec_with_a_full_stderr_exits_2(tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    bad = write_spec(tmp_path / "specs", {"name": "bad"})
    with open("/dev/full", "w") as full:
        res = run_with_fds(tmp_path, "compile", bad, stderr=full)
    assert res.returncode == 2 and res.stdout == "", (res.returncode, res.stdout)


def test_bad_spec_with_stderr_closed_prints_nothing_on_stdout(tmp_path):
    bad = write_spec(tmp_path / "specs", {"name": "bad"})
    res = run_with_fds(tmp_path, "compile", bad, close=(2,))
    assert res.returncode == 2 and res.stdout == "", (res.returncode, res.stdout)


def _hint_runs(tmp_path, res, script_folder: Path, cwd: Path) -> None:
    assert res.returncode == 0, res.stderr
    hint = next(x for x in res.stdout.splitlines() if x.startswith("import: "))[len("import: "):]
    script_folder.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    script = script_folder / "use_it.py"
    script.write_text(f"{hint}\nprint(type(attention).__name__)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=cwd, env=cli_env(tmp_path), timeout=300)
    assert run.returncode == 0, (hint, run.stderr[-2000:])


def test_import_hint_works_from_a_script_in_the_output_folder(tmp_path, spec_path):
    """The default folder generated/ under the current folder; the script in generated/,
    run from another folder (a bare `from generated.<name> import ...` fails there)."""
    res = run_with_fds(tmp_path, "compile", spec_path)
    _hint_runs(tmp_path, res, tmp_path / "generated", tmp_path / "specs")


def test_import_hint_for_an_out_folder_that_is_no_identifier(tmp_path, spec_path):
    res = run_with_fds(tmp_path, "compile", spec_path, "--out", "my-out")
    _hint_runs(tmp_path, res, tmp_path / "scripts", tmp_path / "specs")


def test_explain_help_says_the_defaults_of_seq_len_and_heads():
    rc, out, _ = main_in_process("explain", "--help")
    assert rc == 0
    text = " ".join(out.split()[out.split().index("options:"):])    # past the usage line
    seq = text[text.index("--seq-len SEQ_LEN"):text.index("--png FILE.png ")]
    heads = text[text.index("--heads [H ...]"):text.index("--cu-seqlens 0,")]
    assert "default" in seq and "GFLOP" in seq and "--png" in seq and "ring" in seq, seq
    assert "default 0, 1 and the last head" in heads and "with --png only" in heads, heads
