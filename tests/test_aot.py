"""Ahead-of-time compile (dilgen.aot) on a CPU-only machine: `dilgen build --arch sm90`
compiles cubins with the ptxas of the triton wheel; the runtime computes the artifact key
from the actual launch arguments (Triton's own binder) and launches the stored binary, or
falls back to the JIT. What needs a GPU (loading a cubin, launching it, the JIT itself) is
replaced by recorders; everything up to that call is the real code.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dilgen
from dilgen import aot, cache
from dilgen.aot import build as aot_build
from dilgen.aot import run as aot_run
from dilgen.aot.binder import jit_generated
from dilgen.compiler import build
from dilgen.targets import SM90

if aot.ptxas_path() is None:   # the triton wheel ships it (triton/backends/nvidia/bin/ptxas)
    pytest.skip("ptxas not found (triton wheel without triton/backends/nvidia/bin/ptxas, and "
                "no TRITON_PTXAS_PATH): cannot compile for a GPU target here",
                allow_module_level=True)

TINY = {"name": "aot_tiny", "num_heads": 2, "head_dim": 16, "dtype": "float16",
        "segment_lengths": [16, 32], "dilation_rates": [1, 2]}
OTHER = {"name": "aot_other", "num_heads": 4, "num_kv_heads": 2, "head_dim": 128,
         "dtype": "bfloat16", "segment_lengths": [8, 24], "dilation_rates": [1, 3], "causal": True}
SEQ = 64          # the one sequence length the tests build for
KERNELS = 6       # TINY: forward, preprocess x2 (HAS_DLSE), dkdv x2 branches, dq
# OTHER is causal with head_dim 128: on sm90 every branch is a lane branch (TMA,
# warp-specialized):
# forward_lanes x2 branches, preprocess x2, dkdv x2, dq_lanes x2
OTHER_KERNELS = 8


def _write(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{data['name']}.json"
    path.write_text(json.dumps(data) + "\n")
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One CLI build (a fresh process, as a user runs it) of TINY and OTHER for sm90 into a
    private cache; the tests share it. Yields (cache dir, specs dir, first run's stdout)."""
    root = tmp_path_factory.mktemp("aot")
    specs = root / "specs"
    _write(specs, TINY)
    _write(specs, OTHER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILGEN_")}
    env["DILGEN_CACHE_DIR"] = str(root / "cache")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    res = _cli(root, env, "build", specs, "--arch", "sm90", "--seq-len", SEQ)
    assert res.returncode == 0, res.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DILGEN_CACHE_DIR", str(root / "cache"))
        yield {"root": root, "cache": root / "cache", "specs": specs, "env": env,
               "stdout": res.stdout}


def _cli(cwd, env, *args):
    return subprocess.run([sys.executable, "-m", "dilgen.cli", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def _artifacts(cache_dir: Path) -> list[Path]:
    return sorted(p.parent for p in cache_dir.rglob(aot.CUBIN))


# --------------------------------------------------------------------------- recording

class _Recorder:
    """Stands in for a kernel: `rec[grid](*args, **opts)` records instead of launching."""

    def __init__(self, calls, source_fn):
        self.calls, self.source_fn = calls, source_fn

    def __getitem__(self, grid):
        return lambda *args, **opts: self.calls.append((self.source_fn, grid, args, opts))


def _runtime_launches(attn, n, monkeypatch, *, grad_lse=None, batch=1, dropout_p=0.0):
    """The launches forward_raw + backward_raw make for (batch, n) inputs, recorded on the
    CPU and turned into what they are on a GPU: UPCAST False, the launch options of the
    plan and of BACKWARD_KERNELS (on the CPU those are interpreter settings). dropout_p: a
    dropout plan's call (its seed, cut, scale, rows and streams: dropout_call.dropout_args)."""
    calls = []
    monkeypatch.setattr(attn, "_kernel", lambda interpret, source_fn=None:
                        _Recorder(calls, source_fn or attn._source_fn))
    spec = attn.spec
    dt = getattr(torch, spec["dtype"])
    q = torch.randn(batch, n, spec["num_heads"], spec["head_dim"]).to(dt)
    k = torch.randn(batch, n, spec["num_kv_heads"], spec["head_dim"]).to(dt)
    v = torch.randn_like(k)
    from dilgen.runtime.backward import backward_raw
    from dilgen.runtime.dropout_call import dropout_args
    from dilgen.runtime.forward import forward_raw
    drop = dropout_args(attn, q, dropout_p, 1) if dropout_p else ()
    out, lse = forward_raw(attn, q, k, v, None, dropout=drop)
    backward_raw(attn, q, k, v, out, lse, torch.randn_like(out), grad_lse, None, dropout=drop)
    opts = {fn: o for _, fn, o in aot.kernel_roles(attn)}
    fixed = []
    for fn, grid, args, _ in calls:
        names = list(inspect.signature(fn).parameters)
        args = tuple(False if name == "UPCAST" else a for name, a in zip(names, args))
        fixed.append((fn, grid, args, opts[fn]))
    return fixed


@pytest.fixture
def gpu(monkeypatch):
    """Pretend to be on an sm90 device: the target and the device index come from here;
    loading and launching a binary, and the JIT fallback, are recorded."""
    from triton.backends.compiler import GPUTarget
    rec = {"launched": [], "prepared": [], "jit": [], "target": GPUTarget("cuda", 90, 32)}
    monkeypatch.setattr(aot_run, "_current_target", lambda: rec["target"])
    monkeypatch.setattr(aot_run, "_current_device", lambda: 0)
    monkeypatch.setattr(aot_run, "_prepare", lambda kernel: rec["prepared"].append(kernel))
    monkeypatch.setattr(aot_run, "_launch_compiled",
                        lambda kernel, grid, bound: rec["launched"].append((kernel, grid, bound)))
    monkeypatch.setattr(aot.AOTKernel, "_jit_launch",
                        lambda self, grid, args, opts: rec["jit"].append((grid, args, opts)))
    aot.reset_stats()
    return rec


def _fresh_attention(spec_dict, tuning=None):
    """The sm90 module of a spec (planner `tuning`) and its GeneratedAttention, no
    launchables cached yet."""
    compiled = build(dilgen.spec_from_dict(spec_dict), SM90, tuning)
    attn = compiled.module.attention
    attn._jitted.clear()
    return compiled, attn


def _gpu_kernel(attn, source_fn):
    """What the runtime launches on a GPU for `source_fn` (GeneratedAttention._kernel)."""
    kernel = attn._kernel(False, source_fn)
    assert isinstance(kernel, aot.AOTKernel), kernel
    return kernel


def _forward_launch(attn, n, monkeypatch):
    with monkeypatch.context() as mp:
        return [r for r in _runtime_launches(attn, n, mp) if r[0] is attn._source_fn][0]


# --------------------------------------------------------------------------- tests

def test_ptxas_ships_with_the_triton_wheel():
    path = aot.ptxas_path()
    assert path and Path(path).is_file()


def test_build_writes_cubins_for_the_target(built):
    folders = _artifacts(built["cache"])
    assert len(folders) == KERNELS + OTHER_KERNELS, folders
    assert f"compiled {KERNELS + OTHER_KERNELS} binaries" in built["stdout"], built["stdout"]
    for folder in folders:
        cubin = (folder / aot.CUBIN).read_bytes()
        assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
        meta = json.loads((folder / aot.METADATA).read_text())
        assert meta["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}
        assert meta["name"].startswith(("aot_tiny_", "aot_other_"))
        manifest = json.loads((folder / cache.MANIFEST).read_text())
        assert manifest["target"] == "sm90" and manifest["kernel"] == meta["name"]
    roles = {json.loads((f / cache.MANIFEST).read_text())["role"] for f in folders}
    assert roles == {"forward", "preprocess", "dkdv", "dq", "forward_lanes", "dq_lanes"}


def test_second_build_does_nothing_and_a_changed_spec_rebuilds_only_itself(built):
    root, env, specs = built["root"], built["env"], built["specs"]
    before = {p.name for p in _artifacts(built["cache"])}
    again = _cli(root, env, "build", specs, "--arch", "sm90", "--seq-len", SEQ)
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout, again.stdout
    assert {p.name for p in _artifacts(built["cache"])} == before

    changed = root / "specs2"
    _write(changed, dict(TINY, softmax_scale=0.5))       # changed: new source, new binaries
    _write(changed, OTHER)                               # unchanged
    res = _cli(root, env, "build", changed, "--arch", "sm90", "--seq-len", SEQ)
    assert res.returncode == 0, res.stderr
    assert "built 1 of 2" in res.stdout, res.stdout
    assert f"compiled {KERNELS} binaries" in res.stdout, res.stdout
    for p in _artifacts(built["cache"]):                 # leave the shared cache as it was
        if p.name not in before:
            cache._discard(p, folder=True)


def test_launch_model_matches_the_runtime(monkeypatch):
    """The build's model of the launch arguments gives exactly the specializations of the
    runtime's real arguments: one-token, short, odd and longer N, GQA + causal, Hilbert
    tables (segment and sequence scope; causal curve copies with block lists), with and
    without an lse gradient."""
    import triton
    from triton.compiler import make_backend
    backend = make_backend(aot.gpu_target(SM90))
    specs = [TINY, OTHER,
             dict(TINY, name="aot_hilbert", segment_lengths=[16, 64], dilation_rates=[1, 4],
                  hilbert={"scope": "segment"}),
             dict(TINY, name="aot_hilbert_causal", segment_lengths=[16, 64], dilation_rates=[2, 4],
                  causal=True, hilbert={"scope": "segment"}),
             dict(TINY, name="aot_seq", hilbert={"scope": "sequence", "grid": [8, 12]})]
    jitted = {}

    def desc(fn, args, opts):
        jf = jitted.get(fn) or jitted.setdefault(fn, jit_generated(fn))
        return aot.specialize(jf, backend, args, opts).desc

    for spec_dict in specs:
        _, attn = _fresh_attention(spec_dict)
        for n in aot.seq_lens_for(attn.plan, [1, 7, 64, 100, 1024]):
            model, real = set(), set()
            for launch in aot.predicted_launches(attn, n):
                model.add(desc(launch.source_fn, launch.args, launch.launch_opts))
            for grad_lse in (None, torch.zeros(1, spec_dict["num_heads"], n)):
                with monkeypatch.context() as mp:
                    for fn, _, args, opts in _runtime_launches(attn, n, mp, grad_lse=grad_lse):
                        real.add(desc(fn, args, opts))
            assert real == model, (spec_dict["name"], n)


def test_launch_model_matches_the_runtime_of_the_dropout_plan(monkeypatch):
    """A dropout plan's kernels (seed and streams on the device; the cut and row 0's position
    never specialize them): the model's specializations are the runtime's, at p = 0.1 and
    0.5 alike (cuts 6554 and 32768: one not divisible by 16, one divisible)."""
    from triton.compiler import make_backend
    backend = make_backend(aot.gpu_target(SM90))
    jitted = {}

    def desc(fn, args, opts):
        jf = jitted.get(fn) or jitted.setdefault(fn, jit_generated(fn))
        return aot.specialize(jf, backend, args, opts).desc

    for spec_dict in (TINY, dict(OTHER, name="aot_other_dropout")):
        _, attn = _fresh_attention(spec_dict, {"dropout": True})
        assert attn.plan.get("dropout")
        for n in (7, 64, 100):
            model = {desc(launch.source_fn, launch.args, launch.launch_opts)
                     for launch in aot.predicted_launches(attn, n)}
            for p in (0.1, 0.5):
                real = set()
                for grad_lse in (None, torch.zeros(1, spec_dict["num_heads"], n)):
                    with monkeypatch.context() as mp:
                        real |= {desc(fn, args, opts) for fn, _, args, opts
                                 in _runtime_launches(attn, n, mp, grad_lse=grad_lse, dropout_p=p)}
                assert real == model, (spec_dict["name"], n, p)


def test_the_dropout_plans_kernels_compile_for_sm90(cache_dir):
    """Every kernel of TINY's dropout plan (Philox coins in the MMA's column order, 7 rounds)
    compiles for sm90 on this machine: ptxas gives a cubin for each job of the build."""
    compiled = build(dilgen.spec_from_dict(dict(TINY, name="aot_tiny_dropout")), SM90, {"dropout": True})
    jobs, skipped = aot.plan_jobs(compiled, SM90, [SEQ])
    assert not skipped and {job.role for job in jobs} == {"forward", "preprocess", "dkdv", "dq"}, (jobs, skipped)
    for job in jobs:
        cubin, meta = aot_build.compile_job(job)
        assert cubin[:4] == b"\x7fELF" and json.loads(meta)["name"] == job.fn_name, job.desc


def test_compiled_dropout_kernels_draw_philox_by_64_bit_multiplies(cache_dir):
    """Compiled for a GPU (not interpreted), common.dropout_philox takes each of Philox's
    products as one mul.wide.u32 (IMAD.WIDE.U32): the forward's PTX holds both round multipliers
    in wide multiplies and no umulhi of them (mul.hi.u32 ... -845247145)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from dilgen.aot import artifacts
    compiled = build(dilgen.spec_from_dict(dict(TINY, name="aot_tiny_wide")), SM90, {"dropout": True})
    job = next(j for j in aot.plan_jobs(compiled, SM90, [SEQ])[0] if j.role == "forward")
    module = aot_build._import_path(job.module_path, job.module_sha)
    src = artifacts.source_of(aot_build.as_jit(getattr(module, job.fn_name)), dict(job.signature),
                              dict(job.constexprs), dict(job.attrs))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(job.options)).asm["ptx"]
    assert "mul.wide.u32 t, %r" in ptx and "0xCD9E8D57" in ptx and "0xD2511F53" in ptx
    assert "-845247145" not in ptx and "-766435501" not in ptx


def test_runtime_finds_and_launches_the_artifacts(built, monkeypatch, gpu):
    from triton.backends.compiler import GPUTarget
    _, attn = _fresh_attention(TINY)
    with monkeypatch.context() as mp:
        runs = _runtime_launches(attn, SEQ, mp, grad_lse=torch.zeros(2, 2, SEQ), batch=2)
    assert len(runs) == 5                                  # fwd, pre, dkdv x2, dq
    for fn, grid, args, opts in runs:
        _gpu_kernel(attn, fn)[grid](*args, **opts)
    assert gpu["jit"] == [] and aot.FALLBACKS == [], aot.FALLBACKS
    assert aot.STATS["aot_launches"] == len(runs) and aot.STATS["jit_launches"] == 0
    assert aot.STATS["aot_loads"] == len(gpu["prepared"]) == len(runs)
    for (kernel, grid, bound), (fn, rgrid, args, _) in zip(gpu["launched"], runs):
        assert grid == tuple(rgrid) + (1,) * (3 - len(rgrid))
        assert bound == args                               # every argument, constexprs too
        assert kernel.metadata.target == GPUTarget("cuda", 90, 32)
        assert kernel.name == fn.__name__
        assert kernel.asm["cubin"][:4] == b"\x7fELF"
    # the same specialization again: launched, not loaded again
    fn, grid, args, opts = runs[0]
    _gpu_kernel(attn, fn)[grid](*args, **opts)
    assert aot.STATS["aot_loads"] == len(runs) and len(gpu["launched"]) == len(runs) + 1


def test_runtime_falls_back_to_the_jit_for_another_specialization(built, monkeypatch, gpu):
    from triton.backends.compiler import GPUTarget
    _, attn = _fresh_attention(TINY)
    kernel = _gpu_kernel(attn, attn._source_fn)
    fn, grid, args, opts = _forward_launch(attn, 63, monkeypatch)   # N % 16 != 0: not built
    kernel[grid](*args, **opts)
    assert len(gpu["jit"]) == 1 and not gpu["launched"]
    assert aot.FALLBACKS[-1]["reason"] == "no artifact for this specialization"

    fn, grid, args, opts = _forward_launch(attn, SEQ, monkeypatch)
    kernel[grid](*args, **dict(opts, num_warps=2 * opts["num_warps"]))  # other options
    assert len(gpu["jit"]) == 2 and not gpu["launched"]
    kernel[grid](*args, **opts)                                        # the built one
    assert len(gpu["jit"]) == 2 and len(gpu["launched"]) == 1

    gpu["target"] = GPUTarget("cuda", 80, 32)        # an sm80 device never gets the sm90 cubin
    kernel._per_device.clear()
    kernel._kernels.clear()
    kernel[grid](*args, **opts)
    assert len(gpu["jit"]) == 3 and len(gpu["launched"]) == 1


def test_cubins_of_another_triton_are_named_not_silently_skipped(built, monkeypatch, gpu):
    """A cache built by one Triton and found by a runtime with another: one clear warning
    (which versions, what to run), then the JIT."""
    import re
    import triton
    _, attn = _fresh_attention(TINY)
    kernel = _gpu_kernel(attn, attn._source_fn)
    fn, grid, args, opts = _forward_launch(attn, SEQ, monkeypatch)
    built_with = triton.__version__
    monkeypatch.setattr(triton, "__version__", "0.0.0-other")
    with pytest.warns(RuntimeWarning, match=rf"built with Triton {re.escape(built_with)}, but this "
                                            rf"runtime has Triton 0\.0\.0-other.*dilgen build"):
        kernel[grid](*args, **opts)
    assert len(gpu["jit"]) == 1 and not gpu["launched"]
    assert "this runtime: 0.0.0-other" in aot.FALLBACKS[-1]["reason"]


def test_aot_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DILGEN_AOT", "0")
    _, attn = _fresh_attention(TINY)
    assert not isinstance(attn._kernel(False), aot.AOTKernel)
    attn._jitted.clear()


def test_corrupt_artifact_is_ignored_then_rebuilt(built, monkeypatch, gpu):
    compiled, attn = _fresh_attention(TINY)
    fn, grid, args, opts = _forward_launch(attn, SEQ, monkeypatch)
    jobs, _ = aot.plan_jobs(compiled, SM90, [SEQ])
    (fwd,) = [j for j in jobs if j.role == "forward"]
    folder = cache.entry_dir(fwd.key)
    data = bytearray((folder / aot.CUBIN).read_bytes())
    data[len(data) // 2] ^= 0xFF                                    # one flipped byte
    (folder / aot.CUBIN).write_bytes(bytes(data))

    kernel = _gpu_kernel(attn, attn._source_fn)
    kernel[grid](*args, **opts)
    assert len(gpu["jit"]) == 1 and not gpu["launched"]             # never the bad binary
    assert aot.load_entry(fwd.key) is None                         # it counts as missing

    report = aot.compile_for_target(compiled, SM90, seq_lens=[SEQ])
    assert (report.compiled, report.cached) == (1, KERNELS - 1)
    assert (folder / aot.CUBIN).read_bytes()[:4] == b"\x7fELF"
    kernel._kernels.clear()
    kernel[grid](*args, **opts)
    assert len(gpu["launched"]) == 1

    (folder / aot.METADATA).unlink()                                # a torn entry: missing too
    assert aot.load_entry(fwd.key) is None
    assert aot.compile_for_target(compiled, SM90, seq_lens=[SEQ]).compiled == 1
    assert aot.load_entry(fwd.key) == folder


def _other_kernel(files):
    meta = json.loads(files[aot.METADATA])
    meta["name"] = "not_this_kernel"
    return {aot.METADATA: json.dumps(meta).encode()}


@pytest.mark.parametrize("damage", [
    pytest.param(lambda files: {aot.CUBIN: b"not an ELF file"}, id="not-elf"),
    pytest.param(lambda files: {aot.METADATA: b"[]"}, id="not-triton-metadata"),
    pytest.param(_other_kernel, id="another-kernel"),
])
def test_unusable_entry_is_rebuilt_in_place(built, monkeypatch, gpu, damage):
    """An entry whose files match their manifest but hold no usable binary (written so by
    a broken tool, or by hand) is refused at run time, and the next build compiles it
    again and rewrites it in place: the folder is never deleted (a process may be reading
    it), each file is replaced atomically, the manifest last, and nothing is left over."""
    import hashlib
    compiled, attn = _fresh_attention(TINY)
    jobs, _ = aot.plan_jobs(compiled, SM90, [SEQ])
    (fwd,) = [j for j in jobs if j.role == "forward"]
    folder = cache.entry_dir(fwd.key)
    good = {name: (folder / name).read_bytes() for name in (aot.CUBIN, aot.METADATA)}
    manifest = json.loads((folder / cache.MANIFEST).read_text())
    for name, data in damage(good).items():                        # consistent with the manifest
        (folder / name).write_bytes(data)
        manifest["files"][name] = hashlib.sha256(data).hexdigest()
    (folder / cache.MANIFEST).write_text(json.dumps(manifest))
    assert cache.load(fwd.key, require=aot.CUBIN) == folder         # sound to the cache...
    assert aot.load_entry(fwd.key, fwd.fn_name) is None             # ...unusable to AOT
    inode = folder.stat().st_ino

    fn, grid, args, opts = _forward_launch(attn, SEQ, monkeypatch)
    kernel = _gpu_kernel(attn, attn._source_fn)
    kernel[grid](*args, **opts)
    assert len(gpu["jit"]) == 1 and not gpu["launched"]             # never the bad entry

    report = aot.compile_for_target(compiled, SM90, seq_lens=[SEQ])
    assert (report.compiled, report.repaired, report.cached) == (1, 1, KERNELS - 1)
    assert folder.stat().st_ino == inode                            # rewritten in place
    assert aot.load_entry(fwd.key, fwd.fn_name) == folder
    assert (folder / aot.CUBIN).read_bytes()[:4] == b"\x7fELF"
    assert json.loads((folder / aot.METADATA).read_text())["name"] == fwd.fn_name
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]   # no temporaries
    again = aot.compile_for_target(compiled, SM90, seq_lens=[SEQ])
    assert (again.compiled, again.cached) == (0, KERNELS)
    kernel._kernels.clear()
    kernel[grid](*args, **opts)
    assert len(gpu["jit"]) == 1 and len(gpu["launched"]) == 1       # the rebuilt binary


def test_interpreter_target_compiles_nothing():
    from dilgen.targets import INTERPRETER
    assert aot.compile_for_target(dilgen.spec_from_dict(TINY), INTERPRETER).total == 0
