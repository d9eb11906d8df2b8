"""`dilgen build --arch sm90`: compile the Triton kernels of a generated module for a GPU
architecture on a machine without one, into dilgen's cache.

For every kernel (forward, and sm90's Gluon forward where the plan has it; backward
preprocess, dkdv fused or per branch, dq) and every sequence length of a list, the launch
arguments the runtime would pass are modelled
(launch_model), run through Triton's own binder (binder) to get the specialization its
JIT would use, deduplicated, and compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`. ptxas ships in the
triton wheel, so neither a GPU nor a CUDA toolkit is needed. Each binary is stored as a
cache entry (artifacts); a sound entry is not compiled again, a missing, damaged or
unusable one is compiled and written (in place, atomically file by file)."""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .. import cache
from . import artifacts
from .binder import jit_generated, make_binder, specialize
from .launch_model import DEFAULT_SEQ_LENS, UnknownParameter, predicted_launches, seq_lens_for


def ptxas_path() -> str | None:
    """The ptxas Triton will use for sm < 100 (the triton wheel bundles one), or None."""
    try:
        from triton import knobs
        path = knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001 - missing binary, odd wheel
        return None
    return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


def gpu_target(target) -> Any:
    """triton GPUTarget for a dilgen Target (sm90 -> cuda:90)."""
    from triton.backends.compiler import GPUTarget
    if target.capability is None:
        raise ValueError(f"target {target.name} has no GPU code to compile")
    return GPUTarget("cuda", int(target.capability), 32)


@dataclass
class BuildReport:
    compiled: int = 0
    cached: int = 0
    skipped: list[str] = field(default_factory=list)    # kernels the model could not cover
    keys: list[str] = field(default_factory=list)
    repaired: int = 0       # of `compiled`: entries that were there but damaged or unusable

    @property
    def total(self) -> int:
        return self.compiled + self.cached


@dataclass(frozen=True)
class Job:
    """One compile: a kernel of a generated module, one specialization, one arch."""
    key: str
    module_path: str
    module_sha: str
    fn_name: str
    role: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    arch: int
    desc: str


def _load_generated(module_or_plan, target):
    """(module object, source text, path) for a CompiledModule, a generated module, a
    Spec or a spec path."""
    from types import ModuleType
    from ..compiler import CompiledModule, build
    from ..spec import Spec, load_spec
    obj = module_or_plan
    if isinstance(obj, (str, os.PathLike)):
        obj = load_spec(obj)
    if isinstance(obj, Spec):
        obj = build(obj, target)
    if isinstance(obj, CompiledModule):
        return obj.module, obj.source, str(obj.path)
    if isinstance(obj, ModuleType):
        path = obj.__file__
        return obj, Path(path).read_text(encoding="utf-8"), path
    raise TypeError(f"compile_for_target: expected a CompiledModule, a generated module or a "
                    f"Spec, got {type(obj).__name__}")


def plan_jobs(module_or_plan, target, seq_lens: Iterable[int] | None = None) -> tuple[list[Job], list[str]]:
    """The distinct (kernel, specialization) compiles of a module for `target`, and the
    kernels the launch model could not describe."""
    from triton.compiler import make_backend
    module, source, path = _load_generated(module_or_plan, target)
    attention = module.attention
    gpu = gpu_target(target)
    backend = make_backend(gpu)
    sha = artifacts.module_hash(source)
    jobs: dict[str, Job] = {}
    skipped: list[str] = []
    if attention.plan.get("ring", {}).get("ring_size", 1) > 1:
        return [], [f"{attention.spec['name']}: ring_size > 1 (windowed ring kernels compile "
                    f"on first use)"]
    jitted: dict[str, Any] = {}
    binders: dict[str, Any] = {}
    for n in seq_lens_for(attention.plan, seq_lens or DEFAULT_SEQ_LENS):
        try:
            launches = predicted_launches(attention, n)
        except UnknownParameter as exc:
            msg = f"{attention.spec['name']}: parameter {exc} is not in the AOT launch model"
            if msg not in skipped:
                skipped.append(msg)
            continue
        for launch in launches:
            name = launch.source_fn.__name__
            jit_fn = jitted.get(name) or jitted.setdefault(name, as_jit(launch.source_fn))
            binder = binders.get(name) or binders.setdefault(name, make_binder(jit_fn, backend))
            sp = specialize(jit_fn, backend, launch.args, launch.launch_opts, binder)
            key = artifacts.artifact_key(sha, name, gpu, sp.desc)
            if key not in jobs:
                jobs[key] = Job(key, path, sha, name, launch.role, sp.signature, sp.constexprs,
                                sp.attrs, sp.compile_options(), gpu.arch, sp.desc)
    return list(jobs.values()), skipped


def as_jit(fn):
    """A generated kernel as a JITFunction: the `tl` kernels are plain functions (the runtime
    jits them), the Gluon forward is a @gluon.jit function already."""
    from triton.runtime.jit import JITFunction
    return fn if isinstance(fn, JITFunction) else jit_generated(fn)


def _import_path(path: str, sha: str):
    """The generated module at `path` (a cache entry's module.py, or a file the caller
    named), run from bytes read once without following a link and checked against `sha`
    (the hash the jobs were planned from): a file changed since is refused, never run."""
    from ..compiler import _import_module
    from ..fsafe import read_regular
    name = "dilgen_aot_build." + hashlib.sha256(f"{path}:{sha}".encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    data = read_regular(path)
    if artifacts.module_hash(data) != sha:
        raise RuntimeError(f"{path} changed since its kernels were planned (sha256 "
                           f"{artifacts.module_hash(data)[:12]} != {sha[:12]}); build again")
    return _import_module(Path(path), name, data.decode("utf-8"))


def compile_job(job: Job) -> tuple[bytes, str]:
    """Compile one job: (cubin bytes, metadata json). Runs in a worker process too."""
    import triton
    from triton.backends.compiler import GPUTarget
    module = _import_path(job.module_path, job.module_sha)
    jit_fn = as_jit(getattr(module, job.fn_name))
    src = artifacts.source_of(jit_fn, dict(job.signature), dict(job.constexprs), dict(job.attrs))
    compiled = triton.compile(src, target=GPUTarget("cuda", job.arch, 32), options=dict(job.options))
    meta_path = next(p for n, p in compiled.metadata_group.items() if n.endswith(".json"))
    return bytes(compiled.asm["cubin"]), Path(meta_path).read_text()


def store_job(job: Job, cubin: bytes, meta_json: str) -> Path:
    """Store a compiled job; a damaged or unusable entry of its key is rewritten."""
    return artifacts.store(job.key, cubin, meta_json, kernel=job.fn_name, role=job.role,
                           arch=job.arch, module_sha=job.module_sha, desc=job.desc)


def compile_for_target(module_or_plan, target, *, seq_lens: Iterable[int] | None = None,
                       jobs: int = 1, log: Callable[[str], None] | None = None) -> BuildReport:
    """Compile every kernel of a generated module (or Spec) for `target` (a dilgen Target,
    sm80/sm90) and every specialization that `seq_lens` produce; store them in the cache.
    Sound entries are kept; missing ones are compiled, and damaged or unusable ones
    (artifacts.load_entry refuses them) are compiled and rewritten in place. `log` gets a
    line before the first compile (how many binaries) and one as each binary is stored
    (its number, kernel, role, and the seconds since the first compile began)."""
    if target.capability is None:
        return BuildReport()
    if ptxas_path() is None:
        raise RuntimeError("ahead-of-time compile needs ptxas (the triton wheel ships it in "
                           "triton/backends/nvidia/bin); set TRITON_PTXAS_PATH")
    planned, skipped = plan_jobs(module_or_plan, target, seq_lens)
    report = BuildReport(skipped=skipped, keys=[j.key for j in planned])
    todo = []
    for job in planned:
        if artifacts.load_entry(job.key, job.fn_name) is not None:
            report.cached += 1
        else:
            todo.append(job)
            report.repaired += os.path.lexists(cache.entry_dir(job.key))
    if not todo:
        return report
    start = time.monotonic()
    if log:
        log(f"{len(todo)} binaries to compile for sm{todo[0].arch}"
            + (f" ({report.cached} already in the cache)" if report.cached else ""))

    def done(job, cubin, meta):
        store_job(job, cubin, meta)
        report.compiled += 1
        if log:
            log(f"binary {report.compiled}/{len(todo)}: {job.fn_name} [{job.role}] for "
                f"sm{job.arch}, {time.monotonic() - start:.1f} s elapsed")

    workers = max(1, min(int(jobs or 1), len(todo)))
    if workers == 1:
        for job in todo:
            done(job, *compile_job(job))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        ctx = multiprocessing.get_context("spawn")   # no fork of a process holding LLVM/torch threads
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            for job, result in zip(todo, pool.map(compile_job, todo)):
                done(job, *result)
    return report
