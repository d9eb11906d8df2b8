"""Turning a generated Python function into a launchable kernel, and what every launch
shares: a Triton JIT kernel (or the precompiled binary `dilgen build` stored, through
dilgen.aot.run) on CUDA, an interpreted one on CPU; the scratch allocator of device-side
tensor descriptors; the test switch that poisons fresh outputs."""
from __future__ import annotations

import threading

import torch

from ..aot.binder import jit_generated
from ..aot.run import launcher
from .interpreter import interpreting
from ..knobs import flag

_POISON = flag("DILGEN_POISON", False)
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
    return launcher(jit_generated(source_fn), source_fn)


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
    3-D `grid` and every parameter's value (`args`, defaults included). Through the C launch
    directly (`direct`) when it can: tensors as their pointers, the scratch kept; else through
    the compiled kernel's launcher, the launch hooks getting their metadata only when one is
    set (a profiler's)."""
    from triton import knobs
    go = None if hooked() else direct(kernel)
    if go is not None:
        go(grid, stream, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))
        return
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    wanted = enter is not None and getattr(enter, "calls", True)   # HookChain: its calls
    meta = kernel.launch_metadata(grid, stream, *args) if wanted else None
    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
               meta, enter, leave, *args)


_RUNTIME_KNOBS = []     # triton.knobs.runtime, imported on first use


def hooked() -> bool:
    """Whether a launch hook is set (a profiler's: Triton's HookChain with calls, or any other
    callable): launches then go through the compiled kernels' launchers, which call it."""
    if not _RUNTIME_KNOBS:
        from triton import knobs
        _RUNTIME_KNOBS.append(knobs.runtime)
    knobs = _RUNTIME_KNOBS[0]
    enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or \
        (leave is not None and bool(getattr(leave, "calls", True)))


# -- the C launch of a compiled kernel ------------------------------------------------------
# Triton 3.6's CudaLauncher.__call__(gridX, gridY, gridZ, stream, function, *args) allocates
# the kernel's global scratch (per program: the device-side tensor descriptors it writes)
# through triton's allocator and calls its C `launch`, which reads each tensor's data_ptr()
# and asks the driver where that pointer lives (cuPointerGetAttribute) before launching.
# On an H200 that is 12.5 us a launch; the C launch with integer pointers and a scratch
# buffer kept per stream is 5.1-5.6 us (bench/results/host_pieces-2026-11-27-h200.json).

_LAUNCHER_SHAPES: dict[type, bool] = {}


def _c_launch_shape(runner) -> bool:
    """Whether `runner` is a launcher of Triton 3.6's shape: __call__(gridX, gridY, gridZ,
    stream, function, *args) over a C `launch` taking (grid, stream, function, cooperative,
    pdl, global scratch, profile scratch, metadata, launch metadata, hooks, *args)."""
    kind = type(runner)
    hit = _LAUNCHER_SHAPES.get(kind)
    if hit is None:
        import inspect
        try:
            names = list(inspect.signature(kind.__call__).parameters)
        except (TypeError, ValueError):
            names = []
        hit = _LAUNCHER_SHAPES[kind] = names == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
    return hit


class Direct:
    """One compiled kernel's C launch: `go(grid, stream, args)` with args as integers (a
    tensor's data_ptr()). The global scratch is a buffer kept per stream, grown to
    the largest launch: launches on one stream run one after the other, so they can share it
    (not so with programmatic dependent launch, whose kernels overlap; nor inside a CUDA-graph
    capture, whose buffers belong to the graph: those get a fresh one each launch, as Triton's
    launcher does)."""

    __slots__ = ("raw", "function", "cooperative", "pdl", "metadata", "scratch", "ctas")

    def __init__(self, kernel, runner) -> None:
        self.raw = runner.launch
        self.function, self.metadata = kernel.function, kernel.packed_metadata
        self.cooperative, self.pdl = runner.launch_cooperative_grid, runner.launch_pdl
        self.scratch, self.ctas = runner.global_scratch_size, runner.num_ctas

    def __call__(self, grid: tuple, stream, args: tuple) -> None:
        buf = _scratch(grid[0] * grid[1] * grid[2] * self.ctas * self.scratch, stream, self.pdl) \
            if self.scratch else None
        self.raw(grid[0], grid[1], grid[2], stream, self.function, self.cooperative, self.pdl,
                 None if buf is None else buf.data_ptr(), None, self.metadata, None, None, None, *args)


_SCRATCH: dict[int, torch.Tensor] = {}     # stream handle -> its scratch, kept for the process


def _scratch(nbytes: int, stream, overlapping: bool) -> torch.Tensor:
    """`nbytes` of global scratch for a launch on `stream`, the current stream (a handle,
    unique across devices while the stream lives). A fresh buffer is freed once the launch is
    queued: the caching allocator hands it only to later work on this stream, as with
    Triton's own allocator. Later work that overlaps this launch (programmatic dependent
    launch: `overlapping`) may get the same memory, so a kernel launched that way waits for the
    launch before it ends before it writes its scratch (common.jinja gluon_lane_box)."""
    if overlapping or torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(nbytes, dtype=torch.int8, device="cuda")
    buf = _SCRATCH.get(stream)
    if buf is None or buf.numel() < nbytes:
        buf = _SCRATCH[stream] = torch.empty(nbytes, dtype=torch.int8, device="cuda")
    return buf


def direct(kernel) -> "Direct | None":
    """The C launch of a compiled kernel (kept on it), or None when its launcher is not of
    Triton 3.6's shape or it profiles (then launch_compiled goes through the launcher)."""
    hit = getattr(kernel, "_dilgen_direct", None)
    if hit is None:
        runner = getattr(kernel, "run", None)
        ok = (runner is not None and _c_launch_shape(runner) and hasattr(runner, "launch")
              and not getattr(runner, "profile_scratch_size", 1))
        hit = Direct(kernel, runner) if ok else False
        try:
            kernel._dilgen_direct = hit
        except AttributeError:
            return hit or None
    return hit or None
