"""What runs is what was verified: a cached module is executed from the bytes checked
against its manifest, read once (cache.read_verified), and `dilgen build` runs a generated
module only from bytes whose sha256 is the one its jobs were planned from."""
from __future__ import annotations

import pytest

from dilgen import cache
from dilgen.aot import artifacts
from dilgen.aot.build import _import_path


def test_a_module_changed_after_its_check_is_not_read(cache_dir):
    key = cache.make_key(test="verified")
    folder = cache.store(key, {cache.MODULE: b"X = 1\n"}, {})
    assert cache.load(key) == folder and cache.read_verified(folder) == b"X = 1\n"
    (folder / cache.MODULE).write_bytes(b"X = 2  # not what the manifest says\n")
    assert cache.read_verified(folder) is None
    (folder / cache.MODULE).unlink()
    (folder / cache.MODULE).symlink_to(folder / cache.MANIFEST)
    assert cache.read_verified(folder) is None          # a link is not followed


def test_build_runs_only_the_module_it_planned(tmp_path):
    path = tmp_path / "module.py"
    marker = tmp_path / "ran"
    path.write_text("X = 1\n")
    sha = artifacts.module_hash(b"X = 1\n")
    assert _import_path(str(path), sha).X == 1
    other = tmp_path / "other.py"      # planned from "X = 1", changed before its compile
    other.write_text(f"open({str(marker)!r}, 'w').close()\nX = 2\n")
    with pytest.raises(RuntimeError, match="changed since its kernels were planned"):
        _import_path(str(other), sha)
    assert not marker.exists()


def test_a_binary_is_looked_up_for_the_source_that_ran(tmp_path):
    """The AOT key hashes the module text that was executed (kept in linecache by
    compiler._import_module), not whatever the file at its path holds later."""
    from dilgen.compiler import _import_module
    path = tmp_path / "module.py"
    source = "def kernel():\n    return 1\n"
    path.write_text(source)
    module = _import_module(path, "dilgen_test_verified_module", source)
    path.write_text("def kernel():\n    return 2\n")       # changed after it ran
    assert artifacts.source_fn_module_hash(module.kernel) == artifacts.module_hash(source)
