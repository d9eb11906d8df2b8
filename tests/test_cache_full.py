"""A full file system under the kernel cache (issue 44, item 6): the entry goes to this
process's temporary cache with one warning, as for a read-only folder; when that is full
too, one CacheError line names both folders. Never a raw OSError from a kernel call."""
from __future__ import annotations

import errno
import warnings

import pytest
import torch

import dilgen
from dilgen import cache, compiler
from dilgen.reference import reference_attention

TINY = {"num_heads": 2, "head_dim": 16, "dtype": "float32", "segment_lengths": [8, 16], "dilation_rates": [1, 2]}


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """The cache at tmp_path/cache, where every entry write fails with ENOSPC."""
    root = tmp_path / "cache"
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(root))
    monkeypatch.setattr(cache, "_FALLBACK", {})
    monkeypatch.setattr(compiler, "_MODULES", {})
    real = cache._store

    def store(final, *args, **kwargs):
        if str(final).startswith(str(root)):
            raise OSError(errno.ENOSPC, "No space left on device", str(final))
        return real(final, *args, **kwargs)
    monkeypatch.setattr(cache, "_store", store)
    return root, real


def test_a_full_cache_falls_back_with_one_warning(full_disk):
    root, _ = full_disk
    q, k, v = (torch.randn(1, 32, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kernel = dilgen.compile(dict(TINY, name="full_disk"))
        out = kernel(q, k, v)
    warned = [str(w.message) for w in seen if issubclass(w.category, cache.CacheWarning)]
    assert len(warned) == 1 and "no space left" in warned[0] and "\n" not in warned[0]
    assert (out.double() - reference_attention(q, k, v, kernel.spec)).abs().max() < 1e-4


def test_full_everywhere_is_one_cache_error(full_disk, monkeypatch):
    root, real = full_disk
    monkeypatch.setattr(cache, "_store", lambda final, *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device", str(final))))
    with pytest.raises(cache.CacheError, match="nor in this process's temporary cache") as info, \
            pytest.warns(cache.CacheWarning, match="no space left"):
        dilgen.compile(dict(TINY, name="full_everywhere"))(*(torch.randn(1, 32, 2, 16) for _ in range(3)))
    assert "\n" not in str(info.value) and "DILGEN_CACHE_DIR" in str(info.value)


@pytest.mark.parametrize("variable", ["DILGEN_CACHE_DIR", "DILGEN_DUMP_DIR"])
def test_a_home_that_does_not_exist_is_one_line(variable, monkeypatch):
    monkeypatch.setenv(variable, "~nosuchuser_dilgen/x")
    with pytest.raises(cache.CacheError, match=f"{variable}=") as info:
        cache.cache_dir() if variable == "DILGEN_CACHE_DIR" else cache.dump_dir()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("where", ["writes", "a_file", "proc", "full"])
def test_dump_dir_writes_every_stage_or_says_why_not(where, tmp_path, cache_dir):
    """DILGEN_DUMP_DIR gets the spec, the plan and the source of each compile; a dump that
    cannot be written (a file, a path under /proc, a full device) is one CacheError line."""
    dump = {"writes": tmp_path / "dump", "a_file": tmp_path / "file",
            "proc": "/proc/dilgen_dump", "full": tmp_path / "full"}[where]
    if where == "a_file":
        dump.write_text("not a folder")
    if where == "full":
        (dump / f"dump_{where}-interpreter").mkdir(parents=True)
        (dump / f"dump_{where}-interpreter" / "0-spec.json").symlink_to("/dev/full")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DILGEN_DUMP_DIR", str(dump))
        spec = dilgen.Spec(**TINY, name=f"dump_{where}")
        if where == "writes":
            compiler.build(spec, dilgen.targets.get_target("interpreter"))
            stages = sorted(p.name for p in (dump / f"dump_{where}-interpreter").iterdir())
            assert stages == ["0-spec.json", "1-plan.json", "2-source.py"]
            return
        with pytest.raises(cache.CacheError, match="DILGEN_DUMP_DIR=") as info:
            compiler.build(spec, dilgen.targets.get_target("interpreter"))
    assert "\n" not in str(info.value) and "cannot write" in str(info.value), info.value
