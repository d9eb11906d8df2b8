"""The names torch.compile graphs hold for generated kernels: a string key per
GeneratedAttention (`register`; "<spec name>@<target>:<spec key[:16]>:<tiles>") or per
dilgen.Kernel (`register_kernel`; "kernel:..."), and the objects behind them. The custom
ops (op.py, ring/op.py) take the key, since their schemas hold only tensors and strings.

A GeneratedAttention registers itself on every eager call. A graph compiled before any
eager call meets an unregistered key when it runs: `resolve` then takes the latest living
GeneratedAttention made with that key (`made`, called by its constructor: every module
dilgen builds, or that a program imports from `dilgen compile` output, makes one).
"""
from __future__ import annotations

import hashlib
import json
import threading
import weakref

import torch

_REGISTRY: dict = {}      # key -> GeneratedAttention, or a dilgen.Kernel
_SPECS: dict = {}         # kernel key -> the spec fields that checks.check_inputs reads
_MADE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # key -> latest made
_LOCK = threading.Lock()


def op_key(attn) -> str:
    """The key of a GeneratedAttention: instances with one key compute the same function
    (same spec, same target). Plain string work, which dynamo folds to a constant."""
    return attn.op_key


def made(attn) -> None:
    """Note a new GeneratedAttention, so a compiled graph can find it by key (resolve)."""
    _MADE[op_key(attn)] = attn


def register(attn) -> str:
    """Map op_key(attn) to attn (the latest registered instance wins); return the key."""
    key = op_key(attn)
    if _REGISTRY.get(key) is not attn:
        with _LOCK:
            _REGISTRY[key] = attn
    return key


def register_kernel(kernel) -> str:
    """Register a dilgen.Kernel (spec, fixed target or None, tuning or None) and return its
    key; the op runs `kernel.compiled_for(q.device).attention`. Call it eagerly (it hashes)."""
    spec = kernel.spec
    target = kernel.fixed_target.name if kernel.fixed_target is not None else "auto"
    key = f"kernel:{spec.name}@{target}:{spec.key()[:16]}"
    if kernel.tuning:
        blob = json.dumps(kernel.tuning, sort_keys=True).encode()
        key += ":" + hashlib.sha256(blob).hexdigest()[:8]
    with _LOCK:
        _REGISTRY[key] = kernel
        _SPECS[key] = {f: getattr(spec, f) for f in ("name", "num_heads", "num_kv_heads",
                                                     "head_dim", "dtype", "ring_size",
                                                     "dilation_rates")}
    return key


def resolve(key: str):
    """The object registered under `key` (see the module docstring)."""
    obj = _REGISTRY.get(key)
    if obj is not None:
        return obj
    obj = _MADE.get(key)
    if obj is not None:
        register(obj)
        return obj
    raise RuntimeError(
        f"dilgen: no generated kernel is registered under {key!r}; call it once outside "
        f"torch.compile, or pass it to dilgen.runtime.registry.register() first")


def kernel_spec(key: str) -> dict:
    """The spec fields of a registered dilgen.Kernel (register_kernel)."""
    return _SPECS[key]


def attention_for(key: str, device: torch.device):
    """The GeneratedAttention that runs the op of `key` on `device`."""
    obj = resolve(key)
    if hasattr(obj, "compiled_for"):      # a dilgen.Kernel: the module for this device
        return obj.compiled_for(device).attention
    return obj


def constant_key(make_key, obj) -> str:
    """`make_key(obj)`, a string. Under torch.compile it runs once while tracing, eagerly
    and outside the graph (hashing, building), and its result is a constant of the graph,
    guarded on `obj`: another one is traced again. dilgen.dilated_attention finds (or makes)
    the kernel of a spec with it."""
    return make_key(obj)


# torch.compiler.assume_constant_result(constant_key), without its `import torch._dynamo`
# (2.4 s of every process's import of dilgen, on the CPU machines): the mark it sets.
# tests/test_compile.py checks that torch's decorator sets this attribute and nothing else.
CONSTANT_MARK = "_dynamo_marked_constant"
setattr(constant_key, CONSTANT_MARK, True)


# -- single-device twins of a ring spec (the ring's "local" and "heads" transports) ----------
_TWIN_FACTORY = None


def set_twin_factory(factory) -> None:
    """`factory(spec_json, device) -> GeneratedAttention`: how the runtime gets the module of
    a spec it derives from a ring spec (dilgen.compiler sets it; the runtime never plans)."""
    global _TWIN_FACTORY
    _TWIN_FACTORY = factory


def twins_available() -> bool:
    return _TWIN_FACTORY is not None


def twin(attn, device, tuning: dict | None = None, **changes):
    """The module of attn's spec with `changes` (e.g. ring_size=1, num_heads=H/P,
    head_base=...) and planner `tuning` (e.g. {"dropout": True}), made once per attn,
    changes, tuning and device; None when no factory is set (a generated module imported
    without dilgen's compiler: the ring windows run instead)."""
    if _TWIN_FACTORY is None:
        return None
    cache = attn.__dict__.setdefault("_twins", {})
    key = (json.dumps(changes, sort_keys=True), tuple(sorted((tuning or {}).items())), str(device))
    hit = cache.get(key)
    if hit is None:
        spec = {**attn.spec, **changes}
        hit = cache[key] = _TWIN_FACTORY(spec, device, tuning) if tuning else _TWIN_FACTORY(spec, device)
    return hit
