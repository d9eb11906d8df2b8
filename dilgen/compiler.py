"""The stages in order: spec → plan (IR) → source → cached module → kernel.

`compile(spec)` returns a `Kernel`: a callable that picks the target from the device of
its inputs (the GPU's architecture, or Triton's interpreter for CPU tensors) and runs
the generated module for it, compiling and caching it on first use.
"""
from __future__ import annotations

import builtins
import json
import linecache
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import __version__, cache, codegen, fsafe, planner
from .ir import Plan
from .spec import Spec, SpecError, load_spec, spec_from_dict
from .targets import INTERPRETER, Target, get_target, target_for_capability

STAGES = ("plan", "emit", "cache", "import")


def toolchain() -> dict[str, str]:
    import torch
    import triton
    return {"torch": torch.__version__, "triton": triton.__version__}


def _key_fields(spec: Spec, target: Target, tuning: dict | None) -> dict:
    return dict(generator=__version__, spec=spec.key(), target=target.key(),
                templates=codegen.template_hash(), tuning=json.dumps(tuning or {}, sort_keys=True),
                **toolchain())


def cache_key(spec: Spec, target: Target, tuning: dict | None = None, plan: Plan | None = None) -> str:
    """generator version + spec key + target + toolchain versions + template hash + the
    plan's key (+ the tuned block configuration, which the source bakes in). The plan is in
    the key because the module embeds it: a planner that plans differently (a new field
    the runtime reads) must not load a module planned by an older one."""
    plan = plan if plan is not None else planner.plan(spec, target, tuning)
    return cache.make_key(**_key_fields(spec, target, tuning), plan=plan.key())


def tuned_config(spec: Spec, target: Target) -> dict | None:
    """The autotune winner stored for (spec, target, toolchain), if any."""
    if target.name == "interpreter":
        return None
    return cache.load_tuning(cache.make_key(spec=spec.key(), target=target.key(), **toolchain()))


@dataclass(frozen=True)
class CompiledModule:
    """One spec compiled for one target: the plan, the generated source and its module."""
    spec: Spec
    target: Target
    plan: Plan
    source: str
    path: Path
    module: ModuleType
    cache_hit: bool

    @property
    def attention(self):
        return self.module.attention


def _dump(spec: Spec, plan: Plan, source: str) -> None:
    """Write the stages of a compile into DILGEN_DUMP_DIR/<name>-<target>/ (0-spec.json,
    1-plan.json, 2-source.py), each atomically. The dump folder and its subfolder must be
    real folders of this user that no one else can write (made 0700 when dilgen makes
    them), and no stage's name may be a symlink or a non-regular file; otherwise nothing is
    written and one CacheError line names the folder or file and the reason."""
    root = cache.dump_dir()
    if root is None:
        return
    variable = f"DILGEN_DUMP_DIR={os.environ.get('DILGEN_DUMP_DIR')}"
    folder = root / f"{spec.name}-{plan.target}"
    stages = {"0-spec.json": json.dumps(spec.to_json(), indent=2) + "\n",
              "1-plan.json": plan.dumps() + "\n", "2-source.py": source}
    try:
        for where in (root, folder):
            fsafe.make_private_dir(where)
            reason = fsafe.private_reason(where)
            if reason is not None:
                raise cache.CacheError(f"{variable}: cannot write the dump into {where} ({reason}); "
                                       f"dilgen dumps only into a folder of this user's that no one "
                                       f"else can write: name another folder or unset it")
        for name in stages:                     # all refused before any is written
            fsafe.refuse_non_regular(folder / name)
        for name, text in stages.items():
            fsafe.write_atomic(folder / name, text)
    except cache.CacheError:
        raise
    except fsafe.UnsafePath as exc:
        raise cache.CacheError(f"{variable}: cannot write the dump: {exc}") from None
    except OSError as exc:         # asked for and not written: say so, in one line
        where = exc.filename if isinstance(exc.filename, str) else str(folder)
        raise cache.CacheError(f"{variable}: cannot write {where} ({exc.strerror or exc}); name a "
                               f"writable folder or unset it") from None


def _import_module(path: Path, name: str, source: str) -> ModuleType:
    """Run `source` (the text of the cache entry's module.py at `path`) as module `name`.
    The text goes to linecache under `path`, where inspect (and so Triton's @jit) reads a
    kernel's source: once the entry has been verified and read, the import never needs
    the file again, so a cache folder deleted meanwhile cannot break it."""
    filename = str(path)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    try:
        exec(builtins.compile(source, filename, "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


_MODULES: dict[str, CompiledModule] = {}
_MODULES_LOCK = threading.Lock()


def _store(key: str, source: str, plan: Plan, info: dict) -> Path:
    """Store the entry; the module runs from memory either way (_import_module), so an entry
    that cannot be kept because its folder is deleted again and again while it is written
    costs only the cache (one warning), never the call. Unwritable and full caches have
    their own fallback (cache.store) and their own error."""
    try:
        return cache.store(key, {cache.MODULE: source.encode(), "plan.json": (plan.dumps() + "\n").encode()},
                           info)
    except cache.CacheError:
        raise
    except OSError as exc:
        import warnings
        warnings.warn(f"dilgen: could not keep a kernel in the cache {cache.cache_dir()} "
                      f"({exc.strerror or exc}); this process runs it from memory",
                      cache.CacheWarning, stacklevel=4)
        return cache.entry_dir(key)


def _cached_source(key: str) -> tuple[Path | None, str | None]:
    """(entry folder, module text) of a sound cache entry, or (None, None). An entry that
    vanishes between its check and its read (the cache folder deleted) is a miss."""
    folder = cache.load(key)
    data = None if folder is None else cache.read_verified(folder)   # the bytes that were checked
    if data is None:
        return None, None
    try:
        return folder, data.decode("utf-8")
    except UnicodeDecodeError:
        return None, None


def build(spec: Spec, target: Target, tuning: dict | None = None) -> CompiledModule:
    """Run every stage for (spec, target); cached in memory and on disk. Without an
    explicit `tuning`, an autotune winner stored in the cache is used if there is one."""
    if tuning is None:
        tuning = tuned_config(spec, target)
    fields = _key_fields(spec, target, tuning)
    with _MODULES_LOCK:
        hit = _MODULES.get(cache.make_key(**fields))    # this process built it: no planning again
        if hit is not None and not cache.always_compile():
            return hit
        plan = planner.plan(spec, target, tuning)                          # stage: plan
        key = cache.make_key(**fields, plan=plan.key())
        folder, source = _cached_source(key)                               # stage: cache
        cache_hit = source is not None
        if source is None:
            source = codegen.emit(plan)                                    # stage: emit
            codegen.check_syntax(source, f"{spec.name}.py")
            info = {"spec": spec.to_json(), "target": target.name, "generator": __version__,
                    "templates": codegen.template_hash(), **toolchain()}
            folder = _store(key, source, plan, info)
        _dump(spec, plan, source)
        module = _import_module(folder / cache.MODULE,                     # stage: import
                                f"dilgen_generated.{spec.name}_{target.name}_{key[:12]}", source)
        compiled = CompiledModule(spec, target, plan, source, folder / cache.MODULE, module,
                                  cache_hit)
        _MODULES[cache.make_key(**fields)] = compiled
        return compiled


def target_for_device(device) -> Target:
    if device.type == "cuda":
        import torch
        major, minor = torch.cuda.get_device_capability(device)
        return target_for_capability(major, minor)
    return INTERPRETER


class Kernel:
    """`kernel(q, k, v, return_lse=False)`: dilated attention of one spec (SPEC §3)."""

    def __init__(self, spec: Spec, target: Target | None = None, tuning: dict | None = None) -> None:
        self.spec = spec
        self.fixed_target = target
        self.tuning = tuning
        self._compiled: dict = {}
        from .runtime.registry import register_kernel, set_twin_factory
        self._op_key = register_kernel(self)   # torch.compile: the module resolves when the op runs
        set_twin_factory(_twin)                # a ring spec's single-device twins (ring.heads)

    def __repr__(self) -> str:
        return f"<dilgen.Kernel {self.spec.name} key={self.spec.key()[:12]}>"

    def compiled_for(self, device) -> CompiledModule:
        """The module for `device` (built, or loaded from the cache, on first use; then
        kept, so a call costs no hashing of templates or sources)."""
        key = (getattr(device, "type", str(device)), getattr(device, "index", None))
        hit = self._compiled.get(key)
        if hit is None:
            target = self.fixed_target or target_for_device(device)
            hit = self._compiled[key] = build(self.spec, target, self.tuning)
        return hit

    def plan(self, target: str | Target = "sm90") -> Plan:
        t = get_target(target) if isinstance(target, str) else target
        return planner.plan(self.spec, t)

    def decode(self, q, k_cache, v_cache, cache_seqlens, *, return_lse: bool = False,
               validate: bool = True):
        """Incremental decoding with a KV cache (causal specs; SPEC §3): q (B, T, H, D) new
        tokens, caches (B, N_max, H_kv, D) holding their keys and values, cache_seqlens (B,)
        int32 valid rows (new ones included). Returns rows cache_seqlens[b] - T ..
        cache_seqlens[b] - 1 of the causal forward over each prefix (and lse (B, H, T) with
        return_lse=True). Inference only: not autograd-aware (dilgen.runtime.decode).
        validate=False: see GeneratedAttention.decode."""
        import torch
        if torch.compiler.is_compiling():      # build() (files, hashes) cannot be traced
            from .runtime.dispatch import kernel_decode
            return kernel_decode(self, q, k_cache, v_cache, cache_seqlens, return_lse)
        device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
        return self.compiled_for(device).attention.decode(
            q, k_cache, v_cache, cache_seqlens, return_lse=return_lse, validate=validate)

    def __call__(self, q, k, v, *, return_lse: bool = False, group=None,
                 chunk_order: str = "contiguous", cu_seqlens=None, max_seqlen: int | None = None,
                 dropout_p: float = 0.0):
        """out = kernel(q, k, v); packed sequences with cu_seqlens= (SPEC §3, variable length);
        dropout_p > 0: attention dropout (runtime/dropout_call.py)."""
        import torch
        if torch.compiler.is_compiling():      # build() (files, hashes) cannot be traced
            from .runtime.dispatch import kernel_call
            return kernel_call(self, q, k, v, return_lse=return_lse, group=group, chunk_order=chunk_order,
                               cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, dropout_p=dropout_p)
        device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
        return self.compiled_for(device).attention(q, k, v, return_lse=return_lse, group=group,
                                                   chunk_order=chunk_order, cu_seqlens=cu_seqlens,
                                                   max_seqlen=max_seqlen, dropout_p=dropout_p)

    def padded(self, q, k, v, key_padding_mask, *, return_lse: bool = False, dropout_p: float = 0.0):
        """A padded batch (B, N, ...) with key_padding_mask (B, N), True = padding (left or right): each
        item at its own length, padded rows 0 (GeneratedAttention.padded); dropout_p as in __call__."""
        import torch
        device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
        return self.compiled_for(device).attention.padded(q, k, v, key_padding_mask,
                                                          return_lse=return_lse, dropout_p=dropout_p)


_KERNELS: dict[str, Kernel] = {}


def as_spec(spec: Spec | dict | str | os.PathLike, what: str = "spec") -> Spec:
    """A Spec from a Spec, a dict of its JSON fields (spec_from_dict) or a path to a JSON
    file (load_spec); anything else is one SpecError."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, dict):
        return spec_from_dict(spec, source=str(spec.get("name", "<spec dict>")))
    if isinstance(spec, (str, os.PathLike)):
        return load_spec(spec)
    raise SpecError(f"{what} must be a dilgen.Spec, a dict of spec fields or a path to a spec "
                    f"JSON file, got {type(spec).__name__}")


def compile(spec: Spec | dict | str | os.PathLike, target: str | Target | None = None) -> Kernel:  # noqa: A001
    """Plan, emit and cache `spec` (a Spec, a dict of its fields or a path to its JSON);
    return the callable."""
    spec = as_spec(spec)
    t = get_target(target) if isinstance(target, str) else target
    if t is not None:
        build(spec, t)  # emit and cache now, so errors surface at compile time
    return Kernel(spec, t)


def _kernel_for(spec: Spec) -> Kernel:
    """The Kernel kept for `spec` (one per spec key), made on first use."""
    key = spec.key()
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = Kernel(spec)
    return kernel


def _op_key_for(spec: Spec | dict) -> str:
    return _kernel_for(as_spec(spec, "dilated_attention's spec"))._op_key


def dilated_attention(q, k, v, spec: Spec | dict, *, return_lse: bool = False, group=None,
                      cu_seqlens=None, max_seqlen: int | None = None):
    """One-call form: `dilgen.compile(spec)(q, k, v)` with the kernel kept per spec (a Spec,
    or a dict of its fields validated as a JSON spec is, on every call: keep a Spec in hot
    loops). It runs through the custom op dilgen::attention_fwd, so it traces under
    torch.compile(fullgraph=True): the kernel of `spec` is found (or made) once while
    tracing, outside the graph (runtime.registry.constant_key), and a call with another spec
    with different fields is traced again."""
    import torch
    if torch.compiler.is_compiling():
        from .runtime.dispatch import kernel_call
        from .runtime.registry import constant_key
        # the spec goes out of the graph as its JSON (constants): torch 2.11's dynamo cannot
        # hand a frozen dataclass to a function it calls outside the graph
        fields = spec.to_json() if isinstance(spec, Spec) else spec
        return kernel_call(constant_key(_op_key_for, fields), q, k, v, return_lse=return_lse,
                           group=group, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    spec = as_spec(spec, "dilated_attention's spec")
    return _kernel_for(spec)(q, k, v, return_lse=return_lse, group=group, cu_seqlens=cu_seqlens,
                             max_seqlen=max_seqlen)


def _twin(spec_json: dict, device, tuning: dict | None = None):
    """The module of a spec the runtime derives from a call's own (runtime.registry.twin: a
    ring's single-device twins, the dropout plan of a spec)."""
    spec = as_spec(spec_json, "a derived module's spec")
    if not tuning:
        return _kernel_for(spec).compiled_for(device).attention
    key = (spec.key(), json.dumps(tuning, sort_keys=True))
    kernel = _TUNED.get(key)
    if kernel is None:
        kernel = _TUNED[key] = Kernel(spec, None, tuning)
    return kernel.compiled_for(device).attention


_TUNED: dict[tuple, Kernel] = {}


#: The architecture `dilgen compile` targets unless told otherwise.
DEFAULT_ARCH = "sm90"


def generated_dir(target: str | Target, root: str | os.PathLike = "generated") -> Path:
    """Where `dilgen compile` writes a module for `target` by default, and the layout of
    the repository's generated/ folder: the default architecture's modules at the top
    (`generated/<name>.py`: `from generated.<name> import attention`), every other
    target's in a subpackage named after it (`generated/sm80/<name>.py`:
    `from generated.sm80.<name> import attention`)."""
    name = target if isinstance(target, str) else target.name
    return Path(root) if name == DEFAULT_ARCH else Path(root) / name


def write_module(spec: Spec, target: Target,
                 out_dir: str | os.PathLike | None = None) -> tuple[Path, Plan]:
    """Emit `out_dir/<spec.name>.py` for `target` (default folder: generated_dir(target));
    return its path and plan. The folder gets an `__init__.py` if it has none, so that it
    imports as a package (and so does generated/ itself when the default folder is a
    subpackage of it). Every file is written to a temporary name in its folder and moved
    onto its name (fsafe.write_atomic); a symlink (dangling or not) or a non-regular file
    at any of the names, or a refused DILGEN_DUMP_DIR, is refused (fsafe.UnsafePath,
    cache.CacheError) before anything is written."""
    if out_dir is not None and str(out_dir) == "":
        raise SpecError("write_module: out_dir '' names no folder; give one ('.' for the "
                        "current folder)")
    packages = [Path(out_dir)] if out_dir is not None else \
        list(dict.fromkeys([generated_dir(target), generated_dir(DEFAULT_ARCH)]))
    out = packages[0]
    plan = planner.plan(spec, target)
    source = codegen.emit(plan)
    codegen.check_syntax(source, f"{spec.name}.py")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{spec.name}.py"          # the name is validated: no path separators
    inits = [folder / "__init__.py" for folder in packages]
    for name in (path, *inits):
        fsafe.refuse_non_regular(name)
    _dump(spec, plan, source)
    fsafe.write_atomic(path, source, mode=0o644)
    for init in inits:
        if not os.path.lexists(init):        # an existing regular __init__.py is the user's
            fsafe.write_atomic(init, '"""Modules generated by `dilgen compile`."""\n', mode=0o644)
    return path, plan
