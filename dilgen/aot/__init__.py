"""Ahead-of-time compilation: the Triton kernels of generated modules compiled for a GPU
architecture on a machine without one, stored in dilgen's cache, and launched at run time
without a JIT compile (`dilgen build --arch sm90`; README "Ahead-of-time build").

One job per file:

    build.py         `dilgen build`: which kernels and specializations to compile for a
                     target, compiling them (in worker processes with --jobs), storing them,
                     repairing entries that are damaged
    launch_model.py  the arguments dilgen.runtime passes to each kernel for a sequence
                     length N, modelled without tensors (what the build compiles for)
    binder.py        Triton's binder: the specialization the JIT derives from a launch
                     (signature, constexprs, alignment attributes, options) and its
                     canonical text; build and run time share it, so they agree on keys
    artifacts.py     the cache entries: key, store, load and check, and a stored binary
                     turned back into a Triton CompiledKernel
    run.py           run time: `launcher(jit_fn)`, the AOTKernel that the runtime launches
                     on CUDA; it looks the specialization up and launches the stored binary,
                     or falls back to triton.jit
    counters.py      what happened: STATS, FALLBACKS, count_compiles()

Key = sha256 over: dilgen version, sha256 of the generated module's source (spec, plan,
templates and tuning are all in it), kernel name, GPU target, triton version, the
specialization and Triton's cache-invalidating environment. Never a binary of another
specialization: anything the cache does not hold exactly runs through triton.jit.
"""
from __future__ import annotations

from .artifacts import (CUBIN, METADATA, SPECJSON, artifact_key, check_metadata,
                        load_compiled, load_entry, module_hash)
from .binder import Specialization, describe, specialize
from .build import (BuildReport, Job, compile_for_target, gpu_target, plan_jobs,
                    ptxas_path)
from .counters import FALLBACKS, STATS, count_compiles, reset_stats
from .launch_model import (DEFAULT_SEQ_LENS, Launch, UnknownParameter, kernel_roles,
                           predicted_launches, seq_lens_for)
from .run import AOTKernel, enabled, launcher

__all__ = [
    "CUBIN", "METADATA", "SPECJSON", "DEFAULT_SEQ_LENS", "STATS", "FALLBACKS",
    "AOTKernel", "BuildReport", "Job", "Launch", "Specialization", "UnknownParameter",
    "artifact_key", "check_metadata", "compile_for_target", "count_compiles", "describe",
    "enabled", "gpu_target", "kernel_roles", "launcher", "load_compiled", "load_entry",
    "module_hash", "plan_jobs", "predicted_launches", "ptxas_path", "reset_stats",
    "seq_lens_for", "specialize",
]
