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
