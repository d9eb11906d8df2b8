"""dilgen: a compiler from dilated-attention specs (LongNet) to specialized Triton kernels.

    spec = dilgen.load_spec("longnet_base.json")
    kernel = dilgen.compile(spec)
    out, lse = kernel(q, k, v, return_lse=True)
"""
__version__ = "0.1.0"

import os as _os  # noqa: E402

# Triton 3.9 warns that its default for floating-point fusion (fused multiply-add in the
# generated code) changes in 3.10. dilgen compiles with fusion on, the numerics every
# committed result was measured with (Triton 3.6's default), unless the user chose.
_os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from .spec import Hilbert, Spec, SpecError, load_spec, spec_from_dict  # noqa: E402


# names that load torch/triton-heavy modules on first use: name -> (module, attribute)
_LAZY = {
    **{n: ("compiler", n) for n in ("compile", "dilated_attention", "Kernel", "build", "write_module")},
    "InputError": ("runtime.checks", "InputError"),          # a call's arguments do not fit
    "CacheError": ("cache", "CacheError"),
    "CacheWarning": ("cache", "CacheWarning"),
    "RingAborted": ("runtime.ring.faults", "RingAborted"),   # a rank of the ring failed
}
_SUBMODULES = ("aot", "cache", "compat", "integrations", "nn", "reference", "runtime", "targets")


def __getattr__(name):
    import importlib
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    if name in _SUBMODULES:              # `import dilgen; dilgen.runtime.ring.shard(...)`
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'dilgen' has no attribute {name!r}")


__all__ = ["Spec", "Hilbert", "SpecError", "load_spec", "spec_from_dict", "compile",
           "dilated_attention", "Kernel", "InputError", "CacheError", "CacheWarning",
           "RingAborted", "__version__"]
