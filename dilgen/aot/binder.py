"""Triton's binder: the specialization that triton.jit derives from one launch.

Triton specializes a kernel on its arguments (pointers aligned to 16 bytes, ints equal
to 1 or divisible by 16, i32 or i64) and on its launch options. `specialize` runs
Triton's own binder and _pack_args on a launch's arguments, so the build (on modelled
arguments) and the run time (on the real ones) compute exactly what the JIT would, and
`describe` turns the result into canonical JSON, part of the artifact key."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


#: Arguments whose values never specialize a generated kernel: attention dropout's cut (one
#: for each p) and the position of a call's row 0 (a ring rank's offset in the sequence), so
#: a new p or another rank runs the kernel already compiled, and `dilgen build` covers both
UNSPECIALIZED = ("drop_cut", "drop_pos0")


def jit_generated(fn):
    """triton.jit of a generated kernel function, as the runtime and `dilgen build` both make
    it (UNSPECIALIZED arguments not specialized)."""
    import inspect
    import triton
    names = [n for n in UNSPECIALIZED if n in inspect.signature(fn).parameters]
    return triton.jit(fn, do_not_specialize=names) if names else triton.jit(fn)


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


def jit_kwargs(jit_fn, launch_opts: dict) -> dict:
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


def make_binder(jit_fn, backend):
    """Triton's binder for `jit_fn` on `backend` (what JITFunction.run builds per device)."""
    from triton.runtime.jit import create_function_from_signature
    return create_function_from_signature(jit_fn.signature, jit_fn.params, backend)


def pack(jit_fn, backend, kw: dict, bound, spec_list, options) -> Specialization:
    """The Specialization of a bound launch (Triton's _pack_args, then `describe`)."""
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kw, bound, spec_list,
                                                              options)
    return Specialization(signature, constexprs, attrs, options,
                          describe(jit_fn, signature, constexprs, attrs, options))


def specialize(jit_fn, backend, args: tuple, launch_opts: dict, binder=None) -> Specialization:
    """The specialization Triton's JIT would compile for `args` (exactly its binder and
    _pack_args: same code, same answer)."""
    binder = binder or make_binder(jit_fn, backend)
    kw = jit_kwargs(jit_fn, launch_opts)
    bound, spec_list, options = binder(*args, **kw)
    return pack(jit_fn, backend, kw, bound, spec_list, options)
