"""The kernel cache folder deleted while kernels compile (issue 44, item 6): the entry is
stored again and the module imported from it; no process dies of a vanished file.

Deterministic cases put the deletion at each window (before the entry's temporary folder
is made, between store and import); the last runs 4 processes compiling one spec while
the folder is deleted over and over."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import dilgen
from dilgen import cache, compiler
from dilgen.reference import reference_attention

TINY = {"num_heads": 2, "head_dim": 16, "dtype": "float32", "segment_lengths": [8, 16],
        "dilation_rates": [1, 2]}


def _check(kernel) -> None:
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 32, 2, 16, generator=gen) for _ in range(3))
    assert (kernel(q, k, v).double() - reference_attention(q, k, v, kernel.spec)).abs().max() < 1e-4


def test_folder_deleted_between_store_and_import(cache_dir, monkeypatch):
    """The module runs from the verified text; Triton reads its kernels' source from
    linecache, not from the file that is gone."""
    real, calls = compiler._import_module, []

    def import_after_rm(path, name, source):
        calls.append(path)
        shutil.rmtree(cache_dir)                 # the entry vanishes before its import
        return real(path, name, source)
    monkeypatch.setattr(compiler, "_import_module", import_after_rm)
    _check(dilgen.compile(dict(TINY, name="vanish_import")))
    assert len(calls) == 1 and not calls[0].exists()


def test_entry_deleted_between_check_and_read_is_a_miss(cache_dir, monkeypatch):
    kernel = dilgen.compile(dict(TINY, name="vanish_read"))
    _check(kernel)
    monkeypatch.setattr(compiler, "_MODULES", {})         # as a new process would start
    real = cache.load

    def load_then_rm(key, *args, **kwargs):
        found = real(key, *args, **kwargs)
        if found is not None:
            shutil.rmtree(cache_dir)
        return found
    monkeypatch.setattr(cache, "load", load_then_rm)
    _check(dilgen.compile(dict(TINY, name="vanish_read")))


def test_folder_deleted_before_the_entry_is_published(cache_dir, monkeypatch):
    real, calls = cache.tempfile.mkdtemp, []

    def mkdtemp_after_rm(*args, **kwargs):
        calls.append(kwargs.get("dir"))
        if len(calls) == 1:
            shutil.rmtree(cache_dir)             # its parent folder is gone: FileNotFoundError
        return real(*args, **kwargs)
    monkeypatch.setattr(cache.tempfile, "mkdtemp", mkdtemp_after_rm)
    _check(dilgen.compile(dict(TINY, name="vanish_publish")))
    assert len(calls) >= 2


WORKER = textwrap.dedent("""
    import json, sys, torch, dilgen
    from dilgen.reference import reference_attention
    kernel = dilgen.compile(json.loads(sys.argv[1]))
    q, k, v = (torch.randn(1, 32, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    err = (kernel(q, k, v).double() - reference_attention(q, k, v, kernel.spec)).abs().max().item()
    print(json.dumps({"err": err}))
""")


@pytest.mark.ranks
def test_four_processes_compile_while_the_folder_is_deleted(tmp_path):
    root = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILGEN_")}
    env["DILGEN_CACHE_DIR"] = str(root)
    spec = json.dumps(dict(TINY, name="vanish_race"))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, spec], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    deadline, deletions = time.time() + 240, 0
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)
            deletions += 1
        time.sleep(0.002)
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["err"] < 1e-4
    assert deletions > 0
