"""Shared fixtures: a private kernel cache per test session, poisoned outputs."""
from __future__ import annotations

import os
import signal
import threading
import warnings

import pytest

warnings.filterwarnings("ignore", category=DeprecationWarning)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per CPU core when the kernels run in Triton's interpreter (each
    worker keeps one core busy); none (this process alone) with a GPU, whose memory the
    GPU-only tests need whole."""
    import torch
    return 0 if torch.cuda.is_available() else max(1, os.cpu_count() or 1)


def pytest_configure(config):
    """Ctrl-C and SIGTERM end the run in this process, pytest's or an xdist worker's
    (_take_interrupts). With xdist workers on the CPU (one per core), each worker's numpy
    (OpenBLAS) and torch keep to one thread: two threads a worker on as many cores as
    workers spin against each other (10 % of the interpreter tests' time); and Inductor
    compiles in the worker, not in a pool of compile processes of its own. Set before the
    workers start, so they and the processes they start inherit it; a value already set is
    kept."""
    _take_interrupts()
    if not getattr(config.option, "numprocesses", None):     # no xdist, or -n 0
        return
    import torch
    if torch.cuda.is_available():
        return
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                 "TORCHINDUCTOR_COMPILE_THREADS"):
        os.environ.setdefault(name, "1")


# -- Ctrl-C: the run stops within seconds and leaves no process ---------------------------
class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be: the run ends as on Ctrl-C."""


def _terminated(signum, frame):
    raise Terminated("SIGTERM")


def _take_interrupts() -> None:
    """SIGINT raises KeyboardInterrupt here even when this process started with SIGINT
    ignored - as a shell without job control starts `python -m pytest &`, and the xdist
    workers inherit: Python then never raises it, and the whole suite runs on through
    Ctrl-C. SIGTERM raises Terminated, so that the processes this one started are ended
    too (pytest_keyboard_interrupt) instead of left running without it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)


def pytest_keyboard_interrupt(excinfo):
    """Ctrl-C (or SIGTERM) stopped the run in this process: end every process it started,
    whose own children go with them - xdist workers (in pytest's process), ring ranks and
    their fork server, Inductor's compile workers, CLI runs. Several of those ignore SIGINT
    by design (the fork server, Inductor's workers) and a worker's ending otherwise waits on
    a collective or a 15-s grace period: they are killed, not asked."""
    from proc_tree import end_descendants
    end_descendants()


# The longest tests (10-50 s each on 2 cores, bench/results/test_suite-*.json), longest
# first: started before the rest, so that with --dist worksteal (pyproject) the other worker
# takes the short ones meanwhile and no worker is left running a long test alone at the end.
LONG_FIRST = ("tests/test_ring.py::test_ring_matches_single_device_reference[P2]",
              "tests/test_ring.py::test_ring_matches_single_device_reference[P4]",
              "tests/test_ring.py::test_refused_ring_call", "tests/test_fuzz.py::test_fuzz_load_spec",
              "tests/test_ring.py::test_packed_ring_matches_single_device_packed_call[P2]",
              "tests/test_ring_faults.py::test_rank_failing", "tests/test_cache.py::test_eight_processes",
              "tests/test_ring.py::test_ring_matches", "tests/test_ring_faults.py",
              "tests/test_fused_descriptors.py::test_fused_flags_forward_and_gradients[dual_chain",
              "tests/test_docs.py::test_doc_blocks_run[transformers.md]",
              "tests/test_transformers_zoo.py::test_packed_rows_with_batch_two",
              "tests/test_ring.py::test_packed_ring", "tests/test_cache_vanish.py",
              "tests/test_docs.py::test_doc_blocks_run[README.md]", "tests/test_bench_varlen.py",
              "tests/test_cli_build.py::test_build_progress_then",
              "tests/test_lanes.py::test_lane_branches_forward_and_gradients[hilbert_curve",
              "tests/test_lanes.py::test_lane_branches_forward_and_gradients[tiles_fastest",
              "tests/test_nonfinite.py", "tests/test_transformers.py::test_generate",
              "tests/test_transformers_compile.py", "tests/test_context_parallel.py::test_p2_loss",
              "tests/test_context_parallel_trainer.py::test_example_check", "tests/test_context_parallel.py::test_p4")


# On a GPU the longest are others (35-210 s each on one H200 beside 13 workers,
# bench/results/gpu_tests-2026-12-01-h200.json): the tuning fuzzer, the compiled
# context-parallel steps and the sm90 Gluon checks.
GPU_LONG_FIRST = ("tests/test_tuning_fuzz.py", "tests/test_context_parallel.py::test_p2_under_torch_compile",
                  "tests/test_gluon_lanes_packed.py::test_gradients", "tests/test_gluon_lanes_packed.py::test_replays",
                  "tests/test_gluon_lanes.py::test_replayed", "tests/test_host_path.py::test_a_replayed",
                  "tests/test_gluon_lanes.py::test_matches_the_float64_reference_on_sm90",
                  "tests/test_gluon_lanes_packed.py", "tests/test_gluon_dropout.py::test_gluon_dropout_lane_kernels",
                  "tests/test_context_parallel.py", "tests/test_gluon_curve.py", "tests/test_gluon_packed.py",
                  "tests/test_calibration.py::test_calibrate_under_torchrun", "tests/test_docs.py",
                  "tests/test_context_parallel_trainer.py", "tests/test_ring.py::test_ring_matches_single_device_reference")


def _start_rank(item, first=LONG_FIRST) -> int:
    """Where a test starts: its position in `first`, else after all of them (a stable sort)."""
    return next((i for i, prefix in enumerate(first) if item.nodeid.startswith(prefix)), len(first))


def pytest_collection_modifyitems(config, items):
    import torch
    first = GPU_LONG_FIRST if torch.cuda.is_available() else LONG_FIRST
    items.sort(key=lambda item: _start_rank(item, first))


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


TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}


def _on_sm90() -> bool:
    import torch
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _gluon() -> bool:
    from dilgen.gluon_plan import gluon_available
    return gluon_available()


# The Gluon kernels' tests: compiled for sm90 wherever this Triton has Gluon's Hopper API (no GPU
# needed), launched on an sm90 GPU only
needs_gluon = pytest.mark.skipif(not _gluon(), reason="this Triton has no Gluon Hopper API")
on_sm90 = pytest.mark.skipif(not _on_sm90(), reason="needs an sm90 GPU (the Gluon kernel runs on Hopper only)")


def load_emitted(path, text: str):
    """The generated module `text`, written to `path` (a .py file) and imported."""
    import importlib.util
    path.write_text(text)
    loader = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def compile_sm90(fn, signature: dict, constants: dict | None = None, **options):
    """A @gluon.jit kernel compiled for sm90 (no GPU needed), with the Gluon launches' options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    return triton.compile(GluonASTSource(fn, signature, constants or {}), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": 168, **options})


def assert_waits_before_touching_outputs(ttgir: str, merge: bool, forward: bool, packed: bool = False) -> None:
    """Programmatic dependent launch (KernelConfig.gluon_pdl, common.gdc): a Gluon lane kernel lets
    the next launch start (launch_dependents, once, at its top) and waits for the launch before it
    (griddepcontrol.wait): a writing launch at its top, before any load or store; a merging one
    (merge) in every partition that stores, before its first store and, in the forward, before its
    first plain load of a tensor (of out, lse). What it reads before (q, k, v by TMA; in the
    backward dO too, and lse and Delta by plain loads; over packed rows (packed) the launch
    group's starts and lengths at its top; under dropout the coins' seed and streams, scalar
    loads) is final since the chain's first launch waited at its top. A descriptor made in the
    kernel (packed) is written to the launch's global scratch, which may be the one the launch
    before still reads: in a merging launch the wait comes before it too."""
    import re
    lines = ttgir.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"\s*(default \{|partition\d+\()", line)]
    assert starts, "a warp-specialized kernel"
    regions = [lines[:starts[0]]] + [lines[a:b] for a, b in zip(starts, starts[1:] + [len(lines)])]

    def first(region, pattern):
        return next((i for i, line in enumerate(region) if re.search(pattern, line)), None)
    wait, trigger = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
    load, store = r"= tt\.load |async_tma_copy_global_to_local", r"tt\.store |async_tma_copy_local_to_global|tt\.atomic|async_tma_reduce"
    top = regions[0]
    for region in regions:      # a descriptor written to the global scratch, which may be the launch before's
        made = first(region, "ttng.tensormap_create")
        assert made is None or (first(region, wait) is not None and first(region, wait) < made) \
            or (not merge and region is not top), "a descriptor made before the wait"
    assert packed or not any("ttng.tensormap_create" in line for line in lines)
    assert sum(trigger in line for line in lines) == 1 and first(top, trigger) is not None
    assert first(top, store) is None and (packed or first(top, load) is None)
    if not merge:
        assert first(top, wait) is not None and first(top, wait) < first(top, trigger)
        assert first(top, load) is None or first(top, wait) < first(top, load)
        return
    assert first(top, wait) is None
    for region in regions[1:]:
        s = first(region, store)
        if s is not None:
            w, plain = first(region, wait), first(region, r"= tt\.load [^:]*: tensor<")
            assert w is not None and w < s and (not forward or plain is None or w < plain), "a merge before its wait"


def forbid_dq_kernels(monkeypatch) -> None:
    """A backward whose dQ comes from its dK/dV (gluon_dkdv_dq) launches no dq kernel: any
    launch of one fails the test."""
    from dilgen.runtime import backward

    def no_dq(*args, **kwargs):
        raise AssertionError("a dq kernel was launched")
    monkeypatch.setattr(backward._Launches, "dq", no_dq)


def rel_error(a, b) -> float:
    """||a - b|| / ||b|| in float64 on the CPU."""
    b = b.detach().double().cpu()
    return ((a.detach().double().cpu() - b).norm() / b.norm().clamp_min(1e-300)).item()


def check_against_reference(spec, batch: int, n: int, tuning, seed_name: str) -> None:
    """Kernel(spec, tuning) on fresh random (batch, n) inputs against the float64 reference
    (outputs poisoned by the session fixture): out and lse (-inf exactly where no branch keeps
    a row), then dq, dk, dv of a random output gradient."""
    import torch
    (q, k, v), ref_in = forward_and_gradients_against_reference(spec, batch, n, tuning, seed_name)
    for mine, ref in zip((q, k, v), ref_in):
        assert not torch.isnan(mine.grad).any()
        if ref.grad.norm() > 0:
            assert rel_error(mine.grad, ref.grad) < 2 * TOL[spec.dtype]


def forward_and_gradients_against_reference(spec, batch: int, n: int, tuning, seed_name: str):
    """The forward half of check_against_reference (out, and lse = -inf exactly where no
    branch keeps a row, asserted), then the backward of one random output gradient through
    the kernel and the float64 reference: ((q, k, v), reference inputs), each with .grad."""
    import zlib
    import torch
    from dilgen.compiler import Kernel
    from dilgen.reference import differentiable_reference
    gen = torch.Generator().manual_seed(zlib.crc32(seed_name.encode()))
    dt = getattr(torch, spec.dtype)
    shapes = [(batch, n, spec.num_heads, spec.head_dim)] + 2 * [(batch, n, spec.num_kv_heads, spec.head_dim)]
    q, k, v = (torch.randn(s, generator=gen).to(dt).to(device()).requires_grad_() for s in shapes)
    out, lse = Kernel(spec, None, tuning)(q, k, v, return_lse=True)
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = differentiable_reference(*ref_in, spec)
    tol = TOL[spec.dtype]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten rows"
    assert rel_error(out, ref_out) < tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), ~finite), "rows no branch keeps: lse = -inf"
    if finite.any():
        assert (lse.cpu().double()[finite] - ref_lse.detach()[finite]).abs().max() < 20 * tol
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (ref_out * grad).sum().backward()
    (out * grad.to(dt).to(out.device)).sum().backward()
    return (q, k, v), ref_in


def run_cli(argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of dilgen.cli.main(argv) run in this process, as the
    console script runs it: an escaping exception (KeyboardInterrupt excepted) is printed as
    the interpreter would print it (a traceback) and gives exit code 1."""
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
        except KeyboardInterrupt:
            raise                      # Ctrl-C stops the run, not just this call
        except BaseException:  # noqa: BLE001 - reported as the interpreter would
            traceback.print_exc()
            rc = 1
    return rc, out.getvalue(), err.getvalue()
