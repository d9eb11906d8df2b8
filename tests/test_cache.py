"""The on-disk kernel cache (dilgen/cache.py) under concurrency, damage and upgrades.

- 8 processes compiling the same spec at once into one fresh DILGEN_CACHE_DIR leave
  exactly one sound entry and no temporary or torn files, and every process gets a
  working module (a forward call matches the float64 reference);
- 8 processes racing, round after round, to repair an entry that was damaged before
  the round never read a missing or wrong module file (the window in which an importer
  reads the file it was handed);
- a damaged entry (truncated, flipped bytes, tampered, manifest deleted or garbage,
  files missing, a file where the folder should be) is detected and rebuilt, never
  trusted;
- a changed dilgen, triton or torch version, or template hash, misses the old entry;
- (a cache folder that cannot be written: tests/test_cache_unwritable.py; a full one:
  tests/test_cache_full.py; deleted while kernels compile: tests/test_cache_vanish.py)
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dilgen import cache

from cache_helpers import ENTRY_FILES, RACE_FILES, RACE_INFO, TINY
from cache_helpers import spec as _spec
from cache_helpers import entries as _entries
from cache_helpers import stray as _stray

# --------------------------------------------------------------------------- (a) 8 processes

WORKER = textwrap.dedent("""
    import hashlib, json, sys, time
    from pathlib import Path
    ready, go, spec_path = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    import torch
    from dilgen.compiler import build
    from dilgen.reference import reference_attention
    from dilgen.spec import load_spec
    from dilgen.targets import INTERPRETER
    spec = load_spec(spec_path)
    ready.touch()
    deadline = time.time() + 240
    while not go.exists() and time.time() < deadline:     # start together
        time.sleep(0.002)
    compiled = build(spec, INTERPRETER)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 16) for _ in range(3))
    out = compiled.attention(q, k, v)
    ref = reference_attention(q, k, v, spec)
    print(json.dumps({
        "hit": compiled.cache_hit, "path": str(compiled.path),
        "source_sha": hashlib.sha256(compiled.source.encode()).hexdigest(),
        "file_sha": hashlib.sha256(Path(compiled.path).read_bytes()).hexdigest(),
        "module_file": compiled.module.__file__,
        "err": ((out.double() - ref).norm() / ref.norm()).item(),
    }))
""")


@pytest.mark.ranks
def test_eight_processes_compile_the_same_spec_at_once(tmp_path, monkeypatch):
    from dilgen.compiler import cache_key
    from dilgen.targets import INTERPRETER

    root = tmp_path / "cache"
    spec_path = tmp_path / "cache_race.json"
    spec_path.write_text(json.dumps(TINY))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILGEN_")}
    env["DILGEN_CACHE_DIR"] = str(root)
    go = tmp_path / "go"
    procs = []
    for i in range(8):
        ready = tmp_path / f"ready{i}"
        procs.append((ready, subprocess.Popen(
            [sys.executable, str(script), str(ready), str(go), str(spec_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)))
    deadline = time.time() + 240
    while not all(r.exists() for r, _ in procs) and time.time() < deadline:
        if any(p.poll() is not None for _, p in procs):
            break
        time.sleep(0.01)
    go.touch()
    results = []
    for _, p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))

    monkeypatch.setenv("DILGEN_CACHE_DIR", str(root))
    key = cache_key(_spec(), INTERPRETER)
    entries = _entries(root)
    assert [e.name for e in entries] == [key], entries
    assert _stray(root) == [], "temporary or torn files left behind"
    assert {p.name for p in entries[0].iterdir()} == ENTRY_FILES
    assert cache.load(key) == entries[0], "the entry does not verify against its manifest"
    module = entries[0] / cache.MODULE
    sha = hashlib.sha256(module.read_bytes()).hexdigest()
    for r in results:
        assert Path(r["path"]) == module
        assert r["source_sha"] == r["file_sha"] == sha
        assert r["err"] < 1e-4, r
    assert sum(not r["hit"] for r in results) >= 1


# --------------------------------------------------------------------------- (a') repair race



def _damage(folder: Path, kind: str) -> None:
    module = folder / cache.MODULE
    manifest = folder / cache.MANIFEST
    if kind == "truncate":
        module.write_bytes(module.read_bytes()[:100])
    elif kind == "flip":
        data = bytearray(module.read_bytes())
        data[len(data) // 2] ^= 0xFF
        module.write_bytes(bytes(data))
    elif kind == "tamper":              # still valid Python: must not be trusted either
        module.write_bytes(module.read_bytes() + b"\nTAMPERED = True\n")
    elif kind == "empty_module":
        module.write_bytes(b"")
    elif kind == "delete_module":
        module.unlink()
    elif kind == "delete_manifest":
        manifest.unlink()
    elif kind == "garbage_manifest":
        manifest.write_bytes(b"\x00\xff{not json")
    elif kind == "manifest_not_object":
        manifest.write_text("[1, 2, 3]")
    elif kind == "manifest_wrong_key":
        data = json.loads(manifest.read_text())
        data["key"] = "0" * 64
        manifest.write_text(json.dumps(data))
    elif kind == "manifest_files_list":
        data = json.loads(manifest.read_text())
        data["files"] = sorted(data["files"])
        manifest.write_text(json.dumps(data))
    elif kind == "manifest_without_module":
        data = json.loads(manifest.read_text())
        del data["files"][cache.MODULE]
        manifest.write_text(json.dumps(data))
    elif kind == "flip_plan":
        data = bytearray((folder / "plan.json").read_bytes())
        data[0] ^= 0x01
        (folder / "plan.json").write_bytes(bytes(data))
    elif kind == "empty_folder":
        for p in folder.iterdir():
            p.unlink()
    elif kind == "folder_instead_of_module":
        module.unlink()
        module.mkdir()
        (module / "junk").write_bytes(b"x")
    elif kind == "file_instead_of_folder":
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
        folder.write_bytes(b"junk")
    else:
        raise ValueError(kind)


DAMAGE = ["truncate", "flip", "tamper", "empty_module", "delete_module", "delete_manifest",
          "garbage_manifest", "manifest_not_object", "manifest_wrong_key",
          "manifest_files_list", "manifest_without_module", "flip_plan", "empty_folder",
          "folder_instead_of_module", "file_instead_of_folder"]


def _race_worker(root: str, key: str, rounds: int, barrier, wid: int, queue) -> None:
    """One of 8 processes: each round, load-or-store the entry (as compiler.build does),
    then read the module file twice, as the importer does after it."""
    os.environ["DILGEN_CACHE_DIR"] = root
    os.environ.pop("DILGEN_ALWAYS_COMPILE", None)
    from dilgen import cache as c
    errors = []
    try:
        for r in range(rounds):
            barrier.wait(timeout=60)                 # worker 0 damaged the entry before this
            try:
                folder = c.load(key) or c.store(key, RACE_FILES, RACE_INFO)
                for _ in range(2):
                    if (folder / c.MODULE).read_bytes() != RACE_FILES[c.MODULE]:
                        errors.append(f"round {r}: worker {wid} read a wrong module file")
                    time.sleep(0.001)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                errors.append(f"round {r}: worker {wid}: {exc!r}")
            barrier.wait(timeout=60)                 # everyone has read
            if wid == 0 and r < rounds - 1:
                _damage(c.entry_dir(key), DAMAGE[r % len(DAMAGE)])
    except Exception as exc:  # noqa: BLE001
        errors.append(f"worker {wid} aborted: {exc!r}")
        barrier.abort()
    queue.put(errors)


@pytest.mark.ranks
def test_eight_processes_repairing_a_damaged_entry_never_read_a_bad_file(tmp_path):
    root = tmp_path / "cache"
    key = cache.make_key(test="repair-race")
    ctx = multiprocessing.get_context("spawn")
    rounds, n = 3 * len(DAMAGE) + 1, 8
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(root), key, rounds, barrier, i, queue))
             for i in range(n)]
    for p in procs:
        p.start()
    errors = []
    for _ in procs:
        errors += queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert errors == [], "\n".join(errors[:20])
    entries = _entries(root)
    assert [e.name for e in entries] == [key]
    assert {p.name for p in entries[0].iterdir()} == {cache.MODULE, "plan.json", cache.MANIFEST}
    assert _stray(root) == []
    os.environ.pop("DILGEN_ALWAYS_COMPILE", None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DILGEN_CACHE_DIR", str(root))
        assert cache.load(key) == entries[0]


@pytest.mark.parametrize("kind", ["file", "folder", "link"])
@pytest.mark.parametrize("folder", [True, False])
def test_discard_removes_only_the_kind_it_is_asked_to(tmp_path, kind, folder):
    """The repair deletes a folder where a file should be (and a file where the entry's folder
    should be) in one rename that fails on the other kind, so a sound file or folder that a
    concurrent writer has just put there stays for the readers that hold its path."""
    path = tmp_path / "module.py"
    if kind == "file":
        path.write_bytes(b"sound")
    elif kind == "folder":
        path.mkdir()
        (path / "junk").write_bytes(b"x")
    else:
        path.symlink_to(tmp_path / "elsewhere")
    cache._discard(path, folder=folder)
    assert os.path.lexists(path) == (folder != (kind == "folder"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".trash")] == []
    if kind == "file" and folder:
        assert path.read_bytes() == b"sound"


def test_discard_of_a_judged_folder_keeps_the_folder_that_replaced_it(tmp_path):
    """A folder judged untrusted, then replaced by a writer's sound entry before the discard
    runs (rename(2) puts a folder onto an empty folder whatever it holds): the discard sees
    another inode than the one it judged and puts the sound entry back. (The race that a
    24-worker run of the eight-process repair test found, where trust and kind were two looks.)"""
    path = tmp_path / "entry"
    path.mkdir()
    judged = os.lstat(path)
    path.rename(tmp_path / "old")                 # a concurrent writer: discards, publishes
    path.mkdir()
    (path / "module.py").write_bytes(b"sound")
    cache._discard(path, folder=True, seen=judged)
    assert (path / "module.py").read_bytes() == b"sound"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".trash")] == []
    cache._discard(tmp_path / "old", folder=True, seen=os.lstat(tmp_path / "old"))    # the judged one goes
    assert not os.path.lexists(tmp_path / "old")
    (tmp_path / "gone").mkdir()
    seen = os.lstat(tmp_path / "gone")
    (tmp_path / "gone").rmdir()
    cache._discard(tmp_path / "gone", folder=True, seen=seen)                      # nothing there: nothing made
    assert not os.path.lexists(tmp_path / "gone")


# --------------------------------------------------------------------------- (b) damage


@pytest.fixture
def built(cache_dir):
    """TINY compiled for the interpreter into a fresh cache: (key, entry folder, source)."""
    from dilgen.compiler import build, cache_key
    from dilgen.targets import INTERPRETER
    spec = _spec()
    compiled = build(spec, INTERPRETER)
    assert not compiled.cache_hit
    key = cache_key(spec, INTERPRETER)
    return key, cache.entry_dir(key), compiled.source


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_entry_is_detected_and_rebuilt(built, monkeypatch, kind):
    from dilgen import compiler
    from dilgen.targets import INTERPRETER
    key, folder, source = built
    _damage(folder, kind)
    assert cache.load(key) is None, f"a {kind} entry was trusted"
    monkeypatch.setattr(compiler, "_MODULES", {})
    compiled = compiler.build(_spec(), INTERPRETER)
    assert not compiled.cache_hit, f"a {kind} entry was used"
    assert compiled.source == source
    assert not hasattr(compiled.module, "TAMPERED")
    assert compiled.path == folder / cache.MODULE
    assert (folder / cache.MODULE).read_text() == source
    assert cache.load(key) == folder, "the rebuilt entry does not verify"
    assert _stray(cache.cache_dir()) == []
    # and the repaired entry is a plain hit next time
    monkeypatch.setattr(compiler, "_MODULES", {})
    again = compiler.build(_spec(), INTERPRETER)
    assert again.cache_hit and again.source == source


def test_store_keeps_a_sound_entry_and_repairs_a_bad_one(cache_dir):
    key = cache.make_key(test="store")
    folder = cache.store(key, RACE_FILES, RACE_INFO)
    stat = (folder / cache.MODULE).stat()
    assert cache.store(key, RACE_FILES, RACE_INFO) == folder
    assert (folder / cache.MODULE).stat().st_ino == stat.st_ino, "a sound entry was rewritten"
    for kind in DAMAGE:
        _damage(folder, kind)
        assert cache.load(key) is None, kind
        assert cache.store(key, RACE_FILES, RACE_INFO) == folder
        assert cache.load(key) == folder, kind
        assert (folder / cache.MODULE).read_bytes() == RACE_FILES[cache.MODULE]
    assert _stray(cache_dir) == []


def test_always_compile_rewrites_and_never_loads(cache_dir, monkeypatch):
    key = cache.make_key(test="always")
    folder = cache.store(key, RACE_FILES, RACE_INFO)
    monkeypatch.setenv("DILGEN_ALWAYS_COMPILE", "1")
    assert cache.load(key) is None
    assert cache.store(key, RACE_FILES, RACE_INFO) == folder
    monkeypatch.delenv("DILGEN_ALWAYS_COMPILE")
    assert cache.load(key) == folder
    assert _stray(cache_dir) == []


def test_stale_temporary_folders_are_swept(cache_dir):
    """A writer killed mid-store leaves its temporary folder; a later store removes it
    once it is old enough that no live writer can own it."""
    key = cache.make_key(test="sweep")
    shard = cache.entry_dir(key).parent
    shard.mkdir(parents=True)
    old = shard / f".{key[:16]}-deadbeef"
    old.mkdir()
    (old / cache.MODULE).write_bytes(b"half")
    fresh = shard / f".{key[:16]}-live"
    fresh.mkdir()
    past = time.time() - 2 * 3600
    os.utime(old, (past, past))
    cache.store(key, RACE_FILES, RACE_INFO)
    assert not old.exists(), "a stale temporary folder was kept"
    assert fresh.exists(), "a live writer's temporary folder was removed"


# --------------------------------------------------------------------------- (c) versions


@pytest.mark.parametrize("what", ["dilgen", "triton", "torch", "templates", "plan"])
def test_changed_versions_miss_the_old_entry(built, monkeypatch, what):
    """... and a planner that plans differently: the module embeds its plan, and a runtime
    reading a field an older planner did not write failed (KeyError) on the old entry."""
    import torch
    import triton
    from dilgen import codegen, compiler, ir
    from dilgen.targets import INTERPRETER
    key, folder, source = built
    with pytest.MonkeyPatch.context() as mp:
        if what == "plan":
            key_of = ir.Plan.key
            mp.setattr(ir.Plan, "key", lambda plan: key_of(plan)[::-1])
        elif what == "dilgen":
            mp.setattr(compiler, "__version__", "999.0.0")
        elif what == "triton":
            mp.setattr(triton, "__version__", "0.0.1")
        elif what == "torch":
            mp.setattr(torch, "__version__", "0.0.1")
        else:
            mp.setattr(codegen, "template_hash", lambda: "0" * 16)
        new_key = compiler.cache_key(_spec(), INTERPRETER)
        assert new_key != key
        monkeypatch.setattr(compiler, "_MODULES", {})
        compiled = compiler.build(_spec(), INTERPRETER)
        assert not compiled.cache_hit, f"a changed {what} version used the old entry"
        assert compiled.path == cache.entry_dir(new_key) / cache.MODULE
        manifest = json.loads((cache.entry_dir(new_key) / cache.MANIFEST).read_text())
        expected = {"dilgen": ("generator", "999.0.0"), "triton": ("triton", "0.0.1"),
                    "torch": ("torch", "0.0.1"), "templates": ("templates", "0" * 16),
                    "plan": ("torch", torch.__version__)}[what]     # the plan is in the key alone
        assert manifest[expected[0]] == expected[1]
    assert cache.load(key) == folder, "the old entry must stay for the old toolchain"
    assert sorted(e.name for e in _entries(cache.cache_dir())) == sorted([key, new_key])
    # back on the old toolchain: the old entry is a hit again
    monkeypatch.setattr(compiler, "_MODULES", {})
    again = compiler.build(_spec(), INTERPRETER)
    assert again.cache_hit and again.path == folder / cache.MODULE
