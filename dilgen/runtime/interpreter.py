"""Triton's interpreter inside a process that may also compile for the GPU.

Generated kernels run on CPU tensors in Triton's interpreter (the same source the GPU
compiles). `interpreting()` wraps one launch; see its docstring for what it patches and
puts back."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from ..knobs import flag

_INTERPRET_LOCK = threading.RLock()


def scalar_index(self):
    """A scalar of the interpreter as a Python int (range bounds, indices): its data is an
    array of one element, whatever its rank."""
    data = self.handle.data
    if data.size != 1:
        raise TypeError(f"only a scalar can be an index, got a block of shape {data.shape}")
    return int(data.reshape(-1)[0])


class interpreting:
    """Run Triton's interpreter in a process where triton was imported without
    TRITON_INTERPRET=1: triton.language's own @jit helpers (tl.max, tl.sum, tl.zeros, ...)
    are then JITFunctions, which the interpreter cannot call; route them through
    InterpretedFunction for the duration of one launch.

    Also: Triton 3.6's interpreter turns a scalar into an index with int() of its
    one-element array, which NumPy 2.4 and later refuse for arrays of rank 1 ("only
    0-dimensional arrays can be converted to Python scalars"); its tensor patch gets an
    __index__ that takes the one element, for the duration of the launch.

    And: the interpreter patches triton.language's builtins for interpreted helpers (tl.max,
    tl.sum, ...) and does not undo the patches of triton.language.core, so a GPU compile later
    in the process failed ("'ir.value' object has no attribute 'dtype'"): the attributes of
    the language modules and classes are saved here and put back on exit."""

    def __enter__(self):
        from triton.runtime import interpreter
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
        _INTERPRET_LOCK.acquire()
        self._cls = JITFunction
        self._saved = JITFunction.__call__
        self._interp = interpreter
        self._saved_patch = getattr(interpreter, "_patch_lang_tensor", None)
        if self._saved_patch is not None:
            original = self._saved_patch

            def patch_lang_tensor(tensor, scope):
                original(tensor, scope)
                scope.set_attr(tensor, "__index__", scalar_index)

            interpreter._patch_lang_tensor = patch_lang_tensor
        def call(fn_self, *args, **kwargs):
            # by id: a JITFunction's hash walks its globals, patched here (a lambda is refused)
            kept = _INTERPRETED.get(id(fn_self))
            if kept is None:         # made once per process: it parses and rewrites the source
                kept = _INTERPRETED[id(fn_self)] = (fn_self, InterpretedFunction(fn_self.fn))
            return kept[1](*args, **kwargs)

        JITFunction.__call__ = call
        self._language = [(obj, dict(vars(obj))) for obj in language_namespaces()]
        self._saved_device_call = InterpretedFunction.__call__
        InterpretedFunction.__call__ = _device_call
        self._saved_np_dtype = interpreter._get_np_dtype
        interpreter._get_np_dtype = _np_dtype_table(self._saved_np_dtype)
        builder = interpreter.interpreter_builder
        self._saved_options = builder.options
        check = overflow_checks()
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=check,
                                              debug=check or builder.options.debug)
        self._inits = _fast_inits()
        return self

    def __exit__(self, *exc):
        self._cls.__call__ = self._saved
        self._interp.InterpretedFunction.__call__ = self._saved_device_call
        self._interp._get_np_dtype = self._saved_np_dtype
        self._interp.interpreter_builder.options = self._saved_options
        if self._saved_patch is not None:
            self._interp._patch_lang_tensor = self._saved_patch
        for obj, saved in self._language:
            restore_namespace(obj, saved)
        for cls, init in self._inits:
            cls.__init__ = init
        _INTERPRET_LOCK.release()
        return False


def overflow_checks() -> bool:
    """Whether the interpreter checks every 32-bit integer add, sub and mul for overflow, and
    runs device asserts (DILGEN_INTERPRET_OVERFLOW_CHECK=1: Triton's options sanitize_overflow
    and debug). Off by default. Triton's interpreter computes that check for every integer op
    (again in int64, compared with the bounds: half the interpreter's time in dilgen's
    kernels) and then drops it, since its device_assert does nothing unless debug is on; the
    compiled kernels wrap, as numpy's int32 does (row offsets past 2**31 are tested on the
    GPU, tests/test_row_offsets.py)."""
    return flag("DILGEN_INTERPRET_OVERFLOW_CHECK", False)


def _device_call(fn_self, *args, **kwargs):
    """InterpretedFunction.__call__ (a @jit helper called from a kernel) without patching the
    language again when it is patched already. Triton's version patches triton.language's
    builtins on every helper call (inspect.getmembers over the modules: with the dtype table
    below, 10-15 % of a kernel test's time) and keeps no record to undo it; the launch that
    runs the kernel has patched the classes (tensor, dtype) and the module of the kernel's own
    globals, and a module a helper patched stays patched until `interpreting` puts it back. So
    a helper patches only when one of the language modules in its globals still holds
    Triton's own builtins (tl.program_id is one)."""
    from triton.runtime import interpreter
    import triton.language as tl
    fn = fn_self.fn
    langs = _LANGS.get(fn)
    if langs is None:
        langs = _LANGS[fn] = tuple(v for v in fn.__globals__.values() if v is tl or v is tl.core)
    if not langs or any(tl.core.is_builtin(lang.program_id) for lang in langs):
        interpreter._patch_lang(fn)
    rewritten = fn_self.rewrite()
    try:
        return rewritten(*args, **kwargs)
    except Exception as e:
        raise interpreter.InterpreterError(repr(e)) from e


_LANGS: dict = {}     # a helper's function -> the language modules among its globals
_INTERPRETED: dict = {}   # id of a JITFunction (tl.max, ...) -> (it, its InterpretedFunction)
_NP_DTYPE: dict = {}      # id of Triton's _get_np_dtype -> (it, the table-backed one)


def _np_dtype_table(get_np_dtype):
    """Triton's interpreter._get_np_dtype with its table made once per process (Triton builds
    the 19-entry dict on every call); the same answers."""
    made = _NP_DTYPE.get(id(get_np_dtype))
    if made is not None and made[0] is get_np_dtype:
        return made[1]
    import numpy as np
    import triton.language as tl
    names = ["int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32",
             "uint32", "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv",
             "float8e4b8", "float8e4b15"]
    probe = [getattr(tl, n) for n in names if hasattr(tl, n)]
    table = {}
    for t in probe:
        with contextlib.suppress(KeyError):      # a type this Triton's table lacks
            table[t] = get_np_dtype(t)
    u64 = np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return u64
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, tl.pointer_type):
                return u64
        return table[tt_dtype]
    _NP_DTYPE[id(get_np_dtype)] = (get_np_dtype, np_dtype)
    return np_dtype


def _fast_inits() -> list:
    """Install the constructors below for one launch; returns (class, its own __init__) to
    put back. Each makes the same object as Triton's (the same attributes, the same errors),
    and is installed only where Triton's source is the one it was written against
    (`_known`): in the interpreter a kernel's every tile op builds a tl.tensor and a
    block_type, whose constructors unwrap, validate and wrap the shape again each time
    (a tenth of a kernel test's time)."""
    global _CORE
    import triton.language as tl
    core = _CORE = tl.core
    swaps = []
    for cls, fast in ((core.block_type, _block_type_init), (core.tensor, _tensor_init)):
        own = cls.__init__
        if own is not fast and _known(own):
            swaps.append((cls, own))
            cls.__init__ = fast
    return swaps


_CORE = None          # triton.language.core, kept by _fast_inits for the constructors below
_BLOCK: dict = {}     # a block_type's shape (ints) -> (numel, its tuple_type, name's shape part)
_TENSOR: dict = {}    # a tensor's shape (ints) -> (numel, its constexprs, their tuple_type)


def _ints(shape):
    """The ints of a block_type's shape (a list or a tl.tuple of ints: what its constructor
    takes), as a tuple; else None."""
    if shape.__class__ is _CORE.tuple:
        shape = shape.values
    elif shape.__class__ is not list:
        return None
    key = tuple(shape)
    return key if all(s.__class__ is int for s in key) else None


def _fresh_tuple(values, type_):
    """A tl.tuple of `values` whose type is `type_` (its constructor, without recomputing it)."""
    made = object.__new__(_CORE.tuple)
    made.values = list(values)
    made.type = type_
    return made


def _block_type_init(self, element_ty, shape):
    """block_type.__init__ (Triton 3.6, 3.9): for a shape of ints seen before, its validated
    numel and shape's type are reused; any other shape goes through Triton's own."""
    key = _ints(shape)
    hit = _BLOCK.get(key) if key is not None else None
    if hit is None:
        _OWN_INIT["block_type"](self, element_ty, shape)
        if key is not None:
            _BLOCK[key] = (self.numel, self.shape.type, str(self.shape))
        return
    self.element_ty = element_ty
    self.shape = _fresh_tuple(key, hit[1])
    self.numel = hit[0]
    self.name = f"<{hit[2]}, {element_ty}>"


def _tensor_init(self, handle, type):
    """tl.tensor.__init__ (Triton 3.6, 3.9): a shape seen before reuses its numel and its
    constexprs (immutable) in a fresh tl.tuple."""
    key = _ints(type.shape) if type.is_block() else ()
    hit = _TENSOR.get(key) if key is not None else None
    if hit is None:
        _OWN_INIT["tensor"](self, handle, type)
        if key is not None:
            _TENSOR[key] = (self.numel, list(self.shape.values), self.shape.type)
        return
    self.handle = handle
    self.numel = hit[0]
    self.type = type
    self.dtype = type.scalar
    self.shape = _fresh_tuple(hit[1], hit[2])


# The constructors _fast_inits replaces, by the sha256 of their source as Triton 3.6.0 and
# 3.9.0 ship it; another Triton keeps its own.
_KNOWN_SOURCES = {
    "block_type": {"403f4b016ec5c2c37f33465d4ceab2d800bc4dcb832ce1859b0a7cd4a6f65763"},
    "tensor": {"d9b043b5c9897657533939d47e8463abec325cc6dbd13bfe621b6b681129ed7a"},
}
_OWN_INIT: dict = {}
_CHECKED: dict = {}


def _known(init) -> bool:
    """Whether `init` is the constructor _KNOWN_SOURCES names (its source hashed once)."""
    hit = _CHECKED.get(init)
    if hit is None:
        import hashlib
        name = init.__qualname__.split(".")[0]
        try:
            digest = hashlib.sha256(inspect.getsource(init).encode()).hexdigest()
        except (OSError, TypeError):        # no source to read: keep Triton's
            digest = None
        hit = _CHECKED[init] = digest in _KNOWN_SOURCES.get(name, ())
        if hit:
            _OWN_INIT[name] = init
    return hit


def language_namespaces() -> list:
    """The modules and classes of triton.language whose builtins the interpreter patches."""
    import triton.language as tl
    found = [tl, tl.core, tl.math, tl.core.tensor]
    base = getattr(tl.core, "tensor_descriptor_base", None)
    return found + ([base] if base is not None else [])


def restore_namespace(obj, saved: dict) -> None:
    """Put the attributes of a module or class back as `saved` (its vars() before)."""
    now = vars(obj)
    for name in [n for n in now if n not in saved and not inspect.ismodule(now[n])]:
        delattr(obj, name)      # (a submodule imported meanwhile stays)
    for name, value in saved.items():
        if now.get(name, _MISSING_ATTR) is not value:
            setattr(obj, name, value)


_MISSING_ATTR = object()
