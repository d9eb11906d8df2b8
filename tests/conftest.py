"""Shared fixtures: a private kernel cache per test session, poisoned outputs."""
from __future__ import annotations

import os
import warnings

import pytest

warnings.filterwarnings("ignore", category=DeprecationWarning)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Point DILGEN_CACHE_DIR (and Triton's cache) at a temp dir for the whole session."""
    root = tmp_path_factory.mktemp("dilgen-cache")
    old = {k: os.environ.get(k) for k in ("DILGEN_CACHE_DIR", "DILGEN_POISON")}
    os.environ["DILGEN_CACHE_DIR"] = str(root)
    os.environ["DILGEN_POISON"] = "1"
    from dilgen.runtime import set_poison
    set_poison(True)
    yield root
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty cache for one test."""
    monkeypatch.setenv("DILGEN_CACHE_DIR", str(tmp_path / "cache"))
    from dilgen import compiler
    monkeypatch.setattr(compiler, "_MODULES", {})
    return tmp_path / "cache"


def device():
    import torch
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def run_cli(argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of dilgen.cli.main(argv) run in this process, as the
    console script runs it: an escaping exception is printed as the interpreter would
    print it (a traceback) and gives exit code 1."""
    import contextlib
    import io
    import traceback
    from dilgen.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported as the interpreter would
            traceback.print_exc()
            rc = 1
    return rc, out.getvalue(), err.getvalue()
