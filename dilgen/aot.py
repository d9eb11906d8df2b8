"""Ahead-of-time compilation: Triton kernels of generated modules compiled for a GPU
architecture on a machine without one, stored in dilgen's cache, and launched at run time
without a JIT compile.

Build side (`dilgen build --arch sm90`, `compile_for_target`): for every kernel of a
generated module (forward; backward preprocess, dkdv fused or per branch, dq) and every sequence
length of a list, the launch arguments the runtime would pass are modelled (mock tensors
for pointers, the real ints for N, tile counts and strides of contiguous inputs), run
through Triton's own binder to get the specialization its JIT would use (pointer 16-byte
alignment, ints equal to 1 or divisible by 16, i32/i64), deduplicated, and compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`. ptxas ships in the
triton wheel, so no GPU and no CUDA toolkit are needed.

Artifact: a cache entry (dilgen.cache: temp folder + os.replace, sha256 manifest) holding
`kernel.cubin`, `kernel.json` (Triton's metadata of the compile) and `spec.json` (what the
key was computed from); a damaged entry counts as missing, and the next build repairs it. Key = sha256 over: dilgen version, sha256 of the generated module's
source (spec, plan, templates and tuning are all in it), kernel name, GPU target, triton
version, the specialization (signature, constexprs, attrs, compile options) and Triton's
cache-invalidating environment.

Run side (`launcher`, used by GeneratedAttention._kernel on CUDA): each launch runs the
same binder on the actual arguments, so the key is computed exactly as the JIT would
compute its own; a matching artifact is loaded once per device as a
`triton.compiler.CompiledKernel` (Triton's own cache is not used: its key hashes
libtriton.so, which differs between wheels) and launched like JITFunction.run does.
No artifact, a corrupt one, or one whose metadata disagrees: the JIT runs instead.
Never a binary of another specialization.

Counters: `STATS` (aot_loads, aot_launches, jit_launches, jit_specializations),
`FALLBACKS` (which kernel fell back, and why), `count_compiles()` (every triton.compile
of the process, through triton.knobs.compilation.listener).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from . import __version__, cache

CUBIN, METADATA, SPECJSON = "kernel.cubin", "kernel.json", "spec.json"

#: Sequence lengths whose specializations `dilgen build` compiles unless told otherwise.
#: Specializations depend on N only through classes (1, divisible by 16, other; i32/i64),
#: so a handful of lengths covers every N of the same classes.
DEFAULT_SEQ_LENS = tuple(2 ** k for k in range(10, 18))   # 1024 .. 131072

STATS: dict[str, int] = {"aot_loads": 0, "aot_launches": 0, "jit_launches": 0,
                         "jit_specializations": 0}
FALLBACKS: list[dict] = []
_STATS_LOCK = threading.Lock()


def reset_stats() -> None:
    with _STATS_LOCK:
        for k in STATS:
            STATS[k] = 0
        FALLBACKS.clear()


def _bump(name: str, n: int = 1) -> None:
    with _STATS_LOCK:
        STATS[name] += n


def enabled() -> bool:
    """DILGEN_AOT=0 turns the run-time lookup off (every launch goes to triton.jit)."""
    return os.environ.get("DILGEN_AOT", "1") not in ("0", "", "false", "no")


# --------------------------------------------------------------------------- toolchain

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


def _target_str(gpu) -> str:
    return f"{gpu.backend}:{gpu.arch}:{gpu.warp_size}"


def module_hash(source: str | bytes) -> str:
    data = source.encode() if isinstance(source, str) else source
    return hashlib.sha256(data).hexdigest()


def _source_fn_module_hash(source_fn) -> str | None:
    """sha256 of the file that defines a generated kernel (its module), or None."""
    path = getattr(source_fn, "__globals__", {}).get("__file__")
    if not path:
        return None
    try:
        return module_hash(Path(path).read_bytes())
    except OSError:
        return None


# --------------------------------------------------------------------------- specialization

@dataclass(frozen=True)
class Specialization:
    """What Triton's JIT derives from one launch: the compile inputs and their canonical
    JSON (the `desc`, part of the artifact key)."""
    signature: dict
    constexprs: dict
    attrs: dict
    options: Any            # the backend's options object (CUDAOptions)
    desc: str

    def compile_options(self) -> dict:
        return dict(self.options.__dict__)


def _jit_kwargs(jit_fn, launch_opts: dict) -> dict:
    """The keyword arguments JITFunction.run hands its binder (debug and instrumentation
    come from Triton's knobs, as in JITFunction.run)."""
    from triton import knobs
    kw = dict(launch_opts)
    kw["debug"] = kw.get("debug", getattr(jit_fn, "debug", None)) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    return kw


def _canon(value):
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def describe(jit_fn, signature: dict, constexprs: dict, attrs: dict, options) -> str:
    """Canonical JSON of a specialization. extern_libs is left out: it holds the path of
    libdevice inside site-packages, which differs between machines, not the code."""
    opts = {k: v for k, v in options.__dict__.items() if k != "extern_libs"}
    obj = {
        "kernel": jit_fn.__name__,
        "signature": [[k, _canon(v)] for k, v in signature.items()],
        "constexprs": sorted([[list(k), _canon(v)] for k, v in constexprs.items()],
                             key=lambda kv: kv[0]),
        "attrs": sorted([[list(k), _canon(v)] for k, v in attrs.items()], key=lambda kv: kv[0]),
        "options": _canon(dict(sorted(opts.items()))),
    }
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _binder(jit_fn, backend):
    from triton.runtime.jit import create_function_from_signature
    return create_function_from_signature(jit_fn.signature, jit_fn.params, backend)


def specialize(jit_fn, backend, args: tuple, launch_opts: dict, binder=None) -> Specialization:
    """The specialization Triton's JIT would compile for `args` (exactly its binder and
    _pack_args: same code, same answer)."""
    binder = binder or _binder(jit_fn, backend)
    kw = _jit_kwargs(jit_fn, launch_opts)
    bound, spec_list, options = binder(*args, **kw)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kw, bound, spec_list, options)
    return Specialization(signature, constexprs, attrs, options,
                          describe(jit_fn, signature, constexprs, attrs, options))


def _env_key() -> str:
    from triton._C.libtriton import get_cache_invalidating_env_vars
    return json.dumps(get_cache_invalidating_env_vars(), sort_keys=True)


def artifact_key(module_sha: str, kernel_name: str, gpu, desc: str) -> str:
    import triton
    return cache.make_key(kind="aot-kernel", generator=__version__, module=module_sha,
                          kernel=kernel_name, target=_target_str(gpu), triton=triton.__version__,
                          specialization=desc, env=_env_key())


# --------------------------------------------------------------------------- launch model

class UnknownParameter(ValueError):
    """A kernel parameter the launch model does not know (a template changed)."""


_Q_LIKE = {"q", "o", "do", "dq"}
_KV_LIKE = {"k", "v", "dk"}
_STRIDE = re.compile(r"^stride_(q|k|v|o|do|dq|dk|l)(b|n|h)$")


def _mock(dtype):
    from triton.runtime.jit import MockTensor
    return MockTensor(dtype)       # data_ptr() == 0: 16-byte aligned, like torch's allocations


def _param_value(name: str, ctx: dict):
    """The value the runtime passes for parameter `name` for inputs (B, N, H, D),
    contiguous (dilgen.runtime.forward_raw, runtime.backward.backward_raw)."""
    import torch
    if name in ctx:                 # launch-specific values first (e.g. DK in k's dtype)
        return ctx[name]
    if name in ("Q", "K", "V", "Out", "DO", "DQ"):
        return _mock(ctx["dtype"])
    if name in ("Lse", "Delta", "DLse", "DK", "DV"):
        return _mock(torch.float32)
    if name == "ClassOrder" or re.fullmatch(r"(Fwd|Inv)\d+", name):
        return _mock(torch.int32)
    m = _STRIDE.match(name)
    if m:
        N, H, Hkv, D = ctx["N"], ctx["H"], ctx["Hkv"], ctx["D"]
        t, dim = m.groups()
        if t == "l":
            return {"b": H * N, "h": N}[dim]
        heads = H if t in _Q_LIKE else Hkv
        return {"b": N * heads * D, "n": heads * D, "h": D}[dim]
    raise UnknownParameter(name)


@dataclass(frozen=True)
class Launch:
    role: str               # forward, preprocess, dkdv or dkdv_fused, dq
    source_fn: Callable
    args: tuple
    launch_opts: dict


def kernel_roles(attention) -> list[tuple[str, Callable, dict]]:
    """(role, generated python function, launch options) of a GeneratedAttention."""
    cfg = attention.plan["config"]
    roles = [("forward", attention._source_fn,
              {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})]
    bwd = attention.backward_kernels
    if bwd is not None:
        launch = bwd["config"]["launch"]
        fused = bwd["config"].get("fused_dkdv", False)
        for role in ("preprocess", "dkdv_fused" if fused else "dkdv", "dq"):
            roles.append((role, bwd[role], dict(launch[role])))
    return roles


def seq_lens_for(plan: dict, seq_lens: Iterable[int]) -> list[int]:
    """The lengths a plan can run: Hilbert scope 'sequence' takes exactly rows*cols."""
    for t in plan.get("tables", []):
        if t.get("scope") == "sequence":
            rows, cols = t["grid"]
            return [rows * cols]
    return sorted({int(n) for n in seq_lens if int(n) >= 1})


def predicted_launches(attention, seq_len: int) -> list[Launch]:
    """Every kernel launch of one forward + backward at sequence length `seq_len` (any
    batch: B is not a kernel argument), as the runtime makes them on a GPU."""
    import inspect
    import torch
    plan = attention.plan
    N = int(seq_len)
    base = {"N": N, "H": plan["num_heads"], "Hkv": plan["num_kv_heads"], "D": plan["head_dim"],
            "dtype": {"float16": torch.float16, "bfloat16": torch.bfloat16,
                      "float32": torch.float32}[plan["dtype"]],
            "UPCAST": False}
    lattice = plan["query"]["lattice"]
    out = []

    def add(role, fn, opts, **extra):
        ctx = dict(base, **extra)
        names = list(inspect.signature(fn).parameters)
        out.append(Launch(role, fn, tuple(_param_value(n, ctx) for n in names), opts))

    for role, fn, opts in kernel_roles(attention):
        if role == "forward":
            add(role, fn, opts, num_m_tiles=math.ceil(math.ceil(N / lattice) / plan["config"]["block_m"]))
        elif role == "preprocess":
            for has_dlse in (True, False):
                add(role, fn, opts, HAS_DLSE=has_dlse)
        elif role == "dkdv":
            conf = attention.backward_kernels["config"]
            for br in plan["branches"]:
                lanes = math.ceil(min(br["w"], N) / br["r"])
                add(role, fn, opts, BRANCH=br["index"],
                    num_j_tiles=math.ceil(lanes / conf["kv_block_n"]))
        elif role == "dkdv_fused":
            conf = attention.backward_kernels["config"]
            # the fused kernel writes dK, dV in k's dtype (the per-branch one: float32)
            add(role, fn, opts, DK=_mock(base["dtype"]), DV=_mock(base["dtype"]),
                num_k_tiles=math.ceil(math.ceil(N / lattice) / conf["kv_block_n"]))
        elif role == "dq":
            conf = attention.backward_kernels["config"]
            add(role, fn, opts, num_m_tiles=math.ceil(math.ceil(N / lattice) / conf["dq_block_m"]))
    return out


# --------------------------------------------------------------------------- build

@dataclass
class BuildReport:
    compiled: int = 0
    cached: int = 0
    skipped: list[str] = field(default_factory=list)    # kernels the model could not cover
    keys: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.compiled + self.cached


@dataclass(frozen=True)
class _Job:
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
    from .compiler import CompiledModule, build
    from .spec import Spec, load_spec
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


def plan_jobs(module_or_plan, target, seq_lens: Iterable[int] | None = None) -> tuple[list[_Job], list[str]]:
    """The distinct (kernel, specialization) compiles of a module for `target`, and the
    kernels the launch model could not describe."""
    import triton
    from triton.compiler import make_backend
    module, source, path = _load_generated(module_or_plan, target)
    attention = module.attention
    gpu = gpu_target(target)
    backend = make_backend(gpu)
    sha = module_hash(source)
    jobs: dict[str, _Job] = {}
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
            jit_fn = jitted.get(name) or jitted.setdefault(name, triton.jit(launch.source_fn))
            binder = binders.get(name) or binders.setdefault(name, _binder(jit_fn, backend))
            sp = specialize(jit_fn, backend, launch.args, launch.launch_opts, binder)
            key = artifact_key(sha, name, gpu, sp.desc)
            if key not in jobs:
                jobs[key] = _Job(key, path, sha, name, launch.role, sp.signature, sp.constexprs,
                                 sp.attrs, sp.compile_options(), gpu.arch, sp.desc)
    return list(jobs.values()), skipped


def _import_path(path: str):
    import importlib.util
    name = "dilgen_aot_build." + hashlib.sha256(path.encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _compile_job(job: _Job) -> tuple[bytes, str]:
    """Compile one job: (cubin bytes, metadata json). Runs in a worker process too."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    module = _import_path(job.module_path)
    jit_fn = triton.jit(getattr(module, job.fn_name))
    src = ASTSource(jit_fn, dict(job.signature), dict(job.constexprs), dict(job.attrs))
    compiled = triton.compile(src, target=GPUTarget("cuda", job.arch, 32), options=dict(job.options))
    meta_path = next(p for n, p in compiled.metadata_group.items() if n.endswith(".json"))
    return bytes(compiled.asm["cubin"]), Path(meta_path).read_text()


def _store(job: _Job, cubin: bytes, meta_json: str) -> Path:
    import triton
    meta = json.loads(meta_json)
    info = {"kind": "aot-kernel", "kernel": job.fn_name, "role": job.role,
            "target": f"sm{job.arch}", "triton": triton.__version__, "generator": __version__,
            "module_sha256": job.module_sha, "shared": meta.get("shared"),
            "num_warps": meta.get("num_warps"), "num_stages": meta.get("num_stages")}
    described = {"module_sha256": job.module_sha, "specialization": json.loads(job.desc),
                 "env": json.loads(_env_key())}
    return cache.store(job.key, {CUBIN: cubin, METADATA: meta_json.encode(),
                                 SPECJSON: (json.dumps(described, indent=1) + "\n").encode()}, info)


def compile_for_target(module_or_plan, target, *, seq_lens: Iterable[int] | None = None,
                       jobs: int = 1, log: Callable[[str], None] | None = None) -> BuildReport:
    """Compile every kernel of a generated module (or Spec) for `target` (a dilgen Target,
    sm80/sm90) and every specialization that `seq_lens` produce; store them in the cache.
    Entries already in the cache (and sound) are not compiled again."""
    if target.capability is None:
        return BuildReport()
    if ptxas_path() is None:
        raise RuntimeError("ahead-of-time compile needs ptxas (the triton wheel ships it in "
                           "triton/backends/nvidia/bin); set TRITON_PTXAS_PATH")
    planned, skipped = plan_jobs(module_or_plan, target, seq_lens)
    report = BuildReport(skipped=skipped, keys=[j.key for j in planned])
    todo = []
    for job in planned:
        if _load_entry(job.key) is not None:
            report.cached += 1
        else:
            todo.append(job)
    if not todo:
        return report
    workers = max(1, min(int(jobs or 1), len(todo)))
    if workers == 1:
        for job in todo:
            cubin, meta = _compile_job(job)
            _store(job, cubin, meta)
            report.compiled += 1
            if log:
                log(f"compiled {job.fn_name} [{job.role}] for sm{job.arch}")
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        ctx = multiprocessing.get_context("spawn")   # no fork of a process holding LLVM/torch threads
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            for job, (cubin, meta) in zip(todo, pool.map(_compile_job, todo)):
                _store(job, cubin, meta)
                report.compiled += 1
                if log:
                    log(f"compiled {job.fn_name} [{job.role}] for sm{job.arch}")
    return report


# --------------------------------------------------------------------------- load

def _load_entry(key: str) -> Path | None:
    """A sound artifact folder for `key`, or None. A damaged entry counts as missing and
    is left for cache.store to repair (the next build writes it again)."""
    folder = cache.load(key, require=CUBIN)
    if folder is None:
        return None
    try:
        meta = json.loads((folder / METADATA).read_text())
        if (folder / CUBIN).read_bytes()[:4] != b"\x7fELF" or not isinstance(meta.get("target"), dict):
            return None
    except (OSError, ValueError):
        return None
    return folder


def _check_metadata(meta, kernel_name: str, gpu, sp: Specialization) -> str | None:
    """Why a stored artifact does not fit this launch, or None if it does."""
    import triton
    t = meta.target
    if (t.backend, t.arch, t.warp_size) != (gpu.backend, gpu.arch, gpu.warp_size):
        return f"built for {t.backend}:{t.arch}, device is {gpu.backend}:{gpu.arch}"
    if meta.name != kernel_name:
        return f"artifact holds {meta.name}, not {kernel_name}"
    if getattr(meta, "triton_version", None) != triton.__version__:
        return f"triton {getattr(meta, 'triton_version', '?')} != {triton.__version__}"
    for opt in ("num_warps", "num_stages", "num_ctas", "debug"):
        if getattr(meta, opt, None) != getattr(sp.options, opt, None):
            return f"{opt} {getattr(meta, opt, None)} != {getattr(sp.options, opt, None)}"
    return None


def load_compiled(folder: Path, jit_fn, sp: Specialization):
    """A triton CompiledKernel from an artifact folder (no compile; the binary is loaded
    onto the current device on first launch)."""
    from triton.compiler import ASTSource, CompiledKernel
    src = ASTSource(jit_fn, sp.signature, sp.constexprs, sp.attrs)
    group = {f"{jit_fn.__name__}.json": str(folder / METADATA),
             f"{jit_fn.__name__}.cubin": str(folder / CUBIN)}
    return CompiledKernel(src, group, folder.name)


# --------------------------------------------------------------------------- run

_JIT = object()   # in-memory marker: this specialization runs through triton.jit


def _current_device() -> int:
    from triton.runtime.driver import driver
    return driver.active.get_current_device()


def _current_target():
    from triton.runtime.driver import driver
    return driver.active.get_current_target()


def _prepare(kernel) -> None:
    """Load the binary on the current device (a GPU call: mocked in CPU tests)."""
    kernel._init_handles()


def _launch_compiled(kernel, grid: tuple, bound_args: tuple) -> None:
    """What JITFunction.run does with a compiled kernel (a GPU call: mocked in CPU tests)."""
    from triton import knobs
    from triton.runtime.driver import driver
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    launch_metadata = kernel.launch_metadata(grid, stream, *bound_args)
    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
               launch_metadata, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
               *bound_args)


class AOTKernel:
    """`kernel[grid](*args, num_warps=.., num_stages=..)` like a JITFunction: launches the
    stored binary of the args' specialization, or falls back to the JIT."""

    def __init__(self, jit_fn, source_fn=None) -> None:
        self.jit_fn = jit_fn
        self.source_fn = source_fn if source_fn is not None else jit_fn.fn
        self.__name__ = jit_fn.__name__
        self._module_sha: str | None | bool = False      # False: not computed yet
        self._per_device: dict[int, tuple] = {}          # device -> (gpu, backend, binder)
        self._kernels: dict[tuple, Any] = {}             # (device, spec key) -> kernel or _JIT
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AOTKernel({self.jit_fn!r})"

    def __getattr__(self, name):          # anything else a JITFunction offers
        try:
            jit_fn = self.__dict__["jit_fn"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(jit_fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, **kwargs)

    def module_sha(self) -> str | None:
        if self._module_sha is False:
            self._module_sha = _source_fn_module_hash(self.source_fn)
        return self._module_sha

    def _device_state(self, device: int):
        state = self._per_device.get(device)
        if state is None:
            from triton.compiler import make_backend
            gpu = _current_target()
            backend = make_backend(gpu)
            state = self._per_device[device] = (gpu, backend, _binder(self.jit_fn, backend))
        return state

    def lookup(self, args: tuple, launch_opts: dict):
        """(kernel or None, bound args). None: run the JIT. Computes the specialization
        from `args` with Triton's binder; loads a matching artifact once per device."""
        device = _current_device()
        gpu, backend, binder = self._device_state(device)
        kw = _jit_kwargs(self.jit_fn, launch_opts)
        bound, spec_list, options = binder(*args, **kw)
        fast = (device, str(spec_list) + str(options))
        hit = self._kernels.get(fast)
        if hit is None:
            with self._lock:
                hit = self._kernels.get(fast)
                if hit is None:
                    hit = self._kernels[fast] = self._resolve(device, gpu, backend, kw, bound,
                                                              spec_list, options)
        return (None if hit is _JIT else hit), tuple(bound.values())

    def _resolve(self, device, gpu, backend, kw, bound, spec_list, options):
        name = self.jit_fn.__name__
        sha = self.module_sha()
        if sha is None:
            return self._fallback(name, "the kernel's module file cannot be read")
        options, signature, constexprs, attrs = self.jit_fn._pack_args(backend, kw, bound,
                                                                       spec_list, options)
        sp = Specialization(signature, constexprs, attrs, options,
                            describe(self.jit_fn, signature, constexprs, attrs, options))
        key = artifact_key(sha, name, gpu, sp.desc)
        folder = _load_entry(key)
        if folder is None:
            return self._fallback(name, "no artifact for this specialization", sp.desc)
        try:
            kernel = load_compiled(folder, self.jit_fn, sp)
            why = _check_metadata(kernel.metadata, name, gpu, sp)
            if why is not None:
                return self._fallback(name, f"artifact rejected: {why}", sp.desc)
            _prepare(kernel)
        except Exception as exc:  # noqa: BLE001 - a bad artifact must never take the run down
            return self._fallback(name, f"artifact failed to load: {type(exc).__name__}: {exc}",
                                  sp.desc)
        _bump("aot_loads")
        return kernel

    def _fallback(self, name: str, reason: str, desc: str | None = None):
        _bump("jit_specializations")
        with _STATS_LOCK:
            FALLBACKS.append({"kernel": name, "reason": reason, "specialization": desc,
                              "module_sha256": self.module_sha(), "env": _env_key()})
        return _JIT

    def run(self, *args, grid, **launch_opts):
        kernel, bound = self.lookup(args, launch_opts)
        if kernel is None:
            _bump("jit_launches")
            return self._jit_launch(grid, args, launch_opts)
        if callable(grid):
            grid = grid(dict(zip(self.jit_fn.arg_names, bound)))
        grid = tuple(grid) + (1,) * (3 - len(grid))
        _launch_compiled(kernel, grid, bound)
        _bump("aot_launches")
        return kernel


    def _jit_launch(self, grid, args: tuple, launch_opts: dict):
        return self.jit_fn[grid](*args, **launch_opts)


def launcher(jit_fn, source_fn=None):
    """The launchable the runtime uses on a GPU: an AOTKernel around `jit_fn` (or
    `jit_fn` itself when DILGEN_AOT=0)."""
    if not enabled():
        return jit_fn
    return AOTKernel(jit_fn, source_fn)


# --------------------------------------------------------------------------- proof helpers

@contextlib.contextmanager
def count_compiles():
    """Count every triton.compile of the process (JIT compiles, Triton disk-cache hits
    included) while the block runs: yields a dict {"compiles", "disk_cache_hits", "names"}."""
    from triton import knobs
    counts = {"compiles": 0, "disk_cache_hits": 0, "names": []}
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        counts["disk_cache_hits" if cache_hit else "compiles"] += 1
        counts["names"].append(getattr(src, "name", "?"))
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                     cache_hit=cache_hit)

    knobs.compilation.listener = listener
    try:
        yield counts
    finally:
        knobs.compilation.listener = previous
