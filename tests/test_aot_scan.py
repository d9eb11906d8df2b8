"""A kernel launch with no AOT artifact (every ring spec's kernel: `dilgen build` skips
ring_size > 1) asks which other Triton built this kernel, to name it in a warning. That
answer comes from the cache's manifests, read once per process, not once per launch
specialization: on a warm start of examples/ring_torchrun.py (14 specializations a rank)
re-reading a cache of 3,000 entries every time cost each of 4 ranks about 7 s on a CPU."""
from __future__ import annotations

import json

import pytest
import torch
import triton

from dilgen import aot, cache
from dilgen.aot import artifacts
from dilgen.aot import run as aot_run


@triton.jit
def _probe(X, n, m):
    pass


def _fake_entry(i: int, **info) -> None:
    files = {aot.CUBIN: b"\x7fELF" + bytes(16), aot.METADATA: b"{}"} if info else \
        {cache.MODULE: b"x = 1\n", "plan.json": b"{}\n"}
    cache.store(cache.make_key(test=str(i)), files, info)


@pytest.fixture
def scans(tmp_path, monkeypatch):
    """A private cache holding modules and AOT entries of an older Triton; counts how many
    times anything lists the cache's entries (cache.trusted_entries)."""
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(artifacts, "_BUILDS", {}, raising=False)
    for i in range(20):
        _fake_entry(i)
    for i, kernel in enumerate(("fwd", "dq")):
        _fake_entry(100 + i, kind="aot-kernel", kernel=kernel, module_sha256="sha", triton="0.0.0-old")
    count = [0]
    listing = cache.trusted_entries

    def counted(root):
        count[0] += 1
        return listing(root)

    monkeypatch.setattr(cache, "trusted_entries", counted)
    return count


def test_other_triton_builds_reads_the_manifests_once(scans):
    for _ in range(5):
        assert artifacts.other_triton_builds("sha", "fwd") == ["0.0.0-old"]
        assert artifacts.other_triton_builds("sha", "dq") == ["0.0.0-old"]
        assert artifacts.other_triton_builds("sha", "dkdv") == []
        assert artifacts.other_triton_builds("other", "fwd") == []
    assert scans[0] == 1


def test_an_entry_this_process_stores_joins_the_index(scans, monkeypatch):
    """An entry stored after the cache was read is known without reading it again."""
    assert artifacts.other_triton_builds("sha", "dkdv") == []
    meta = json.dumps({"name": "dkdv", "target": {"backend": "cuda", "arch": 90, "warp_size": 32}})
    with monkeypatch.context() as mp:       # written by another Triton than the one asking
        mp.setattr(triton, "__version__", "0.0.1-new")
        artifacts.store(cache.make_key(test="new"), b"\x7fELF", meta, kernel="dkdv", role="dkdv",
                        arch=90, module_sha="sha", desc="{}")
    assert artifacts.other_triton_builds("sha", "dkdv") == ["0.0.1-new"]
    assert artifacts.other_triton_builds("sha", "fwd") == ["0.0.0-old"]
    assert scans[0] == 1


def test_launches_that_fall_back_to_the_jit_list_the_cache_once(scans, monkeypatch):
    """Three specializations with no artifact (n = 1, a multiple of 16, neither): three JIT
    fallbacks, one reading of the cache."""
    from triton.backends.compiler import GPUTarget
    jit = []
    monkeypatch.setattr(aot_run, "_current_target", lambda: GPUTarget("cuda", 90, 32))
    monkeypatch.setattr(aot_run, "_current_device", lambda: 0)
    monkeypatch.setattr(aot.AOTKernel, "_jit_launch", lambda self, grid, args, opts: jit.append(args))
    aot.reset_stats()
    kernel = aot.AOTKernel(_probe)
    x = torch.empty(16)
    for n in (1, 32, 7, 1, 32, 7):
        kernel[(1,)](x, n, 3)
    assert len(jit) == 6 and len(aot.FALLBACKS) == 3
    assert {f["reason"] for f in aot.FALLBACKS} == {"no artifact for this specialization"}
    assert scans[0] == 1
