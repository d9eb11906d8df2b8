"""Turning a generated Python function into a launchable kernel, and what every launch
shares: a Triton JIT kernel (or the precompiled binary `dilgen build` stored, through
dilgen.aot.run) on CUDA, an interpreted one on CPU; the scratch allocator of device-side
tensor descriptors; the test switch that poisons fresh outputs."""
from __future__ import annotations

import os
import threading

import torch

from ..aot.run import launcher
from .interpreter import interpreting

_POISON = os.environ.get("DILGEN_POISON", "") not in ("", "0")
_TMA_ALLOCATOR = threading.local()


def set_poison(enabled: bool) -> None:
    """Fill fresh outputs with NaN before each launch, so an unwritten row shows (tests)."""
    global _POISON
    _POISON = bool(enabled)


def poison(*tensors: torch.Tensor) -> None:
    """NaN-fill `tensors` when poisoning is on (set_poison, DILGEN_POISON=1)."""
    if _POISON:
        for t in tensors:
            t.fill_(float("nan"))


def make_kernel(source_fn, interpret: bool):
    """The kernel of a generated kernel function (plain Python, not yet jitted):
    interpreted on CPU, else jitted (a precompiled binary when `dilgen build` stored one
    for the launch)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(source_fn)
    import triton
    return launcher(triton.jit(source_fn), source_fn)


def ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors (the lane kernels' TMA loads) need a scratch
    allocator. Triton keeps it per thread (a context variable), and autograd runs the
    backward on its own thread, so it is set once per thread."""
    if not getattr(_TMA_ALLOCATOR, "set", False):
        import triton
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _TMA_ALLOCATOR.set = True


def run_launches(launches, interpret: bool) -> None:
    """Launch each (kernel, grid, args, options): on CPU inside the interpreter's context
    (whose options are the interpreter's own), else with the options."""
    for kernel, grid, args, opts in launches:
        if interpret:
            with interpreting():
                kernel[grid](*args)
        else:
            kernel[grid](*args, **opts)


_INT32 = (-2**31, 2**31)


def _arg_class(arg):
    """What of a launch argument Triton's specialization depends on: a tensor's dtype and
    16-byte alignment; an int's type (i32, i64, u64 by range), divisibility by 16 and
    equality to 1; a bool's value. Anything else is kept as it is (hashable)."""
    kind = type(arg)
    if kind is int:
        return (arg == 1, arg % 16 == 0, _INT32[0] <= arg < _INT32[1], arg < 2**63)
    if kind is bool or arg is None:
        return arg
    if kind is float:
        return float
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return arg


class RepeatLauncher:
    """`kernel[grid](*args, **options)` for a jitted kernel launched again and again with
    arguments of one shape (decoding: every step, every layer). The first launch of a
    specialization goes through triton.jit (binder, compile or cache, launch) and keeps the
    compiled kernel under a key of the arguments' classes (`_arg_class`, as fine as Triton's
    own specialization; constexpr parameters by value); later launches with that key call the
    compiled kernel's launcher directly (`launch`), as JITFunction.run does, without the
    binder. A caller that knows its own finer key may keep the compiled kernel itself."""

    def __init__(self, jit_fn) -> None:
        self.jit_fn = jit_fn
        self._constexpr = tuple(p.is_constexpr for p in jit_fn.params)
        self._defaults = tuple(p.default for p in jit_fn.params)
        self._kernels: dict[tuple, object] = {}

    def __getitem__(self, grid):
        return lambda *args, **options: self.run(grid, args, options)

    def run(self, grid, args: tuple, options: dict):
        """Launch; return the compiled kernel that ran."""
        from triton.runtime.driver import driver
        device = driver.active.get_current_device()
        key = (device, len(args), tuple(sorted(options.items())),
               *(a if c else _arg_class(a) for a, c in zip(args, self._constexpr)))
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self.jit_fn[grid](*args, **options)
            if kernel is not None:
                self._kernels[key] = kernel
            return kernel
        self.launch(kernel, grid, args)
        return kernel

    def launch(self, kernel, grid, args: tuple) -> None:
        """Launch a compiled kernel of this function (one that an earlier `run` returned
        for arguments of the same classes) on the current stream."""
        from triton.runtime.driver import driver
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        launch_compiled(kernel, tuple(grid) + (1,) * (3 - len(grid)), stream,
                        args + self._defaults[len(args):])


def launch_compiled(kernel, grid: tuple, stream, args: tuple) -> None:
    """What JITFunction.run does with a compiled kernel: its launcher on `stream` with the
    3-D `grid` and every parameter's value (`args`, defaults included); the launch hooks
    get their metadata only when one is set (a profiler's)."""
    from triton import knobs
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    hooked = enter is not None and getattr(enter, "calls", True)   # HookChain: its calls
    meta = kernel.launch_metadata(grid, stream, *args) if hooked else None
    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
               meta, enter, leave, *args)
