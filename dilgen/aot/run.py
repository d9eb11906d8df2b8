"""Run time: launch the binary `dilgen build` stored for a launch's specialization, or
fall back to triton.jit.

`launcher(jit_fn, source_fn)` is what dilgen.runtime launches on CUDA (GeneratedAttention
._kernel): an AOTKernel, used like a JITFunction (`kernel[grid](*args, num_warps=..)`).
Each launch runs Triton's binder on the actual arguments (binder), so the key is
computed exactly as the JIT computes its own; a matching entry (artifacts) is loaded once
per device as a triton CompiledKernel (Triton's own cache is not used: its key hashes
libtriton.so, which differs between wheels) and launched like JITFunction.run does.
No entry, a damaged one, or one whose metadata disagrees: the JIT runs instead (counted
in counters.STATS, explained in counters.FALLBACKS). DILGEN_AOT=0 turns the lookup off.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

from . import artifacts, counters
from .binder import jit_kwargs, make_binder, pack
from ..knobs import flag

_JIT = object()   # in-memory marker: this specialization runs through triton.jit


def enabled() -> bool:
    """DILGEN_AOT=0 turns the run-time lookup off (every launch goes to triton.jit)."""
    return flag("DILGEN_AOT", True)


# The GPU calls, one function each (tests/test_aot.py replaces them on a CPU machine).

def _current_device() -> int:
    from triton.runtime.driver import driver
    return driver.active.get_current_device()


def _current_target():
    from triton.runtime.driver import driver
    return driver.active.get_current_target()


def _prepare(kernel) -> None:
    """Load the binary on the current device."""
    kernel._init_handles()


def _launch_compiled(kernel, grid: tuple, bound_args: tuple) -> None:
    """What JITFunction.run does with a compiled kernel."""
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
            self._module_sha = artifacts.source_fn_module_hash(self.source_fn)
        return self._module_sha

    def _device_state(self, device: int):
        state = self._per_device.get(device)
        if state is None:
            from triton.compiler import make_backend
            gpu = _current_target()
            backend = make_backend(gpu)
            state = self._per_device[device] = (gpu, backend, make_binder(self.jit_fn, backend))
        return state

    def lookup(self, args: tuple, launch_opts: dict):
        """(kernel or None, bound args). None: run the JIT. Computes the specialization
        from `args` with Triton's binder; loads a matching artifact once per device."""
        device = _current_device()
        gpu, backend, binder = self._device_state(device)
        kw = jit_kwargs(self.jit_fn, launch_opts)
        bound, spec_list, options = binder(*args, **kw)
        fast = (device, str(spec_list) + str(options))
        hit = self._kernels.get(fast)
        if hit is None:
            with self._lock:
                hit = self._kernels.get(fast)
                if hit is None:
                    hit = self._kernels[fast] = self._resolve(gpu, backend, kw, bound,
                                                              spec_list, options)
        return (None if hit is _JIT else hit), tuple(bound.values())

    def _resolve(self, gpu, backend, kw, bound, spec_list, options):
        name = self.jit_fn.__name__
        sha = self.module_sha()
        if sha is None:
            return self._fallback(name, "the kernel's module file cannot be read")
        sp = pack(self.jit_fn, backend, kw, bound, spec_list, options)
        key = artifacts.artifact_key(sha, name, gpu, sp.desc)
        folder = artifacts.load_entry(key, name)
        if folder is None:
            others = artifacts.other_triton_builds(sha, name)
            if others:
                import triton
                msg = (f"dilgen: the AOT cache {cache_dir_text()} holds {name} built with Triton "
                       f"{', '.join(others)}, but this runtime has Triton {triton.__version__}: "
                       f"those binaries cannot be used and the kernel compiles with the JIT; "
                       f"run `dilgen build` under Triton {triton.__version__} to rebuild them")
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                return self._fallback(name, f"artifacts built with Triton {', '.join(others)} "
                                            f"only (this runtime: {triton.__version__})", sp.desc)
            return self._fallback(name, "no artifact for this specialization", sp.desc)
        try:
            kernel = artifacts.load_compiled(folder, self.jit_fn, sp)
            why = artifacts.check_metadata(kernel.metadata, name, gpu, sp, self.jit_fn.is_gluon())
            if why is not None:
                return self._fallback(name, f"artifact rejected: {why}", sp.desc)
            _prepare(kernel)
        except Exception as exc:  # noqa: BLE001 - a bad artifact must never take the run down
            return self._fallback(name, f"artifact failed to load: {type(exc).__name__}: {exc}",
                                  sp.desc)
        counters.bump("aot_loads")
        return kernel

    def _fallback(self, name: str, reason: str, desc: str | None = None):
        counters.record_fallback({"kernel": name, "reason": reason, "specialization": desc,
                                  "module_sha256": self.module_sha(),
                                  "env": artifacts.env_key()})
        return _JIT

    def run(self, *args, grid, **launch_opts):
        kernel, bound = self.lookup(args, launch_opts)
        if kernel is None:
            counters.bump("jit_launches")
            return self._jit_launch(grid, args, launch_opts)
        if callable(grid):
            grid = grid(dict(zip(self.jit_fn.arg_names, bound)))
        grid = tuple(grid) + (1,) * (3 - len(grid))
        _launch_compiled(kernel, grid, bound)
        counters.bump("aot_launches")
        return kernel

    def _jit_launch(self, grid, args: tuple, launch_opts: dict):
        return self.jit_fn[grid](*args, **launch_opts)


def cache_dir_text() -> str:
    from .. import cache
    return str(cache.cache_dir())


def launcher(jit_fn, source_fn=None):
    """The launchable the runtime uses on a GPU: an AOTKernel around `jit_fn` (or
    `jit_fn` itself when DILGEN_AOT=0)."""
    if not enabled():
        return jit_fn
    return AOTKernel(jit_fn, source_fn)
