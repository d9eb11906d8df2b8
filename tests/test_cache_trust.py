"""The kernel cache trusts only what this user made (issue 56, items 1, 2 and 5).

- a cache folder another user owns (or anyone can write) holding a planted entry under
  the real key, with a consistent manifest: the entry is not imported, nothing is written
  there, one CacheWarning names the folder and why; `dilgen build` refuses in one line;
- a shared sticky (1777) cache folder, or a private one, where another user made a shard:
  the same; an entry folder of another user in our own shard counts as missing;
- under umask 000, the folders dilgen makes are 0700 and its files 0600;
- every shard name a symlink to a home with old hidden files: nothing there is touched,
  deleted or written (the sweep never goes through a link);
- a FIFO in an entry is damage, not a hang;
- a planted AOT entry (an ELF header then junk, consistent manifest) in a folder the cache
  does not trust is not returned by aot.artifacts.load_entry nor listed by _builds.

The cases with another user chown to uid 65534 (`nobody`), which needs root: they skip
elsewhere; the cases with a folder of this user that others can write run everywhere.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
import warnings
from pathlib import Path

import pytest

from dilgen import cache, codegen, compiler, planner
from dilgen.aot import artifacts
from dilgen.spec import spec_from_dict
from dilgen.targets import INTERPRETER

from cache_helpers import RACE_FILES, RACE_INFO, TINY
from cache_helpers import spec as _spec
from cli_helpers import main_in_process, one_error_line, write_spec

NOBODY = 65534


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a folder of another user is made with os.chown to uid 65534 "
                    "(nobody), which only root may do")


@pytest.fixture
def fresh(monkeypatch):
    """No temporary cache of an earlier test, no module or AOT index in memory."""
    monkeypatch.setattr(cache, "_FALLBACK", {})
    monkeypatch.setattr(compiler, "_MODULES", {})
    monkeypatch.setattr(artifacts, "_BUILDS", {})
    monkeypatch.delenv("DILGEN_ALWAYS_COMPILE", raising=False)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _plant_files(root: Path, key: str, files: dict[str, bytes], info: dict | None = None) -> Path:
    """An entry <root>/<key[:2]>/<key> with `files` and a manifest that matches them."""
    entry = root / key[:2] / key
    entry.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (entry / name).write_bytes(data)
    manifest = {**(info or {}), "key": key, "files": {n: _sha(d) for n, d in files.items()}}
    (entry / cache.MANIFEST).write_text(json.dumps(manifest))
    return entry


def _plant_module(root: Path, marker: Path) -> tuple[str, Path]:
    """The attacker's entry for the real key of the tiny spec: the real generated module
    plus a line that writes `marker` when it is imported. (key, entry folder)"""
    spec = _spec()
    key = compiler.cache_key(spec, INTERPRETER)
    source = codegen.emit(planner.plan(spec, INTERPRETER, None))
    source += f"\nopen({str(marker)!r}, 'w').write('attacker code ran')\n"
    return key, _plant_files(root, key, {cache.MODULE: source.encode(), "plan.json": b"{}\n"})


def _give_away(top: Path, mode: int | None = None) -> None:
    """Everything under `top` (and `top`) to uid 65534; `top` chmod `mode`."""
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), NOBODY, -1)
    os.chown(top, NOBODY, -1)
    if mode is not None:
        os.chmod(top, mode)


def _snapshot(top: Path) -> dict:
    """What is under `top` (links not followed): mode, owner, size, mtime, content."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for p in [Path(dirpath), *(Path(dirpath) / n for n in dirnames + filenames)]:
            st = os.lstat(p)
            body = _sha(p.read_bytes()) if stat.S_ISREG(st.st_mode) else None
            seen[str(p.relative_to(top))] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, body)
    return seen


def _build(*dicts: dict) -> tuple[list, list[str]]:
    """compiler.build of each spec for the interpreter: (compiled modules, CacheWarnings)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        built = [compiler.build(spec_from_dict(dict(d)), INTERPRETER) for d in dicts]
    return built, [str(w.message) for w in seen if issubclass(w.category, cache.CacheWarning)]


def _check_refused(root: Path, folder: Path, why: str, marker: Path, before: dict) -> None:
    """Compile the planted spec and another: nothing of the attacker's runs, both modules
    come from this process's temporary cache, one warning names `folder` and `why`, and
    nothing under `root` changed."""
    built, warned = _build(TINY, dict(TINY, name="trust_second", num_heads=4))
    assert not marker.exists(), "the planted module was imported"
    assert not built[0].cache_hit
    fallback = cache._FALLBACK[str(root)]
    assert all(b.path.is_relative_to(fallback) for b in built), [b.path for b in built]
    assert len(warned) == 1, warned
    assert f"{folder} cannot be trusted" in warned[0] and why in warned[0], warned[0]
    assert "DILGEN_CACHE_DIR" in warned[0] and "\n" not in warned[0]
    assert _snapshot(root) == before, "dilgen wrote in a folder it does not trust"
    key = compiler.cache_key(_spec(), INTERPRETER)
    assert cache.load(key) == cache.entry_dir(key, fallback)


# --------------------------------------------------------------------------- whose folders


@pytest.mark.parametrize("who", ["other_user", "world_writable"])
def test_a_cache_folder_others_can_write_is_neither_read_nor_written(tmp_path, monkeypatch,
                                                                     fresh, who):
    root, marker = tmp_path / "shared", tmp_path / "marker"
    _plant_module(root, marker)
    if who == "other_user":
        _needs_root()
        _give_away(root, 0o777)
        why = f"owned by uid {NOBODY}"
    else:
        for p in [root, *root.rglob("*")]:
            os.chmod(p, 0o777)
        why = "group or others can write it (mode 0777)"
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(root))
    _check_refused(root, root, why, marker, _snapshot(root))


@pytest.mark.parametrize("root_mode", [0o1777, 0o700])
def test_a_shard_another_user_made_is_neither_read_nor_written(tmp_path, monkeypatch, fresh,
                                                               root_mode):
    """A shared sticky folder (as /tmp) where another user made the shard first, or a
    private cache folder where a shard is another user's: the planted entry is not run."""
    _needs_root()
    root, marker = tmp_path / "tmp-like", tmp_path / "marker"
    key, entry = _plant_module(root, marker)
    _give_away(entry.parent, 0o777 if root_mode == 0o1777 else 0o755)
    os.chmod(root, root_mode)
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(root))
    if root_mode == 0o1777:
        folder, why = root, "group or others can write it (mode 1777)"
    else:
        folder, why = entry.parent, f"owned by uid {NOBODY}"
    _check_refused(root, folder, why, marker, _snapshot(root))


def test_an_entry_folder_of_another_user_counts_as_missing(cache_dir, fresh):
    """In this user's own cache folder and shard: not imported, replaced by an entry of
    this user's (no warning: the cache folder itself is fine)."""
    _needs_root()
    marker = cache_dir.parent / "marker"
    key, entry = _plant_module(cache_dir, marker)
    os.chmod(cache_dir, 0o700)
    os.chmod(entry.parent, 0o700)
    _give_away(entry, 0o755)
    assert cache.load(key) is None
    built, warned = _build(TINY)
    assert not marker.exists() and not built[0].cache_hit and warned == []
    assert built[0].path == entry / cache.MODULE and cache.load(key) == entry
    st = os.lstat(entry)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_dilgen_build_refuses_an_untrusted_cache_in_one_line(tmp_path, monkeypatch, fresh):
    root, marker = tmp_path / "shared", tmp_path / "marker"
    _plant_module(root, marker)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, 0o777)
    before = _snapshot(root)
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(root))
    write_spec(tmp_path / "specs", TINY)
    rc, out, err = main_in_process("build", tmp_path / "specs", "--arch", "interpreter")
    line = one_error_line((rc, err))
    assert f"{root} cannot be trusted (group or others can write it" in line, line
    assert "DILGEN_CACHE_DIR" in line and cache._FALLBACK == {}
    assert not marker.exists() and _snapshot(root) == before


# --------------------------------------------------------------------------- modes


def test_folders_are_0700_and_files_0600_whatever_the_umask(tmp_path, monkeypatch, fresh):
    """The default cache (~/.cache/dilgen) under umask 000: made, repaired, tuned."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DILGEN_CACHE_DIR")
    old = os.umask(0)
    try:
        built, warned = _build(TINY)
        key = compiler.cache_key(_spec(), INTERPRETER)
        os.unlink(cache.entry_dir(key) / "plan.json")          # damaged: repaired in place
        monkeypatch.setattr(compiler, "_MODULES", {})
        again, _ = _build(TINY)
        cache.store(cache.make_key(test="umask"), RACE_FILES, RACE_INFO)
        cache.store_tuning("t" * 64, {"block_m": 64}, {})
    finally:
        os.umask(old)
    assert warned == [] and not again[0].cache_hit
    top = home / ".cache"
    assert built[0].path.is_relative_to(top / "dilgen")
    found = [top, *top.rglob("*")]
    assert len(found) > 10
    for p in found:
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p}: {mode:04o}"


# --------------------------------------------------------------------------- links


@pytest.mark.parametrize("root_owner", ["mine", "other_user"])
def test_shards_linked_to_a_home_touch_nothing_there(tmp_path, monkeypatch, fresh, root_owner):
    """Every shard name a symlink to a "home" with hidden files two hours old (what the
    sweep deleted): after compiles, a store and a sweep there, the home is as it was."""
    home, root = tmp_path / "victim-home", tmp_path / "squatted"
    (home / ".ssh").mkdir(parents=True)
    (home / ".bashrc").write_text("export PATH\n")
    (home / ".ssh" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (home / ".0123456789abcdef-tmp").mkdir()
    past = time.time() - 2 * 3600
    for p in [home / ".ssh" / "id_rsa", home / ".bashrc", home / ".ssh",
              home / ".0123456789abcdef-tmp", home]:
        os.utime(p, (past, past))
    root.mkdir(mode=0o700)
    for i in range(256):
        (root / f"{i:02x}").symlink_to(home, target_is_directory=True)
    key = compiler.cache_key(_spec(), INTERPRETER)
    if root_owner == "other_user":
        _needs_root()
        _give_away(root, 0o777)
        folder, why = root, f"it is owned by uid {NOBODY}"
    else:
        folder, why = root / key[:2], "it is a symlink"
    before = _snapshot(home)
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(root))
    built, warned = _build(TINY, dict(TINY, name="trust_second", num_heads=4))
    cache.store(cache.make_key(test="links"), RACE_FILES, RACE_INFO)
    cache._sweep(root / key[:2])
    assert _snapshot(home) == before, "the home behind the shard links was changed"
    assert len(warned) == 1 and f"{folder} cannot be trusted ({why}" in warned[0], warned
    fallback = cache._FALLBACK[str(root)]
    assert all(b.path.is_relative_to(fallback) for b in built)


# --------------------------------------------------------------------------- FIFOs


def _bounded(call, fifo: Path, seconds: float = 30.0):
    """call() in a thread; if it is still blocked after `seconds` (on the FIFO), a writer
    opens and closes the FIFO so that the reader gets EOF, and the test fails."""
    result, error = [], []

    def run():
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            error.append(exc)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        worker.join(10)
        pytest.fail(f"blocked for more than {seconds} s on the FIFO {fifo}")
    if error:
        raise error[0]
    return result[0]


@pytest.mark.parametrize("name", [cache.MODULE, cache.MANIFEST, "plan.json"])
def test_a_fifo_in_an_entry_is_damage_not_a_hang(cache_dir, fresh, monkeypatch, name):
    built, _ = _build(TINY)
    key = compiler.cache_key(_spec(), INTERPRETER)
    entry = cache.entry_dir(key)
    (entry / name).unlink()
    os.mkfifo(entry / name)
    assert _bounded(lambda: cache.load(key), entry / name) is None
    monkeypatch.setattr(compiler, "_MODULES", {})
    again = _bounded(lambda: compiler.build(_spec(), INTERPRETER), entry / name)
    assert not again.cache_hit and again.source == built[0].source
    assert stat.S_ISREG(os.lstat(entry / name).st_mode)
    assert cache.load(key) == entry


# --------------------------------------------------------------------------- AOT entries


def _plant_aot(root: Path, key: str) -> Path:
    meta = {"name": "planted_kernel", "target": {"backend": "cuda", "arch": 90, "warp_size": 32}}
    files = {artifacts.CUBIN: b"\x7fELF" + os.urandom(64), artifacts.METADATA: json.dumps(meta).encode(),
             artifacts.SPECJSON: b"{}\n"}
    info = {"kind": "aot-kernel", "kernel": "planted_kernel", "module_sha256": "m" * 64,
            "triton": "0.0-planted"}
    return _plant_files(root, key, files, info)


@pytest.mark.parametrize("who", ["other_user", "world_writable", "linked_shard"])
def test_a_planted_aot_entry_is_not_loaded(tmp_path, monkeypatch, fresh, who):
    root = tmp_path / "cache"
    key = cache.make_key(kind="aot-kernel", test="planted")
    if who == "linked_shard":                  # this user's cache, one shard a link elsewhere
        elsewhere = tmp_path / "elsewhere"
        _plant_aot(elsewhere, key)
        root.mkdir(mode=0o700)
        (root / key[:2]).symlink_to(elsewhere / key[:2], target_is_directory=True)
    else:
        _plant_aot(root, key)
        if who == "other_user":
            _needs_root()
            _give_away(root, 0o777)
        else:
            for p in [root, *root.rglob("*")]:
                os.chmod(p, 0o777)
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(root))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert artifacts.load_entry(key) is None
        assert artifacts.load_entry(key, "planted_kernel") is None
    assert [w for w in seen if issubclass(w.category, cache.CacheWarning)]
    assert artifacts._builds(root) == {}
    assert artifacts.other_triton_builds("m" * 64, "planted_kernel") == []
