"""A kernel cache folder that cannot be written (a file, under /proc, read-only) falls back
to a temporary folder of the process with one warning; a read-only cache still serves its
entries; strict() (`dilgen build`) refuses in one line."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from dilgen import cache

from cache_helpers import RACE_FILES, RACE_INFO, TINY
from cache_helpers import spec as _spec
from cache_helpers import entries as _entries
from cache_helpers import stray as _stray


# --------------------------------------------------------------------------- (d) unwritable


@pytest.fixture
def fresh_fallback(monkeypatch):
    """No temporary cache of an earlier test, no module compiled in memory."""
    from dilgen import compiler
    monkeypatch.setattr(cache, "_FALLBACK", {})
    monkeypatch.setattr(compiler, "_MODULES", {})


def _compile_twice_and_warnings(bad: Path) -> tuple[list, list]:
    """Compile and run two specs with the cache at `bad`: (CacheWarnings, module paths).
    Every call must still match the float64 reference."""
    import warnings
    import torch
    import dilgen
    from dilgen.reference import reference_attention
    paths = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for name in ("unwritable_a", "unwritable_b"):
            kernel = dilgen.compile(dict(TINY, name=name))
            q, k, v = (torch.randn(1, 32, 2, 16, generator=torch.Generator().manual_seed(i))
                       for i in range(3))
            out = kernel(q, k, v)
            ref = reference_attention(q.double(), k.double(), v.double(), kernel.spec)
            assert (out.double() - ref).abs().max() < 1e-4
            paths.append(kernel.compiled_for(q.device).path)
    return [w for w in seen if issubclass(w.category, cache.CacheWarning)], paths


def _check_fallback(bad: Path, why: str) -> None:
    warned, paths = _compile_twice_and_warnings(bad)
    assert len(warned) == 1, [str(w.message) for w in warned]
    msg = str(warned[0].message)
    tmp = cache._FALLBACK[str(bad)]
    assert "\n" not in msg
    assert str(bad) in msg and why in msg and str(tmp) in msg and "DILGEN_CACHE_DIR" in msg, msg
    assert all(Path(p).is_relative_to(tmp) for p in paths), (paths, tmp)   # stored, atomically:
    assert _stray(tmp) == []                                                 # whole entries only
    assert len(_entries(tmp)) == 2


def test_cache_dir_that_is_a_file_falls_back_with_one_warning(tmp_path, monkeypatch, fresh_fallback):
    bad = tmp_path / "afile"
    bad.write_text("not a folder\n")
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(bad))
    _check_fallback(bad, "is a file, not a folder")
    assert bad.read_text() == "not a folder\n"


def test_cache_dir_under_proc_falls_back_with_one_warning(monkeypatch, fresh_fallback):
    bad = Path(f"/proc/self/dilgen-cache-{os.getpid()}")      # not writable, even for root
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(bad))
    _check_fallback(bad, "cannot write")


def _read_only(monkeypatch, root: Path) -> None:
    """Make `root` read-only: chmod 0o500 when that stops this user, else (root ignores
    modes) every create under it fails with EROFS, as on a read-only file system."""
    import errno
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o500)                            # the caller restores 0o700
    if not os.access(root, os.W_OK):
        return
    real_mkdir, real_open = os.mkdir, os.open

    def under(path) -> bool:
        return Path(os.fsdecode(path)).absolute().is_relative_to(root)

    def mkdir(path, *a, **kw):
        if under(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_mkdir(path, *a, **kw)

    def open_(path, flags, *a, **kw):
        if under(path) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)


def test_read_only_cache_falls_back_with_one_warning(tmp_path, monkeypatch, fresh_fallback):
    bad = tmp_path / "ro" / "cache"
    try:
        _read_only(monkeypatch, tmp_path / "ro")
        monkeypatch.setenv("DILGEN_CACHE_DIR", str(bad))
        _check_fallback(bad, "cannot write")
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_read_only_cache_still_serves_its_entries(tmp_path, monkeypatch, fresh_fallback):
    """A cache filled once (say by `dilgen build`) and then mounted read-only is read as
    before: no warning, no temporary folder."""
    from dilgen import compiler
    from dilgen.targets import INTERPRETER
    root = tmp_path / "ro"
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(root / "cache"))
    compiler.build(_spec(), INTERPRETER)
    monkeypatch.setattr(compiler, "_MODULES", {})
    try:
        _read_only(monkeypatch, root)
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = compiler.build(_spec(), INTERPRETER)
        assert again.cache_hit and cache._FALLBACK == {}
    finally:
        os.chmod(root, 0o700)


def test_store_tuning_falls_back_too(tmp_path, monkeypatch, fresh_fallback):
    bad = tmp_path / "afile"
    bad.write_text("")
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(bad))
    with pytest.warns(cache.CacheWarning, match="DILGEN_CACHE_DIR"):
        path = cache.store_tuning("k" * 64, {"block_m": 64}, {})
    assert path.is_relative_to(cache._FALLBACK[str(bad)])
    assert cache.load_tuning("k" * 64) == {"block_m": 64}


def test_strict_refuses_in_one_line(tmp_path, monkeypatch, fresh_fallback):
    bad = tmp_path / "afile"
    bad.write_text("")
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(bad))
    with cache.strict(), pytest.raises(cache.CacheError, match="DILGEN_CACHE_DIR") as info:
        cache.store("k" * 64, RACE_FILES, RACE_INFO)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)
    assert cache._FALLBACK == {}
