"""Ahead-of-time compilation (`dilgen build --arch sm90`, docs/aot.md): kernels compiled
for a GPU on a machine without one, stored in dilgen's cache, launched without a JIT.

    build.py         `dilgen build`: which kernels and specializations, compile, store, repair
    launch_model.py  the launches the runtime makes for a length N, modelled without tensors
    binder.py        Triton's binder: a launch's specialization and its canonical text
    artifacts.py     cache entries (key: version, module source hash, kernel, target, triton,
                     specialization, Triton's environment): store, load, check
    run.py           `launcher(jit_fn)`: the stored binary of exactly this specialization,
                     else triton.jit
    counters.py      what happened: STATS, FALLBACKS, count_compiles()
"""

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
